"""Side effects of a reconcile: apply child objects and write an object's status.

Children are written with server-side apply (``PATCH`` with ``application/apply-patch+yaml``,
field manager ``FIELD_MANAGER``, ``force``): the API server merges the desired fields, keeps
what other managers own (defaults, the HPA's or a user's fields), removes the fields this
manager set before and no longer sends, and changes nothing, not even the resourceVersion,
when the object already holds them. So the operator never compares objects itself: what the
server would store after defaulting and normalising is exactly what it compares.

Conflicts (409) and transient failures (429, 5xx, connection errors) are retried with
exponential backoff and jitter; when the attempts run out, :class:`TransientApiError` tells the
caller to try again later (kopf's ``TemporaryError``). A child controlled by another owner is
never taken over (:class:`OwnershipConflict`); one still controlled by a deleted object of the
same kind and name (garbage collection is asynchronous) is :class:`StaleOwner`, retried soon.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import kubernetes
import urllib3

from kvpilot import __version__

T = TypeVar("T")

MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
FIELD_MANAGER = "kvpilot-operator"
"""The server-side apply field manager of everything the operator writes."""
USER_AGENT = f"kvpilot-operator/{__version__}"

# Kinds the operator writes: (apiVersion, kind) -> plural. All are namespaced.
PLURALS: dict[tuple[str, str], str] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("kvpilot.dev/v1alpha1", "LLMDeployment"): "llmdeployments",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("v1", "Pod"): "pods",
}
_TRANSIENT_STATUSES = {409, 429, 500, 502, 503, 504}


class KubeApiError(Exception):
    """A non-2xx answer from the API server.

    Attributes:
        status: the HTTP status code.
        reason: the ``reason`` of the returned ``Status`` (``Conflict``, ``NotFound``, ...).
        message: the ``message`` of the returned ``Status``.
        fields: the fields its ``details.causes`` name (a 422's invalid fields), in order.
    """

    def __init__(
        self, status: int, reason: str, message: str, fields: tuple[str, ...] = ()
    ) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.fields = fields


class TransientApiError(Exception):
    """Conflicts or transient API failures outlasted the retries; try the reconcile later."""


class OwnershipConflict(Exception):
    """A child's name is taken by an object that another controller owns."""


class StaleOwner(TransientApiError):
    """A child's name is taken by the child of a deleted owner of the same kind and name,
    which the garbage collector has not removed yet: try again shortly."""


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    """What :func:`apply_child` did: ``action`` is ``created``, ``patched`` or ``unchanged``."""

    action: str
    obj: dict[str, Any]


def object_path(
    api_version: str,
    kind: str,
    namespace: str,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of an object (or of its collection when ``name`` is None).

    Raises:
        KeyError: a kind the operator does not manage.
    """
    plural = PLURALS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [prefix, "namespaces", namespace, plural, name, subresource]
    return "/".join(p for p in parts if p)


class KubeClient:
    """JSON REST calls with the kubernetes client's configuration (kubeconfig or in-cluster).

    Objects go in and come out as plain dicts, so the same code handles every kind.
    """

    def __init__(self, api_client: kubernetes.client.ApiClient | None = None) -> None:
        self.api_client = api_client or kubernetes.client.ApiClient()
        self.api_client.user_agent = USER_AGENT

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        """Send one request; return the decoded JSON answer.

        Raises:
            KubeApiError: a non-2xx answer.
            urllib3.exceptions.HTTPError: the server could not be reached.
        """
        headers = {"Accept": "application/json", "Content-Type": content_type}
        serialized = self.api_client.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self.api_client.call_api(*serialized)
        response.read()
        data = json.loads(response.data) if response.data else {}
        if not 200 <= response.status < 300:
            causes = (data.get("details") or {}).get("causes") or []
            raise KubeApiError(
                response.status,
                data.get("reason", ""),
                data.get("message", response.data.decode(errors="replace")),
                tuple(c["field"] for c in causes if c.get("field")),
            )
        return data

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The live object, or None if it does not exist."""
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name))
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """POST ``obj`` into its namespace."""
        meta = obj["metadata"]
        return self.request(
            "POST", object_path(obj["apiVersion"], obj["kind"], meta["namespace"]), obj
        )

    def patch(
        self, obj_ref: dict[str, Any], patch: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        """JSON-merge-patch the object that ``obj_ref`` (apiVersion, kind, metadata) names."""
        meta = obj_ref["metadata"]
        path = object_path(
            obj_ref["apiVersion"], obj_ref["kind"], meta["namespace"], meta["name"], subresource
        )
        return self.request("PATCH", path, patch, MERGE_PATCH)

    def apply(self, obj: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        """Server-side apply ``obj`` (created if absent) as ``FIELD_MANAGER``, forcing
        conflicts with other managers; returns the object as stored."""
        meta = obj["metadata"]
        path = object_path(
            obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], subresource
        )
        query = f"?fieldManager={FIELD_MANAGER}&force=true"
        return self.request("PATCH", path + query, obj, APPLY_PATCH)


def with_retries(
    action: Callable[[], T],
    *,
    attempts: int = 5,
    base_delay: float = 0.1,
    max_delay: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run ``action``, retrying on 409 and transient failures with exponential backoff.

    The delay before retry ``k`` (from 0) is ``min(max_delay, base_delay * 2**k)`` scaled by a
    random factor in [0.5, 1) so that competing writers spread out ("full jitter" halved).

    Raises:
        TransientApiError: every attempt failed with a retryable error.
        KubeApiError: a non-retryable API error (the first one).
    """
    last: Exception | None = None
    for delay in _delays(attempts, base_delay, max_delay):
        try:
            return action()
        except KubeApiError as exc:
            if exc.status not in _TRANSIENT_STATUSES:
                raise
            last = exc
        except urllib3.exceptions.HTTPError as exc:
            last = exc
        if delay is not None:
            sleep(delay * random.uniform(0.5, 1.0))
    raise TransientApiError(f"gave up after {attempts} attempts: {last}") from last


def _delays(attempts: int, base: float, cap: float) -> Iterator[float | None]:
    for k in range(attempts):
        yield min(cap, base * 2**k) if k < attempts - 1 else None


def _controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref
    return None


def apply_child(client: KubeClient, desired: dict[str, Any], **retry: Any) -> ApplyResult:
    """Server-side apply ``desired`` (a full object with its ownerReferences).

    ``action`` is ``created`` when the object did not exist, ``unchanged`` when every field the
    operator applies reads the same, as the API server stores it, before and after, and it owns
    the same fields (none was removed); what other controllers write meanwhile, status or their
    own annotations, does not count. Else ``patched``. ``retry`` goes to :func:`with_retries`
    (attempts, delays).

    Raises:
        OwnershipConflict: the live object is controlled by another owner.
        StaleOwner: it is controlled by a deleted owner of desired's owner's kind and name.
        TransientApiError: conflicts or transient errors outlasted the retries.
        KubeApiError: the API refused the object (e.g. 422 invalid).
    """
    meta = desired["metadata"]

    def attempt() -> ApplyResult:
        live = client.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
        if live is not None:
            _check_owner(live, desired)
        applied = client.apply(desired)
        if live is None:
            return ApplyResult("created", applied)
        same = _project(applied, desired) == _project(live, desired) and _owned_fields(
            applied
        ) == _owned_fields(live)
        return ApplyResult("unchanged" if same else "patched", applied)

    return with_retries(attempt, **retry)


def _project(obj: Any, shape: Any) -> Any:
    """The parts of ``obj`` under the keys of ``shape``, descending objects (lists whole)."""
    if isinstance(shape, dict) and isinstance(obj, dict):
        return {key: _project(obj.get(key), sub) for key, sub in shape.items()}
    return obj


def _owned_fields(obj: dict[str, Any]) -> Any:
    """The fields ``FIELD_MANAGER`` owns by applying (``managedFields``), or None."""
    for entry in obj.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") == FIELD_MANAGER and entry.get("operation") == "Apply":
            return entry.get("fieldsV1")
    return None


def _check_owner(live: dict[str, Any], desired: dict[str, Any]) -> None:
    owner, wanted = _controller(live), _controller(desired)
    if owner is None or wanted is None or owner.get("uid") == wanted.get("uid"):
        return
    meta = desired["metadata"]
    where = f"{desired['kind']} {meta['namespace']}/{meta['name']}"
    if (owner.get("kind"), owner.get("name")) == (wanted.get("kind"), wanted.get("name")):
        raise StaleOwner(
            f"{where} still belongs to a deleted {owner.get('kind')} {owner.get('name')} "
            f"(uid {owner.get('uid')}); waiting for the garbage collector"
        )
    raise OwnershipConflict(
        f"{where} exists and is controlled by another owner (uid {owner.get('uid')})"
    )


def status_changed(previous: Any, status: Any) -> bool:
    """Whether merge-patching ``status`` onto ``previous`` would change any field.

    Objects compare key by key (keys only in ``previous`` stay, a null removes one), anything
    else by value (numbers by value: JSON does not keep 1 and 1.0 apart).
    """
    if isinstance(status, dict):
        if not isinstance(previous, dict):
            return True
        return any(
            (key in previous) if value is None else status_changed(previous.get(key), value)
            for key, value in status.items()
        )
    return previous != status or isinstance(previous, bool) != isinstance(status, bool)


def patch_status(client: KubeClient, obj: dict[str, Any], status: dict[str, Any]) -> bool:
    """Merge ``status`` into the object's status subresource unless it already holds it.

    Carries ``obj``'s resourceVersion, so a status computed from an outdated object is refused
    (409) rather than written. Returns whether a patch was sent.

    Raises:
        KubeApiError: 409 when the object changed since ``obj`` was read (read it again and
            recompute), or any other refusal.
    """
    if not status_changed(obj.get("status") or {}, status):
        return False
    patch = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "status": status}
    client.patch(obj, patch, subresource="status")
    return True
