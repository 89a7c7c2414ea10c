"""Reading config.json from each kind of model source (local files, an offline hub cache)."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from huggingface_hub import constants
from transformers import GPT2Config, WhisperConfig

from kvpilot.engine.model_loader.resolve import DEFAULT_GGUF_NAME, DEFAULT_MODEL_PACKAGE
from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator.handlers import desired_status, plan_user_spec
from kvpilot.operator.model_source import load_model_shape, read_model_config
from kvpilot.operator.planner import PlanError
from kvpilot.operator.spec import ModelSource, parse_spec

CONFIGS = Path(__file__).parent / "configs"
LLAMA3_8B = json.loads((CONFIGS / "Meta-Llama-3-8B.json").read_text())


def source(model: dict) -> ModelSource:
    return parse_spec({"model": model}).model


def test_inline_config_wins():
    model = source({"source": "pvc://weights/llama", "config": LLAMA3_8B})
    assert load_model_shape(model).num_parameters() == 8_030_261_248


def test_file_source_reads_the_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert read_model_config(source({"source": f"file://{tmp_path}"})) == LLAMA3_8B
    with pytest.raises(PlanError) as caught:
        read_model_config(source({"source": f"file://{tmp_path}/missing"}))
    assert caught.value.reason == "ConfigUnavailable"
    assert "spec.model.config" in caught.value.message


def test_pvc_source_without_config_is_unavailable():
    with pytest.raises(PlanError) as caught:
        read_model_config(ModelSource(source="pvc://weights", scheme="pvc", claim_name="weights"))
    assert caught.value.reason == "ConfigUnavailable"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A Hugging Face cache holding org/llama's config.json at revision main, hub offline."""
    repo = tmp_path / "hub" / "models--org--llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(LLAMA3_8B))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_hub_source_fetches_config_json_only(offline_hub):
    assert read_model_config(source({"source": "hf://org/llama", "revision": "main"})) == LLAMA3_8B
    with pytest.raises(PlanError) as caught:
        read_model_config(source({"source": "hf://org/other"}))
    assert caught.value.reason == "ConfigUnavailable"
    assert "hf://org/other" in caught.value.message


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({**LLAMA3_8B, "num_hidden_layers": None}, "InvalidModelConfig"),
        ({**LLAMA3_8B, "kv_lora_rank": 512}, "InvalidModelConfig"),
        ({**LLAMA3_8B, "num_experts": 60}, "UnsupportedArchitecture"),
    ],
)
def test_unusable_configs(config, reason):
    with pytest.raises(PlanError) as caught:
        load_model_shape(source({"config": config}))
    assert caught.value.reason == reason


def test_an_unknown_checkpoint_dtype_is_an_invalid_model_config():
    # Sized as bfloat16 before; now the Sized condition names the field, the value and the
    # accepted dtypes.
    body = {
        "metadata": {"name": "llama", "namespace": "ml", "generation": 1},
        "spec": {"model": {"config": {**LLAMA3_8B, "torch_dtype": "int3"}}, "gpu": {"type": "L4"}},
    }
    planned = plan_user_spec(body, load_model_shape, "engine:1")
    assert (planned.ok, planned.reason, planned.message) == (
        False,
        "InvalidModelConfig",
        "spec.model.config: 'torch_dtype' (the checkpoint's dtype) must be one of "
        "float32, float, float16, half, bfloat16, float8_e4m3fn, float8_e5m2, got 'int3'",
    )
    status = desired_status(body, planned, None, now=datetime.datetime.now(datetime.UTC))
    sized = next(c for c in status["conditions"] if c["type"] == "Sized")
    assert (sized["status"], sized["reason"], sized["message"]) == (
        "False",
        "InvalidModelConfig",
        planned.message,
    )


@pytest.mark.parametrize(
    ("config", "named"),
    [
        # transformers' defaults are these models' public configs (gpt2, whisper-tiny's layout).
        ({**GPT2Config().to_dict(), "architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel'"),
        (
            {**WhisperConfig().to_dict(), "architectures": ["WhisperForConditionalGeneration"]},
            "'WhisperForConditionalGeneration'",
        ),
        ({"model_type": "t5", "num_layers": 6}, "'t5'"),
        ({"architectures": "BertModel"}, "'BertModel'"),
    ],
)
def test_a_config_of_an_architecture_the_engine_lacks_says_so(config, named):
    """Not "missing 'num_hidden_layers'": the architecture is what is wrong."""
    with pytest.raises(PlanError) as caught:
        load_model_shape(source({"config": config}))
    assert caught.value.reason == "UnsupportedArchitecture"
    assert caught.value.message.startswith(f"{named} is not implemented by the kvpilot engine")
    assert "LlamaForCausalLM" in caught.value.message
    with pytest.raises(PlanError) as caught:
        load_model_shape(source({"config": {"hidden_size": 8}}))
    assert (caught.value.reason, caught.value.message) == (
        "InvalidModelConfig",
        "spec.model.config: model config is missing 'num_hidden_layers'",
    )


def test_builtin_default_reads_the_gguf_metadata():
    """The default model's sizes, from the GGUF the engine serves, match its public config."""
    default = load_model_shape(ModelSource())
    public = load_model_shape(
        source({"config": json.loads((CONFIGS / "SmolLM2-135M-Instruct.json").read_text())})
    )
    assert default.num_parameters() == public.num_parameters() == 134_515_008
    assert default.kv_bytes_per_token(4) == public.kv_bytes_per_token(4)
    assert default.is_supported_by_engine


def _write_gguf(path: Path, arch: str, *, tied: bool, **metadata) -> Path:
    """A GGUF file of ``arch`` with ``metadata``'s writer calls, a 64-token vocabulary and
    placeholder tensors (sizing reads metadata and tensor names only)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    for method, value in metadata.items():
        getattr(writer, f"add_{method}")(value)
    writer.add_token_list([f"t{i}" for i in range(64)])
    names = ["token_embd.weight", "blk.0.attn_q.weight"] + ([] if tied else ["output.weight"])
    for name in names:
        writer.add_tensor(name, np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TINY_SIZES = dict(
    block_count=2,
    embedding_length=64,
    head_count=8,
    head_count_kv=2,
    feed_forward_length=160,
    context_length=4096,
    rope_freq_base=1_000_000.0,
    layer_norm_rms_eps=1e-6,
)


def _default_gguf() -> Path:
    package = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE).submodule_search_locations[0]
    return Path(package) / DEFAULT_GGUF_NAME


@pytest.mark.parametrize(
    ("arch", "tied", "extra"),
    [
        ("builtin", None, {}),
        ("llama", False, {"rope_dimension_count": 8}),
        ("qwen2", True, {}),
        # Qwen3 heads are 128 wide whatever the width (transformers assumes it, the file says it).
        ("qwen3", False, {"key_length": 128, "vocab_size": 80}),
    ],
)
def test_gguf_config_matches_transformers(tmp_path, arch, tied, extra):
    """Every config field ModelShape reads, and the ModelShape built from them, equal what
    transformers' GGUF loader reads from the same file (the engine converts GGUFs with it)."""
    from transformers import AutoConfig

    if arch == "builtin":
        path = _default_gguf()
        ours = read_model_config(ModelSource())
    else:
        path = _write_gguf(tmp_path / f"{arch}.gguf", arch, tied=tied, **TINY_SIZES, **extra)
        ours = read_model_config(source({"source": f"file://{path}"}))
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    assert {key: theirs[key] for key in ours} == ours
    assert ModelShape.from_hf_config(ours) == ModelShape.from_hf_config(theirs)


def test_gguf_moe_and_rope_scaling(tmp_path):
    """A Mixtral-style "llama" GGUF is sized as a mixture of experts, a Qwen2-MoE one with its
    expert and shared-expert widths, and a YaRN scaling stretches the context from its original
    length."""
    mixtral = _write_gguf(
        tmp_path / "mixtral.gguf",
        "llama",
        tied=False,
        expert_count=8,
        expert_used_count=2,
        rope_scaling_type=gguf.RopeScalingType.YARN,
        rope_scaling_factor=4.0,
        rope_scaling_orig_ctx_len=1024,
        **TINY_SIZES,
    )
    spec = load_model_shape(source({"source": f"file://{mixtral}"}))
    assert (spec.num_experts, spec.num_experts_per_tok, spec.vocab_size) == (8, 2, 64)
    assert spec.derived_max_model_len == 4 * 1024
    qwen_moe = _write_gguf(
        tmp_path / "qwen2moe.gguf",
        "qwen2moe",
        tied=True,
        expert_count=4,
        expert_used_count=2,
        expert_feed_forward_length=32,
        expert_shared_feed_forward_length=96,
        **TINY_SIZES,
    )
    qwen = load_model_shape(source({"source": f"file://{qwen_moe}"}))
    assert (qwen.num_experts, qwen.moe_intermediate_size) == (4, 32)
    assert qwen.shared_expert_intermediate_size == 96
    # Sized, but the engine does not implement Qwen2-MoE: the planner refuses it by name.
    assert "'qwen2_moe' is not implemented" in qwen.engine_support_error()
    without_width = _write_gguf(tmp_path / "moe.gguf", "qwen2moe", tied=True, expert_count=4)
    with pytest.raises(PlanError) as caught:
        load_model_shape(source({"source": f"file://{without_width}"}))
    # Not sizable either, but what is wrong first is the architecture.
    assert caught.value.reason == "UnsupportedArchitecture"
    assert "'qwen2_moe' is not implemented" in caught.value.message


def test_unreadable_gguf_is_unavailable(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(PlanError) as caught:
        read_model_config(source({"source": f"file://{broken}"}))
    assert caught.value.reason == "ConfigUnavailable"
    assert str(broken) in caught.value.message


# A fresh interpreter: threads read the default model and a .gguf file source at the same
# moment, as kopf's handler threads can, then the `kvpilot plan` command sizes the default model;
# none of it may import torch or transformers (the operator image has neither).
CONCURRENT_READS = textwrap.dedent(
    """
    import contextlib, io, sys, threading
    from kvpilot.cli import main
    from kvpilot.operator.model_source import read_model_config
    from kvpilot.operator.spec import parse_spec

    sources = [parse_spec({}).model, parse_spec({"model": {"source": "file://%s"}}).model]
    barrier = threading.Barrier(4)
    layers, errors = [], []

    def read(source):
        barrier.wait()
        try:
            layers.append(read_model_config(source)["num_hidden_layers"])
        except Exception as error:
            errors.append(repr(error))

    threads = [threading.Thread(target=read, args=(sources[i %% 2],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    plan = io.StringIO()
    with contextlib.redirect_stdout(plan):
        try:
            main(["plan", "--gpu", "cpu", "--memory", "3Gi"])
        except SystemExit as exit:
            errors.extend([exit.code] if exit.code else [])
    heavy = [name for name in ("torch", "transformers") if name in sys.modules]
    print("SmolLM2-135M-Instruct" in plan.getvalue())
    print(sorted(layers), errors, heavy)
    """
)


def test_concurrent_reads_import_neither_torch_nor_transformers():
    """Several threads reading GGUF sources at once all get the config, and neither they nor
    `kvpilot plan` for the built-in model import torch or transformers."""
    done = subprocess.run(
        [sys.executable, "-c", CONCURRENT_READS % _default_gguf()],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-2:] == ["True", "[30, 30, 30, 30] [] []"]
