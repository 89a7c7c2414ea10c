"""The router's replicas from the Kubernetes API (``kvpilot router --kubernetes``), and its wake
hook.

Discovery: two list-then-watch loops (each in a thread of its own, the kubernetes client being
synchronous) follow the ``LLMDeployment`` objects the router serves and their engine pods
(label ``kvpilot.dev/llmdeployment``). A pod is a replica while it is Ready, has an IP and no
``deletionTimestamp``: a pod being deleted (a scale-down, a rollout) gets no new request from
the moment the API server marks it, while the requests already relayed there finish (the
engine's preStop hook waits for them, ``kvpilot drain``). Its URL is ``http://<podIP>:<port>``,
the port named ``http`` of its first container (8000 without one). The model names it serves
are its LLMDeployment's (``status.model``, the adapters' names) until the router's own poll of
the replica reads them from the engine.

The wake hook: a request for a model whose deployments have no ready replica makes
:meth:`KubernetesDiscovery.request_wake` write the autoscaler's wake request, the annotation
``kvpilot.dev/wake`` set to the current Unix time, on each such ``LLMDeployment`` whose
``spec.replicas`` is 0 (the operator's wake handler then ticks it at once; see
docs/autoscaling.md). It is written at most once per ``wake_interval_s`` per deployment; the
autoscaler ignores a request older than its last scaling, so a repeat never keeps a
deployment awake longer than its traffic does.

Held requests as demand: while the router holds requests for the model,
:meth:`KubernetesDiscovery.report_held` writes their number in ``kvpilot.dev/held-requests``
together with a fresh ``kvpilot.dev/wake`` time on each deployment serving it that has no
ready pod (at zero, or with its pods still starting), whenever the count changed and at least
every ``wake_interval_s``; once none is held, ``kvpilot.dev/held-requests: "0"``. The
autoscaler starts enough replicas for the requests waiting (one sequence slot each), and
keeps a deployment whose requests wait from being scaled to zero.

What the router's ServiceAccount needs (the operator grants exactly this, per LLMDeployment):
``list`` and ``watch`` on pods, ``get``, ``list``, ``watch`` and ``patch`` on its
``llmdeployments`` (by name).

A watch that ends (its server-side timeout) resumes from the last resourceVersion; a 410 Gone
or any error lists again after a second. The watches never stop the router: while the API
server is away the router keeps the replicas it knew.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from kvpilot.operator.manifests import HTTP_PORT, LLMDEPLOYMENT_LABEL

logger = logging.getLogger("kvpilot.router.kubernetes")

WAKE_ANNOTATION = "kvpilot.dev/wake"
"""The autoscaler's wake request (``kvpilot.operator.autoscaling_handlers.WAKE_ANNOTATION``; a
test checks they agree: the router must not import the operator's kopf handlers)."""
HELD_REQUESTS_ANNOTATION = "kvpilot.dev/held-requests"
"""The requests the router holds for the deployment, as of the ``kvpilot.dev/wake`` time
(``kvpilot.operator.autoscaling_handlers.HELD_REQUESTS_ANNOTATION``, checked alike)."""
LLMD_GROUP, LLMD_VERSION, LLMD_PLURAL = "kvpilot.dev", "v1alpha1", "llmdeployments"
WATCH_TIMEOUT_S = 300
RELIST_DELAY_S = 1.0


def is_ready(pod: dict[str, Any]) -> bool:
    """Ready (condition ``Ready`` True), with an IP, and not being deleted."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return ready and bool(status.get("podIP")) and not meta.get("deletionTimestamp")


def pod_url(pod: dict[str, Any]) -> str | None:
    """The engine's base URL on a ready pod (``http://<podIP>:<http port>``), else None."""
    if not is_ready(pod):
        return None
    port = HTTP_PORT
    containers = (pod.get("spec") or {}).get("containers") or []
    for spec_port in (containers[0].get("ports") or []) if containers else []:
        if spec_port.get("name") == "http":
            port = int(spec_port["containerPort"])
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def served_models(llmd: dict[str, Any]) -> set[str]:
    """The model names an LLMDeployment's engines serve: ``status.model`` (the served model
    name the operator computed) and its adapters' names; empty before its first reconcile."""
    names = set()
    model = (llmd.get("status") or {}).get("model")
    if model:
        names.add(model)
    for adapter in (llmd.get("spec") or {}).get("adapters") or []:
        if adapter.get("name"):
            names.add(adapter["name"])
    return names


def replicas_by_url(
    llmds: dict[str, dict[str, Any]], pods: dict[str, dict[str, Any]]
) -> dict[str, set[str]]:
    """URL -> model names of every ready pod of a known LLMDeployment (pure)."""
    out: dict[str, set[str]] = {}
    for pod in pods.values():
        owner = ((pod.get("metadata") or {}).get("labels") or {}).get(LLMDEPLOYMENT_LABEL)
        url = pod_url(pod)
        if owner in llmds and url is not None:
            out[url] = served_models(llmds[owner])
    return out


class KubernetesDiscovery:
    """Follows LLMDeployments and their engine pods in one namespace (see the module docstring).

    Args:
        namespace: the namespace to watch.
        names: the LLMDeployments to serve; empty: every one in the namespace.
        on_change: awaited with URL -> model names after every change of the ready replicas.
        client: a ``kubernetes.client.ApiClient`` (default: in-cluster, else ``KUBECONFIG``).
        wake_interval_s: the least time between two wake requests for one deployment.

    Raises:
        kubernetes.config.ConfigException: no cluster configuration (when ``client`` is None).
    """

    def __init__(
        self,
        namespace: str,
        names: list[str],
        on_change: Callable[[dict[str, set[str]]], Awaitable[None]],
        client: Any = None,
        wake_interval_s: float = 5.0,
    ) -> None:
        import kubernetes

        if client is None:
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
            client = kubernetes.client.ApiClient()
        client.user_agent = "kvpilot-router"
        self.client = client
        self.namespace = namespace
        self.names = list(names)
        self.on_change = on_change
        self.wake_interval_s = wake_interval_s
        self.llmds: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self._woken: dict[str, float] = {}
        self._held_written: dict[str, int] = {}  # deployment -> held count last written
        self._changed = asyncio.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._published: dict[str, set[str]] | None = None
        self._lock = threading.Lock()  # the watch threads write llmds and pods

    # ---- what the router asks -------------------------------------------------------------

    def models(self) -> set[str]:
        """Every model name the watched LLMDeployments serve, with replicas or at zero."""
        with self._lock:
            return {m for llmd in self.llmds.values() for m in served_models(llmd)}

    def can_wake(self, model: str) -> bool:
        """Whether a watched LLMDeployment serves ``model`` (the router then holds a request
        for it while no replica is ready, instead of answering 404)."""
        return model in self.models()

    async def request_wake(self, model: str) -> None:
        """Record a wake request on every watched LLMDeployment serving ``model`` at 0 replicas
        (the wake hook; see the module docstring). A refused write is logged, not raised: the
        request then waits out its timeout, as it would for a slow start.
        """
        now = time.time()
        with self._lock:
            llmds = list(self.llmds.items())
        for name, llmd in llmds:
            if model not in served_models(llmd):
                continue
            if (llmd.get("spec") or {}).get("replicas", 1) != 0:
                continue
            if now - self._woken.get(name, float("-inf")) < self.wake_interval_s:
                continue
            self._woken[name] = now
            await self._annotate(name, {WAKE_ANNOTATION: f"{now:.3f}"}, "wake request")

    async def report_held(self, model: str, held: int) -> None:
        """Write ``held`` (requests held for ``model``) with a fresh wake time on each watched
        LLMDeployment serving ``model`` without a ready pod, when it changed or
        ``wake_interval_s`` passed since the last write; 0 once, when none is held any more
        (see the module docstring). A refused write is logged, not raised."""
        now = time.time()
        with self._lock:
            llmds = list(self.llmds.items())
            ready = {
                (pod.get("metadata") or {}).get("labels", {}).get(LLMDEPLOYMENT_LABEL)
                for pod in self.pods.values()
                if is_ready(pod)
            }
        for name, llmd in llmds:
            if model not in served_models(llmd):
                continue
            last = self._held_written.get(name, 0)
            if held == 0:
                if last == 0:
                    continue
                annotations = {HELD_REQUESTS_ANNOTATION: "0"}
            else:
                recent = now - self._woken.get(name, float("-inf")) < self.wake_interval_s
                if name in ready or (recent and held == last):
                    continue
                self._woken[name] = now
                annotations = {WAKE_ANNOTATION: f"{now:.3f}", HELD_REQUESTS_ANNOTATION: str(held)}
            self._held_written[name] = held
            await self._annotate(name, annotations, f"{held} held requests")

    async def _annotate(self, name: str, annotations: dict[str, str], what: str) -> None:
        """Merge ``annotations`` into LLMDeployment ``name``'s; a refusal is logged."""
        try:
            await asyncio.to_thread(self._patch_annotations, name, annotations)
            logger.info("%s for LLMDeployment %s/%s", what, self.namespace, name)
        except Exception as exc:  # noqa: BLE001 - an API refusal or outage
            logger.warning("%s for %s/%s failed: %s", what, self.namespace, name, exc)

    def _patch_annotations(self, name: str, annotations: dict[str, str]) -> None:
        path = f"/apis/{LLMD_GROUP}/{LLMD_VERSION}/namespaces/{self.namespace}/{LLMD_PLURAL}/{name}"
        body = {"metadata": {"annotations": annotations}}
        response = self.client.call_api(
            *self.client.param_serialize(
                "PATCH",
                path,
                header_params={"Content-Type": "application/merge-patch+json"},
                body=body,
                auth_settings=["BearerToken"],
            ),
            _request_timeout=30,
        )
        response.read()
        if not 200 <= response.status < 300:
            raise RuntimeError(f"PATCH {path}: HTTP {response.status}: {response.data[:200]!r}")

    # ---- running --------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch until cancelled, calling ``on_change`` after each change of the replicas."""
        self._loop = asyncio.get_running_loop()
        threads = [
            threading.Thread(target=self._follow, args=(kind, query), daemon=True)
            for kind, query in self._watches()
        ]
        for thread in threads:
            thread.start()
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                with self._lock:
                    current = replicas_by_url(self.llmds, self.pods)
                if current != self._published:
                    self._published = current
                    await self.on_change(current)
        finally:
            self._stop.set()

    def _watches(self) -> list[tuple[str, dict[str, str]]]:
        if self.names:
            selector = f"{LLMDEPLOYMENT_LABEL} in ({','.join(sorted(self.names))})"
            llmds = [("llmd", {"fieldSelector": f"metadata.name={n}"}) for n in self.names]
        else:
            selector = LLMDEPLOYMENT_LABEL
            llmds = [("llmd", {})]
        return [("pod", {"labelSelector": selector}), *llmds]

    def _collection(self, kind: str) -> str:
        if kind == "pod":
            return f"/api/v1/namespaces/{self.namespace}/pods"
        return f"/apis/{LLMD_GROUP}/{LLMD_VERSION}/namespaces/{self.namespace}/{LLMD_PLURAL}"

    def _store(self, kind: str) -> dict[str, dict[str, Any]]:
        return self.pods if kind == "pod" else self.llmds

    def _notify(self) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._changed.set)

    def _get(self, path: str, query: dict[str, str], stream: bool = False) -> Any:
        url = f"{path}?{urllib.parse.urlencode(query)}"
        response = self.client.call_api(
            *self.client.param_serialize(
                "GET", url, header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
            ),
            _request_timeout=WATCH_TIMEOUT_S + 30 if stream else 30,
        )  # fmt: skip
        if stream:
            return response.response  # urllib3's, unread: the watch's lines as they come
        response.read()
        if not 200 <= response.status < 300:
            raise RuntimeError(f"GET {url}: HTTP {response.status}: {response.data[:200]!r}")
        return json.loads(response.data)

    def _follow(self, kind: str, query: dict[str, str]) -> None:
        """List, then watch from the list's resourceVersion, for ever (a thread)."""
        path = self._collection(kind)
        name_filter = query.get("fieldSelector", "").removeprefix("metadata.name=") or None
        while not self._stop.is_set():
            try:
                listing = self._get(path, query)
                store = self._store(kind)
                with self._lock:
                    for key in [k for k in store if name_filter in (None, k)]:
                        del store[key]
                    for item in listing.get("items") or []:
                        store[item["metadata"]["name"]] = item
                self._notify()
                version = listing["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    version = self._watch_once(kind, path, query, version)
                    if version is None:
                        break  # 410 Gone: list again
            except Exception as exc:  # noqa: BLE001 - API outages: keep what is known, retry
                logger.warning("watching %s in %s: %s; listing again", kind, self.namespace, exc)
            self._stop.wait(RELIST_DELAY_S)

    def _watch_once(self, kind: str, path: str, query: dict[str, str], version: str) -> str | None:
        """One watch request; returns the last resourceVersion, or None after a 410."""
        watch = {
            **query,
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        response = self._get(path, watch, stream=True)
        try:
            if response.status == 410:
                return None
            if response.status != 200:
                raise RuntimeError(f"watch {path}: HTTP {response.status}")
            store = self._store(kind)
            buffer = b""
            for chunk in response.stream(4096, decode_content=True):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in filter(None, lines):
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        if obj.get("code") == 410:
                            return None
                        raise RuntimeError(f"watch {path}: {obj.get('message')}")
                    version = (obj.get("metadata") or {}).get("resourceVersion", version)
                    if event.get("type") == "BOOKMARK":
                        continue
                    name = obj["metadata"]["name"]
                    with self._lock:
                        if event.get("type") == "DELETED":
                            store.pop(name, None)
                        else:
                            store[name] = obj
                    self._notify()
                if self._stop.is_set():
                    break
            return version
        finally:
            response.release_conn()
