"""The Helm chart on a real control plane: install as users do, RBAC held to exactly what the
operator calls (read back from the API server's audit log), upgrades, uninstall orders, globs.

These tests change cluster-wide state (an operator watching every namespace, the CRD), so they
run on clusters of their own (``own_cluster``), not the session's.
"""

from __future__ import annotations

import base64
import json
import pathlib
import tarfile
import urllib.parse

import pytest
import yaml

from tests.cluster import CHART, Cluster, condition, dump, wait_for
from tests.cluster.fixtures import own_cluster
from tests.cluster.specs import NO_ENGINE, engineless

PREVIOUS_CHART = pathlib.Path(__file__).parents[2] / "chart" / "previous" / "kvpilot-0.1.0.tgz"
"""The chart as released before this one (crds/ folder, no CRD upgrades)."""
RELEASE_NAMESPACE = "kvpilot-system"
OPERATOR_USER = f"system:serviceaccount:{RELEASE_NAMESPACE}:kvpilot-operator"
FAST = ["--retry-delay=1", "--autoscale-interval=2", "--resync-interval=5"]

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Cluster:
    with own_cluster(tmp_path_factory.mktemp("fresh-cluster")) as cluster:
        yield cluster


def install(
    kube: Cluster, *sets: str, chart: pathlib.Path = CHART, release: str = "kvpilot"
) -> None:
    extra = ",".join(FAST)
    kube.helm(
        "upgrade", "--install", release, str(chart), "--namespace", RELEASE_NAMESPACE,
        "--create-namespace", "--wait", "--timeout", "5m",
        f"--set-json=operator.extraArgs={json.dumps(FAST)}", *sets,
    )  # fmt: skip
    assert extra  # the flags above make its loops tick fast enough for a test
    # The operator's first children should not meet the admission's lag on the new CRD (a 403
    # that its retry gets past: refused_for_good does not count it, but it is noise).
    kube.wait_for_owner_kind("kvpilot.dev/v1alpha1", "LLMDeployment")


def rendered_rules(kube: Cluster, *sets: str) -> list[dict]:
    """The rules of every Role and ClusterRole the chart renders with ``sets``."""
    text = kube.helm(
        "template", "kvpilot", str(CHART), "--namespace", RELEASE_NAMESPACE, *sets
    ).stdout
    return [
        rule
        for doc in yaml.safe_load_all(text)
        if doc and doc["kind"] in ("ClusterRole", "Role")
        for rule in doc["rules"]
    ]


def audit_calls(kube: Cluster, user: str) -> list[dict]:
    """The API calls ``user`` made, from the API server's audit log: verb, group, resource
    (with its subresource), name, HTTP code, request URI and, for a refusal, its message."""
    calls = []
    for event in kube.control_plane.audit_events():
        ref = event.get("objectRef") or {}
        if event.get("user", {}).get("username") != user or not ref.get("resource"):
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        calls.append(
            {
                "verb": event["verb"],
                "group": ref.get("apiGroup", ""),
                "resource": resource,
                "name": ref.get("name"),
                "code": (event.get("responseStatus") or {}).get("code"),
                "uri": event.get("requestURI", ""),
                "message": (event.get("responseStatus") or {}).get("message", ""),
            }
        )
    return calls


def refused_for_good(calls: list[dict]) -> list[dict]:
    """The calls refused (403) that the operator never made again with success (same verb,
    same path). RBAC does not change after the install, so a missing rule refuses every retry;
    a refusal its retry got past was the API server catching up on the new objects (the
    admission's discovery of the new CRD, the namespace), which is not what the chart grants."""
    refused = []
    for i, call in enumerate(calls):
        if call["code"] != 403:
            continue
        path = call["uri"].split("?")[0]
        if not any(
            later["verb"] == call["verb"]
            and later["uri"].split("?")[0] == path
            and 200 <= (later["code"] or 0) < 300
            for later in calls[i + 1 :]
        ):
            refused.append(call)
    return refused


def grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def used(calls: list[dict]) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of each successful call; a server-side apply that created its
    object (201) used ``create`` as well as ``patch``, as the API server authorizes it."""
    out = set()
    for call in calls:
        out.add((call["group"], call["resource"], call["verb"]))
        if call["verb"] == "patch" and call["code"] == 201:
            out.add((call["group"], call["resource"], "create"))
    return out


# Grants no request of the operator's shows, which the API server checks anyway: the
# OwnerReferencesPermissionEnforcement admission plugin lets a child set blockOwnerDeletion
# only with update on its owner's finalizers (tests/operator/cluster/test_lifecycle.py
# creates children with it enabled).
CHECKED_BY_ADMISSION = {("kvpilot.dev", "llmdeployments/finalizers", "update")}


def scenario(
    kube: Cluster, namespace: str, config_source: str, multi_node_source: str | None = None
) -> None:
    """Every code path that talks to the API server, in one namespace (``multi_node_source``:
    also a model that needs a LeaderWorkerSet)."""
    gpu = {"model": {"source": config_source}, "gpu": {"type": "H100-80GB"}, "image": NO_ENGINE}
    token = base64.b64encode(b"hf_test").decode()
    kube.api().request(
        "POST",
        f"/api/v1/namespaces/{namespace}/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hf-token"},
            "data": {"token": token},
        },
    )
    kube.create_llmd(namespace, "plain", gpu)
    kube.create_llmd(
        namespace, "cached", {**gpu, "modelCache": {"size": "40Gi", "storageClassName": "standard"}}
    )
    hub = {
        "model": {
            "source": "hf://meta-llama/Meta-Llama-3-8B",
            "hfTokenSecretRef": {"name": "hf-token"},
        },
        "gpu": {"type": "L4"},
        "image": NO_ENGINE,
    }
    kube.create_llmd(namespace, "hub", hub)
    kube.create_llmd(
        namespace, "scaled", {**gpu, "autoscaling": {"minReplicas": 2, "maxReplicas": 3}}
    )

    if multi_node_source is not None:
        kube.create_llmd(namespace, "big", {**gpu, "model": {"source": multi_node_source}})

    def cond(name: str, type_: str) -> dict:
        return condition(kube.llmd(namespace, name), type_)

    if multi_node_source is not None:
        wait_for(
            lambda: kube.get(
                f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{namespace}/leaderworkersets/big"
            ),
            "the multi-node replica's LeaderWorkerSet",
        )

    wait_for(lambda: cond("plain", "Ready").get("status") == "True", "plain ready")
    wait_for(lambda: cond("hub", "Sized").get("reason") == "ConfigUnavailable", "hub reported")
    wait_for(
        lambda: (
            (kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/scaled") or {})
            .get("spec", {})
            .get("replicas")
            == 2
        ),
        "scaled to its minimum",
    )
    wait_for(
        lambda: cond("cached", "Degraded").get("reason") == "ModelCacheClaimPending",
        "the unbound claim reported",
    )
    # Drift of the children is repaired by the next reconcile (the resync, every 5 s here).
    kube.kubectl(
        "patch", "service", "cached", "-n", namespace, "--type=merge",
        "-p", '{"metadata": {"labels": {"app.kubernetes.io/component": "edited"}}}',
    )  # fmt: skip
    kube.kubectl(
        "patch", "pdb", "cached", "-n", namespace, "--type=merge",
        "-p", '{"spec": {"maxUnavailable": 3}}',
    )  # fmt: skip
    wait_for(
        lambda: (
            kube.get(f"/api/v1/namespaces/{namespace}/services/cached")["metadata"]["labels"][
                "app.kubernetes.io/component"
            ]
            == "engine"
        ),
        "Service repaired",
    )
    wait_for(
        lambda: (
            kube.get(f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/cached")["spec"][
                "maxUnavailable"
            ]
            == 1
        ),
        "PDB repaired",
    )
    # A scale-down (kubectl scale, as HPA would): the pods' deletion costs are written first.
    kube.create_llmd(
        namespace,
        "down",
        {**gpu, "replicas": 2, "autoscaling": {"mode": "external", "maxReplicas": 2}},
    )
    deployment = f"/apis/apps/v1/namespaces/{namespace}/deployments/down"
    wait_for(
        lambda: (kube.get(deployment) or {}).get("status", {}).get("readyReplicas") == 2,
        "two replicas",
    )
    kube.kubectl("scale", "llmd", "down", "-n", namespace, "--replicas=1")
    wait_for(lambda: kube.get(deployment)["spec"]["replicas"] == 1, "scaled down to 1")
    kube.kubectl("delete", "llmd", "plain", "-n", namespace, "--wait=true", "--timeout=60s")


def test_helm_install_rbac_is_exactly_what_the_operator_calls(fresh: Cluster, model_config_source):
    """The default install (every namespace): every call the operator makes with its
    ServiceAccount's token is allowed, and every rule of the chart is used."""
    install(fresh)
    crd = fresh.get(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/llmdeployments.kvpilot.dev"
    )
    assert condition(crd, "Established")["status"] == "True"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    namespace = fresh.create_namespace("apps")
    scenario(
        fresh,
        namespace,
        model_config_source("Meta-Llama-3-8B"),
        multi_node_source=model_config_source("Meta-Llama-3.1-405B"),
    )
    calls = audit_calls(fresh, OPERATOR_USER)
    assert calls, "the audit log shows no call of the operator"
    refused = refused_for_good(calls)
    assert refused == [], dump(refused)
    granted = grants(rendered_rules(fresh))
    assert used(calls) <= granted, dump(sorted(used(calls) - granted))
    unused = granted - used(calls) - CHECKED_BY_ADMISSION
    assert unused == set(), f"granted but never used: {sorted(unused)}"
    # The Secret is read by name only (bug 15): the ClusterRole names it.
    secrets = [c for c in calls if c["resource"] == "secrets"]
    assert {c["name"] for c in secrets} == {"hf-token"}

    # Issue 15, bug 14: the operator lists and watches only its own Deployments and pods (a
    # server-side label selector), and every watch has a server-side timeout.
    for resource in ("deployments", "leaderworkersets", "pods"):
        watches = [c for c in calls if c["resource"] == resource and c["verb"] in ("list", "watch")]
        assert watches, resource
        for call in watches:
            query = urllib.parse.parse_qs(urllib.parse.urlparse(call["uri"]).query)
            (selector,) = query.get("labelSelector", [""])
            assert selector.startswith("kvpilot.dev/llmdeployment"), call["uri"]
            if call["verb"] == "watch":
                assert query.get("timeoutSeconds") == ["300"], call["uri"]
    fresh.kubectl("delete", "namespace", namespace, "--wait=false")


def test_namespace_globs_follow_matching_namespaces(fresh: Cluster, model_config_source):
    """Issue 15, bug 13: ``--namespace 'glob-*'`` watches every namespace the glob matches,
    including one created after the operator started; others are left alone."""
    install(fresh, '--set-json=operator.watchNamespaces=["globbed-*"]')
    spec = engineless(model_config_source("Meta-Llama-3-8B"), "L4")
    for name in ("globbed-a", "elsewhere"):
        fresh.kubectl("create", "namespace", name)
        fresh.create_llmd(name, "m", spec)
    wait_for(
        lambda: condition(fresh.llmd("globbed-a", "m"), "Ready").get("status") == "True",
        "globbed-a",
    )
    fresh.kubectl("create", "namespace", "globbed-later")
    fresh.create_llmd("globbed-later", "m", spec)
    wait_for(
        lambda: condition(fresh.llmd("globbed-later", "m"), "Ready").get("status") == "True",
        "a namespace created after the operator",
    )
    assert "status" not in fresh.llmd("elsewhere", "m")
    # This test's namespaces, and cluster-scoped calls: the namespace of the test before is
    # being deleted, where a create is refused (403) while its objects go.
    ours = ("/namespaces/globbed-", "/namespaces/elsewhere/")
    refused = [
        c
        for c in refused_for_good(audit_calls(fresh, OPERATOR_USER))
        if "/namespaces/" not in c["uri"] or any(n in c["uri"] for n in ours)
    ]
    assert refused == [], dump(refused)
    for name in ("globbed-a", "elsewhere", "globbed-later"):
        fresh.kubectl("delete", "namespace", name, "--wait=false")


def test_uninstall_before_or_after_the_deployments(fresh: Cluster, model_config_source):
    """Issue 15, bug 9: no LLMDeployment carries a finalizer, so deleting one needs no running
    operator, in either order, and a namespace of them deletes cleanly. Uninstalling keeps the
    CRD (and the deployments serving); reinstalling takes them over again."""
    install(fresh)
    spec = engineless(model_config_source("Meta-Llama-3-8B"), "L4")
    namespace = fresh.create_namespace("order")
    for name in ("first", "second"):
        fresh.create_llmd(namespace, name, spec)
    wait_for(
        lambda: condition(fresh.llmd(namespace, "second"), "Ready").get("status") == "True", "ready"
    )
    assert fresh.llmd(namespace, "second")["metadata"].get("finalizers") in (None, [])

    # Deployments first, operator running: gone, children collected.
    fresh.kubectl("delete", "llmd", "first", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        lambda: fresh.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/first") is None, "GC"
    )

    # The chart first: the CRD stays, and with it the deployment and its pods.
    fresh.helm("uninstall", "kvpilot", "--namespace", RELEASE_NAMESPACE, "--wait")
    assert fresh.get(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/llmdeployments.kvpilot.dev"
    )
    assert fresh.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/second") is not None
    # Reinstalled: it adopts the CRD and the object it left.
    install(fresh)
    fresh.kubectl("annotate", "llmd", "second", "-n", namespace, "touch=1")
    wait_for(
        lambda: (
            "touch"
            in fresh.llmd(namespace, "second")["metadata"]["annotations"].get(
                "kopf.zalando.org/last-handled-configuration", ""
            )
        ),
        "the reinstalled operator handling it",
    )
    # And uninstalled again, then the namespace goes: nothing waits for a missing operator.
    fresh.helm("uninstall", "kvpilot", "--namespace", RELEASE_NAMESPACE, "--wait")
    fresh.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s")
    assert fresh.get(f"/api/v1/namespaces/{namespace}") is None


def test_invalid_values_fail_the_install_before_anything_is_applied(kube: Cluster, namespace):
    result = kube.helm(
        "install", "broken", str(CHART), "--namespace", namespace,
        "--set", "operator.metricsPort=70000", check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "metricsPort" in result.stderr
    assert kube.items(f"/apis/apps/v1/namespaces/{namespace}/deployments") == []
    assert kube.helm("list", "-n", namespace, "-q").stdout.strip() == ""


def test_upgrading_from_the_previous_chart_applies_the_new_crd(tmp_path, model_config_source):
    """Issue 15, bug 8: Helm never upgrades a chart's crds/ folder. The previous chart shipped
    the CRD there; this one renders it as a template, so an upgrade applies the new schema
    (once with --take-ownership, to adopt the CRD the previous chart's crds/ left unmanaged)."""
    with own_cluster(tmp_path / "cluster") as kube:
        with tarfile.open(PREVIOUS_CHART) as archive:
            archive.extractall(tmp_path / "previous", filter="data")
        kube.helm(
            "install", "kvpilot", str(tmp_path / "previous" / "kvpilot"), "--namespace",
            RELEASE_NAMESPACE, "--create-namespace", "--wait", "--timeout", "5m",
        )  # fmt: skip
        namespace = kube.create_namespace("upgrade")
        spec = {
            "model": {"source": model_config_source("Meta-Llama-3-8B")},
            "gpu": {"type": "L4"},
            "image": NO_ENGINE,
            "modelCache": {
                "size": "10Gi",
                "storageClassName": "standard",
                "accessMode": "ReadWriteMany",
            },
        }
        obj = {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": "m"},
            "spec": spec,
        }
        old = kube.admission_error(namespace, obj)
        assert old is not None and "accessMode" in old.message  # the old schema has no such field
        plain = kube.run(
            "helm", "upgrade", "kvpilot", str(CHART), "--namespace", RELEASE_NAMESPACE, check=False
        )
        assert (
            plain.returncode != 0
            and "take-ownership" in plain.stderr + plain.stdout
            or plain.returncode != 0
        )
        install(kube, "--take-ownership")
        assert kube.admission_error(namespace, obj) is None
        kube.create_llmd(namespace, "m", spec)
        wait_for(
            lambda: (
                (
                    kube.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/m-model-cache")
                    or {}
                )
                .get("spec", {})
                .get("accessModes")
                == ["ReadWriteMany"]
            ),
            "the new field honoured",
        )
        # A later upgrade needs no flag: the CRD is the release's now.
        install(kube)
