"""The Kubernetes API emulator: kmock's server and discovery, our store's semantics.

kmock 0.8 provides the HTTP server, request parsing and recording, the reaction DSL (tests can
still inject faults: ``emulator["patch", kmock.resource("apps", "v1", "deployments")] << 409``),
Kubernetes error rendering, and API discovery (``/api``, ``/apis``, ``/apis/{group}/{version}``)
seeded with kmock's bundled built-in resources. Everything stateful is answered by
:class:`~.store.ObjectStore`; this module maps HTTP onto it:

==========================  ==========================================================
``GET`` (no name)           list (``kind: XList`` with the current ``resourceVersion``),
                            or a Table for ``kubectl get``
``GET ?watch=true``         watch: without ``resourceVersion`` (or ``0``) the current objects
                            as ADDED, then changes; with one, only changes after it;
                            objects entering/leaving a selector are ADDED/DELETED;
                            ``timeoutSeconds`` ends the stream
``GET`` (name)              get, ``/status``, ``/scale``
``POST``                    create (201)
``PUT``                     replace the object, ``/status`` or ``/scale``
``PATCH``                   merge, JSON, strategic merge, apply patch; ``/status``, ``/scale``
``DELETE``                  delete (finalizers, garbage collection, ``propagationPolicy``);
                            without a name, deletecollection (with selectors)
==========================  ==========================================================

Every resource request is appended to :attr:`KubeEmulator.calls` as an :class:`ApiCall`
(the RBAC verb, group, resource, subresource, namespace, and the bearer token as the user).
Protobuf bodies (``kubectl create`` of built-in kinds) get 415 Unsupported Media Type, before
kmock sees (or records) them; ``kubectl apply`` sends JSON and works.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from . import paths, tables
from .resources import builtin_types, discovery_info
from .schema import admit_custom_resource
from .store import NAMESPACE_KEY, ApiError, ObjectStore, TypeKey, WatchEvent

_INITIAL_NAMESPACES = ("default", "kube-system")


@dataclasses.dataclass(frozen=True)
class ApiCall:
    """One resource request, in the terms RBAC rules use."""

    user: str
    verb: str
    group: str
    resource: str
    subresource: str | None
    namespace: str | None
    name: str | None

    @property
    def rbac_resource(self) -> str:
        """``resource`` or ``resource/subresource``, as written in a Role's ``resources``."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def _verb(method: str, api: paths.ApiPath, params: dict[str, str]) -> str:
    if method == "GET":
        if params.get("watch") in ("true", "1"):
            return "watch"
        return "list" if api.name is None else "get"
    if method == "DELETE" and api.name is None:
        return "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
        method, method.lower()
    )


def _user(headers: dict[str, str]) -> str:
    auth = headers.get("Authorization", "")
    return auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else "anonymous"


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesScaffold):
    """A Kubernetes API server on localhost, good enough for a real kopf operator and kubectl.

    Use it as kmock documents (``async with KubeEmulator() as em, kmock.Server(em) as srv``),
    or through :func:`~.harness.running_emulator`, which serves it from a thread of its own.
    The ``default`` and ``kube-system`` namespaces exist from the start.
    """

    store: ObjectStore = attrs.field(init=False)
    calls: list[ApiCall] = attrs.field(factory=list, init=False)
    _loop: asyncio.AbstractEventLoop | None = attrs.field(default=None, init=False)
    _changed: asyncio.Event | None = attrs.field(default=None, init=False)
    _closing: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        self.store = ObjectStore(builtin_types(self.resources), admitter=admit_custom_resource)
        self.store.add_listener(self._notify)
        self.store.add_type_listener(self._refresh_discovery)
        for name in _INITIAL_NAMESPACES:
            self.store.create(NAMESPACE_KEY, None, {"metadata": {"name": name}})
        self.fallback[lambda request: paths.parse(request.url.path) is not None] << self._serve

    async def __aenter__(self) -> KubeEmulator:
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._closing = False
        return await super().__aenter__()

    async def __aexit__(self, *exc_info: Any) -> None:
        self._closing = True
        self._wake()
        await super().__aexit__(*exc_info)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock 0.8's path parser raises on the namespace collection (/api/v1/namespaces) before
        # any reaction runs. An empty segment keeps its parser happy; paths.parse skips it.
        if raw_request.path.rstrip("/") == "/api/v1/namespaces":
            raw_request = raw_request.clone(
                rel_url=raw_request.rel_url.with_path("/api/v1//namespaces")
            )
        # kmock decodes every body as text, which fails on protobuf (kubectl create of built-in
        # kinds): answer as an API server that does not speak it would.
        if "protobuf" in raw_request.headers.get("Content-Type", ""):
            message = "the emulator speaks JSON only; protobuf bodies are not understood"
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 415}
            status.update(reason="UnsupportedMediaType", message=message)
            return aiohttp.web.json_response(status, status=415)
        return await super().__call__(raw_request)

    # ---- plumbing ---------------------------------------------------------------------------

    def _notify(self) -> None:
        # Store writes may come from any thread (tests poke the store directly).
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _serve_version(self, request: kmock.Request) -> Any:
        # kmock repeats a resource's short names and categories on its subresources (a real API
        # server does not; kubectl then warns that "llmd" is ambiguous), and names the core
        # group version "/v1" (kubectl then finds no core kinds).
        listing = await super()._serve_version(request)
        listing["groupVersion"] = listing["groupVersion"].lstrip("/")  # kmock writes "/v1" for core
        for entry in listing["resources"]:
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[], singularName="")
                if entry["name"].endswith("/scale"):
                    entry.update(kind="Scale", group="autoscaling", version="v1")
        return listing

    def _refresh_discovery(self) -> None:
        for res in list(self.resources):
            if (res.group, res.version, res.plural) not in self.store.types:
                del self.resources[res]
        for rtype in self.store.types.values():
            if rtype.custom:
                self.resources[f"{rtype.group}/{rtype.version}/{rtype.plural}"] = discovery_info(
                    rtype
                )

    async def _handle(self, request: kmock.Request) -> Any:
        api = paths.parse(request.url.path)
        if api is not None:
            self.calls.append(
                ApiCall(
                    user=_user(dict(request.headers)),
                    verb=_verb(str(request.method.value), api, dict(request.params)),
                    group=api.group,
                    resource=api.plural,
                    subresource=api.subresource,
                    namespace=api.namespace,
                    name=api.name,
                )
            )
        return await super()._handle(request)

    # ---- requests ---------------------------------------------------------------------------

    async def _serve(self, request: kmock.Request) -> Any:
        api = paths.parse(request.url.path)
        assert api is not None  # guaranteed by the reaction's criterion
        try:
            payload = self._dispatch(request, api, (api.group, api.version, api.plural))
            # kmock keeps the status of the last returned Response on the (shared) reaction, so
            # every answer names its status explicitly.
            return kmock.Response(
                status=201 if request.method.value == "POST" else 200, payload=payload
            )
        except ApiError as exc:
            raise kmock.KubernetesError(
                status=exc.code,
                reason=exc.reason,
                message=exc.message,
                details={
                    "name": exc.name or api.name or "",
                    "group": api.group,
                    "kind": exc.kind or api.plural,
                    "causes": exc.causes,
                },
            ) from None

    def _body(self, request: kmock.Request) -> Any:
        content_type = request.headers.get("Content-Type", "application/json")
        if "yaml" in content_type:
            return yaml.safe_load(request.text)
        return request.data

    def _dispatch(self, request: kmock.Request, api: paths.ApiPath, key: TypeKey) -> Any:
        store, params, method = self.store, dict(request.params), str(request.method.value)
        rtype = store.resource_type(key)
        table = tables.wants_table(request.headers.get("Accept", ""))
        if method == "GET" and params.get("watch") in ("true", "1"):
            fields = params.get("fieldSelector")
            if api.name is not None:
                fields = ",".join(filter(None, [fields, f"metadata.name={api.name}"]))
            return self._watch(key, api.namespace, params, fields)
        if method == "GET" and api.name is None:
            items, revision = store.list(
                key, api.namespace, params.get("labelSelector"), params.get("fieldSelector")
            )
            if table:
                return tables.render_table(rtype, items, revision)
            return {
                "apiVersion": rtype.api_version,
                "kind": f"{rtype.kind}List",
                "metadata": {"resourceVersion": str(revision)},
                "items": items,
            }
        if method == "GET" and api.subresource == "scale":
            return store.get_scale(key, api.namespace, api.name)
        if method == "GET" and api.subresource in (None, "status"):
            obj = store.get(key, api.namespace, api.name)
            return tables.render_table(rtype, [obj], store.resource_version) if table else obj
        strict = params.get("fieldValidation") == "Strict"
        if method == "POST" and api.name is None:
            return store.create(key, api.namespace, self._body(request), strict)
        if method == "PUT" and api.name is not None:
            body = self._body(request)
            return store.replace(key, api.namespace, api.name, body, api.subresource, strict)
        if method == "PATCH" and api.name is not None:
            content_type = request.headers.get("Content-Type", "")
            body = self._body(request)
            return store.patch(
                key, api.namespace, api.name, content_type, body, api.subresource, strict
            )
        if method == "DELETE" and api.name is not None:
            options = self._body(request) if request.body else {}
            propagation = (
                (options or {}).get("propagationPolicy")
                or params.get("propagationPolicy")
                or "Background"
            )
            return store.delete(key, api.namespace, api.name, propagation)
        if method == "DELETE":  # deletecollection
            items, _ = store.list(
                key, api.namespace, params.get("labelSelector"), params.get("fieldSelector")
            )
            deleted = [
                store.delete(key, o["metadata"].get("namespace"), o["metadata"]["name"])
                for o in items
            ]
            return {
                "apiVersion": rtype.api_version,
                "kind": f"{rtype.kind}List",
                "metadata": {},
                "items": deleted,
            }
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {request.url.path}")

    def _watch(
        self, key: TypeKey, namespace: str | None, params: dict[str, str], fields: str | None
    ) -> AsyncIterator[Any]:
        matches = self.store.matcher(namespace, params.get("labelSelector"), fields)
        since = params.get("resourceVersion")
        if since in (None, "", "0"):
            items, start = self.store.list(key, namespace, params.get("labelSelector"), fields)
            initial = [{"type": "ADDED", "object": obj} for obj in items]
        else:
            if not since.isdigit():
                raise ApiError(400, "BadRequest", f"invalid resourceVersion {since!r}")
            start, initial = int(since), []
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        selective = bool(params.get("labelSelector") or fields)
        return self._stream(key, matches, selective, start, initial, timeout)

    def _translate(self, event: WatchEvent, matches: Any, selective: bool) -> str | None:
        """The event type a watcher with this selector sees, or None for no event.

        An object whose labels or fields move it into a selection is ADDED for that watcher,
        one that moves out is DELETED, as the API server's watch cache reports them.
        """
        if event.type == "DELETED" or not selective:
            return event.type if matches(event.obj) else None
        before = self.store.state_before(event)
        was_in, now_in = before is not None and matches(before), matches(event.obj)
        if now_in:
            return event.type if was_in else "ADDED"
        return "DELETED" if was_in else None

    async def _stream(
        self,
        key: TypeKey,
        matches: Any,
        selective: bool,
        position: int,
        initial: list[Any],
        timeout: float | None,
    ) -> AsyncIterator[Any]:
        yield b""  # sends the headers now: a watch with nothing to report must still start
        for event in initial:
            yield event
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._closing:
            for event in self.store.events_after(position):
                position = event.resource_version
                seen_as = (
                    self._translate(event, matches, selective) if event.type_key == key else None
                )
                if seen_as is not None:
                    yield {"type": seen_as, "object": event.obj}
            changed = self._changed
            assert changed is not None
            if self.store.resource_version > position:
                continue
            try:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return
