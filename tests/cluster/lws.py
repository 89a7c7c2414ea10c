"""The LeaderWorkerSet controller (``sigs.k8s.io/lws``) as a control plane component.

``hack/control-plane/build-lws.sh`` builds the controller from its pinned Go module and copies,
from the same module, what its release installs beside it: the ``LeaderWorkerSet`` CRD, the
controller's ClusterRole and its admission webhooks. This module installs those as the
release's kustomization would, with two changes that the test machines need:

- The webhooks are called at ``https://127.0.0.1:PORT`` (``clientConfig.url``) instead of
  through the ``webhook-service`` Service (nothing here connects to a ClusterIP); their
  serving certificate is issued by the cluster's CA instead of the controller's own cert
  rotation (``internalCertManagement.enable: false``).
- The controller authenticates with a client certificate (user ``system:lws-controller``)
  bound to its ClusterRole, instead of a service account token: it is held to the same RBAC.

The pod webhooks keep the release's ``objectSelector`` (only pods that carry the
``leaderworkerset.sigs.k8s.io/name`` label), applied from the module's own kustomize patches.
"""

from __future__ import annotations

import copy
import pathlib
import subprocess
from typing import Any

import yaml

from . import pki

BUILD_SCRIPT = (
    pathlib.Path(__file__).resolve().parents[2] / "hack" / "control-plane" / "build-lws.sh"
)
CRD_FILE = "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"
IDENTITY = pki.ClientIdentity("system:lws-controller")
"""The controller's client identity, bound to the module's ``manager-role`` ClusterRole."""


def build() -> pathlib.Path:
    """Build (or reuse) the controller; returns the folder with it and its manifests.

    Raises:
        RuntimeError: the build failed (its output went to stderr).
    """
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=None, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed with exit code {result.returncode}")
    return pathlib.Path(result.stdout.strip().splitlines()[-1])


def crd(folder: pathlib.Path) -> dict[str, Any]:
    """The ``LeaderWorkerSet`` CustomResourceDefinition the pinned module ships."""
    return yaml.safe_load((folder / CRD_FILE).read_text())


def crds(folder: pathlib.Path) -> list[dict[str, Any]]:
    """Every CRD the module ships (``LeaderWorkerSet`` and ``DisaggregatedSet``, which the
    controller also watches: without it the controller logs errors and its cache never syncs
    that kind)."""
    return [yaml.safe_load(path.read_text()) for path in sorted(folder.glob("*.x-k8s.io_*.yaml"))]


def leader_worker_set_schema(folder: pathlib.Path) -> dict[str, Any]:
    """The OpenAPI v3 schema of ``leaderworkerset.x-k8s.io/v1`` objects (for validating
    rendered manifests without a cluster)."""
    for version in crd(folder)["spec"]["versions"]:
        if version["name"] == "v1":
            return version["schema"]["openAPIV3Schema"]
    raise KeyError(f"{CRD_FILE} has no v1 version")


def _patched(configuration: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """``configuration`` with the kustomize JSON patch ``patch`` applied (only the
    ``replace /webhooks/N`` operations the module's patches use)."""
    out = copy.deepcopy(configuration)
    for op in patch:
        parts = op["path"].strip("/").split("/")
        if op["op"] != "replace" or len(parts) != 2 or parts[0] != "webhooks":
            raise ValueError(f"unexpected webhook patch operation {op}")
        out["webhooks"][int(parts[1])] = op["value"]
    return out


def webhook_configurations(folder: pathlib.Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """The module's Mutating- and ValidatingWebhookConfiguration, patched as its release is,
    calling the controller at ``https://127.0.0.1:port`` with ``ca_bundle`` (base64 PEM)."""
    patches = {
        "MutatingWebhookConfiguration": "webhook-mutating-patch.yaml",
        "ValidatingWebhookConfiguration": "webhook-validating-patch.yaml",
    }
    out = []
    for configuration in yaml.safe_load_all((folder / "webhook-manifests.yaml").read_text()):
        if not configuration:
            continue
        patch = yaml.safe_load((folder / patches[configuration["kind"]]).read_text())
        configuration = _patched(configuration, patch)
        configuration["metadata"]["name"] = f"lws-{configuration['metadata']['name']}"
        for webhook in configuration["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": ca_bundle,
            }
        out.append(configuration)
    return out


def rbac(folder: pathlib.Path) -> list[dict[str, Any]]:
    """The controller's ClusterRole (from the module) and its binding to :data:`IDENTITY`."""
    role = yaml.safe_load((folder / "manager-role.yaml").read_text())
    role["metadata"]["name"] = "lws-manager-role"
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "lws-manager-rolebinding"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role["metadata"]["name"],
        },
        "subjects": [
            {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": IDENTITY.user}
        ],
    }
    return [role, binding]


def configuration(webhook_port: int, health_port: int, cert_dir: pathlib.Path) -> dict[str, Any]:
    """The controller's ``config.lws.x-k8s.io/v1alpha1`` Configuration: webhooks on
    127.0.0.1 with certificates from ``cert_dir``, no cert rotation, no leader election, no
    metrics endpoint, health probes on 127.0.0.1."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
    }
