"""operator/apply.py against the real API server: server-side apply, ownership, status writes;
and the retry policy and status comparison (pure)."""

from __future__ import annotations

import json
import pathlib

import pytest

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import manifests
from kvpilot.operator.apply import (
    FIELD_MANAGER,
    KubeApiError,
    KubeClient,
    OwnershipConflict,
    StaleOwner,
    TransientApiError,
    apply_child,
    patch_status,
    status_changed,
    with_retries,
)
from kvpilot.operator.planner import plan_for_spec
from kvpilot.operator.spec import parse_spec
from tests.cluster import Cluster

LLAMA_3_8B = pathlib.Path(__file__).parent / "configs" / "Meta-Llama-3-8B.json"


@pytest.fixture
def owner(kube: Cluster, namespace: str) -> dict:
    """A live object to own the children (a ConfigMap), so the garbage collector keeps them."""
    return kube.api().request(
        "POST",
        f"/api/v1/namespaces/{namespace}/configmaps",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}},
    )


def owner_ref(obj: dict, kind: str = "ConfigMap") -> dict:
    return {
        "apiVersion": "v1",
        "kind": kind,
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": True,
    }


def service(namespace: str, name: str, owner: dict, port: int = 8000, **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app": name},
            "ownerReferences": [owner_ref(owner)],
        },
        "spec": {"ports": [{"name": "http", "port": port}], **spec},
    }


def test_create_then_unchanged_then_patched(kube, namespace, owner):
    client = kube.api()
    first = apply_child(client, service(namespace, "svc", owner))
    assert first.action == "created"
    version = first.obj["metadata"]["resourceVersion"]
    again = apply_child(client, service(namespace, "svc", owner))
    assert (again.action, again.obj["metadata"]["resourceVersion"]) == ("unchanged", version)
    moved = apply_child(client, service(namespace, "svc", owner, port=9000))
    assert moved.action == "patched"
    live = kube.get(f"/api/v1/namespaces/{namespace}/services/svc")
    assert [p["port"] for p in live["spec"]["ports"]] == [9000]
    managers = {m["manager"]: m["operation"] for m in live["metadata"]["managedFields"]}
    assert managers[FIELD_MANAGER] == "Apply"


def test_fields_no_longer_sent_are_removed_and_others_fields_stay(kube, namespace, owner):
    client = kube.api()
    apply_child(client, service(namespace, "svc", owner, sessionAffinity="ClientIP"))
    kube.kubectl("label", "service", "svc", "team=x", "-n", namespace)
    result = apply_child(client, service(namespace, "svc", owner))
    live = kube.get(f"/api/v1/namespaces/{namespace}/services/svc")
    assert result.action == "patched"
    assert live["spec"]["sessionAffinity"] == "None"  # back to the server's default
    assert live["metadata"]["labels"] == {"app": "svc", "team": "x"}  # kubectl's label stays


def test_drift_is_repaired(kube, namespace, owner):
    client = kube.api()
    apply_child(client, service(namespace, "svc", owner))
    kube.kubectl(
        "patch", "service", "svc", "-n", namespace, "--type=merge",
        "-p", '{"metadata": {"labels": {"app": "edited"}}, "spec": {"sessionAffinity": "ClientIP"}}',
    )  # fmt: skip
    assert apply_child(client, service(namespace, "svc", owner)).action == "patched"
    live = kube.get(f"/api/v1/namespaces/{namespace}/services/svc")
    assert live["metadata"]["labels"]["app"] == "svc"  # the field it applies is taken back
    # A field it never applied belongs to whoever set it: kept, as kubectl apply keeps it.
    assert live["spec"]["sessionAffinity"] == "ClientIP"


def test_a_rendered_engine_deployment_applies_once(kube, namespace, owner):
    """Issue 15, bug 5: the API server defaults and normalises a Deployment (empty values
    dropped, quantities canonical, probe and strategy defaults); applying the same desired
    object again is still a no-op, so a resync writes nothing."""
    spec = parse_spec(
        {
            "model": {
                "source": "hf://meta-llama/Meta-Llama-3-8B",
                "hfTokenSecretRef": {"name": "hf"},
            },
            "gpu": {"type": "H100-80GB"},
            "engine": {"maxModelLen": 8192, "extraArgs": ["--seed", "1"]},
            "resources": {"requests": {"memory": "16384Mi", "cpu": "4000m"}},
            "env": [
                {"name": "EMPTY", "value": ""},  # the API server drops the empty value
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ],
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "modelCache": {"size": "100Gi"},
            "adapters": [{"name": "sql", "source": "pvc://loras/sql"}],
        }
    )
    plan = plan_for_spec(spec, ModelShape.from_hf_config(json.loads(LLAMA_3_8B.read_text())))
    desired = manifests.deployment("engine", namespace, spec, plan)
    desired["metadata"]["ownerReferences"] = [owner_ref(owner)]
    client = kube.api()
    first = apply_child(client, desired)
    assert first.action == "created"
    for _ in range(2):
        again = apply_child(client, desired)
        assert again.action == "unchanged"
        # Nothing of the operator's was written: the spec's generation and the time of the
        # operator's own field ownership stay (the Deployment controller writes the status
        # and a revision annotation meanwhile, which are its own).
        assert again.obj["metadata"]["generation"] == 1
        assert applied_at(again.obj) == applied_at(first.obj)


def applied_at(obj: dict) -> str:
    (entry,) = [m for m in obj["metadata"]["managedFields"] if m["manager"] == FIELD_MANAGER]
    return entry["time"]


def test_an_object_of_another_controller_is_not_taken_over(kube, namespace, owner):
    client = kube.api()
    other = kube.api().request(
        "POST",
        f"/api/v1/namespaces/{namespace}/configmaps",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "other"}},
    )
    apply_child(client, service(namespace, "svc", other))
    with pytest.raises(OwnershipConflict, match=other["metadata"]["uid"]):
        apply_child(client, service(namespace, "svc", owner, port=1))
    live = kube.get(f"/api/v1/namespaces/{namespace}/services/svc")
    assert live["spec"]["ports"][0]["port"] == 8000


def test_a_child_of_a_deleted_namesake_is_stale_not_a_conflict(kube, namespace, owner):
    """Issue 15, bug 10: a child still owned by a deleted owner of the same kind and name
    (garbage collection is asynchronous) is retried soon, not reported as a conflict."""
    client = kube.api()
    apply_child(client, service(namespace, "svc", owner))
    reborn = dict(
        owner, metadata={**owner["metadata"], "uid": "00000000-0000-0000-0000-000000000001"}
    )
    with pytest.raises(StaleOwner, match="garbage collector"):
        apply_child(client, service(namespace, "svc", reborn))


def test_refusals_are_not_retried(kube, owner):
    lost = service("no-such-namespace", "svc", owner)
    with pytest.raises(KubeApiError) as caught:
        apply_child(kube.api(), lost, base_delay=0.01)
    assert caught.value.status == 404


class FlakyApply(KubeClient):
    """The real client, whose first ``failures`` applies are answered 409 (a conflict another
    writer caused): a stand-in for a busy API server, to count the retries."""

    def __init__(self, real: KubeClient, failures: int) -> None:
        super().__init__(real.api_client)
        self.failures = failures
        self.calls: list[str] = []

    def get(self, *args, **kwargs):
        self.calls.append("get")
        return super().get(*args, **kwargs)

    def apply(self, obj, subresource=None):
        self.calls.append("apply")
        if self.failures:
            self.failures -= 1
            raise KubeApiError(409, "Conflict", "the object has been modified")
        return super().apply(obj, subresource)


def test_conflicts_are_retried_then_reported(kube, namespace, owner):
    flaky = FlakyApply(kube.api(), failures=1)
    result = apply_child(flaky, service(namespace, "svc", owner), base_delay=0.01)
    assert result.action == "created"
    assert flaky.calls == ["get", "apply", "get", "apply"]
    exhausted = FlakyApply(kube.api(), failures=3)
    with pytest.raises(TransientApiError, match="3 attempts"):
        apply_child(
            exhausted, service(namespace, "svc", owner, port=9200), attempts=3, base_delay=0.01
        )


def test_status_patch_needs_the_current_version(kube, crd, namespace):
    created = kube.create_llmd(namespace, "st", {"model": {}})
    client = kube.api()
    assert patch_status(client, created, {"readyReplicas": 1}) is True
    assert patch_status(client, kube.llmd(namespace, "st"), {"readyReplicas": 1}) is False
    with pytest.raises(KubeApiError) as caught:
        patch_status(client, created, {"readyReplicas": 2})  # computed from an outdated object
    assert caught.value.status == 409


def test_with_retries_backs_off_exponentially():
    delays: list[float] = []
    outcomes = iter(
        [KubeApiError(503, "ServiceUnavailable", ""), KubeApiError(409, "Conflict", ""), "done"]
    )

    def action() -> str:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert with_retries(action, base_delay=1.0, sleep=delays.append) == "done"
    assert len(delays) == 2 and 0.5 <= delays[0] < 1.0 and 1.0 <= delays[1] < 2.0


def test_status_changed_is_what_a_merge_patch_would_change():
    previous = {"replicas": 2, "plan": {"a": 1, "b": 2}, "conditions": [{"type": "Ready"}]}
    assert not status_changed(previous, {"replicas": 2, "plan": {"a": 1}})
    assert not status_changed(previous, {"replicas": 2.0})
    assert not status_changed(previous, {"gone": None})
    assert status_changed(previous, {"plan": None})
    assert status_changed(previous, {"replicas": 3})
    assert status_changed(previous, {"conditions": [{"type": "Ready", "status": "True"}]})
    assert status_changed({"flag": 1}, {"flag": True})
