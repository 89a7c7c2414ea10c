"""The real ``kvpilot operator`` process against the API emulator: an LLMDeployment's life.

Create -> children with owner references and status; spec change -> rolled Deployment and
observed generation; Deployment readiness -> Ready; invalid or unplannable spec -> conditions,
events, no children, no retry loop; conflicts -> retried; restart -> no duplicate writes;
delete -> children collected. The operator's liveness and metrics endpoints are read back.
"""

from __future__ import annotations

import pathlib
import shutil
import urllib.request

import kmock
import kubernetes
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.operator.emulator import (
    DEPLOYMENTS,
    EVENTS,
    LLMD,
    OPERATOR_TOKEN,
    PDBS,
    SERVICES,
    ApiError,
    llm_deployment,
    operator_process,
    running_emulator,
    running_operator,
    settled,
    wait_for,
)

ROOT = pathlib.Path(__file__).parents[2]
CONFIGS = pathlib.Path(__file__).parent / "configs"
CHILDREN = (DEPLOYMENTS, SERVICES, PDBS)
WRITES = {"create", "update", "patch", "delete"}


@pytest.fixture(scope="module")
def cluster():
    with running_emulator() as running:
        running.install_crd(ROOT / "crds" / "llmdeployment.yaml")
        yield running


@pytest.fixture(scope="module")
def custom(cluster, tmp_path_factory):
    kubeconfig = cluster.write_kubeconfig(tmp_path_factory.mktemp("admin") / "config")
    return kubernetes.client.CustomObjectsApi(
        kubernetes.config.new_client_from_config(str(kubeconfig))
    )


@pytest.fixture(scope="module")
def apps(cluster, tmp_path_factory):
    kubeconfig = cluster.write_kubeconfig(tmp_path_factory.mktemp("admin") / "config")
    return kubernetes.client.AppsV1Api(kubernetes.config.new_client_from_config(str(kubeconfig)))


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    with running_operator(
        cluster, tmp_path_factory.mktemp("operator"), "--retry-delay=1"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def model_source(tmp_path_factory) -> str:
    """A ``file://`` model source: a folder holding Meta-Llama-3-8B's config.json."""
    folder = tmp_path_factory.mktemp("llama-3-8b")
    shutil.copy(CONFIGS / "Meta-Llama-3-8B.json", folder / "config.json")
    return f"file://{folder}"


def gpu_spec(model_source: str, **extra) -> dict:
    return {
        "model": {"source": model_source},
        "gpu": {"type": "H100-80GB"},
        "engine": {"maxModelLen": 8192},
        **extra,
    }


def condition(obj: dict, type_: str) -> dict:
    return next(c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_)


def children(cluster, namespace: str, name: str) -> list[dict]:
    found = []
    for key in CHILDREN:
        try:
            found.append(cluster.store.get(key, namespace, name))
        except ApiError:
            pass
    return found


def events_for(cluster, namespace: str, name: str) -> list[dict]:
    items, _ = cluster.store.list(EVENTS, namespace, field_selector=f"involvedObject.name={name}")
    return items


def observed(cluster, namespace: str, name: str, generation: int) -> dict | None:
    obj = cluster.store.get(LLMD, namespace, name)
    return obj if obj.get("status", {}).get("observedGeneration") == generation else None


def ready(cluster, namespace: str, name: str) -> dict | None:
    obj = cluster.store.get(LLMD, namespace, name)
    return obj if condition(obj, "Ready")["status"] == "True" else None


def container_args(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_lifecycle_create_update_ready_delete(cluster, custom, apps, operator, model_source):
    cluster.create_namespace("life")
    created = custom.create_namespaced_custom_object(
        *LLMD[:2], "life", LLMD[2], llm_deployment("llama", gpu_spec(model_source))
    )
    obj = wait_for(lambda: observed(cluster, "life", "llama", 1), "status of generation 1")

    plan = obj["status"]["plan"]
    assert (
        plan["gpuType"],
        plan["tensorParallelSize"],
        plan["gpusPerReplica"],
        plan["maxModelLen"],
    ) == ("H100-80GB", 1, 1, 8192)
    assert obj["status"]["selector"] == "kvpilot.dev/llmdeployment=llama"
    assert obj["status"]["endpoint"] == "http://llama.life.svc.cluster.local:8000/v1"
    assert {
        c["type"]: (c["status"], c["observedGeneration"]) for c in obj["status"]["conditions"]
    } == {
        "Sized": ("True", 1),
        "Progressing": ("True", 1),
        "Ready": ("False", 1),
        "Degraded": ("False", 1),
    }
    kids = children(cluster, "life", "llama")
    assert [k["kind"] for k in kids] == ["Deployment", "Service", "PodDisruptionBudget"]
    for kid in kids:
        (ref,) = kid["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "LLMDeployment",
            "llama",
            created["metadata"]["uid"],
            True,
        )
    args = container_args(kids[0])
    assert args[args.index("--max-model-len") + 1] == "8192"
    assert kids[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"
    ] in (1, "1")

    custom.patch_namespaced_custom_object(
        *LLMD[:2], "life", LLMD[2], "llama", {"spec": {"engine": {"maxModelLen": 4096}}}
    )
    obj = wait_for(lambda: observed(cluster, "life", "llama", 2), "status of generation 2")
    assert obj["status"]["plan"]["maxModelLen"] == 4096
    deployment = cluster.store.get(DEPLOYMENTS, "life", "llama")
    assert (
        container_args(deployment)[container_args(deployment).index("--max-model-len") + 1]
        == "4096"
    )
    assert deployment["metadata"]["generation"] == 2

    rollout = {
        "observedGeneration": 2,
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 1,
        "availableReplicas": 1,
    }
    apps.patch_namespaced_deployment_status("llama", "life", {"status": rollout})
    obj = wait_for(lambda: ready(cluster, "life", "llama"), "Ready=True")
    assert (obj["status"]["readyReplicas"], obj["status"]["replicas"]) == (1, 1)
    assert (condition(obj, "Progressing")["status"], condition(obj, "Progressing")["reason"]) == (
        "False",
        "RolloutComplete",
    )

    def reasons() -> list[str]:
        return [e["reason"] for e in events_for(cluster, "life", "llama")]

    # kopf posts events from a queue of its own, shortly after the status is written.
    wait_for(lambda: {"Created", "Updated", "ReplicasReady"} <= set(reasons()), "events")
    assert reasons().count("Planned") == 2  # one per plan: maxModelLen 8192, then 4096

    wait_for(lambda: settled(cluster.store, LLMD, "life", "llama"), "kopf done with the update")
    custom.delete_namespaced_custom_object(*LLMD[:2], "life", LLMD[2], "llama")
    wait_for(lambda: not children(cluster, "life", "llama"), "children garbage-collected")
    wait_for(
        lambda: not cluster.store.list(LLMD, "life")[0], "LLMDeployment gone (finalizer released)"
    )


def test_invalid_spec_is_reported_without_children_or_retries(
    cluster, custom, operator, model_source
):
    cluster.create_namespace("invalid")
    # minReplicas > maxReplicas passes the schema (a CEL rule, which the emulator does not run).
    spec = gpu_spec(model_source, autoscaling={"minReplicas": 3, "maxReplicas": 2})
    custom.create_namespaced_custom_object(
        *LLMD[:2], "invalid", LLMD[2], llm_deployment("bad", spec)
    )
    obj = wait_for(lambda: observed(cluster, "invalid", "bad", 1), "status of the invalid spec")
    sized, degraded = condition(obj, "Sized"), condition(obj, "Degraded")
    assert (sized["status"], sized["reason"], degraded["status"]) == (
        "False",
        "InvalidSpec",
        "True",
    )
    assert "spec.autoscaling.minReplicas" in sized["message"]
    assert children(cluster, "invalid", "bad") == []
    # kopf records a handled state only when the handler succeeded, i.e. it will not retry.
    wait_for(lambda: settled(cluster.store, LLMD, "invalid", "bad"), "kopf's handled state")
    warnings = [(e["type"], e["reason"]) for e in events_for(cluster, "invalid", "bad")]
    assert warnings == [("Warning", "InvalidSpec")]

    custom.patch_namespaced_custom_object(
        *LLMD[:2], "invalid", LLMD[2], "bad", {"spec": {"autoscaling": {"minReplicas": 1}}}
    )
    wait_for(lambda: observed(cluster, "invalid", "bad", 2), "status of the fixed spec")
    wait_for(lambda: len(children(cluster, "invalid", "bad")) == 3, "children of the fixed spec")
    wait_for(
        lambda: (
            {"Planned", "Recovered"} <= {e["reason"] for e in events_for(cluster, "invalid", "bad")}
        ),
        "events of the recovery",
    )


def test_a_model_that_does_not_fit_is_not_deployed(cluster, custom, operator, tmp_path):
    cluster.create_namespace("toobig")
    shutil.copy(CONFIGS / "Meta-Llama-3-70B.json", tmp_path / "config.json")
    spec = {"model": {"source": f"file://{tmp_path}"}, "gpu": {"type": "L4", "perNode": 1}}
    custom.create_namespaced_custom_object(
        *LLMD[:2], "toobig", LLMD[2], llm_deployment("huge", spec)
    )
    obj = wait_for(lambda: observed(cluster, "toobig", "huge", 1), "status of the unplannable spec")
    assert (condition(obj, "Sized")["status"], condition(obj, "Sized")["reason"]) == (
        "False",
        "ModelTooLarge",
    )
    assert "plan" not in obj["status"]
    assert children(cluster, "toobig", "huge") == []


def test_conflicting_writes_are_retried(cluster, custom, operator, model_source):
    cluster.create_namespace("conflict")
    custom.create_namespaced_custom_object(
        *LLMD[:2], "conflict", LLMD[2], llm_deployment("busy", gpu_spec(model_source))
    )
    wait_for(lambda: observed(cluster, "conflict", "busy", 1), "first status")
    before = len(cluster.emulator.calls)
    # The next two deployment patches of this object are refused as conflicts.
    deployment_patch = cluster.emulator[
        "patch", kmock.resource("apps", "v1", "deployments"), kmock.namespace("conflict")
    ]
    deployment_patch[:2] << 409
    custom.patch_namespaced_custom_object(
        *LLMD[:2], "conflict", LLMD[2], "busy", {"spec": {"engine": {"maxModelLen": 2048}}}
    )
    wait_for(lambda: observed(cluster, "conflict", "busy", 2), "status after the conflicts")
    args = container_args(cluster.store.get(DEPLOYMENTS, "conflict", "busy"))
    assert args[args.index("--max-model-len") + 1] == "2048"
    patches = [
        c
        for c in cluster.emulator.calls[before:]
        if (c.verb, c.resource, c.namespace) == ("patch", "deployments", "conflict")
    ]
    assert len(patches) == 3


def test_liveness_and_metrics(operator):
    assert wait_for(
        lambda: urllib.request.urlopen(operator.liveness_url).status == 200, "liveness endpoint"
    )
    text = wait_for(
        lambda: urllib.request.urlopen(operator.metrics_url).read().decode(), "metrics endpoint"
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    created = samples[
        ("kvpilot_operator_reconciles_total", (("result", "changed"), ("trigger", "create")))
    ]
    assert created >= 3  # one per LLMDeployment created by the tests above
    total = sum(
        v for (name, _), v in samples.items() if name == "kvpilot_operator_reconciles_total"
    )
    durations = sum(
        v
        for (name, _), v in samples.items()
        if name == "kvpilot_operator_reconcile_duration_seconds_count"
    )
    assert durations == total


def test_restart_does_no_duplicate_work(model_source, tmp_path):
    # A cluster of its own: the module's operator must not see these objects.
    with running_emulator() as cluster:
        cluster.install_crd(ROOT / "crds" / "llmdeployment.yaml")
        kubeconfig = cluster.write_kubeconfig(tmp_path / "operator-config", token=OPERATOR_TOKEN)
        with operator_process(kubeconfig, tmp_path / "first.log", "--retry-delay=1") as first:
            cluster.store.create(LLMD, "default", llm_deployment("steady", gpu_spec(model_source)))
            wait_for(lambda: observed(cluster, "default", "steady", 1), "first status")
            wait_for(
                lambda: settled(cluster.store, LLMD, "default", "steady"), "kopf's handled state"
            )
            assert first.process.poll() is None, first.log()
        before = len(cluster.emulator.calls)
        events_before = len(events_for(cluster, "default", "steady"))
        with operator_process(kubeconfig, tmp_path / "second.log") as second:

            def resumed() -> bool:
                text = urllib.request.urlopen(second.metrics_url).read().decode()
                return (
                    'kvpilot_operator_reconciles_total{result="unchanged",trigger="resume"} 1.0'
                    in text
                )

            wait_for(resumed, "the resume reconcile")
        writes = [
            c
            for c in cluster.emulator.calls[before:]
            if c.user == OPERATOR_TOKEN and c.verb in WRITES
        ]
        assert writes == []
        assert len(events_for(cluster, "default", "steady")) == events_before


def test_an_api_outage_is_retried_and_counted(cluster, custom, operator, model_source):
    cluster.create_namespace("outage")
    # Six refused creates outlast one reconcile's five attempts: kopf retries it after
    # --retry-delay, and the next attempt succeeds.
    (
        cluster.emulator[
            "post", kmock.resource("apps", "v1", "deployments"), kmock.namespace("outage")
        ][:6]
        << 503
    )
    custom.create_namespaced_custom_object(
        *LLMD[:2], "outage", LLMD[2], llm_deployment("flaky", gpu_spec(model_source))
    )
    wait_for(lambda: len(children(cluster, "outage", "flaky")) == 3, "children after the outage")
    wait_for(lambda: observed(cluster, "outage", "flaky", 1), "status after the outage")
    assert "ReconcileFailed" in [e["reason"] for e in events_for(cluster, "outage", "flaky")]
    text = urllib.request.urlopen(operator.metrics_url).read().decode()
    assert 'kvpilot_operator_reconcile_errors_total{reason="ApiError",trigger="create"}' in text


def test_a_namespaced_operator_leaves_other_namespaces_alone(model_source, tmp_path):
    with running_emulator() as cluster:
        cluster.install_crd(ROOT / "crds" / "llmdeployment.yaml")
        for namespace in ("watched", "ignored"):
            cluster.create_namespace(namespace)
        with running_operator(cluster, tmp_path, namespaces=("watched",)):
            for namespace in ("ignored", "watched"):
                cluster.store.create(LLMD, namespace, llm_deployment("llm", gpu_spec(model_source)))
            wait_for(lambda: observed(cluster, "watched", "llm", 1), "the watched object's status")
            assert children(cluster, "ignored", "llm") == []
            assert "status" not in cluster.store.get(LLMD, "ignored", "llm")
        operator_calls = [c for c in cluster.emulator.calls if c.user == OPERATOR_TOKEN]
        assert {c.namespace for c in operator_calls} == {"watched"}  # no cluster-wide scan either
