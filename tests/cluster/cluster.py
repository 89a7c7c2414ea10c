"""The test cluster as one object: the control plane, the kubelet stand-in, and the clients and
command-line tools a test or a person uses against it (kubectl, helm).

The suite starts one cluster per session (:func:`tests.cluster.fixtures.kube`) and gives each
test a namespace of its own; ``make cluster`` starts the same cluster for a person
(``python -m tests.cluster``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pathlib
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import yaml

from kvpilot.operator.apply import KubeApiError, KubeClient

from .control_plane import ControlPlane, build_binaries
from .kubelet import KubeletStandIn
from .nodes import DEFAULT_POOLS, NodePool

T = TypeVar("T")

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpilot"
TOOLS = REPO / ".tools" / "bin"
LLMD_API = "kvpilot.dev/v1alpha1"
DESCRIBE_TIMEOUT = 30
"""Seconds each ``kubectl`` of a failed test's namespace report may take."""
_counter = itertools.count(1)


class ToolError(subprocess.CalledProcessError):
    """A kubectl or helm command failed; its message carries the command's output."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr}{self.stdout}"


def wait_for(
    predicate: Callable[[], T], what: str, timeout: float = 120.0, interval: float = 0.2
) -> T:
    """Poll ``predicate`` until it returns something truthy (exceptions count as not yet).

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


class Cluster:
    """A running test cluster (see the module docstring).

    Attributes:
        control_plane: the etcd, API server, controller manager, scheduler and kwok processes.
        kubelet: the stand-in that runs the pods' containers.
        client: a cluster-admin JSON client (``kvpilot.operator.apply.KubeClient``).
        kubeconfig: the cluster-admin kubeconfig (what ``KUBECONFIG`` should point at).
    """

    def __init__(
        self,
        workdir: pathlib.Path,
        pools: tuple[NodePool, ...] = DEFAULT_POOLS,
        binaries: pathlib.Path | None = None,
        subnet: int = 1,
    ) -> None:
        """``subnet``: the second octet of the pod addresses (``127.SUBNET.*``); clusters that
        run at the same time need different ones."""
        self.workdir = workdir
        self.control_plane = ControlPlane(workdir, binaries or build_binaries(), pools, subnet)
        self.kubeconfig = self.control_plane.admin_kubeconfig
        self.client: KubeClient | None = None
        self.kubelet: KubeletStandIn | None = None

    def start(self) -> Cluster:
        """Start the control plane, register the nodes and start running pods."""
        self.control_plane.start()
        self.client = KubeClient(self.control_plane.api_client())
        self.kubelet = KubeletStandIn(
            KubeClient(self.control_plane.api_client()),
            self.workdir,
            self.control_plane.url,
            self.control_plane.ca_file,
        )
        self.kubelet.start()
        return self

    def stop(self) -> None:
        """Stop the pods' processes, then the control plane."""
        if self.kubelet is not None:
            self.kubelet.stop()
        self.control_plane.stop()

    # ---- tools ------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """This process's environment pointed at the cluster (``KUBECONFIG``, tools on PATH)."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{TOOLS}:{os.environ.get('PATH', '')}",
        }

    def run(
        self,
        tool: str,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl`` or ``helm`` (from ``.tools/bin``) against the cluster, for at most
        ``timeout`` seconds.

        Raises:
            subprocess.CalledProcessError: with ``check`` and a non-zero exit (output included).
            subprocess.TimeoutExpired: past ``timeout``.
        """
        result = subprocess.run(
            [str(TOOLS / tool), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise ToolError(result.returncode, result.args, result.stdout, result.stderr)
        return result

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """``kubectl ARGS`` against the cluster (see :meth:`run`)."""
        return self.run("kubectl", *args, **kwargs)

    def helm(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """``helm ARGS`` against the cluster (see :meth:`run`)."""
        return self.run("helm", *args, **kwargs)

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]]) -> None:
        """``kubectl apply`` an object (or several) given as dicts."""
        docs = obj if isinstance(obj, list) else [obj]
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

    # ---- objects ----------------------------------------------------------------------------

    def api(self) -> KubeClient:
        """The cluster-admin client (the cluster must be started)."""
        assert self.client is not None, "the cluster is not started"
        return self.client

    def get(self, path: str) -> dict[str, Any] | None:
        """GET an API path; None on 404."""
        try:
            return self.api().request("GET", path)
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    def items(self, path: str, **query: str) -> list[dict[str, Any]]:
        """The items of a list path, with optional query parameters (``labelSelector``...)."""
        if query:
            import urllib.parse

            path = f"{path}?{urllib.parse.urlencode(query)}"
        return self.api().request("GET", path).get("items") or []

    def wait_for_owner_kind(self, api_version: str, kind: str) -> None:
        """Wait until the API server's admission knows ``kind`` (a CRD just installed) as an
        owner: until its discovery is refreshed (every 10 s), ``OwnerReferencesPermissionEnforcement``
        refuses any user's object that sets ``blockOwnerDeletion`` on an owner of that kind with a
        403 ("cannot find RESTMapping"), which is not the RBAC a test checks. Probes with a
        server-side dry run of such an object, retried (nothing is stored)."""
        probe = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "generateName": "owner-probe-",
                "ownerReferences": [
                    {
                        "apiVersion": api_version,
                        "kind": kind,
                        "name": "probe",
                        "uid": "00000000-0000-0000-0000-000000000000",
                        "blockOwnerDeletion": True,
                    }
                ],
            },
        }
        wait_for(
            lambda: self.api().request(
                "POST", "/api/v1/namespaces/default/configmaps?dryRun=All", probe
            ),
            f"the API server to map {api_version} {kind} for owner references",
        )

    def create_namespace(self, prefix: str = "t") -> str:
        """Create a namespace with a unique name starting with ``prefix``; returns the name."""
        name = f"{prefix}-{next(_counter)}-{os.getpid() % 10000}"
        self.api().request(
            "POST",
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
        )
        return name

    def events(self, namespace: str, name: str | None = None) -> list[dict[str, Any]]:
        """Events in ``namespace`` (about the object ``name`` when given), oldest first."""
        query = {"fieldSelector": f"involvedObject.name={name}"} if name else {}
        items = self.items(f"/api/v1/namespaces/{namespace}/events", **query)
        return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    # ---- LLMDeployments ---------------------------------------------------------------------

    def install_crd(self) -> dict[str, Any]:
        """Apply the chart's rendering of the LLMDeployment CRD and wait until it is served."""
        rendered = self.helm("template", "crds", str(CHART), "--show-only", "templates/crds.yaml")
        self.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", "-", input=rendered.stdout
        )
        name = "llmdeployments.kvpilot.dev"
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"

        def established() -> dict[str, Any] | None:
            crd = self.get(path) or {}
            conds = {
                c["type"]: c["status"] for c in (crd.get("status") or {}).get("conditions") or []
            }
            return crd if conds.get("Established") == "True" else None

        return wait_for(established, "the CRD to be established")

    def llmd_path(
        self, namespace: str, name: str | None = None, subresource: str | None = None
    ) -> str:
        """The REST path of an LLMDeployment (or of the namespace's collection)."""
        parts = [f"/apis/{LLMD_API}/namespaces/{namespace}/llmdeployments", name, subresource]
        return "/".join(p for p in parts if p)

    def create_llmd(self, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Create an LLMDeployment; returns it as stored."""
        body = {
            "apiVersion": LLMD_API,
            "kind": "LLMDeployment",
            "metadata": {"name": name},
            "spec": spec,
        }
        return self.api().request("POST", self.llmd_path(namespace), body)

    def admission_error(self, namespace: str, obj: dict[str, Any]) -> KubeApiError | None:
        """What the API server says to creating the LLMDeployment ``obj`` (dry run, strict
        field validation, as ``kubectl apply`` sends it): None when it would accept it."""
        try:
            self.api().request(
                "POST", self.llmd_path(namespace) + "?dryRun=All&fieldValidation=Strict", obj
            )
        except KubeApiError as exc:
            return exc
        return None

    def stored(self, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        """``obj`` as the API server would store it (dry run: defaults applied, nothing kept)."""
        return self.api().request("POST", self.llmd_path(namespace) + "?dryRun=All", obj)

    def llmd(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The LLMDeployment as stored now, or None."""
        return self.get(self.llmd_path(namespace, name))

    # ---- the operator -----------------------------------------------------------------------

    @contextlib.contextmanager
    def operator(
        self,
        namespace: str,
        *,
        release: str | None = None,
        values: dict[str, Any] | None = None,
        watch: tuple[str, ...] | None = None,
        uninstall: bool = True,
    ) -> Iterator[str]:
        """``helm install`` the chart into ``namespace`` and wait for its operator pod to run.

        ``watch``: the namespaces it watches (default: ``namespace`` itself); ``values``: more
        chart values (merged over the defaults of this helper). Yields the release name; the
        release is uninstalled afterwards (unless ``uninstall`` is False).

        The router is off here (``router.enabled: false``) unless ``values`` turn it on: a
        router process per LLMDeployment would cost every test CPU it does not need; the
        router's own tests (``tests/router/test_router_cluster.py``) and the RBAC test of
        the default install run it.
        """
        release = release or f"kvp{next(_counter)}"
        merged: dict[str, Any] = {
            "crds": {"install": False},
            "operator": {
                "watchNamespaces": list(watch if watch is not None else (namespace,)),
                "extraArgs": ["--retry-delay=1", "--autoscale-interval=2"],
            },
            "router": {"enabled": False},
        }
        _deep_update(merged, values or {})
        values_file = self.workdir / f"values-{release}.yaml"
        values_file.write_text(yaml.safe_dump(merged))
        self.helm(
            "install",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--values",
            str(values_file),
            "--wait",
            "--timeout",
            "5m",
        )
        try:
            yield release
        finally:
            if uninstall:
                self.helm("uninstall", release, "--namespace", namespace, "--wait", check=False)

    def describe_namespace(self, namespace: str, log_lines: int = 40) -> str:
        """Objects, Events and the tail of every pod's log in ``namespace`` (for failures).
        Each ``kubectl`` gets ``DESCRIBE_TIMEOUT`` seconds: an API server that stopped
        answering (a full disk stops etcd) is reported as such instead of holding the report
        for minutes."""
        assert self.kubelet is not None
        queries = [
            ("get", "llmd,deploy,rs,pods,pvc", "-o", "wide"),
            ("get", "llmd", "-o", "yaml"),
            ("get", "events", "--sort-by=.lastTimestamp"),
        ]
        parts = []
        for query in queries:
            try:
                out = self.kubectl(*query, "-n", namespace, check=False, timeout=DESCRIBE_TIMEOUT)
                parts.append(out.stdout)
            except subprocess.TimeoutExpired:
                parts.append(f"kubectl {' '.join(query)}: no answer in {DESCRIBE_TIMEOUT} s")
        for path in sorted(self.workdir.glob(f"pods/{namespace}_*/logs/*.log")):
            tail = path.read_text(errors="replace").splitlines()[-log_lines:]
            parts.append(f"--- {path.relative_to(self.workdir)} ---\n" + "\n".join(tail))
        return "\n".join(parts)

    def operator_pod(self, namespace: str) -> dict[str, Any]:
        """The running operator pod in ``namespace`` (waits for it)."""

        def running() -> dict[str, Any] | None:
            pods = self.items(
                f"/api/v1/namespaces/{namespace}/pods",
                labelSelector="app.kubernetes.io/component=operator",
            )
            live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            ready = [p for p in live if condition(p, "Ready").get("status") == "True"]
            return ready[0] if len(live) == 1 and ready else None

        return wait_for(running, f"the operator pod in {namespace}")

    def operator_metrics(self, namespace: str) -> str:
        """The operator's own /metrics text (port 9090 of its pod)."""
        import urllib.request

        ip = self.operator_pod(namespace)["status"]["podIP"]
        with urllib.request.urlopen(f"http://{ip}:9090/metrics", timeout=10) as answer:
            return answer.read().decode()

    def operator_log(self, namespace: str) -> str:
        """The log of the operator pod(s) in ``namespace`` (what the kubelet stand-in saved)."""
        assert self.kubelet is not None
        texts = []
        for pod in self.items(
            f"/api/v1/namespaces/{namespace}/pods",
            labelSelector="app.kubernetes.io/component=operator",
        ):
            path = self.kubelet.log_path(namespace, pod["metadata"]["name"], "operator")
            if path is not None and path.exists():
                texts.append(path.read_text(errors="replace"))
        return "\n".join(texts)


def _deep_update(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value


def dump(obj: Any) -> str:
    """JSON for assertion messages."""
    return json.dumps(obj, indent=1, sort_keys=True, default=str)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    """The status condition ``type_`` of ``obj`` (``{}`` when it has none)."""
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return {}
