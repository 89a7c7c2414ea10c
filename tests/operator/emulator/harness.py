"""Run the emulator for a test: in a thread of its own, with kubeconfigs and an operator process.

The emulator serves from its own event loop in a background thread, so tests can stay
synchronous: they call the kubernetes client, ``kubectl`` and the operator's HTTP endpoints
directly and read the emulator's store (thread-safe) for assertions. Async tests can use
:class:`~.server.KubeEmulator` directly in their own loop instead.

Pods and local engines (for tests that scrape engine metrics): every address in 127.0.0.0/8
reaches this machine, so :func:`create_ready_pod` gives each emulated pod its own loopback
address as ``status.podIP``. A test binds its stand-in engine's HTTP server to that address and
the pod's container port, and whatever the operator derives from the Pod object
(``http://{podIP}:{port}/metrics``) reaches it, with no address mapping anywhere. (The
scraper's own ``AddressMap`` hook, ``operator/scraper.py``, rewrites ``podIP:port`` to any URL
instead, for engines on arbitrary local ports.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import kmock
import yaml

from .server import KubeEmulator
from .store import CRD_KEY, NAMESPACE_KEY, ObjectStore

T = TypeVar("T")

OPERATOR_COMMAND = [sys.executable, "-m", "kvpilot", "operator"]
"""The real ``kvpilot operator`` command, run with this interpreter."""

ADMIN_TOKEN = "test-admin"
"""Bearer token of the test's own clients (kubectl, the kubernetes client in tests)."""
OPERATOR_TOKEN = "kvpilot-operator"
"""Bearer token of the operator process: its calls are the ones the RBAC test checks."""


@dataclasses.dataclass
class RunningEmulator:
    """A started emulator: its URL, its store, and the calls it has answered."""

    emulator: KubeEmulator
    url: str

    @property
    def store(self) -> ObjectStore:
        """The object store (thread-safe) for direct reads and writes in tests."""
        return self.emulator.store

    def install_crd(self, path: pathlib.Path) -> dict[str, Any]:
        """Create the CustomResourceDefinition in the YAML file at ``path``; returns it."""
        return self.store.create(CRD_KEY, None, yaml.safe_load(path.read_text()))

    def create_namespace(self, name: str) -> None:
        """Create a namespace (objects can only be created in existing namespaces)."""
        self.store.create(NAMESPACE_KEY, None, {"metadata": {"name": name}})

    def write_kubeconfig(self, path: pathlib.Path, token: str = ADMIN_TOKEN) -> pathlib.Path:
        """Write a kubeconfig for this emulator authenticating with ``token``; returns ``path``."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": token, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": token, "namespace": "default"},
                }
            ],
            "current-context": "emulator",
        }
        path.write_text(yaml.safe_dump(config))
        return path


@contextlib.contextmanager
def running_emulator() -> Iterator[RunningEmulator]:
    """Serve a fresh :class:`KubeEmulator` on a random localhost port until the block exits."""
    started = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        async with KubeEmulator() as emulator, kmock.Server(emulator) as server:
            state["running"] = RunningEmulator(emulator, str(server.url).rstrip("/"))
            state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
            started.set()
            await state["stop"].wait()

    def main() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:  # surfaced to the test by the started check below
            state["error"] = exc
            started.set()

    thread = threading.Thread(target=main, name="kube-emulator", daemon=True)
    thread.start()
    started.wait(30)
    if "running" not in state:
        raise RuntimeError(f"the emulator did not start: {state.get('error')!r}")
    try:
        yield state["running"]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(30)


def wait_for(
    predicate: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.1
) -> T:
    """Poll ``predicate`` until it returns something truthy (API errors count as not yet).

    The timeout only bounds a hung test; no test asserts on how long anything took.

    Raises:
        AssertionError: ``timeout`` seconds passed; the message names ``what`` and the last error.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
        except Exception as exc:  # noqa: BLE001 - an object that does not exist yet, etc.
            last_error, result = exc, None
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last error: {last_error!r}")


KOPF_HANDLED_ANNOTATION = "kopf.zalando.org/last-handled-configuration"


def settled(store: ObjectStore, key: tuple[str, str, str], namespace: str, name: str) -> bool:
    """Whether kopf has finished handling the object's current spec.

    kopf records the spec it handled in an annotation once every handler for it succeeded
    (a failing handler is retried instead). Deleting an object while kopf is still handling
    an update makes kopf postpone the finalizer's removal by up to a minute, so tests wait
    for this before deleting.
    """
    obj = store.get(key, namespace, name)
    recorded = obj["metadata"].get("annotations", {}).get(KOPF_HANDLED_ANNOTATION)
    return recorded is not None and json.loads(recorded).get("spec") == obj.get("spec")


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class OperatorProcess:
    """A running ``kvpilot operator`` subprocess and where to reach it."""

    process: subprocess.Popen[bytes]
    log_path: pathlib.Path
    liveness_url: str
    metrics_url: str

    def log(self) -> str:
        """Everything the operator has written to stdout/stderr so far."""
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def operator_process(
    kubeconfig: pathlib.Path,
    log_path: pathlib.Path,
    *extra_args: str,
    namespaces: tuple[str, ...] = (),
) -> Iterator[OperatorProcess]:
    """Run the real ``kvpilot operator`` (standalone) against ``kubeconfig``.

    It watches ``namespaces`` (``--namespace``), or every namespace when none are given. The
    Hugging Face Hub is offline for it (``HF_HUB_OFFLINE=1``): hub sources fail at once with
    ``ConfigUnavailable`` instead of waiting on the network. Stops it with SIGTERM (kopf's
    graceful shutdown) when the block exits, SIGKILL if it hangs.
    """
    liveness_port, metrics_port = free_port(), free_port()
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    args = [
        *OPERATOR_COMMAND,
        "--standalone",
        *([f"--namespace={n}" for n in namespaces] or ["--all-namespaces"]),
        f"--liveness=http://127.0.0.1:{liveness_port}/healthz",
        f"--metrics-port={metrics_port}", "--metrics-host=127.0.0.1",
        "--log-level=debug",
        *extra_args,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    running = OperatorProcess(
        process,
        log_path,
        f"http://127.0.0.1:{liveness_port}/healthz",
        f"http://127.0.0.1:{metrics_port}/metrics",
    )
    try:
        yield running
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@contextlib.contextmanager
def running_operator(
    cluster: RunningEmulator,
    folder: pathlib.Path,
    *extra_args: str,
    namespaces: tuple[str, ...] = (),
) -> Iterator[OperatorProcess]:
    """:func:`operator_process` against ``cluster`` as the operator (``OPERATOR_TOKEN``).

    Its kubeconfig (``config``) and log (``operator.log``) go in ``folder``. When the block
    exits without an error, asserts that the operator is still running (its log otherwise).
    """
    kubeconfig = cluster.write_kubeconfig(folder / "config", token=OPERATOR_TOKEN)
    with operator_process(
        kubeconfig, folder / "operator.log", *extra_args, namespaces=namespaces
    ) as running:
        yield running
        assert running.process.poll() is None, running.log()


_loopback_hosts = itertools.count()


def create_ready_pod(
    store: ObjectStore,
    namespace: str,
    name: str,
    labels: dict[str, str],
    container_port: int = 8000,
    owner: dict[str, Any] | None = None,
) -> str:
    """Create a Running, Ready pod whose ``status.podIP`` is a fresh loopback address.

    Returns the address (``127.0.0.N``); bind a local server to it and ``container_port``.
    """
    n = next(_loopback_hosts)
    ip = f"127.1.{n // 250}.{n % 250 + 1}"
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
            }
        ]
    spec = {
        "containers": [
            {
                "name": "engine",
                "image": "kvpilot",
                "ports": [{"name": "http", "containerPort": container_port}],
            }
        ]
    }
    pods = ("", "v1", "pods")
    store.create(
        pods, namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
    )
    status = {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    store.patch(
        pods,
        namespace,
        name,
        "application/merge-patch+json",
        {"status": status},
        subresource="status",
    )
    return ip
