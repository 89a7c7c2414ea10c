"""The emulator's object store: Kubernetes API semantics over plain dicts, without HTTP.

What it does that a plain key-value store (and kmock 0.8) does not:

- ``metadata.uid``, ``creationTimestamp``, and a cluster-wide monotonic ``resourceVersion``
  (an etcd-like revision) on every write; a write that changes nothing keeps the version and
  emits no watch event;
- optimistic concurrency: a write whose body carries a stale ``metadata.resourceVersion`` is
  refused with 409 Conflict;
- ``metadata.generation`` starts at 1 and is bumped only when something outside ``metadata``
  and ``status`` changes;
- the status subresource: writes to ``/status`` change only ``status``, writes to the main
  resource keep the stored ``status`` (and ``status`` is dropped on create);
- the scale subresource as an ``autoscaling/v1`` ``Scale``;
- finalizers: DELETE sets ``deletionTimestamp`` while finalizers remain, and the object goes
  away when the last one is removed;
- garbage collection: deleting an owner deletes the objects whose ``ownerReferences`` point
  only to deleted owners (synchronously; ``propagationPolicy: Orphan`` detaches them instead),
  and an object created with owner references to owners that no longer exist is deleted;
- CustomResourceDefinitions: creating one serves its resource (and marks it Established);
  deleting one removes its objects;
- custom resources are defaulted and validated against the CRD schema on every write
  (422 naming the field);
- a history of watch events, so a watch can resume from any resourceVersion without replay.

Every method is thread-safe; listeners registered with :meth:`ObjectStore.add_listener` are
called after each committed change (from the writer's thread).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import secrets
import threading
import uuid
from collections.abc import Callable
from typing import Any

from . import patches, selectors
from .resources import ResourceType, crd_types

TypeKey = tuple[str, str, str]
ObjectKey = tuple[TypeKey, str | None, str]
CRD_KEY: TypeKey = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACE_KEY: TypeKey = ("", "v1", "namespaces")

# (custom resource type, object, strict) -> (admitted object, 422 causes {"field", "message"}).
# ``strict``: the client asked for fieldValidation=Strict (unknown fields are errors).
Admitter = Callable[
    [ResourceType, dict[str, Any], bool], tuple[dict[str, Any], list[dict[str, str]]]
]


@dataclasses.dataclass
class ApiError(Exception):
    """An API failure rendered as a ``Status`` object with this HTTP code and reason."""

    code: int
    reason: str
    message: str
    causes: list[dict[str, str]] = dataclasses.field(default_factory=list)
    kind: str | None = None
    name: str | None = None

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    """One change: ``type`` is ADDED, MODIFIED or DELETED; ``obj`` is the state after it."""

    resource_version: int
    type: str
    type_key: TypeKey
    obj: dict[str, Any]


def now() -> str:
    """The current time as Kubernetes writes timestamps (RFC 3339, seconds, UTC)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_path(obj: dict[str, Any], path: str) -> Any:
    """Read a dotted path such as ``.spec.replicas``; ``None`` where anything is missing."""
    node: Any = obj
    for part in path.strip(".").split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def write_path(obj: dict[str, Any], path: str, value: Any) -> None:
    """Write ``value`` at a dotted path, creating the intermediate objects."""
    *parents, last = path.strip(".").split(".")
    node = obj
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _without(obj: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


class ObjectStore:
    """In-memory objects with Kubernetes write semantics (see the module docstring).

    Args:
        types: the served resource types by (group, version, plural).
        admitter: prunes, defaults and validates custom resources against their schema.
    """

    def __init__(
        self, types: dict[TypeKey, ResourceType], admitter: Admitter | None = None
    ) -> None:
        self.types = dict(types)
        self._admitter = admitter
        self._objects: dict[ObjectKey, dict[str, Any]] = {}
        self._history: list[WatchEvent] = []
        self._revision = 0
        self._lock = threading.RLock()
        self._listeners: list[Callable[[], None]] = []
        self._type_listeners: list[Callable[[], None]] = []

    # ---- registration and observation -------------------------------------------------------

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every committed change (watch streams wake up on it)."""
        self._listeners.append(callback)

    def add_type_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when a CRD adds or removes served types (discovery refresh)."""
        self._type_listeners.append(callback)

    def resource_type(self, key: TypeKey) -> ResourceType:
        """The served type for (group, version, plural). Raises ApiError 404 if not served."""
        try:
            return self.types[key]
        except KeyError:
            group, version, plural = key
            raise ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource ({plural}.{version}.{group})",
            ) from None

    @property
    def resource_version(self) -> int:
        """The latest revision (the ``resourceVersion`` of the newest write)."""
        return self._revision

    def events_after(self, revision: int) -> list[WatchEvent]:
        """Watch events newer than ``revision``, oldest first."""
        with self._lock:
            # Revisions are dense and start at 1, so the history index is revision - 1.
            return self._history[revision:]

    def state_before(self, event: WatchEvent) -> dict[str, Any] | None:
        """The object's state just before ``event`` (None if it did not exist)."""
        meta = event.obj["metadata"]
        identity = (event.type_key, meta.get("namespace"), meta["name"])
        with self._lock:
            for earlier in reversed(self._history[: event.resource_version - 1]):
                other = earlier.obj["metadata"]
                if (earlier.type_key, other.get("namespace"), other["name"]) == identity:
                    return None if earlier.type == "DELETED" else earlier.obj
        return None

    # ---- reads ------------------------------------------------------------------------------

    def get(self, key: TypeKey, namespace: str | None, name: str) -> dict[str, Any]:
        """A deep copy of one object. Raises ApiError 404."""
        rtype = self.resource_type(key)
        with self._lock:
            obj = self._objects.get((key, self._scope(rtype, namespace), name))
            if obj is None:
                raise ApiError(
                    404, "NotFound", f'{rtype.plural}.{rtype.group or "core"} "{name}" not found'
                )
            return copy.deepcopy(obj)

    def list(
        self,
        key: TypeKey,
        namespace: str | None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[list[dict[str, Any]], int]:
        """Objects of a type (in ``namespace``, or everywhere when ``None``), with the revision.

        Raises:
            ApiError: 404 for an unknown type, 400 for a selector that does not parse.
        """
        self.resource_type(key)
        matches = self.matcher(namespace, label_selector, field_selector)
        with self._lock:
            items = [
                copy.deepcopy(obj)
                for (k, _, _), obj in sorted(
                    self._objects.items(), key=lambda kv: (kv[0][1] or "", kv[0][2])
                )
                if k == key and matches(obj)
            ]
            return items, self._revision

    @staticmethod
    def matcher(
        namespace: str | None, label_selector: str | None, field_selector: str | None
    ) -> selectors.Predicate:
        """A predicate for list/watch filtering. Raises ApiError 400 on a bad selector."""
        try:
            labels = selectors.label_selector(label_selector)
            fields = selectors.field_selector(field_selector)
        except selectors.SelectorError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from None
        return lambda obj: (
            (namespace is None or obj["metadata"].get("namespace") == namespace)
            and labels(obj)
            and fields(obj)
        )

    # ---- writes -----------------------------------------------------------------------------

    def create(
        self, key: TypeKey, namespace: str | None, body: dict[str, Any], strict: bool = False
    ) -> dict[str, Any]:
        """POST: store a new object and return it (``strict``: unknown fields are errors).

        Raises:
            ApiError: 400 (kind/namespace mismatch, no name), 404 (namespace missing),
                409 (already exists), 422 (schema validation).
        """
        rtype = self.resource_type(key)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        self._check_identity(rtype, obj)
        if rtype.namespaced:
            ns = meta.get("namespace") or namespace
            if namespace is not None and meta.get("namespace") not in (None, namespace):
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the object does not match the namespace of the URL",
                )
            if not ns:
                raise ApiError(400, "BadRequest", "a namespaced object needs a namespace")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(
                    422,
                    "Invalid",
                    f"{rtype.kind} is invalid: metadata.name: Required value",
                    [{"field": "metadata.name", "message": "Required value"}],
                )
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        with self._lock:
            if rtype.namespaced and (NAMESPACE_KEY, None, meta["namespace"]) not in self._objects:
                raise ApiError(404, "NotFound", f'namespaces "{meta["namespace"]}" not found')
            okey = (key, meta.get("namespace"), meta["name"])
            if okey in self._objects:
                raise ApiError(
                    409, "AlreadyExists", f'{rtype.plural} "{meta["name"]}" already exists'
                )
            if rtype.has_status:
                obj.pop("status", None)
            for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
                meta.pop(field, None)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
            obj = self._admit(rtype, obj, strict)
            if key == CRD_KEY:
                obj["status"] = self._crd_status(obj)
            self._commit(rtype, okey, "ADDED", obj)
            if key == CRD_KEY:
                self._register_crd(obj)
            created = copy.deepcopy(obj)
            self._collect_if_orphaned(okey)
            return created

    def replace(
        self,
        key: TypeKey,
        namespace: str | None,
        name: str,
        body: dict[str, Any],
        subresource: str | None = None,
        strict: bool = False,
    ) -> dict[str, Any]:
        """PUT on the object or its ``status``/``scale`` subresource; returns the new state."""
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        return self._update(
            key, namespace, name, subresource, lambda _: copy.deepcopy(body), strict
        )

    def patch(
        self,
        key: TypeKey,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str | None = None,
        strict: bool = False,
    ) -> dict[str, Any]:
        """PATCH (merge, JSON, strategic or apply patch); returns the new state.

        Raises:
            ApiError: 404, 409 (stale resourceVersion in the patch), 415 (patch type),
                422 (failed JSON-patch ``test``, schema validation).
        """

        def mutate(current: dict[str, Any]) -> dict[str, Any]:
            try:
                return patches.apply_patch(content_type, current, patch)
            except patches.PatchError as exc:
                raise ApiError(422, "Invalid", str(exc)) from None
            except ValueError as exc:
                raise ApiError(415, "UnsupportedMediaType", str(exc)) from None

        return self._update(key, namespace, name, subresource, mutate, strict)

    def get_scale(self, key: TypeKey, namespace: str | None, name: str) -> dict[str, Any]:
        """GET /scale: the object's replicas as an ``autoscaling/v1`` Scale."""
        rtype = self._scalable(key)
        return self._scale_view(rtype, self.get(key, namespace, name))

    def delete(
        self, key: TypeKey, namespace: str | None, name: str, propagation: str = "Background"
    ) -> dict[str, Any]:
        """DELETE: mark (finalizers present) or remove, then collect orphaned dependents.

        Returns the last state of the object. Raises ApiError 404.
        """
        rtype = self.resource_type(key)
        with self._lock:
            okey = (key, self._scope(rtype, namespace), name)
            current = self.get(key, namespace, name)
            if current["metadata"].get("finalizers"):
                if not current["metadata"].get("deletionTimestamp"):
                    current["metadata"]["deletionTimestamp"] = now()
                    current["metadata"]["deletionGracePeriodSeconds"] = 0
                    self._commit(rtype, okey, "MODIFIED", current)
                return current
            self._remove(rtype, okey, propagation)
            return current

    # ---- internals --------------------------------------------------------------------------

    @staticmethod
    def _scope(rtype: ResourceType, namespace: str | None) -> str | None:
        return namespace if rtype.namespaced else None

    @staticmethod
    def _check_identity(rtype: ResourceType, obj: dict[str, Any]) -> None:
        if (
            obj.get("apiVersion", rtype.api_version) != rtype.api_version
            or obj.get("kind", rtype.kind) != rtype.kind
        ):
            raise ApiError(
                400,
                "BadRequest",
                f"the object is a {obj.get('apiVersion')}/{obj.get('kind')}, not a {rtype.api_version}/{rtype.kind}",
            )
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind

    def _scalable(self, key: TypeKey) -> ResourceType:
        rtype = self.resource_type(key)
        if rtype.scale is None:
            raise ApiError(404, "NotFound", f"{rtype.plural} has no scale subresource")
        return rtype

    @staticmethod
    def _scale_view(rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        assert rtype.scale is not None
        meta = obj["metadata"]
        if rtype.scale.label_selector_path is None:
            selector = selectors.match_labels_string(read_path(obj, ".spec.selector"))
        else:
            selector = read_path(obj, rtype.scale.label_selector_path) or ""
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": read_path(obj, rtype.scale.spec_replicas_path) or 0},
            "status": {
                "replicas": read_path(obj, rtype.scale.status_replicas_path) or 0,
                "selector": selector,
            },
        }

    def _update(
        self,
        key: TypeKey,
        namespace: str | None,
        name: str,
        subresource: str | None,
        mutate: Callable[[dict[str, Any]], dict[str, Any]],
        strict: bool = False,
    ) -> dict[str, Any]:
        rtype = self.resource_type(key)
        if subresource not in (None, "status", "scale") or (
            subresource == "status" and not rtype.has_status
        ):
            raise ApiError(404, "NotFound", f"{rtype.plural} has no {subresource} subresource")
        with self._lock:
            current = self.get(key, namespace, name)
            okey = (key, self._scope(rtype, namespace), name)
            if subresource == "scale":
                rtype = self._scalable(key)
                assert rtype.scale is not None
                scale = mutate(self._scale_view(rtype, current))
                self._check_precondition(rtype, current, scale)
                replicas = read_path(scale, ".spec.replicas")
                if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                    raise ApiError(
                        422,
                        "Invalid",
                        f"Scale.autoscaling is invalid: spec.replicas: Invalid value: {replicas!r}: must be a non-negative integer",
                        [{"field": "spec.replicas", "message": "must be a non-negative integer"}],
                    )
                candidate = copy.deepcopy(current)
                write_path(candidate, rtype.scale.spec_replicas_path, replicas)
                updated = self._write(rtype, okey, current, candidate, strict)
                return self._scale_view(rtype, updated)
            candidate = mutate(copy.deepcopy(current))
            if not isinstance(candidate, dict):
                raise ApiError(422, "Invalid", "the result of the write is not an object")
            self._check_precondition(rtype, current, candidate)
            if subresource == "status":
                merged = copy.deepcopy(current)
                if "status" in candidate:
                    merged["status"] = candidate["status"]
                else:
                    merged.pop("status", None)
                candidate = merged
            else:
                self._check_identity(rtype, candidate)
                if rtype.has_status:
                    candidate = _without(candidate, "status")
                    if "status" in current:
                        candidate["status"] = current["status"]
            return self._write(rtype, okey, current, candidate, strict)

    @staticmethod
    def _check_precondition(
        rtype: ResourceType, current: dict[str, Any], candidate: dict[str, Any]
    ) -> None:
        wanted = (candidate.get("metadata") or {}).get("resourceVersion")
        if wanted not in (None, "") and str(wanted) != current["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {rtype.plural}.{rtype.group or "core"} "{current["metadata"]["name"]}": '
                "the object has been modified; please apply your changes to the latest version and try again",
            )

    def _write(
        self,
        rtype: ResourceType,
        okey: ObjectKey,
        current: dict[str, Any],
        candidate: dict[str, Any],
        strict: bool,
    ) -> dict[str, Any]:
        meta = candidate.setdefault("metadata", {})
        for field in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
            else:
                meta.pop(field, None)
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        candidate = self._admit(rtype, candidate, strict)
        if _without(candidate, "metadata", "status") != _without(current, "metadata", "status"):
            meta = candidate["metadata"]
            meta["generation"] = current["metadata"].get("generation", 0) + 1
        if candidate == current:
            return current
        if okey[0] == CRD_KEY:
            candidate["status"] = self._crd_status(candidate)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(rtype, okey, "Background", last=candidate)
            return candidate
        self._commit(rtype, okey, "MODIFIED", candidate)
        if okey[0] == CRD_KEY:
            self._register_crd(candidate)
        return copy.deepcopy(candidate)

    def _admit(self, rtype: ResourceType, obj: dict[str, Any], strict: bool) -> dict[str, Any]:
        if not rtype.custom or self._admitter is None:
            return obj
        obj, causes = self._admitter(rtype, obj, strict)
        if causes:
            details = "; ".join(f"{c['field']}: {c['message']}" for c in causes)
            name = obj.get("metadata", {}).get("name", "")
            message = f'{rtype.kind}.{rtype.group} "{name}" is invalid: {details}'
            raise ApiError(422, "Invalid", message, causes, kind=rtype.kind, name=name)
        return obj

    def _commit(
        self, rtype: ResourceType, okey: ObjectKey, event_type: str, obj: dict[str, Any]
    ) -> None:
        self._revision += 1
        obj["metadata"]["resourceVersion"] = str(self._revision)
        if event_type == "DELETED":
            self._objects.pop(okey, None)
        else:
            self._objects[okey] = copy.deepcopy(obj)
        self._history.append(WatchEvent(self._revision, event_type, rtype.key, copy.deepcopy(obj)))
        for listener in self._listeners:
            listener()

    def _remove(
        self,
        rtype: ResourceType,
        okey: ObjectKey,
        propagation: str,
        last: dict[str, Any] | None = None,
    ) -> None:
        obj = copy.deepcopy(last if last is not None else self._objects[okey])
        self._commit(rtype, okey, "DELETED", obj)
        if okey[0] == CRD_KEY:
            self._unregister_crd(obj)
        self._collect_dependents(obj["metadata"]["uid"], propagation)

    def _collect_if_orphaned(self, okey: ObjectKey) -> None:
        # The garbage collector also deletes objects created with owner references to owners
        # that are already gone (a controller racing its owner's deletion).
        refs = self._objects[okey]["metadata"].get("ownerReferences") or []
        live_uids = {o["metadata"]["uid"] for o in self._objects.values()}
        if refs and not any(r.get("uid") in live_uids for r in refs):
            self.delete(*okey)

    def _collect_dependents(self, owner_uid: str, propagation: str) -> None:
        live_uids = {o["metadata"]["uid"] for o in self._objects.values()}
        for okey, obj in list(self._objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if okey not in self._objects or not any(r.get("uid") == owner_uid for r in refs):
                continue
            rtype = self.types[okey[0]]
            remaining = [r for r in refs if r.get("uid") != owner_uid]
            if propagation == "Orphan" or any(r.get("uid") in live_uids for r in remaining):
                detached = copy.deepcopy(obj)
                detached["metadata"]["ownerReferences"] = remaining
                self._commit(rtype, okey, "MODIFIED", detached)
            else:
                self.delete(okey[0], okey[1], okey[2])

    @staticmethod
    def _crd_status(crd: dict[str, Any]) -> dict[str, Any]:
        stamp = now()
        return {
            "acceptedNames": crd["spec"]["names"],
            "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
            "conditions": [
                {
                    "type": t,
                    "status": "True",
                    "reason": r,
                    "message": m,
                    "lastTransitionTime": stamp,
                }
                for t, r, m in (
                    ("NamesAccepted", "NoConflicts", "no conflicts found"),
                    ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
                )
            ],
        }

    def _register_crd(self, crd: dict[str, Any]) -> None:
        for rtype in crd_types(crd):
            self.types[rtype.key] = rtype
        for listener in self._type_listeners:
            listener()

    def _unregister_crd(self, crd: dict[str, Any]) -> None:
        for rtype in crd_types(crd):
            for okey in [k for k in self._objects if k[0] == rtype.key]:
                self._commit(rtype, okey, "DELETED", copy.deepcopy(self._objects[okey]))
            self.types.pop(rtype.key, None)
        for listener in self._type_listeners:
            listener()
