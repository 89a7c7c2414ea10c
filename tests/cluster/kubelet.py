"""A stand-in for the kubelet and its container runtime: runs the containers of the pods kwok
has started as local processes, and reports their readiness, restarts and termination.

This is a hand-written stand-in for a real component (there is no container runtime on the
test machines); tests that rely on it say so. What it does, as a kubelet would:

- Pods that kwok moved to Running (they have an IP from their node's loopback pod CIDR) get
  their containers started: the project's own images as processes of this checkout
  (:mod:`tests.cluster.images`), any other image as a container with no process.
- Networking: a pod's IP is a loopback address of this machine. "0.0.0.0" in a container's
  arguments (listen on every interface of the pod) becomes the pod's IP, so every pod has its
  own address and ports never collide.
- Volumes: every volume is a folder (emptyDir per pod; a PersistentVolumeClaim's folder is
  shared by every pod using the claim and outlives them, like a volume); paths under a
  container's mount points, in its arguments and environment, are mapped to those folders.
  The service account token volume becomes a kubeconfig with the pod's own service account
  token (``KUBECONFIG``): the process authenticates as that service account, so RBAC applies.
- Environment: ``value``, ``secretKeyRef``, ``configMapKeyRef`` and ``fieldRef`` (name,
  namespace, pod IP, node name, service account) are resolved from the API server; a missing
  secret or config map keeps the container waiting (``CreateContainerConfigError``).
- GPUs: a container that asks for ``nvidia.com/gpu`` runs its engine on the CPU
  (``--device cpu``, float32, a small KV cache, ``--tensor-parallel-size 1``): the nodes' GPUs
  are simulated, the engine process is real.
- Probes: the readiness probe (HTTP GET) runs in a thread of its own per container process,
  as the kubelet's prober workers do, about every second (sooner than its ``periodSeconds``, so
  that tests do not wait) with the probe's ``timeoutSeconds``; the container turns ready after
  ``successThreshold`` successes in a row and unready after ``failureThreshold`` failures in
  a row (the kubelet's defaults 1 s, 1 and 3), so one slow answer on a loaded machine does not
  take a serving pod out. ``Ready``/``ContainersReady`` follow it. A container without one is
  ready once started. Liveness and startup probes are not run.
- Restarts: a process that exits is restarted with the kubelet's doubling back-off (1 s,
  doubling, at most 30 s here), ``restartCount`` and ``lastState`` reported.
- Deletion: a pod with a deletion timestamp has each container stopped at once, in parallel,
  as the kubelet does: the container's ``lifecycle.preStop`` hook first (``exec``: the command
  run as a process of the container's image, environment and mounts, with the pod's loopback
  address, ``127.0.0.1`` or ``localhost``, read as the pod's IP, since here a pod's network is
  its IP; ``httpGet``: a GET to the pod's IP), then SIGTERM, then SIGKILL once the pod's
  ``terminationGracePeriodSeconds`` (counted from the start of the hook) has passed, with at
  least 2 s between SIGTERM and SIGKILL when the hook used the whole grace period (the kubelet's
  minimum). A hook's output is appended to the container's log (a kubelet keeps it only in a
  ``FailedPreStopHook`` Event). The pod is then removed (grace period 0), as the kubelet
  confirms a deletion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from kvpilot.operator.apply import KubeApiError, KubeClient

from . import images, processes
from .control_plane import write_kubeconfig

logger = logging.getLogger("tests.cluster.kubelet")

GPU_RESOURCE = "nvidia.com/gpu"
GPU_POD_KV_CACHE_MEMORY = "64MiB"
"""KV cache of an engine whose GPUs are simulated (it runs on the CPU)."""
SERVICE_ACCOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_SECONDS = 7 * 24 * 3600
MAX_BACKOFF_SECONDS = 30.0
MIN_KILL_GRACE_SECONDS = 2.0
"""The kubelet's least time between SIGTERM and SIGKILL after a preStop hook overran."""
POLL_SECONDS = 0.5
PROBE_SECONDS = 1.0


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- pure rewriting of what a container runs ---------------------------------------------------


def bind_to_pod_ip(values: list[str], pod_ip: str) -> list[str]:
    """``values`` with every "0.0.0.0" (all interfaces) replaced by the pod's own IP."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return [re.sub(r"(?<![\d.])0\.0\.0\.0(?![\d.])", host, value) for value in values]


def loopback_to_pod_ip(values: list[str], pod_ip: str) -> list[str]:
    """``values`` with the pod's own loopback address (``127.0.0.1``, ``localhost``) replaced
    by its IP: an exec hook that calls its own container reaches it there."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return [
        re.sub(r"(?<![\w.-])(127\.0\.0\.1|localhost)(?![\w.-])", host, value) for value in values
    ]


def map_paths(value: str, mounts: dict[str, pathlib.Path]) -> str:
    """``value`` with every path under a mount point replaced by the mount's host folder.

    ``mounts`` maps a container mount path to its folder; the longest match wins, and one pass
    replaces them all (a host folder is never mapped again).
    """
    if not mounts:
        return value
    by_length = sorted((m.rstrip("/") for m in mounts), key=len, reverse=True)
    pattern = "|".join(re.escape(m) for m in by_length)
    folders = {m.rstrip("/"): str(folder) for m, folder in mounts.items()}
    return re.sub(
        rf"(?<![\w.-])({pattern})(?=/|$|[\s:,;=\"'])", lambda m: folders[m.group(1)], value
    )


def emulate_gpus(argv: list[str]) -> list[str]:
    """An engine command line that asked for GPUs, rewritten to run on the CPU.

    ``--device cuda`` -> ``cpu``, 16-bit ``--dtype`` -> ``float32``,
    ``--gpu-memory-utilization X`` -> ``--kv-cache-memory GPU_POD_KV_CACHE_MEMORY``,
    ``--tensor-parallel-size N`` -> ``1``.
    """
    out: list[str] = []
    replacements = {
        "--device": lambda _v: "cpu",
        "--dtype": lambda v: "float32" if v in ("bfloat16", "float16", "half") else v,
        "--tensor-parallel-size": lambda _v: "1",
        "-tp": lambda _v: "1",
    }
    i = 0
    while i < len(argv):
        flag, inline, value = argv[i].partition("=")
        has_value = bool(inline) or i + 1 < len(argv)
        if flag == "--gpu-memory-utilization" and has_value:
            out += ["--kv-cache-memory", GPU_POD_KV_CACHE_MEMORY]
            i += 1 if inline else 2
            continue
        if flag in replacements and has_value:
            current = value if inline else argv[i + 1]
            out += [flag, replacements[flag](current)]
            i += 1 if inline else 2
            continue
        out.append(argv[i])
        i += 1
    return out


def asks_for_gpus(container: dict[str, Any]) -> bool:
    """Whether the container requests or limits ``nvidia.com/gpu``."""
    resources = container.get("resources") or {}
    return any(GPU_RESOURCE in (resources.get(part) or {}) for part in ("limits", "requests"))


# ---- state --------------------------------------------------------------------------------------


@dataclasses.dataclass
class ProbeResults:
    """A probe's verdict from its results in a row, as the kubelet's prober worker keeps it: the
    verdict changes only after ``success_threshold`` successes or ``failure_threshold``
    failures in a row, and starts as a failure (a container is not ready before its first
    successful readiness probe)."""

    success_threshold: int = 1
    failure_threshold: int = 3
    ok: bool = False
    last: bool | None = None
    run: int = 0

    def record(self, ok: bool) -> bool:
        """Add one probe's result (True: it succeeded); returns the verdict after it."""
        self.run = self.run + 1 if ok == self.last else 1
        self.last = ok
        if self.run >= (self.success_threshold if ok else self.failure_threshold):
            self.ok = ok
        return self.ok


@dataclasses.dataclass
class ContainerRun:
    """One container of a pod: its process and what is reported about it."""

    spec: dict[str, Any]
    argv: list[str] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: str | None = None
    ready: bool = False
    waiting_reason: str | None = "ContainerCreating"
    waiting_message: str = ""
    last_exit: dict[str, Any] | None = None
    next_start: float = 0.0
    prober: subprocess.Popen[bytes] | None = None
    """The process whose readiness probe thread runs (one per run of the container)."""

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclasses.dataclass
class PodRun:
    """A pod the stand-in runs."""

    namespace: str
    name: str
    uid: str
    ip: str
    sandbox: pathlib.Path
    containers: list[ContainerRun]
    mounts: dict[str, dict[str, pathlib.Path]] = dataclasses.field(default_factory=dict)
    terminating: bool = False
    reported: str = ""


class KubeletStandIn:
    """Runs the pods of the simulated nodes (see the module docstring).

    Args:
        client: a cluster-admin client (the kubelet's own rights are wider than it needs).
        workdir: folder for pod sandboxes (volumes, logs) and claim volumes.
        server: the API server URL, for the pods' service account kubeconfigs.
        ca_file: the cluster CA, for the same.
    """

    def __init__(
        self, client: KubeClient, workdir: pathlib.Path, server: str, ca_file: pathlib.Path
    ) -> None:
        self.client = client
        self.workdir = workdir
        self.server = server
        self.ca_file = ca_file
        self.runs: dict[str, PodRun] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- public -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start supervising pods in a background thread."""
        self._thread = threading.Thread(target=self._loop, name="kubelet-stand-in", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop every process and the supervising thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        with self._lock:
            for run in self.runs.values():
                for container in run.containers:
                    if container.process is not None:
                        processes.stop(container.process, grace_seconds=5)

    def log_path(self, namespace: str, pod: str, container: str) -> pathlib.Path | None:
        """The log file of a container of a pod the stand-in ran (or runs), if any."""
        for run in list(self.runs.values()):
            if (run.namespace, run.name) == (namespace, pod):
                return run.sandbox / "logs" / f"{container}.log"
        candidates = sorted(self.workdir.glob(f"pods/{namespace}_{pod}_*/logs/{container}.log"))
        return candidates[-1] if candidates else None

    def kill_container(self, namespace: str, pod: str, container: str) -> None:
        """SIGKILL a running container's process (a crash); it is restarted as any exit is."""
        for run in list(self.runs.values()):
            if (run.namespace, run.name) == (namespace, pod):
                for c in run.containers:
                    if c.name == container and c.process is not None:
                        processes.kill(c.process)
                        return
        raise LookupError(f"no running container {container} in pod {namespace}/{pod}")

    # ---- loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception:  # noqa: BLE001 - the API server may be restarting; try again
                logger.warning("kubelet stand-in: sync failed", exc_info=True)
            self._stop.wait(POLL_SECONDS)

    def _sync(self) -> None:
        pods = self.client.request("GET", "/api/v1/pods").get("items") or []
        seen = set()
        for pod in pods:
            status = pod.get("status") or {}
            uid = pod["metadata"]["uid"]
            if not pod["spec"].get("nodeName") or not status.get("podIP"):
                continue
            seen.add(uid)
            with self._lock:
                run = self.runs.get(uid)
                if run is None:
                    if pod["metadata"].get("deletionTimestamp"):
                        self._remove(pod)
                        continue
                    run = self.runs[uid] = self._admit(pod)
            if pod["metadata"].get("deletionTimestamp"):
                if not run.terminating:
                    run.terminating = True
                    threading.Thread(target=self._terminate, args=(run, pod), daemon=True).start()
                continue
            self._supervise(run, pod)
            self._report(run, pod)
        with self._lock:
            for uid in [u for u in self.runs if u not in seen]:
                run = self.runs.pop(uid)
                for container in run.containers:
                    if container.process is not None:
                        processes.kill(container.process)

    def _admit(self, pod: dict[str, Any]) -> PodRun:
        meta = pod["metadata"]
        sandbox = self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        sandbox.mkdir(parents=True, exist_ok=True)
        run = PodRun(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=meta["uid"],
            ip=pod["status"]["podIP"],
            sandbox=sandbox,
            containers=[ContainerRun(spec=c) for c in pod["spec"].get("containers") or []],
        )
        return run

    # ---- containers -------------------------------------------------------------------------

    def _volumes(self, run: PodRun, pod: dict[str, Any]) -> dict[str, pathlib.Path]:
        """Volume name -> host folder (made on first use)."""
        folders = {}
        for volume in pod["spec"].get("volumes") or []:
            name = volume["name"]
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim:
                folder = self.workdir / "claims" / run.namespace / claim
            else:
                folder = run.sandbox / "volumes" / name
            folder.mkdir(parents=True, exist_ok=True)
            folders[name] = folder
            if "projected" in volume or "secret" in volume or "configMap" in volume:
                self._fill_volume(run, pod, volume, folder)
        return folders

    def _fill_volume(
        self, run: PodRun, pod: dict[str, Any], volume: dict[str, Any], folder: pathlib.Path
    ) -> None:
        sources = (volume.get("projected") or {}).get("sources") or [volume]
        for source in sources:
            if "serviceAccountToken" in source:
                token = self._token(pod)
                (folder / "token").write_text(token)
                shutil.copy(self.ca_file, folder / "ca.crt")
                (folder / "namespace").write_text(run.namespace)
            for kind, plural in (("secret", "secrets"), ("configMap", "configmaps")):
                ref = source.get(kind)
                if not ref:
                    continue
                name = ref.get("name") or ref.get("secretName")
                obj = self.client.request(
                    "GET", f"/api/v1/namespaces/{run.namespace}/{plural}/{name}"
                )
                for key, value in (obj.get("data") or {}).items():
                    data = value if kind == "configMap" else _b64(value)
                    (folder / key).write_text(data)

    def _token(self, pod: dict[str, Any]) -> str:
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        answer = self.client.request(
            "POST",
            f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "expirationSeconds": TOKEN_SECONDS,
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": meta["name"],
                        "uid": meta["uid"],
                    },
                },
            },
        )
        return answer["status"]["token"]

    def _env(self, run: PodRun, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        """The container's environment (raises LookupError for a missing secret/config map)."""
        env: dict[str, str] = {}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = item["value"]
                continue
            source = item.get("valueFrom") or {}
            if "fieldRef" in source:
                env[item["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
            for kind, plural in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
                ref = source.get(kind)
                if not ref:
                    continue
                try:
                    obj = self.client.request(
                        "GET", f"/api/v1/namespaces/{run.namespace}/{plural}/{ref['name']}"
                    )
                except KubeApiError as exc:
                    if ref.get("optional"):
                        continue
                    raise LookupError(f"{plural[:-1]} {ref['name']!r} not found") from exc
                value = (obj.get("data") or {}).get(ref["key"])
                if value is None:
                    if ref.get("optional"):
                        continue
                    raise LookupError(f"couldn't find key {ref['key']} in {ref['name']}")
                env[item["name"]] = _b64(value) if kind == "secretKeyRef" else value
        return env

    def _prepare(self, run: PodRun, pod: dict[str, Any], container: ContainerRun) -> None:
        folders = self._volumes(run, pod)
        mounts = {
            m["mountPath"]: folders[m["name"]]
            for m in container.spec.get("volumeMounts") or []
            if m["name"] in folders
        }
        command = images.container_argv(container.spec)
        if command is None:
            container.argv = None
            return
        program, argv = command
        argv = bind_to_pod_ip(argv, run.ip)
        if asks_for_gpus(container.spec):
            argv = emulate_gpus(argv)
        env = {
            key: map_paths(value, mounts)
            for key, value in self._env(run, pod, container.spec).items()
        }
        base = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(run.sandbox),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        token_folder = mounts.get(SERVICE_ACCOUNT_PATH)
        if token_folder is not None:
            base["KUBECONFIG"] = str(
                write_kubeconfig(
                    run.sandbox / "serviceaccount.kubeconfig",
                    self.server,
                    self.ca_file,
                    {"token": (token_folder / "token").read_text()},
                    namespace=run.namespace,
                )
            )
        container.argv = program + [map_paths(a, mounts) for a in argv]
        container.env = {**base, **env}
        run.mounts[container.name] = mounts

    def _supervise(self, run: PodRun, pod: dict[str, Any]) -> None:
        for container in run.containers:
            process = container.process
            if process is not None and process.poll() is not None:
                container.last_exit = {
                    "terminated": {
                        "exitCode": process.returncode,
                        "reason": "Completed" if process.returncode == 0 else "Error",
                        "startedAt": container.started_at,
                        "finishedAt": _now(),
                    }
                }
                container.process = None
                container.ready = False
                container.restarts += 1
                backoff = min(MAX_BACKOFF_SECONDS, 2.0 ** (container.restarts - 1))
                container.next_start = time.monotonic() + backoff
                container.waiting_reason = "CrashLoopBackOff"
                container.waiting_message = f"back-off {backoff:.0f}s restarting failed container"
            if (
                container.process is None
                and container.started_at is None
                or (
                    container.process is None
                    and container.waiting_reason == "CrashLoopBackOff"
                    and time.monotonic() >= container.next_start
                )
            ):
                self._start_container(run, pod, container)
            self._probe(run, container)

    def _start_container(self, run: PodRun, pod: dict[str, Any], container: ContainerRun) -> None:
        try:
            self._prepare(run, pod, container)
        except LookupError as exc:
            container.waiting_reason = "CreateContainerConfigError"
            container.waiting_message = str(exc)
            return
        except KubeApiError as exc:
            container.waiting_reason = "CreateContainerError"
            container.waiting_message = str(exc)
            return
        container.started_at = _now()
        container.waiting_reason = None
        container.waiting_message = ""
        if container.argv is None:
            container.ready = True
            return
        log = run.sandbox / "logs" / f"{container.name}.log"
        try:
            container.process = processes.spawn(
                container.argv, log, env=container.env, cwd=run.sandbox
            )
        except OSError as exc:  # as a runtime reports an entrypoint it cannot exec
            container.started_at = None
            container.waiting_reason = "RunContainerError"
            container.waiting_message = str(exc)

    def _probe(self, run: PodRun, container: ContainerRun) -> None:
        if container.argv is None:
            return
        process = container.process
        if process is None:
            container.ready = False
            return
        probe = container.spec.get("readinessProbe")
        http = (probe or {}).get("httpGet")
        if http is None:
            container.ready = True  # no probe, or an exec/tcp one (not run): ready once started
            return
        if container.prober is not process:
            container.prober = process
            port = self._named_port(container, http.get("port"))
            host = f"[{run.ip}]" if ":" in run.ip else run.ip
            url = f"http://{host}:{port}{http.get('path', '/')}"
            threading.Thread(
                target=self._run_probe,
                args=(container, process, url, probe),
                name=f"probe-{run.name}-{container.name}",
                daemon=True,
            ).start()

    def _run_probe(
        self,
        container: ContainerRun,
        process: subprocess.Popen[bytes],
        url: str,
        probe: dict[str, Any],
    ) -> None:
        """The readiness probe of one run of a container, until that process ends."""
        timeout = float(probe.get("timeoutSeconds", 1))
        results = ProbeResults(
            success_threshold=int(probe.get("successThreshold", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
        )
        while not self._stop.is_set() and process.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as answer:
                    ok = 200 <= answer.status < 400
            except (urllib.error.URLError, OSError, ValueError):
                ok = False
            ready = results.record(ok)
            if container.process is not process:
                return
            container.ready = ready
            self._stop.wait(PROBE_SECONDS)

    @staticmethod
    def _named_port(container: ContainerRun, port: Any) -> Any:
        """A probe's or hook's port: a number, or the name of one of the container's ports."""
        if isinstance(port, str) and not port.isdigit():
            return next(
                (
                    p["containerPort"]
                    for p in container.spec.get("ports") or []
                    if p.get("name") == port
                ),
                None,
            )
        return port

    # ---- status -----------------------------------------------------------------------------

    def _container_status(self, container: ContainerRun) -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": container.name,
            "image": container.spec.get("image", ""),
            "imageID": "",
            "ready": container.ready,
            "started": container.process is not None
            or (container.argv is None and container.started_at is not None),
            "restartCount": container.restarts,
        }
        if container.waiting_reason:
            status["state"] = {
                "waiting": {
                    "reason": container.waiting_reason,
                    "message": container.waiting_message,
                }
            }
        else:
            status["state"] = {"running": {"startedAt": container.started_at}}
        if container.last_exit:
            status["lastState"] = container.last_exit
        return status

    def _report(self, run: PodRun, pod: dict[str, Any]) -> None:
        ready = all(c.ready for c in run.containers)
        statuses = [self._container_status(c) for c in run.containers]
        conditions = []
        for kind in ("ContainersReady", "Ready"):
            before = next(
                (c for c in (pod["status"].get("conditions") or []) if c.get("type") == kind), {}
            )
            state = "True" if ready else "False"
            condition = {
                "type": kind,
                "status": state,
                "lastTransitionTime": before.get("lastTransitionTime") or _now(),
            }
            if before.get("status") != state:
                condition["lastTransitionTime"] = _now()
            if not ready:
                waiting = [c.name for c in run.containers if not c.ready]
                condition["reason"] = "ContainersNotReady"
                condition["message"] = f"containers with unready status: [{' '.join(waiting)}]"
            conditions.append(condition)
        key = json.dumps([ready, statuses], sort_keys=True)
        if key == run.reported:
            return
        body = {"status": {"conditions": conditions, "containerStatuses": statuses}}
        try:
            self.client.request(
                "PATCH",
                f"/api/v1/namespaces/{run.namespace}/pods/{run.name}/status",
                body,
                "application/strategic-merge-patch+json",
            )
            run.reported = key
        except KubeApiError as exc:
            logger.debug("status of %s/%s not written: %s", run.namespace, run.name, exc)

    # ---- deletion ---------------------------------------------------------------------------

    def _terminate(self, run: PodRun, pod: dict[str, Any]) -> None:
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        grace = (pod["metadata"].get("deletionGracePeriodSeconds") or grace) if grace else 0
        deadline = time.monotonic() + float(grace)
        stopping = [
            threading.Thread(target=self._stop_container, args=(run, c, deadline), daemon=True)
            for c in run.containers
            if c.process is not None
        ]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()
        self._remove(pod)

    def _stop_container(self, run: PodRun, container: ContainerRun, deadline: float) -> None:
        """preStop hook (bounded by ``deadline``), SIGTERM, SIGKILL at ``deadline``."""
        assert container.process is not None
        hook = (container.spec.get("lifecycle") or {}).get("preStop")
        if hook is not None and deadline > time.monotonic():
            try:
                self._run_hook(run, container, hook, deadline)
            except Exception as exc:  # noqa: BLE001 - a failed hook is reported, then SIGTERM
                logger.info("preStop of %s/%s failed: %s", run.name, container.name, exc)
        remaining = deadline - time.monotonic()
        if hook is not None:
            remaining = max(remaining, MIN_KILL_GRACE_SECONDS)
        processes.stop(container.process, grace_seconds=max(0.0, remaining))

    def _run_hook(
        self, run: PodRun, container: ContainerRun, hook: dict[str, Any], deadline: float
    ) -> None:
        log = run.sandbox / "logs" / f"{container.name}.log"
        if "exec" in hook:
            image = container.spec.get("image", "")
            command = images.container_argv({"image": image, "command": hook["exec"]["command"]})
            if command is None:
                return  # an image without a process: nothing to run the hook in
            program, argv = command
            mounts = run.mounts.get(container.name, {})
            argv = [map_paths(a, mounts) for a in loopback_to_pod_ip(argv, run.ip)]
            process = processes.spawn(program + argv, log, env=container.env, cwd=run.sandbox)
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                processes.kill(process)
            return
        http = hook.get("httpGet")
        if http is not None:
            port = self._named_port(container, http.get("port"))
            host = f"[{run.ip}]" if ":" in run.ip else run.ip
            url = f"http://{host}:{port}{http.get('path', '/')}"
            timeout = max(0.1, deadline - time.monotonic())
            with urllib.request.urlopen(url, timeout=timeout) as answer:
                answer.read()

    def _remove(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(KubeApiError):
            self.client.request(
                "DELETE",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
            )


def _b64(value: str) -> str:
    import base64

    return base64.b64decode(value).decode()


def _field(pod: dict[str, Any], path: str) -> str:
    fields = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "metadata.uid": pod["metadata"]["uid"],
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.podIP": (pod.get("status") or {}).get("podIP", ""),
        "status.hostIP": (pod.get("status") or {}).get("hostIP", ""),
    }
    if path in fields:
        return fields[path]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if match:
        return (pod["metadata"].get(match.group(1)) or {}).get(match.group(2), "")
    raise LookupError(f"fieldRef {path} is not supported by the kubelet stand-in")
