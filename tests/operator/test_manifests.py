"""Rendered children: valid Kubernetes objects (kubernetes-validate --strict) with the right fields."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import kubernetes_validate
import pytest

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import manifests
from kvpilot.operator.crd import MANAGED_FLAGS
from kvpilot.operator.gpus import GiB
from kvpilot.operator.images import ENGINE_IMAGE
from kvpilot.operator.planner import plan_for_spec
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.tuning import EngineSettings, Rollout

CONFIGS = Path(__file__).parent / "configs"
K8S_VERSION = "1.32.0"


def model(name: str) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()))


def render(spec_dict: dict, config: str, name: str = "llm") -> tuple:
    spec = parse_spec(spec_dict)
    p = plan_for_spec(spec, model(config))
    return spec, p, manifests.children(name, "team-a", spec, p)


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in objects}


def container(objects: list[dict]) -> dict:
    (engine,) = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]["containers"]
    return engine


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


GPU_SPEC = {
    "model": {
        "source": "hf://meta-llama/Meta-Llama-3-70B-Instruct",
        "revision": "main",
        "servedModelName": "llama-3-70b",
        "hfTokenSecretRef": {"name": "hf-token"},
    },
    "engine": {"maxModelLen": 8192, "enablePrefixCaching": False, "extraArgs": ["--seed=7"]},
    "gpu": {"type": "H100-80GB"},
    "replicas": 3,
    "modelCache": {"claimName": "models"},
    "nodeSelector": {"pool": "h100"},
}
CPU_SPEC = {"engine": {"maxModelLen": 4096}, "resources": {"limits": {"memory": "3Gi"}}}


def test_children_are_valid_kubernetes_objects():
    for spec_dict, config in ((GPU_SPEC, "Meta-Llama-3-70B"), (CPU_SPEC, "SmolLM2-135M-Instruct")):
        _, _, objects = render(spec_dict, config)
        assert [o["kind"] for o in objects] == ["Deployment", "Service", "PodDisruptionBudget"]
        for obj in objects:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_flag_the_operator_sets_is_reserved_from_extra_args():
    for spec_dict, config in ((GPU_SPEC, "Meta-Llama-3-70B"), (CPU_SPEC, "SmolLM2-135M-Instruct")):
        args = container(render(spec_dict, config)[2])["args"]
        extra = parse_spec(spec_dict).engine.extra_args
        flags = [a for a in args[: len(args) - len(extra)] if a.startswith("-")]
        assert flags and set(flags) <= set(MANAGED_FLAGS)


def test_gpu_deployment_args_and_resources_follow_the_plan():
    spec, p, objects = render(GPU_SPEC, "Meta-Llama-3-70B")
    assert p.tensor_parallel_size == 2
    engine = container(objects)
    args = engine["args"]
    assert engine["command"] == ["kvpilot"] and engine["image"] == ENGINE_IMAGE
    assert args[:2] == ["serve", "meta-llama/Meta-Llama-3-70B-Instruct"]
    assert flag(args, "--tensor-parallel-size") == "2"
    assert flag(args, "--gpu-memory-utilization") == "0.9"
    assert flag(args, "--max-model-len") == "8192"
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--device") == "cuda"
    assert flag(args, "--max-num-seqs") == "256"
    assert flag(args, "--revision") == "main"
    assert flag(args, "--served-model-name") == "llama-3-70b"
    assert "--no-enable-prefix-caching" in args and "--kv-cache-memory" not in args
    assert args[-1] == "--seed=7"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert engine["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}
    pod = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "h100"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert by_kind(objects)["Deployment"]["spec"]["replicas"] == 3


def test_tensor_parallel_pods_get_shared_memory_and_single_gpu_pods_do_not():
    _, _, objects = render(GPU_SPEC, "Meta-Llama-3-70B")
    pod = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    _, _, small = render({**GPU_SPEC, "gpu": {"type": "H100-80GB"}}, "Meta-Llama-3-8B")
    small_pod = by_kind(small)["Deployment"]["spec"]["template"]["spec"]
    assert all(v["name"] != "dshm" for v in small_pod["volumes"])


def test_probes_metrics_and_security():
    _, _, objects = render(GPU_SPEC, "Meta-Llama-3-70B")
    engine = container(objects)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 3600
    assert engine["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    template = by_kind(objects)["Deployment"]["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert template["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    pod_security = template["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] == 1000
    assert engine["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def test_model_cache_and_hf_token():
    _, _, objects = render(GPU_SPEC, "Meta-Llama-3-70B")
    engine = container(objects)
    pod = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"] == {"claimName": "models"}
    env = {e["name"]: e for e in engine["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env["HF_HOME"]["value"] == "/models/cache/huggingface"
    no_cache = {**GPU_SPEC, "modelCache": {"size": "100Gi"}}
    pod = by_kind(render(no_cache, "Meta-Llama-3-70B")[2])["Deployment"]["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache == {"name": "model-cache", "emptyDir": {"sizeLimit": "100Gi"}}


def test_cache_claim_created_for_size_and_storage_class():
    spec_dict = {**GPU_SPEC, "modelCache": {"size": "200Gi", "storageClassName": "fast-rwx"}}
    _, _, objects = render(spec_dict, "Meta-Llama-3-70B", name="big")
    claim = objects[0]
    assert claim["kind"] == "PersistentVolumeClaim"
    kubernetes_validate.validate(claim, K8S_VERSION, strict=True)
    assert claim["metadata"]["name"] == "big-model-cache"
    # Issue 15, bug 2: ReadWriteOnce unless asked, which every block storage class binds.
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    pod = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"] == {"claimName": "big-model-cache"}
    shared = {**spec_dict, "modelCache": {**spec_dict["modelCache"], "accessMode": "ReadWriteMany"}}
    assert render(shared, "Meta-Llama-3-70B", name="big")[2][0]["spec"]["accessModes"] == [
        "ReadWriteMany"
    ]


def test_a_claims_immutable_spec_is_kept_and_the_refusal_said():
    """Issue 15, bug 2: only a bound claim's size may change (grow); the rest stays as created
    and the refusal names what and how to get it."""
    spec_dict = {**GPU_SPEC, "modelCache": {"size": "200Gi", "storageClassName": "fast"}}
    desired = render(spec_dict, "Meta-Llama-3-70B", name="big")[2][0]
    assert manifests.claim_update(desired, None) == manifests.ClaimUpdate(desired)
    live = {
        **desired,
        "spec": {
            **desired["spec"],
            "storageClassName": "slow",
            "resources": {"requests": {"storage": "100Gi"}},
        },
        "status": {"phase": "Pending"},
    }
    update = manifests.claim_update(desired, live)
    assert update.desired["spec"]["storageClassName"] == "slow"
    assert update.desired["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert "storageClassName 'slow' -> 'fast'" in update.refused
    assert "size 100Gi -> 200Gi (the claim is not bound yet)" in update.refused
    assert "delete the claim" in update.refused
    bound = {
        **live,
        "spec": {**live["spec"], "storageClassName": "fast"},
        "status": {"phase": "Bound"},
    }
    grown = manifests.claim_update(desired, bound)
    assert (grown.desired["spec"]["resources"]["requests"]["storage"], grown.refused) == (
        "200Gi",
        "",
    )
    smaller = {**bound, "spec": {**bound["spec"], "resources": {"requests": {"storage": "300Gi"}}}}
    shrink = manifests.claim_update(desired, smaller)
    assert shrink.desired["spec"]["resources"]["requests"]["storage"] == "300Gi"
    assert "a claim cannot shrink" in shrink.refused


def test_pvc_source_is_mounted_read_only():
    config = json.loads((CONFIGS / "Meta-Llama-3-8B.json").read_text())
    spec_dict = {
        **GPU_SPEC,
        "model": {"source": "pvc://weights/llama/8b", "config": config},
    }
    _, _, objects = render(spec_dict, "Meta-Llama-3-8B")
    engine = container(objects)
    assert engine["args"][1] == "/models/pvc/weights/llama/8b"
    assert {"name": "model-source", "mountPath": "/models/pvc/weights", "readOnly": True} in engine[
        "volumeMounts"
    ]
    kubernetes_validate.validate(by_kind(objects)["Deployment"], K8S_VERSION, strict=True)


def test_cpu_deployment_passes_the_kv_budget():
    _, p, objects = render(CPU_SPEC, "SmolLM2-135M-Instruct")
    args = container(objects)["args"]
    assert args[1] == "--host"  # no MODEL: the built-in default
    assert flag(args, "--device") == "cpu"
    assert flag(args, "--dtype") == "float32"
    assert flag(args, "--kv-cache-memory") == str(p.kv_cache_bytes_per_gpu)
    assert flag(args, "--block-size") == "8"  # the engine's on CPU (16 on a GPU)
    assert "--gpu-memory-utilization" not in args
    limits = container(objects)["resources"]["limits"]
    assert limits == {"memory": "3Gi"}
    assert p.kv_cache_bytes_per_gpu < 3 * GiB


def test_labels_selector_service_and_pdb():
    _, _, objects = render(GPU_SPEC, "Meta-Llama-3-70B", name="chat")
    kinds = by_kind(objects)
    selector = {"kvpilot.dev/llmdeployment": "chat"}
    assert kinds["Deployment"]["spec"]["selector"]["matchLabels"] == selector
    assert kinds["Service"]["spec"]["selector"] == selector
    assert kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector
    assert kinds["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    for obj in objects:
        assert obj["metadata"]["namespace"] == "team-a"
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "chat"
    pod_labels = kinds["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert kinds["Service"]["spec"]["ports"][0]["port"] == 8000
    assert manifests.selector("chat") == "kvpilot.dev/llmdeployment=chat"
    assert manifests.endpoint("chat", "team-a") == "http://chat.team-a.svc.cluster.local:8000/v1"


def test_recommended_labels_and_the_charts_part_of():
    """Kubernetes' recommended labels: the children are managed by the operator (the chart's
    own objects by Helm), and both halves are part of the same application as in the chart."""
    _, _, objects = render(CPU_SPEC, "SmolLM2-135M-Instruct", name="chat")
    helpers = (Path(__file__).parents[2] / "charts/kvpilot/templates/_helpers.tpl").read_text()
    (chart_part_of,) = re.findall(r"^app\.kubernetes\.io/part-of: (\S+)$", helpers, re.M)
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "kvpilot-operator"
        assert labels["app.kubernetes.io/part-of"] == chart_part_of == "kvpilot"
        assert labels["app.kubernetes.io/name"] == "kvpilot-engine"


def rollout(phase: str, previous: EngineSettings | None = None) -> Rollout:
    return Rollout(phase, EngineSettings(0.95, 512), previous, 100.0, "preempting")


def engine_flags(deployment: dict) -> tuple[str, str]:
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]
    args = engine["args"]
    return flag(args, "--gpu-memory-utilization"), flag(args, "--max-num-seqs")


def test_a_tuning_canary_is_one_replica_of_its_own_deployment():
    spec = parse_spec(GPU_SPEC)
    plan = plan_for_spec(spec, model("Meta-Llama-3-70B"))
    objects = manifests.children("chat", "team-a", spec, plan, rollout("Canary"))
    assert [o["kind"] for o in objects] == ["Deployment", "Deployment", "Service",
                                            "PodDisruptionBudget"]  # fmt: skip
    main, canary, service, pdb = objects
    assert (main["metadata"]["name"], canary["metadata"]["name"]) == ("chat", "chat-canary")
    assert (main["spec"]["replicas"], canary["spec"]["replicas"]) == (2, 1)
    assert engine_flags(main) == (f"{plan.gpu_memory_utilization:g}", str(plan.max_num_seqs))
    assert engine_flags(canary) == ("0.95", "512")
    canary_pods = canary["spec"]["template"]["metadata"]["labels"]
    main_pods = main["spec"]["template"]["metadata"]["labels"]
    assert canary_pods["kvpilot.dev/canary"] == "true" and "kvpilot.dev/canary" not in main_pods
    assert canary["spec"]["selector"]["matchLabels"] == {
        "kvpilot.dev/llmdeployment": "chat",
        "kvpilot.dev/canary": "true",
    }
    # One Service and one disruption budget over both pod groups.
    for selector in (service["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= canary_pods.items() and selector.items() <= main_pods.items()
    assert canary["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "h100"}
    assert template_hash([canary]) != template_hash([main])
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_applied_and_rolled_back_settings_run_on_every_replica():
    spec = parse_spec(GPU_SPEC)
    plan = plan_for_spec(spec, model("Meta-Llama-3-70B"))
    planned = (f"{plan.gpu_memory_utilization:g}", str(plan.max_num_seqs))
    earlier = EngineSettings(0.92, 300)
    for phase, previous, expected in (
        ("Applied", None, ("0.95", "512")),
        ("RolledBack", None, planned),
        ("RolledBack", earlier, ("0.92", "300")),
        ("Canary", earlier, ("0.92", "300")),  # the replicas beside the canary
    ):
        main, canary = manifests.children("chat", "team-a", spec, plan, rollout(phase, previous))[
            :2
        ]
        assert main["spec"]["replicas"] + canary["spec"]["replicas"] == 3
        assert canary["spec"]["replicas"] == (1 if phase == "Canary" else 0)
        assert engine_flags(main) == expected
        # The canary keeps the settings it tried: retiring it changes only its replicas.
        assert engine_flags(canary) == ("0.95", "512")
    # No rollout: no canary Deployment, the plan's settings.
    (main,) = [
        o for o in manifests.children("chat", "team-a", spec, plan) if o["kind"] == "Deployment"
    ]
    assert engine_flags(main) == planned and main["spec"]["replicas"] == 3


def test_a_single_replica_is_never_the_canary():
    spec = parse_spec({**GPU_SPEC, "replicas": 1})
    plan = plan_for_spec(spec, model("Meta-Llama-3-70B"))
    main, canary = manifests.children("chat", "team-a", spec, plan, rollout("Canary"))[:2]
    assert (main["spec"]["replicas"], canary["spec"]["replicas"]) == (1, 0)


def test_cpu_plans_are_not_tuned():
    spec = parse_spec(CPU_SPEC)
    plan = plan_for_spec(spec, model("SmolLM2-135M-Instruct"))
    assert manifests.tuned(plan, EngineSettings(0.95, 512)) is plan


def template_hash(objects: list[dict]) -> str:
    deployment = by_kind(objects)["Deployment"]
    value = deployment["spec"]["template"]["metadata"]["annotations"]["kvpilot.dev/template-hash"]
    assert deployment["metadata"]["annotations"]["kvpilot.dev/template-hash"] == value
    return value


def test_template_hash_rolls_on_pod_changes_only():
    spec, p, objects = render(GPU_SPEC, "Meta-Llama-3-70B")
    again = manifests.children("llm", "team-a", parse_spec(GPU_SPEC), p)
    assert again == objects and template_hash(again) == template_hash(objects)
    # Replicas are not part of the pod: scaling must not roll the pods.
    scaled = manifests.children("llm", "team-a", replace(spec, replicas=5), p)
    assert template_hash(scaled) == template_hash(objects)
    longer = {**GPU_SPEC, "engine": {**GPU_SPEC["engine"], "maxModelLen": 4096}}
    assert template_hash(render(longer, "Meta-Llama-3-70B")[2]) != template_hash(objects)
    assert template_hash(
        manifests.children("llm", "team-a", spec, replace(p, gpu_memory_utilization=0.8))
    ) != template_hash(objects)


def test_user_env_overrides_operator_env():
    spec_dict = {**GPU_SPEC, "env": [{"name": "HF_HOME", "value": "/data/hf"}]}
    env = container(render(spec_dict, "Meta-Llama-3-70B")[2])["env"]
    assert [e["value"] for e in env if e["name"] == "HF_HOME"] == ["/data/hf"]


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        (
            {"enableChunkedPrefill": False, "maxNumBatchedTokens": 8192},
            ["--no-enable-chunked-prefill"],
        ),
        ({"enablePrefixCaching": True}, ["--enable-prefix-caching"]),
        (
            {"speculativeConfig": {"method": "ngram", "num_speculative_tokens": 4}},
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'],
        ),
    ],
)
def test_optional_engine_flags(engine, expected):
    spec = parse_spec({**GPU_SPEC, "engine": {"maxModelLen": 8192, **engine}})
    args = manifests.engine_args(spec, plan_for_spec(spec, model("Meta-Llama-3-70B")))
    position = args.index(expected[0])
    assert args[position : position + len(expected)] == expected


def test_adapters_render_lora_modules_and_mount_their_claims():
    config = json.loads((CONFIGS / "Meta-Llama-3-8B.json").read_text())
    adapters = [
        {"name": "sql", "source": "hf://org/sql-lora"},
        {"name": "chat", "source": "file:///adapters/chat"},
        {"name": "legal", "source": "pvc://loras/legal/v2"},
        {"name": "beside", "source": "pvc://weights/adapters/x"},  # the model's claim
    ]
    spec_dict = {
        **GPU_SPEC,
        "model": {"source": "pvc://weights/llama/8b", "config": config},
        "adapters": adapters,
    }
    _, _, objects = render(spec_dict, "Meta-Llama-3-8B")
    engine = container(objects)
    args = engine["args"]
    assert "--enable-lora" in args
    assert flag(args, "--max-loras") == flag(args, "--max-cpu-loras") == "4"
    start = args.index("--lora-modules") + 1
    assert args[start:] == [
        "sql=org/sql-lora",
        "chat=/adapters/chat",
        "legal=/models/pvc/loras/legal/v2",
        "beside=/models/pvc/weights/adapters/x",
        "--seed=7",  # extraArgs still come last
    ]
    mounts = [m for m in engine["volumeMounts"] if m["mountPath"].startswith("/models/pvc/")]
    assert [(m["mountPath"], m["readOnly"]) for m in mounts] == [
        ("/models/pvc/weights", True),
        ("/models/pvc/loras", True),
    ]
    volumes = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]["volumes"]
    claims = [v["persistentVolumeClaim"] for v in volumes if "persistentVolumeClaim" in v]
    assert {"claimName": "loras", "readOnly": True} in claims
    kubernetes_validate.validate(by_kind(objects)["Deployment"], K8S_VERSION, strict=True)


def test_many_adapters_share_the_resident_slots():
    adapters = [{"name": f"a{i}", "source": f"hf://org/a{i}"} for i in range(10)]
    args = container(render({**CPU_SPEC, "adapters": adapters}, "SmolLM2-135M-Instruct")[2])["args"]
    assert flag(args, "--max-loras") == str(manifests.MAX_RESIDENT_ADAPTERS) == "8"
    assert flag(args, "--max-cpu-loras") == "10"  # host copies of them all
    assert len(args) - args.index("--lora-modules") - 1 == 10
    assert "--enable-lora" not in container(render(CPU_SPEC, "SmolLM2-135M-Instruct")[2])["args"]


@pytest.mark.parametrize(
    ("extra", "slots", "host_copies"),
    [
        ([], 2, 2),
        (["--max-loras", "4"], 4, 4),  # the engine's default: as many host copies as slots
        (["--max-loras=4", "--max-cpu-loras", "6"], 4, 6),
        (["--max-cpu-loras=5"], 2, 5),
    ],
)
def test_extra_args_may_size_the_lora_slots_and_host_copies(extra, slots, host_copies):
    """The operator's --max-cpu-loras (every adapter) is left out when extraArgs set either
    LoRA size, which the engine would otherwise refuse (fewer host copies than slots)."""
    adapters = [{"name": "sql", "source": "hf://org/sql"}, {"name": "chat", "source": "hf://o/c"}]
    spec_dict = {**CPU_SPEC, "adapters": adapters, "engine": {"extraArgs": extra}}
    args = container(render(spec_dict, "SmolLM2-135M-Instruct")[2])["args"]
    engine = engine_args_accepted(args)
    assert (engine.max_loras, engine.max_cpu_loras or engine.max_loras) == (slots, host_copies)


def engine_args_accepted(args: list[str]):
    """``kvpilot serve ARGS`` as the engine's own parser and EngineArgs validation see them."""
    import argparse

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return EngineArgs.from_cli_args(parser.parse_args(args[1:]))


@pytest.mark.parametrize("chunked", [True, False])
def test_the_rendered_engine_limits_are_ones_the_engine_accepts(chunked):
    """Issue 15, bug 6: without chunked prefill the engine needs a step budget of at least
    maxModelLen; planner and engine resolve it with one function, so the rendered flags are
    what the engine runs with (8,192 would have been refused beside a 32,768 context)."""
    from kvpilot.engine.config import resolve_max_num_batched_tokens

    spec_dict = {**GPU_SPEC, "engine": {"maxModelLen": 8192, "enableChunkedPrefill": chunked}}
    spec, plan, objects = render(spec_dict, "Meta-Llama-3-70B")
    args = container(objects)["args"]
    expected = resolve_max_num_batched_tokens(
        None, 8192, enable_chunked_prefill=chunked, on_gpu=True
    )
    assert plan.max_num_batched_tokens == int(flag(args, "--max-num-batched-tokens")) == expected
    engine = engine_args_accepted(args)
    assert engine.enable_chunked_prefill is chunked
    long_spec = parse_spec({**spec_dict, "engine": {"enableChunkedPrefill": chunked}})
    long_plan = plan_for_spec(long_spec, model("Qwen2.5-72B-Instruct"))
    assert long_plan.max_num_batched_tokens == (8192 if chunked else long_plan.max_model_len)


KV_AND_QUANTIZATION = {"kvCacheDtype": "fp8", "quantization": "fp8"}


def test_kv_cache_dtype_and_quantization_are_parsed_rendered_and_planned():
    spec_dict = {**GPU_SPEC, "engine": {**GPU_SPEC["engine"], **KV_AND_QUANTIZATION}}
    spec, plan, objects = render(spec_dict, "Meta-Llama-3-70B")
    assert (spec.engine.kv_cache_dtype, spec.engine.quantization) == ("fp8", "fp8")
    args = container(objects)["args"]
    assert (flag(args, "--kv-cache-dtype"), flag(args, "--quantization")) == ("fp8", "fp8")
    assert args[-1] == "--seed=7"  # extraArgs still last
    # Planned with them: 1-byte KV (at TP 2, 4 KV heads per rank), 1-byte decoder weights: more
    # than twice the tokens of the bf16 plan at the same TP 2.
    assert (plan.kv_cache_dtype, plan.quantization, plan.tensor_parallel_size) == ("fp8", "fp8", 2)
    assert plan.kv_bytes_per_token == 2 * 80 * 4 * 128 * 1
    _, bf16, default_objects = render(GPU_SPEC, "Meta-Llama-3-70B")
    assert bf16.tensor_parallel_size == 2
    assert plan.kv_capacity_tokens > 2 * bf16.kv_capacity_tokens
    # Defaults: auto, the checkpoint's own quantization; neither flag is passed.
    default_args = container(default_objects)["args"]
    assert parse_spec(GPU_SPEC).engine.kv_cache_dtype == "auto"
    assert "--kv-cache-dtype" not in default_args and "--quantization" not in default_args


@pytest.mark.parametrize(
    ("engine", "error"),
    [
        ({"kvCacheDtype": "int8"}, "spec.engine.kvCacheDtype: 'int8' is not one of auto, fp8,"),
        ({"quantization": "bitsandbytes"}, "spec.engine.quantization: 'bitsandbytes' is not one"),
        ({"extraArgs": ["--kv-cache-dtype=fp8"]}, "--kv-cache-dtype is set by the operator"),
        ({"extraArgs": ["--pipeline-parallel-size=2"]}, "--pipeline-parallel-size is set by"),
    ],
)
def test_kv_cache_dtype_and_quantization_are_validated(engine, error):
    from kvpilot.operator.spec import SpecError

    with pytest.raises(SpecError, match=re.escape(error)):
        parse_spec({**GPU_SPEC, "engine": engine})


def test_allow_kv_cache_dtype_is_parsed_with_its_crd_default():
    auto = {"maxReplicas": 2, "tuneEngine": True}
    assert parse_spec({**GPU_SPEC, "autoscaling": auto}).autoscaling.allow_kv_cache_dtype is False
    allowed = {**auto, "allowKvCacheDtype": True}
    assert parse_spec({**GPU_SPEC, "autoscaling": allowed}).autoscaling.allow_kv_cache_dtype
    with pytest.raises(ValueError, match="allowKvCacheDtype: must be true or false"):
        parse_spec({**GPU_SPEC, "autoscaling": {**auto, "allowKvCacheDtype": "yes"}})


def test_a_fp8_kv_canary_runs_the_fp8_flag_alone():
    spec = parse_spec(GPU_SPEC)
    plan = plan_for_spec(spec, model("Meta-Llama-3-70B"))
    fp8 = Rollout("Canary", EngineSettings(0.9, 256, "fp8"), None, 1.0, "pressure")
    main, canary = manifests.children("chat", "team-a", spec, plan, fp8)[:2]
    kv = [container([d])["args"] for d in (main, canary)]
    assert "--kv-cache-dtype" not in kv[0] and flag(kv[1], "--kv-cache-dtype") == "fp8"


def test_the_engine_accepts_the_rendered_kv_and_quantization_flags():
    spec_dict = {**GPU_SPEC, "engine": {**GPU_SPEC["engine"], **KV_AND_QUANTIZATION}}
    engine = engine_args_accepted(container(render(spec_dict, "Meta-Llama-3-70B")[2])["args"])
    assert (engine.kv_cache_dtype, engine.quantization) == ("fp8", "fp8")
