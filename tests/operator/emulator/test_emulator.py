"""The emulator's Kubernetes semantics, through the real kubernetes client over HTTP."""

from __future__ import annotations

import datetime
import json
import pathlib
import socket

import kubernetes
import pytest
import yaml

from tests.operator.emulator import ApiError, create_ready_pod, running_emulator
from tests.operator.emulator.patches import (
    PatchError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from tests.operator.emulator.resources import DEPLOYMENTS, LLMD
from tests.operator.emulator.selectors import label_selector
from tests.operator.emulator.tables import human_age, jsonpath

CRD_PATH = pathlib.Path(__file__).parents[3] / "crds" / "llmdeployment.yaml"


def deployment(name: str, replicas: int = 1, labels: dict[str, str] | None = None) -> dict:
    labels = labels or {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]},
            },
        },
    }


@pytest.fixture(scope="module")
def cluster():
    with running_emulator() as running:
        yield running


@pytest.fixture(scope="module")
def api(cluster, tmp_path_factory):
    kubeconfig = cluster.write_kubeconfig(tmp_path_factory.mktemp("kube") / "config")
    return kubernetes.config.new_client_from_config(str(kubeconfig))


@pytest.fixture(scope="module")
def apps(api):
    return kubernetes.client.AppsV1Api(api)


def raw(
    api,
    method: str,
    path: str,
    body=None,
    content_type: str = "application/json",
    accept: str = "application/json",
):
    """One request through the kubernetes client's configuration; returns (status, decoded body)."""
    serialized = api.param_serialize(
        method,
        path,
        header_params={"Content-Type": content_type, "Accept": accept},
        body=body,
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*serialized)
    response.read()
    return response.status, json.loads(response.data)


def test_create_sets_identity_and_monotonic_versions(apps):
    first = apps.create_namespaced_deployment("default", deployment("identity-a"))
    second = apps.create_namespaced_deployment("default", deployment("identity-b"))
    assert first.metadata.uid and second.metadata.uid and first.metadata.uid != second.metadata.uid
    assert first.metadata.creation_timestamp is not None
    assert first.metadata.generation == 1
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)


def test_stale_resource_version_is_a_conflict(apps):
    created = apps.create_namespaced_deployment("default", deployment("stale"))
    apps.patch_namespaced_deployment("stale", "default", {"spec": {"replicas": 2}})
    stale = {
        "metadata": {"resourceVersion": created.metadata.resource_version},
        "spec": {"replicas": 3},
    }
    with pytest.raises(kubernetes.client.ApiException) as caught:
        apps.patch_namespaced_deployment("stale", "default", stale)
    assert caught.value.status == 409
    assert apps.read_namespaced_deployment("stale", "default").spec.replicas == 2


def test_put_replaces_and_checks_the_version(api, apps):
    created = apps.create_namespaced_deployment("default", deployment("put-me"))
    body = deployment("put-me", replicas=4)
    body["metadata"]["resourceVersion"] = created.metadata.resource_version
    status, replaced = raw(api, "PUT", "/apis/apps/v1/namespaces/default/deployments/put-me", body)
    assert (status, replaced["spec"]["replicas"], replaced["metadata"]["generation"]) == (200, 4, 2)
    with pytest.raises(kubernetes.client.ApiException) as caught:
        apps.replace_namespaced_deployment("put-me", "default", body)  # the version is now stale
    assert caught.value.status == 409


def test_generation_moves_with_spec_only_and_status_is_isolated(apps):
    apps.create_namespaced_deployment("default", deployment("gen"))
    after_meta = apps.patch_namespaced_deployment(
        "gen", "default", {"metadata": {"labels": {"x": "y"}}}
    )
    assert after_meta.metadata.generation == 1
    after_status = apps.patch_namespaced_deployment_status(
        "gen", "default", {"status": {"readyReplicas": 1}, "spec": {"replicas": 9}}
    )
    assert after_status.metadata.generation == 1
    assert after_status.spec.replicas == 1  # a /status write changes status only
    after_spec = apps.patch_namespaced_deployment(
        "gen", "default", {"spec": {"replicas": 2}, "status": {"readyReplicas": 7}}
    )
    assert after_spec.metadata.generation == 2
    assert after_spec.status.ready_replicas == 1  # a main-resource write keeps the stored status


def test_a_write_that_changes_nothing_keeps_the_version(apps):
    created = apps.create_namespaced_deployment("default", deployment("noop"))
    again = apps.patch_namespaced_deployment("noop", "default", {"spec": {"replicas": 1}})
    assert again.metadata.resource_version == created.metadata.resource_version


def test_scale_subresource(apps):
    apps.create_namespaced_deployment(
        "default", deployment("scaled", replicas=2, labels={"app": "scaled", "tier": "x"})
    )
    scale = apps.read_namespaced_deployment_scale("scaled", "default")
    assert (scale.kind, scale.spec.replicas, scale.status.selector) == (
        "Scale",
        2,
        "app=scaled,tier=x",
    )
    apps.patch_namespaced_deployment_scale("scaled", "default", {"spec": {"replicas": 5}})
    assert apps.read_namespaced_deployment("scaled", "default").spec.replicas == 5
    with pytest.raises(kubernetes.client.ApiException) as caught:
        apps.patch_namespaced_deployment_scale("scaled", "default", {"spec": {"replicas": -1}})
    assert caught.value.status == 422


def test_label_selectors(apps):
    apps.create_namespaced_deployment(
        "default", deployment("sel-a", labels={"sel": "a", "tier": "web"})
    )
    apps.create_namespaced_deployment("default", deployment("sel-b", labels={"sel": "b"}))

    def names(selector: str) -> list[str]:
        return [
            d.metadata.name
            for d in apps.list_namespaced_deployment("default", label_selector=selector).items
        ]

    assert names("sel=a") == ["sel-a"]
    assert names("sel in (a,b)") == ["sel-a", "sel-b"]
    assert names("sel,!tier") == ["sel-b"]
    assert names("sel notin (a),sel") == ["sel-b"]


def test_watch_resumes_without_replay(apps):
    created = apps.create_namespaced_deployment("default", deployment("watched"))
    apps.patch_namespaced_deployment("watched", "default", {"spec": {"replicas": 3}})
    events = list(
        kubernetes.watch.Watch().stream(
            apps.list_namespaced_deployment,
            "default",
            field_selector="metadata.name=watched",
            resource_version=created.metadata.resource_version,
            timeout_seconds=1,
        )
    )
    assert [(e["type"], e["object"].spec.replicas) for e in events] == [("MODIFIED", 3)]


def test_watch_without_version_lists_current_objects_first(apps):
    apps.create_namespaced_deployment("default", deployment("listed"))
    events = list(
        kubernetes.watch.Watch().stream(
            apps.list_namespaced_deployment,
            "default",
            field_selector="metadata.name=listed",
            timeout_seconds=1,
        )
    )
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "listed")]


def test_finalizers_delay_deletion(cluster, apps):
    body = deployment("finalized")
    body["metadata"]["finalizers"] = ["example.com/hold"]
    apps.create_namespaced_deployment("default", body)
    apps.delete_namespaced_deployment("finalized", "default")
    marked = apps.read_namespaced_deployment("finalized", "default")
    assert marked.metadata.deletion_timestamp is not None
    apps.patch_namespaced_deployment("finalized", "default", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiError):
        cluster.store.get(DEPLOYMENTS, "default", "finalized")


def owner_reference(owner: kubernetes.client.V1Deployment) -> dict:
    """An ``ownerReferences`` entry pointing at the Deployment ``owner``."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": owner.metadata.name,
        "uid": owner.metadata.uid,
    }


def test_deleting_an_owner_collects_its_dependents(cluster, api, apps):
    core = kubernetes.client.CoreV1Api(api)
    owner = apps.create_namespaced_deployment("default", deployment("owner"))
    ref = {**owner_reference(owner), "controller": True}
    for name in ("child-a", "child-b"):
        core.create_namespaced_config_map(
            "default", {"metadata": {"name": name, "ownerReferences": [ref]}, "data": {}}
        )
    core.create_namespaced_config_map("default", {"metadata": {"name": "bystander"}, "data": {}})
    apps.delete_namespaced_deployment("owner", "default")
    names = [c.metadata.name for c in core.list_namespaced_config_map("default").items]
    assert "bystander" in names and "child-a" not in names and "child-b" not in names


def test_orphan_propagation_detaches_dependents(api, apps):
    core = kubernetes.client.CoreV1Api(api)
    owner = apps.create_namespaced_deployment("default", deployment("orphaner"))
    core.create_namespaced_config_map(
        "default", {"metadata": {"name": "orphan", "ownerReferences": [owner_reference(owner)]}}
    )
    apps.delete_namespaced_deployment("orphaner", "default", propagation_policy="Orphan")
    assert core.read_namespaced_config_map("orphan", "default").metadata.owner_references in (
        None,
        [],
    )


def test_missing_namespace_and_duplicates_are_refused(apps):
    with pytest.raises(kubernetes.client.ApiException) as missing:
        apps.create_namespaced_deployment("nowhere", deployment("lost"))
    apps.create_namespaced_deployment("default", deployment("twice"))
    with pytest.raises(kubernetes.client.ApiException) as duplicate:
        apps.create_namespaced_deployment("default", deployment("twice"))
    assert (missing.value.status, duplicate.value.status) == (404, 409)


def test_json_patch_test_failure_is_422(api, apps):
    apps.create_namespaced_deployment("default", deployment("jp"))
    path = "/apis/apps/v1/namespaces/default/deployments/jp"
    ops = [
        {"op": "test", "path": "/spec/replicas", "value": 1},
        {"op": "replace", "path": "/spec/replicas", "value": 2},
    ]
    status, patched = raw(api, "PATCH", path, ops, "application/json-patch+json")
    assert (status, patched["spec"]["replicas"]) == (200, 2)
    failed = [{"op": "test", "path": "/spec/replicas", "value": 1}]
    status, answer = raw(api, "PATCH", path, failed, "application/json-patch+json")
    assert (status, answer["reason"]) == (422, "Invalid")


def test_crd_is_served_with_discovery_scale_and_table(cluster, api):
    crd = yaml.safe_load(CRD_PATH.read_text())
    kubernetes.client.ApiextensionsV1Api(api).create_custom_resource_definition(crd)
    status, resources = raw(api, "GET", "/apis/kvpilot.dev/v1alpha1")
    names = {r["name"]: r for r in resources["resources"]}
    assert {"llmdeployments", "llmdeployments/status", "llmdeployments/scale"} <= set(names)
    assert (
        names["llmdeployments"]["shortNames"] == ["llmd"]
        and names["llmdeployments"]["kind"] == "LLMDeployment"
    )

    custom = kubernetes.client.CustomObjectsApi(api)
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "tiny"},
        "spec": {"replicas": 2},
    }
    created = custom.create_namespaced_custom_object(
        "kvpilot.dev", "v1alpha1", "default", "llmdeployments", body
    )
    custom.patch_namespaced_custom_object_status(
        "kvpilot.dev", "v1alpha1", "default", "llmdeployments", "tiny",
        {"status": {"selector": "app=tiny", "replicas": 2, "readyReplicas": 1, "plan": {"tensorParallelSize": 2}}},
    )  # fmt: skip
    scale = custom.get_namespaced_custom_object_scale(
        "kvpilot.dev", "v1alpha1", "default", "llmdeployments", "tiny"
    )
    assert (
        scale["spec"]["replicas"],
        scale["status"]["replicas"],
        scale["status"]["selector"],
    ) == (2, 2, "app=tiny")
    custom.patch_namespaced_custom_object_scale(
        "kvpilot.dev", "v1alpha1", "default", "llmdeployments", "tiny", {"spec": {"replicas": 3}}
    )
    stored = cluster.store.get(LLMD, "default", "tiny")
    assert (stored["spec"]["replicas"], stored["metadata"]["generation"]) == (
        3,
        created["metadata"]["generation"] + 1,
    )

    _, table = raw(
        api,
        "GET",
        "/apis/kvpilot.dev/v1alpha1/namespaces/default/llmdeployments",
        accept="application/json;as=Table;v=v1;g=meta.k8s.io",
    )
    columns = [c["name"] for c in table["columnDefinitions"]]
    row = dict(zip(columns, table["rows"][0]["cells"], strict=True))
    assert (row["Name"], row["TP"], row["Replicas"], row["Ready"]) == ("tiny", 2, 3, 1)


def test_patch_formats():
    target = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    assert merge_patch(target, {"a": {"b": None, "c": [3]}, "e": 2}) == {
        "a": {"c": [3]},
        "d": 1,
        "e": 2,
    }
    assert target == {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    named = {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]}
    merged = strategic_merge_patch(named, {"containers": [{"name": "b", "image": "z"}]})
    assert merged == {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "z"}]}
    ops = [
        {"op": "add", "path": "/a/c/-", "value": 3},
        {"op": "move", "from": "/d", "path": "/f"},
        {"op": "remove", "path": "/a/b"},
    ]
    assert json_patch(target, ops) == {"a": {"c": [1, 2, 3]}, "f": 1}
    with pytest.raises(PatchError, match="does not exist"):
        json_patch(target, [{"op": "remove", "path": "/zzz"}])


def test_selector_and_jsonpath_helpers():
    obj = {
        "metadata": {"labels": {"a": "1"}},
        "status": {
            "conditions": [
                {"type": "Sized", "status": "True"},
                {"type": "Ready", "status": "False"},
            ]
        },
    }
    assert (
        label_selector("a=1")(obj)
        and not label_selector("a!=1")(obj)
        and label_selector("b notin (x)")(obj)
    )
    assert jsonpath(obj, '.status.conditions[?(@.type=="Ready")].status') == ["False"]
    assert jsonpath(obj, ".status.conditions[*].type") == ["Sized", "Ready"]
    assert jsonpath(obj, ".status.conditions[1].type") == ["Ready"]
    assert jsonpath(obj, ".spec.missing") == []
    now = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
    assert [
        human_age(t, now)
        for t in (
            "2026-01-01T11:59:15Z",
            "2026-01-01T11:55:00Z",
            "2026-01-01T07:00:00Z",
            "2025-12-20T12:00:00Z",
        )
    ] == ["45s", "5m", "5h", "12d"]


def test_calls_are_recorded_with_rbac_terms(cluster, apps):
    before = len(cluster.emulator.calls)
    apps.create_namespaced_deployment("default", deployment("recorded"))
    apps.patch_namespaced_deployment_status("recorded", "default", {"status": {"replicas": 1}})
    apps.list_deployment_for_all_namespaces()
    calls = [
        (c.user, c.verb, c.group, c.rbac_resource, c.namespace)
        for c in cluster.emulator.calls[before:]
    ]
    assert calls == [
        ("test-admin", "create", "apps", "deployments", "default"),
        ("test-admin", "patch", "apps", "deployments/status", "default"),
        ("test-admin", "list", "apps", "deployments", None),
    ]


def test_custom_resources_are_pruned_defaulted_and_validated(cluster, api):
    if ("kvpilot.dev", "v1alpha1", "llmdeployments") not in cluster.store.types:
        cluster.install_crd(CRD_PATH)
    path = "/apis/kvpilot.dev/v1alpha1/namespaces/default/llmdeployments"
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "pruned"},
        "spec": {"gpu": {"type": "L4"}, "unknownField": 1},
    }
    status, created = raw(api, "POST", path, body)
    assert status == 201 and "unknownField" not in created["spec"]
    assert created["spec"]["gpu"]["resourceName"] == "nvidia.com/gpu"  # the CRD's default

    strict = {**body, "metadata": {"name": "strict"}}
    status, refused = raw(api, "POST", path + "?fieldValidation=Strict", strict)
    assert (status, refused["reason"]) == (422, "Invalid")
    assert [c["field"] for c in refused["details"]["causes"]] == ["spec.unknownField"]

    invalid = {
        **body,
        "metadata": {"name": "invalid"},
        "spec": {"gpu": {"type": "T4"}, "replicas": -1},
    }
    status, refused = raw(api, "POST", path, invalid)
    assert status == 422
    assert sorted(c["field"] for c in refused["details"]["causes"]) == [
        "spec.gpu.type",
        "spec.replicas",
    ]
    assert refused["details"]["kind"] == "LLMDeployment" and refused["details"]["name"] == "invalid"
    with pytest.raises(ApiError):
        cluster.store.get(LLMD, "default", "invalid")


def test_generate_name_and_crd_deletion(cluster):
    crd = yaml.safe_load(CRD_PATH.read_text())
    crd["metadata"]["name"] = "widgets.example.com"
    crd["spec"].update(
        group="example.com", names={"kind": "Widget", "plural": "widgets", "singular": "widget"}
    )
    crd["spec"]["versions"][0]["schema"] = {
        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    }
    cluster.store.create(("apiextensions.k8s.io", "v1", "customresourcedefinitions"), None, crd)
    widgets = ("example.com", "v1alpha1", "widgets")
    made = cluster.store.create(
        widgets, "default", {"metadata": {"generateName": "w-"}, "spec": {"a": 1}}
    )
    assert made["metadata"]["name"].startswith("w-") and len(made["metadata"]["name"]) == 7
    cluster.store.delete(
        ("apiextensions.k8s.io", "v1", "customresourcedefinitions"), None, "widgets.example.com"
    )
    assert widgets not in cluster.store.types
    with pytest.raises(ApiError) as caught:
        cluster.store.list(widgets, "default")
    assert caught.value.code == 404


def test_ready_pods_get_their_own_loopback_address(cluster):
    first = create_ready_pod(
        cluster.store, "default", "engine-0", {"app": "engine"}, container_port=8123
    )
    second = create_ready_pod(cluster.store, "default", "engine-1", {"app": "engine"})
    assert first != second and first.startswith("127.")
    pod = cluster.store.get(("", "v1", "pods"), "default", "engine-0")
    assert (
        pod["status"]["podIP"],
        pod["status"]["phase"],
        pod["spec"]["containers"][0]["ports"][0]["containerPort"],
    ) == (first, "Running", 8123)
    with socket.socket() as sock:  # the address is usable: a local engine can listen on it
        sock.bind((first, 0))


def test_objects_moving_across_a_selector_are_added_and_deleted(apps):
    created = apps.create_namespaced_deployment(
        "default", deployment("mover", labels={"app": "mover"})
    )
    apps.patch_namespaced_deployment(
        "mover", "default", {"metadata": {"labels": {"stage": "canary"}}}
    )
    apps.patch_namespaced_deployment("mover", "default", {"metadata": {"labels": {"stage": None}}})
    events = kubernetes.watch.Watch().stream(
        apps.list_namespaced_deployment,
        "default",
        label_selector="stage=canary",
        resource_version=created.metadata.resource_version,
        timeout_seconds=1,
    )
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "mover"),
        ("DELETED", "mover"),
    ]


def test_delete_collection_with_a_selector(api):
    core = kubernetes.client.CoreV1Api(api)
    for name, tier in (("dc-a", "x"), ("dc-b", "x"), ("dc-c", "y")):
        core.create_namespaced_config_map(
            "default", {"metadata": {"name": name, "labels": {"tier": tier}}}
        )
    core.delete_collection_namespaced_config_map("default", label_selector="tier=x")
    names = [
        c.metadata.name
        for c in core.list_namespaced_config_map("default", label_selector="tier").items
    ]
    assert names == ["dc-c"]
