"""A real Kubernetes control plane as local processes: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok, built from pinned Go modules by
``hack/control-plane/build.sh``.

The API server runs as clusters are usually configured: TLS with client certificates, RBAC and
Node authorization, its default admission plugins plus ``NodeRestriction`` and
``OwnerReferencesPermissionEnforcement`` (on in OpenShift: setting ``blockOwnerDeletion`` needs
``update`` on the owner's ``finalizers``), service account tokens, and an audit log of every
request made by a service account outside ``kube-system`` (what the RBAC tests read). The
controller manager runs every default controller (Deployment, ReplicaSet, garbage collector,
disruption, namespace, persistent volume binder, ...) each with its own service account, as
``kubeadm`` sets it up, but the Endpoints and EndpointSlice ones (they refuse loopback pod
IPs). The scheduler is the default one. kwok simulates the nodes of
``tests/cluster/nodes.py``. The LeaderWorkerSet controller (``sigs.k8s.io/lws``, the add-on
multi-node replicas use) runs beside them with its CRD and webhooks (:mod:`tests.cluster.lws`).

Everything listens on 127.0.0.1; node and pod addresses are in 127.0.0.0/8 too. No component
downloads anything. Any component can be restarted alone (:meth:`ControlPlane.restart`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import yaml

from kvpilot.ports import free_port

from . import lws, pki, processes
from .nodes import DEFAULT_POOLS, NodePool, node_objects

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack" / "control-plane" / "build.sh"
KWOK_CONFIG = pathlib.Path(__file__).with_name("kwok.yaml")
SERVICE_CIDR = "10.96.0.0/16"
"""ClusterIPs are allocated from here; nothing in the suite ever connects to one."""
ADMISSION_PLUGINS = "NodeRestriction,OwnerReferencesPermissionEnforcement"
"""Enabled on top of the API server's default admission plugins."""
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ],
}
# Component -> client identity (CN, O). The superuser group for the test's own clients and for
# kwok, which stands for every node's kubelet.
IDENTITIES = {
    "admin": pki.ClientIdentity("kubernetes-admin", ("system:masters",)),
    "kube-controller-manager": pki.ClientIdentity("system:kube-controller-manager"),
    "kube-scheduler": pki.ClientIdentity("system:kube-scheduler"),
    "kwok": pki.ClientIdentity("kwok-controller", ("system:masters",)),
}


def build_binaries() -> pathlib.Path:
    """Build (or reuse) the control plane binaries; returns their folder.

    Raises:
        RuntimeError: the build failed (its output is in the message).
    """
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=None, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed with exit code {result.returncode}")
    return pathlib.Path(result.stdout.strip().splitlines()[-1])


def write_kubeconfig(
    path: pathlib.Path,
    server: str,
    ca_file: pathlib.Path,
    user: dict[str, Any],
    namespace: str = "default",
) -> pathlib.Path:
    """Write a kubeconfig for ``server`` with the ``user`` entry (cert/key paths or a token)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kvpilot-test",
                "cluster": {"server": server, "certificate-authority": str(ca_file)},
            }
        ],
        "users": [{"name": "user", "user": user}],
        "contexts": [
            {
                "name": "kvpilot-test",
                "context": {"cluster": "kvpilot-test", "user": "user", "namespace": namespace},
            }
        ],
        "current-context": "kvpilot-test",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@dataclasses.dataclass
class Component:
    """One control plane process: its command, how to tell it is up, and the live process."""

    name: str
    command: list[str]
    healthy: Callable[[], bool]
    process: subprocess.Popen[bytes] | None = None


class ControlPlane:
    """Start, restart and stop the control plane in ``workdir`` (certificates, data, logs).

    Attributes:
        url: the API server's URL (``https://127.0.0.1:PORT``).
        admin_kubeconfig: a kubeconfig with cluster-admin rights.
        audit_log: the API server's audit log (JSON lines).
    """

    ORDER = (
        "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok",
        "lws-controller",
    )  # fmt: skip

    def __init__(
        self,
        workdir: pathlib.Path,
        binaries: pathlib.Path,
        pools: tuple[NodePool, ...] = DEFAULT_POOLS,
        subnet: int = 1,
        lws_folder: pathlib.Path | None = None,
    ) -> None:
        """``lws_folder``: what ``hack/control-plane/build-lws.sh`` built (built on demand when
        None)."""
        self.workdir = workdir
        self.binaries = binaries
        self.lws_folder = lws_folder or lws.build()
        self.lws_webhook_port = free_port()
        self.pools = pools
        self.subnet = subnet
        self.pki_dir = workdir / "pki"
        self.log_dir = workdir / "logs"
        self.audit_log = self.log_dir / "audit.log"
        self.apiserver_port = free_port()
        self.url = f"https://127.0.0.1:{self.apiserver_port}"
        self.admin_kubeconfig = workdir / "admin.kubeconfig"
        self.components: dict[str, Component] = {}

    # ---- set-up -----------------------------------------------------------------------------

    def _prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        pki.make_ca(self.pki_dir)
        pki.make_serving_cert(
            self.pki_dir,
            "kube-apiserver",
            ["127.0.0.1"],
            ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"],
        )
        pki.make_serving_cert(self.pki_dir, "lws-webhook", ["127.0.0.1"], ["localhost"])
        lws_certs = self.workdir / "lws-certs"
        lws_certs.mkdir(exist_ok=True)
        for suffix, target in (("crt", "tls.crt"), ("key", "tls.key")):
            (lws_certs / target).write_bytes((self.pki_dir / f"lws-webhook.{suffix}").read_bytes())
        for name, identity in {**IDENTITIES, "lws-controller": lws.IDENTITY}.items():
            cert, key = pki.make_client_cert(self.pki_dir, name, identity)
            write_kubeconfig(
                self.kubeconfig_path(name),
                self.url,
                self.ca_file,
                {"client-certificate": str(cert), "client-key": str(key)},
            )
        (self.workdir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        self.components = {c.name: c for c in self._components()}

    @property
    def ca_file(self) -> pathlib.Path:
        """The cluster CA certificate."""
        return self.pki_dir / f"{pki.CA}.crt"

    def kubeconfig_path(self, name: str) -> pathlib.Path:
        """The kubeconfig of the client identity ``name`` (``IDENTITIES``)."""
        return self.workdir / f"{name}.kubeconfig"

    def _components(self) -> list[Component]:
        bin_, pki_dir, work = self.binaries, self.pki_dir, self.workdir
        etcd_port, peer_port = free_port(), free_port()
        kcm_port, scheduler_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        lws_health_port = free_port()
        lws_config = work / "lws-config.yaml"
        lws_config.write_text(
            yaml.safe_dump(
                lws.configuration(self.lws_webhook_port, lws_health_port, work / "lws-certs")
            )
        )
        kcm = str(self.kubeconfig_path("kube-controller-manager"))
        scheduler = str(self.kubeconfig_path("kube-scheduler"))
        return [
            Component(
                "etcd",
                [
                    str(bin_ / "etcd"), "--name=default", f"--data-dir={work / 'etcd'}",
                    f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
                    f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=default={peer_url}", "--unsafe-no-fsync",
                    "--log-level=warn",
                ],
                lambda: self._http_ok(f"{etcd_url}/health"),
            ),
            Component(
                "kube-apiserver",
                [
                    str(bin_ / "kube-apiserver"),
                    f"--etcd-servers={etcd_url}",
                    "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                    f"--secure-port={self.apiserver_port}",
                    f"--tls-cert-file={pki_dir / 'kube-apiserver.crt'}",
                    f"--tls-private-key-file={pki_dir / 'kube-apiserver.key'}",
                    f"--client-ca-file={self.ca_file}",
                    "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                    f"--service-account-key-file={pki_dir / 'sa.pub'}",
                    f"--service-account-signing-key-file={pki_dir / 'sa.key'}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--authorization-mode=Node,RBAC",
                    f"--enable-admission-plugins={ADMISSION_PLUGINS}",
                    f"--audit-policy-file={work / 'audit-policy.yaml'}",
                    f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
                    "--audit-log-maxsize=0",
                    # The "kubernetes" Service's endpoint would be 127.0.0.1, which Endpoints
                    # refuse (loopback); nothing here uses that Service.
                    "--endpoint-reconciler-type=none",
                    "--profiling=false",
                ],
                lambda: self._http_ok(f"{self.url}/readyz"),
            ),
            Component(
                "kube-controller-manager",
                [
                    str(bin_ / "kube-controller-manager"),
                    f"--kubeconfig={kcm}", f"--authentication-kubeconfig={kcm}",
                    f"--authorization-kubeconfig={kcm}",
                    "--bind-address=127.0.0.1", f"--secure-port={kcm_port}",
                    "--use-service-account-credentials=true",
                    f"--service-account-private-key-file={pki_dir / 'sa.key'}",
                    f"--root-ca-file={self.ca_file}",
                    f"--cluster-signing-cert-file={self.ca_file}",
                    f"--cluster-signing-key-file={pki_dir / 'ca.key'}",
                    # Pod IPs are loopback addresses, which Endpoints and EndpointSlices refuse:
                    # their controllers would only retry and post warnings. Nothing here reaches
                    # pods through a Service (clients use the pods' own addresses).
                    "--controllers=*,-endpoint,-endpointslice,-endpointslicemirroring",
                    "--leader-elect=false",
                    "--profiling=false",
                ],
                lambda: self._http_ok(f"https://127.0.0.1:{kcm_port}/healthz", verify=False),
            ),
            Component(
                "kube-scheduler",
                [
                    str(bin_ / "kube-scheduler"),
                    f"--kubeconfig={scheduler}", f"--authentication-kubeconfig={scheduler}",
                    f"--authorization-kubeconfig={scheduler}",
                    "--bind-address=127.0.0.1", f"--secure-port={scheduler_port}",
                    "--leader-elect=false",
                    "--profiling=false",
                ],
                lambda: self._http_ok(
                    f"https://127.0.0.1:{scheduler_port}/healthz", verify=False
                ),
            ),
            Component(
                "kwok",
                [
                    str(bin_ / "kwok"),
                    f"--kubeconfig={self.kubeconfig_path('kwok')}",
                    f"--config={KWOK_CONFIG}",
                ],
                lambda: True,
            ),
            Component(
                "lws-controller",
                [
                    str(self.lws_folder / "lws-controller"),
                    f"--kubeconfig={self.kubeconfig_path('lws-controller')}",
                    f"--config={lws_config}",
                ],
                lambda: self._http_ok(f"http://127.0.0.1:{lws_health_port}/readyz"),
            ),
        ]  # fmt: skip

    # ---- health -----------------------------------------------------------------------------

    def _ssl_context(self, verify: bool = True) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if not verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(self.pki_dir / "admin.crt", self.pki_dir / "admin.key")
        return context

    def _http_ok(self, url: str, verify: bool = True) -> bool:
        context = self._ssl_context(verify) if url.startswith("https") else None
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as answer:
                return answer.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _wait_healthy(self, component: Component, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert component.process is not None
            if component.process.poll() is not None:
                raise RuntimeError(
                    f"{component.name} exited with {component.process.returncode}; "
                    f"see {self.log_dir / (component.name + '.log')}"
                )
            if component.healthy():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{component.name} did not become healthy within {timeout:.0f} s")

    # ---- lifecycle --------------------------------------------------------------------------

    def _start_component(self, name: str) -> None:
        component = self.components[name]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        component.process = processes.spawn(
            component.command, self.log_dir / f"{name}.log", env=env, cwd=self.workdir
        )
        self._wait_healthy(component)

    def start(self) -> None:
        """Start every component in order and register the nodes; returns once all are up.

        Raises:
            RuntimeError: a component exited or did not become healthy (its log is named).
        """
        self._prepare()
        write_kubeconfig(
            self.admin_kubeconfig,
            self.url,
            self.ca_file,
            {
                "client-certificate": str(self.pki_dir / "admin.crt"),
                "client-key": str(self.pki_dir / "admin.key"),
            },
        )
        for name in self.ORDER:
            if name == "lws-controller":
                self._install_lws()
            self._start_component(name)
        self._register_nodes()

    def restart(self, name: str) -> None:
        """Stop the component ``name`` (SIGTERM) and start it again with the same flags."""
        component = self.components[name]
        if component.process is not None:
            processes.stop(component.process)
        self._start_component(name)

    def stop(self) -> None:
        """Stop every component, last started first."""
        for name in reversed(self.ORDER):
            component = self.components.get(name)
            if component is not None and component.process is not None:
                processes.stop(component.process, grace_seconds=5)

    def _install_lws(self) -> None:
        """The LeaderWorkerSet CRD, the controller's RBAC and its webhooks (see
        :mod:`tests.cluster.lws`), before the controller starts."""
        import base64

        import kubernetes

        client = self.api_client()
        ca_bundle = base64.b64encode(self.ca_file.read_bytes()).decode()
        objects = [
            *lws.crds(self.lws_folder),
            *lws.rbac(self.lws_folder),
            *lws.webhook_configurations(self.lws_folder, self.lws_webhook_port, ca_bundle),
        ]
        for obj in objects:
            kubernetes.utils.create_from_dict(client, obj)
        extensions = kubernetes.client.ApiextensionsV1Api(client)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = extensions.read_custom_resource_definition(lws.CRD_NAME).status
            if any(c.type == "Established" and c.status == "True" for c in status.conditions or []):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the {lws.CRD_NAME} CRD was not Established within 60 s")

    def _register_nodes(self) -> None:
        import kubernetes

        api = kubernetes.client.CoreV1Api(self.api_client())
        nodes = node_objects(self.pools, self.subnet)
        for node in nodes:
            with contextlib.suppress(kubernetes.client.ApiException):
                api.create_node(node)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            nodes = api.list_node().items
            ready = [
                n
                for n in nodes
                if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
            ]
            if len(ready) == len(nodes):
                return
            time.sleep(0.2)
        raise RuntimeError("kwok did not make the nodes Ready within 60 s")

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` with cluster-admin rights."""
        import kubernetes

        return kubernetes.config.new_client_from_config(str(self.admin_kubeconfig))

    def audit_events(self) -> list[dict[str, Any]]:
        """Every audit event logged so far (service accounts outside kube-system only)."""
        if not self.audit_log.exists():
            return []
        events = []
        for line in self.audit_log.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
        return events
