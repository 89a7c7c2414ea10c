"""operator/apply.py: create-or-patch semantics over real HTTP (the emulator), retries, comparison."""

from __future__ import annotations

import kmock
import kubernetes
import pytest

from kvpilot.operator.apply import (
    LAST_APPLIED_ANNOTATION,
    KubeApiError,
    KubeClient,
    OwnershipConflict,
    TransientApiError,
    apply_child,
    covers,
    patch_status,
    removals,
    with_retries,
)
from tests.operator.emulator import SERVICES, running_emulator

CONFIGMAPS = ("", "v1", "configmaps")


@pytest.fixture(scope="module")
def cluster():
    with running_emulator() as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster, tmp_path_factory) -> KubeClient:
    kubeconfig = cluster.write_kubeconfig(tmp_path_factory.mktemp("kube") / "config")
    return KubeClient(kubernetes.config.new_client_from_config(str(kubeconfig)))


def owner_ref(uid: str) -> dict:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "LLMDeployment",
        "name": "o",
        "uid": uid,
        "controller": True,
    }


def service(name: str, port: int = 8000, owner_uid: str | None = None, **spec) -> dict:
    meta = {"name": name, "namespace": "default", "labels": {"app": name}}
    if owner_uid is not None:
        meta["ownerReferences"] = [owner_ref(owner_uid)]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {"ports": [{"name": "http", "port": port}], **spec},
    }


@pytest.fixture
def owner_uid(cluster, request) -> str:
    # A live owner object, so the emulator's garbage collector keeps the children.
    name = request.node.name.replace("_", "-")[:50]
    return cluster.store.create(CONFIGMAPS, "default", {"metadata": {"name": name}})["metadata"][
        "uid"
    ]


def test_create_then_unchanged_then_patched(cluster, client, owner_uid):
    first = apply_child(client, service("svc-a", owner_uid=owner_uid))
    assert first.action == "created"
    version = first.obj["metadata"]["resourceVersion"]
    again = apply_child(client, service("svc-a", owner_uid=owner_uid))
    assert (again.action, again.obj["metadata"]["resourceVersion"]) == ("unchanged", version)
    moved = apply_child(client, service("svc-a", port=9000, owner_uid=owner_uid))
    assert moved.action == "patched"
    assert cluster.store.get(SERVICES, "default", "svc-a")["spec"]["ports"] == [
        {"name": "http", "port": 9000}
    ]


def test_fields_no_longer_desired_are_removed(cluster, client, owner_uid):
    apply_child(client, service("svc-b", owner_uid=owner_uid, sessionAffinity="ClientIP"))
    cluster.store.patch(
        SERVICES,
        "default",
        "svc-b",
        "application/merge-patch+json",
        {"metadata": {"labels": {"team": "x"}}},
    )
    result = apply_child(client, service("svc-b", owner_uid=owner_uid))
    live = cluster.store.get(SERVICES, "default", "svc-b")
    assert result.action == "patched"
    assert "sessionAffinity" not in live["spec"]
    assert live["metadata"]["labels"] == {"app": "svc-b", "team": "x"}  # someone else's label stays
    assert LAST_APPLIED_ANNOTATION in live["metadata"]["annotations"]


def test_drift_is_repaired(cluster, client, owner_uid):
    apply_child(client, service("svc-c", owner_uid=owner_uid))
    cluster.store.patch(
        SERVICES,
        "default",
        "svc-c",
        "application/merge-patch+json",
        {"spec": {"ports": [{"name": "http", "port": 1}]}},
    )
    assert apply_child(client, service("svc-c", owner_uid=owner_uid)).action == "patched"
    assert cluster.store.get(SERVICES, "default", "svc-c")["spec"]["ports"][0]["port"] == 8000


def test_an_object_of_another_controller_is_not_taken_over(cluster, client, owner_uid):
    other = cluster.store.create(CONFIGMAPS, "default", {"metadata": {"name": "other-owner"}})[
        "metadata"
    ]["uid"]
    cluster.store.create(SERVICES, "default", service("svc-d", owner_uid=other))
    with pytest.raises(OwnershipConflict, match=other):
        apply_child(client, service("svc-d", port=1, owner_uid=owner_uid))
    assert cluster.store.get(SERVICES, "default", "svc-d")["spec"]["ports"][0]["port"] == 8000


def test_conflicts_are_retried_then_reported(cluster, client, owner_uid):
    apply_child(client, service("svc-e", owner_uid=owner_uid))
    patches = cluster.emulator["patch", kmock.resource("", "v1", "services"), kmock.name("svc-e")]
    patches[:1] << 409
    before = len(cluster.emulator.calls)
    result = apply_child(client, service("svc-e", port=9100, owner_uid=owner_uid), base_delay=0.01)
    assert result.action == "patched"
    assert [c.verb for c in cluster.emulator.calls[before:]] == ["get", "patch", "get", "patch"]
    exhausted = cluster.emulator["patch", kmock.resource("", "v1", "services"), kmock.name("svc-g")]
    apply_child(client, service("svc-g", owner_uid=owner_uid))
    exhausted[:3] << 409
    with pytest.raises(TransientApiError, match="3 attempts"):
        apply_child(
            client, service("svc-g", port=9200, owner_uid=owner_uid), attempts=3, base_delay=0.01
        )


def test_refusals_are_not_retried(client, owner_uid):
    lost = service("svc-f", owner_uid=owner_uid)
    lost["metadata"]["namespace"] = "nowhere"
    with pytest.raises(KubeApiError) as caught:
        apply_child(client, lost, base_delay=0.01)
    assert caught.value.status == 404


def test_status_patch_needs_the_current_version(cluster, client):
    created = cluster.store.create(
        ("apps", "v1", "deployments"),
        "default",
        {"metadata": {"name": "st"}, "spec": {"replicas": 1}},
    )
    assert patch_status(client, created, {"readyReplicas": 1}) is True
    assert (
        patch_status(
            client,
            cluster.store.get(("apps", "v1", "deployments"), "default", "st"),
            {"readyReplicas": 1},
        )
        is False
    )
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


def test_covers():
    live = {
        "spec": {
            "replicas": 2,
            "template": {"x": 1},
            "resources": {"limits": {"memory": "1024Mi"}},
        },
        "status": {},
    }
    assert covers(live, {"spec": {"replicas": 2, "resources": {"limits": {"memory": "1Gi"}}}})
    assert not covers(live, {"spec": {"replicas": 3}})
    assert not covers({"args": ["a", "b"]}, {"args": ["a"]})
    assert not covers({"n": 1}, {"n": True})
    assert not covers({"args": ["1Gi"]}, {"args": ["1024Mi"]})  # quantities only under resources


def test_removals():
    last = {
        "metadata": {"labels": {"a": "1", "b": "2"}},
        "spec": {"nodeSelector": {"x": "y"}, "replicas": 1},
    }
    desired = {"metadata": {"labels": {"a": "1"}}, "spec": {"replicas": 1}}
    assert removals(last, desired) == {
        "metadata": {"labels": {"b": None}},
        "spec": {"nodeSelector": None},
    }
    assert removals({}, desired) == {}
