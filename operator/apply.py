"""Side effects of a reconcile: create or patch child objects and write an object's status.

Apply is "make the live object cover the desired one": a child that does not exist is created;
one whose fields already equal every desired field is left alone (no request, so a reconcile
that changes nothing writes nothing); otherwise one JSON merge patch sets the desired fields,
carries the live ``resourceVersion`` (the API server refuses it with 409 if the object moved
meanwhile), and sets to ``null`` the fields the previous apply wrote that are no longer desired
(a three-way merge like ``kubectl apply``: the last applied fields live in the
``kvpilot.dev/last-applied`` annotation).

Conflicts (409) and transient failures (429, 5xx, connection errors) are retried with
exponential backoff and jitter, re-reading the live object each time; when the attempts run
out, :class:`TransientApiError` tells the caller to try again later (kopf's
``TemporaryError``). A child controlled by another owner is never taken over
(:class:`OwnershipConflict`).
"""

from __future__ import annotations

import copy
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
LAST_APPLIED_ANNOTATION = "kvpilot.dev/last-applied"
USER_AGENT = f"kvpilot-operator/{__version__}"

# Kinds the operator writes: (apiVersion, kind) -> plural. All are namespaced.
PLURALS: dict[tuple[str, str], str] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("kvpilot.dev/v1alpha1", "LLMDeployment"): "llmdeployments",
}
_TRANSIENT_STATUSES = {409, 429, 500, 502, 503, 504}
# Quantities are compared by value under these keys ("1Gi" == "1024Mi"), as the API server
# may hand them back in another canonical form.
_QUANTITY_KEYS = {"limits", "requests", "sizeLimit", "storage"}


class KubeApiError(Exception):
    """A non-2xx answer from the API server.

    Attributes:
        status: the HTTP status code.
        reason: the ``reason`` of the returned ``Status`` (``Conflict``, ``NotFound``, ...).
        message: the ``message`` of the returned ``Status``.
    """

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class TransientApiError(Exception):
    """Conflicts or transient API failures outlasted the retries; try the reconcile later."""


class OwnershipConflict(Exception):
    """A child's name is taken by an object that another controller owns."""


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
            raise KubeApiError(
                response.status,
                data.get("reason", ""),
                data.get("message", response.data.decode(errors="replace")),
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


def covers(live: Any, desired: Any, quantity: bool = False) -> bool:
    """Whether ``live`` already holds every field of ``desired`` with the same value.

    Objects compare key by key (extra live keys, e.g. server defaults, are fine), lists
    element by element (same length), quantities (under ``limits``, ``requests``,
    ``sizeLimit``, ``storage``) by value, numbers by value (JSON does not keep 1 and 1.0 apart).
    """
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and covers(live[k], v, quantity or k in _QUANTITY_KEYS)
            for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(covers(a, b, quantity) for a, b in zip(live, desired, strict=True))
        )
    if quantity and isinstance(desired, str) and isinstance(live, str):
        return live == desired or _same_quantity(live, desired)
    return live == desired and isinstance(live, bool) == isinstance(desired, bool)


def _same_quantity(a: str, b: str) -> bool:
    try:
        return kubernetes.utils.parse_quantity(a) == kubernetes.utils.parse_quantity(b)
    except ValueError:
        return False


def removals(last_applied: Any, desired: Any) -> dict[str, Any]:
    """A merge patch fragment that nulls the fields of ``last_applied`` absent from ``desired``.

    Only objects are descended (lists are replaced whole by a merge patch anyway).
    """
    if not isinstance(last_applied, dict) or not isinstance(desired, dict):
        return {}
    patch: dict[str, Any] = {}
    for key, old in last_applied.items():
        if key not in desired:
            patch[key] = None
        elif nested := removals(old, desired[key]):
            patch[key] = nested
    return patch


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        elif key not in merged:
            merged[key] = value
    return merged


def _nulls_present(live: Any, nulls: dict[str, Any]) -> bool:
    # Whether any field the three-way merge would remove is still on the live object.
    if not isinstance(live, dict):
        return False
    return any(k in live and (v is None or _nulls_present(live[k], v)) for k, v in nulls.items())


def _controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def _with_last_applied(desired: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(desired)
    annotations = obj["metadata"].setdefault("annotations", {})
    annotations[LAST_APPLIED_ANNOTATION] = json.dumps(
        desired, sort_keys=True, separators=(",", ":")
    )
    return obj


def apply_child(client: KubeClient, desired: dict[str, Any], **retry: Any) -> ApplyResult:
    """Create or patch ``desired`` (a full object with its ownerReferences) until live covers it.

    ``retry`` goes to :func:`with_retries` (attempts, delays).

    Raises:
        OwnershipConflict: the live object is controlled by an owner other than desired's.
        TransientApiError: conflicts or transient errors outlasted the retries.
        KubeApiError: the API refused the object (e.g. 422 invalid).
    """
    wanted = _with_last_applied(desired)
    meta = desired["metadata"]

    def attempt() -> ApplyResult:
        live = client.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
        if live is None:
            return ApplyResult("created", client.create(wanted))
        owner = _controller_uid(live)
        if owner is not None and owner != _controller_uid(desired):
            raise OwnershipConflict(
                f"{desired['kind']} {meta['namespace']}/{meta['name']} exists and is controlled by another owner (uid {owner})"
            )
        previous = json.loads(
            live["metadata"].get("annotations", {}).get(LAST_APPLIED_ANNOTATION, "{}")
        )
        nulls = removals(previous, desired)
        if covers(live, wanted) and not _nulls_present(live, nulls):
            return ApplyResult("unchanged", live)
        patch = _merge(wanted, nulls)
        patch["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        return ApplyResult("patched", client.patch(desired, patch))

    return with_retries(attempt, **retry)


def patch_status(client: KubeClient, obj: dict[str, Any], status: dict[str, Any]) -> bool:
    """Merge ``status`` into the object's status subresource unless it already holds it.

    Carries ``obj``'s resourceVersion, so a status computed from an outdated object is refused
    (409) rather than written. Returns whether a patch was sent.

    Raises:
        KubeApiError: 409 when the object changed since ``obj`` was read (read it again and
            recompute), or any other refusal.
    """
    if covers(obj.get("status") or {}, status):
        return False
    patch = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "status": status}
    client.patch(obj, patch, subresource="status")
    return True
