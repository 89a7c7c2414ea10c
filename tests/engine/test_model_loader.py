"""Model loading: the default model's GGUF conversion cache, folders, Hub ids, errors, EOS ids."""

from __future__ import annotations

import json
import pathlib
import shutil
import types

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvpilot.engine.layers.rotary_embedding import RotaryEmbedding
from kvpilot.engine.model_loader import (
    DEFAULT_MODEL_NAME,
    get_eos_token_ids,
    load_model,
    load_tokenizer,
    read_model_config,
    resolve_dtype,
    resolve_model,
)
from kvpilot.engine.model_loader.resolve import DEFAULT_GGUF_NAME, DEFAULT_MODEL_PACKAGE
from kvpilot.engine.models import get_model_class

CPU = torch.device("cpu")


def copy_model(src: pathlib.Path, dst: pathlib.Path, config_changes: dict) -> pathlib.Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def gguf_path() -> pathlib.Path:
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME


def test_default_model_is_converted_once_and_reused(default_model_dir, monkeypatch):
    assert DEFAULT_MODEL_NAME in default_model_dir.name
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    assert "quantization_config" not in config
    assert (default_model_dir / "model.safetensors").is_file()

    # A second resolve must not convert again: make any conversion attempt fail loudly.
    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion was not reused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    assert resolve_model(None) == default_model_dir
    assert resolve_model(DEFAULT_MODEL_NAME) == default_model_dir


def test_failed_conversion_leaves_no_cache_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model(None)
    assert list((tmp_path / "models").iterdir()) == []


def test_tokenizer_and_chat_template_come_from_the_gguf(default_model_dir):
    ours = load_tokenizer(default_model_dir)
    path = gguf_path()
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["Hello, world!", "Kubernetes schedules pods. 123 + 456 = 579\n", "héllo 🚀"]:
        assert ours(text).input_ids == reference(text).input_ids
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert ours.convert_ids_to_tokens(2) == "<|im_end|>"


def test_eos_token_ids_prefer_generation_config(default_model_dir, tiny_model_dir, tmp_path):
    assert get_eos_token_ids(default_model_dir) == {2}

    folder = copy_model(tiny_model_dir("llama"), tmp_path / "m", {"eos_token_id": 7})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert get_eos_token_ids(folder) == {2, 5}
    (folder / "generation_config.json").unlink()
    assert get_eos_token_ids(folder) == {7}
    copy_model(folder, tmp_path / "n", {"eos_token_id": None})
    assert get_eos_token_ids(tmp_path / "n") == {2}  # the tokenizer's <|im_end|>


def test_local_folder_resolves_to_itself(tiny_model_dir):
    folder = tiny_model_dir("llama")
    assert resolve_model(str(folder)) == folder


def test_hub_id_goes_through_the_hub_cache(tiny_model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--kvpilot-tests--tiny-llama"
    shutil.copytree(tiny_model_dir("llama"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("kvpilot-tests/tiny-llama") == repo / "snapshots" / commit


def test_unknown_hub_id_raises_naming_it(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="no-such-org/no-such-model@v2"):
        resolve_model("no-such-org/no-such-model", revision="v2")


@pytest.mark.parametrize("name", ["./missing-model", "/no/such/dir", "~/missing", "a/b/c"])
def test_missing_path_raises_naming_it(name):
    with pytest.raises(FileNotFoundError, match=name.split("/")[-1]):
        resolve_model(name)


def test_folder_problems_are_named(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model(str(empty))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir("llama"), no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(no_weights))


def test_unsupported_architecture_is_refused_by_name(tiny_model_dir, tmp_path):
    folder = copy_model(
        tiny_model_dir("llama"), tmp_path / "m", {"architectures": ["FalconForCausalLM"]}
    )
    with pytest.raises(ValueError, match="unsupported model architecture 'FalconForCausalLM'"):
        load_model(folder, torch.float32, CPU)


@pytest.mark.parametrize("architectures", ["LlamaForCausalLM", None, []])
def test_a_config_without_a_list_of_architectures_still_builds(
    tiny_model_dir, tmp_path, architectures
):
    # The planner sizes these (one name as a list of one; none, by model_type "llama"), so the
    # engine builds them too: the same model as the config with ["LlamaForCausalLM"].
    folder = copy_model(tiny_model_dir("llama"), tmp_path / "m", {"architectures": architectures})
    model = load_model(folder, torch.float32, CPU)
    reference = load_model(tiny_model_dir("llama"), torch.float32, CPU)
    assert type(model) is type(reference)
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    falcon = types.SimpleNamespace(architectures=None, model_type="falcon")
    with pytest.raises(ValueError, match="no 'architectures' entry \\(and model_type 'falcon'"):
        get_model_class(falcon)


def test_weights_that_do_not_fit_are_named(tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir("llama"), tmp_path / "m", {"intermediate_size": 96})
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.mlp.down_proj.weight' has shape \(64, 128\), the model expects \(64, 96\)",
    ):
        load_model(folder, torch.float32, CPU)
    deeper = copy_model(tiny_model_dir("llama"), tmp_path / "n", {"num_hidden_layers": 3})
    with pytest.raises(ValueError, match="model.layers.2.self_attn.qkv_proj.weight"):
        load_model(deeper, torch.float32, CPU)
    # Phi-3 stores q/k/v fused: 4 + 2 * 2 heads of 16 rows; one KV head in the config wants 96.
    fused = copy_model(tiny_model_dir("phi3"), tmp_path / "f", {"num_key_value_heads": 1})
    with pytest.raises(ValueError, match=r"qkv_proj.weight' has shape \(128, 64\), .* \(96, 64\)"):
        load_model(fused, torch.float32, CPU)


def test_llama3_rope_scaling_matches_transformers(tiny_model_dir):
    rope_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    folder = tiny_model_dir("llama", rope_scaling=rope_scaling, rope_theta=500000.0)
    model = load_model(folder, torch.float32, CPU)
    rope = model.model.rotary_emb
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.rope_parameters["rope_type"] == "llama3"
    reference = LlamaRotaryEmbedding(config)
    torch.testing.assert_close(rope.inv_freq, reference.inv_freq, atol=0, rtol=0)
    plain = RotaryEmbedding(transformers.AutoConfig.from_pretrained(tiny_model_dir("llama")), 16)
    assert not torch.equal(rope.inv_freq, plain.inv_freq)

    positions = torch.tensor([0, 3, 100, 1500])
    cos, sin = rope.cos_sin(positions, torch.float32)
    ref_cos, ref_sin = reference(torch.zeros(1), positions[None])
    torch.testing.assert_close(cos[:, 0], ref_cos[0], atol=0, rtol=0)
    torch.testing.assert_close(sin[:, 0], ref_sin[0], atol=0, rtol=0)


def test_unknown_rope_type_is_named(tiny_model_dir, tmp_path):
    folder = copy_model(
        tiny_model_dir("llama"),
        tmp_path / "m",
        {"rope_parameters": {"rope_type": "spiral", "rope_theta": 10000.0}},
    )
    with pytest.raises(ValueError, match="spiral"):
        load_model(folder, torch.float32, CPU)


def test_an_unknown_checkpoint_dtype_is_refused_naming_it(tiny_model_dir, tmp_path):
    # transformers looks the name up in torch: "int3" became torch.int3 (and the model ran in
    # the float32 or bfloat16 of "auto"), a name torch lacks an AttributeError traceback.
    for value in ("int3", "int33"):
        stated = {"dtype": None, "torch_dtype": value}  # as transformers 4 wrote it
        folder = copy_model(tiny_model_dir("llama"), tmp_path / value, stated)
        with pytest.raises(ValueError) as refused:
            read_model_config(folder)
        assert str(refused.value) == (
            f"{folder}/config.json: 'torch_dtype' (the checkpoint's dtype) must be "
            f"one of float32, float, float16, half, bfloat16, float8_e4m3fn, float8_e5m2, got "
            f"{value!r}"
        )


@pytest.mark.parametrize(
    ("stated", "dtype"),
    [("torch.bfloat16", torch.bfloat16), ("half", torch.float16), ("float", torch.float32)],
)
def test_a_checkpoint_dtype_reaches_transformers_by_its_canonical_name(
    tiny_model_dir, tmp_path, stated, dtype
):
    # "torch.bfloat16" (older exports; the planner accepts it) failed inside transformers.
    folder = copy_model(tiny_model_dir("llama"), tmp_path / "m", {"dtype": stated})
    raw, config = read_model_config(folder)
    assert config.dtype == dtype
    assert raw["dtype"] == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("stated", ["torch.bfloat16", "", "auto"])
def test_the_tokenizer_loads_beside_a_dtype_transformers_cannot_look_up(
    default_model_dir, tmp_path, stated
):
    # transformers read config.json again for the tokenizer and failed in getattr(torch, ...)
    # on "torch.bfloat16" and "" (kvpilot serve: a traceback) where the engine runs the model.
    folder = copy_model(default_model_dir, tmp_path / "m", {"dtype": None, "torch_dtype": stated})
    prompt = "The capital of France is"
    assert load_tokenizer(folder).encode(prompt) == load_tokenizer(default_model_dir).encode(prompt)
    (folder / "config.json").write_text(
        json.dumps({**json.loads((folder / "config.json").read_text()), "torch_dtype": "int3"})
    )
    with pytest.raises(ValueError, match="'torch_dtype' .* got 'int3'"):
        load_tokenizer(folder)


def test_resolve_dtype():
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("half", CPU) == torch.float16
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype(torch.float16, CPU) == torch.float16
    with pytest.raises(ValueError, match="'float8'"):
        resolve_dtype("float8", CPU)


def test_a_missing_stacked_shard_is_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir("qwen2"), folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"lacks weights for: model.layers.1.self_attn.qkv_proj.bias$"
    ):
        load_model(folder, torch.float32, CPU)


def test_a_file_that_is_not_gguf_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="cannot convert GGUF file .*broken.gguf"):
        resolve_model(str(bad))
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_sharded_checkpoint_reads_only_indexed_shards(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    source = tiny_model_dir("llama")
    folder = tmp_path / "sharded"
    folder.mkdir()
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(source / name, folder / name)
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, shard_names in halves.items():
        save_file({n: tensors[n] for n in shard_names}, folder / shard, metadata={"format": "pt"})
    weight_map = {n: shard for shard, shard_names in halves.items() for n in shard_names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # A file in another format that the index does not list must be ignored.
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, folder / "consolidated.safetensors")

    sharded = load_model(folder, torch.float32, CPU)
    whole = load_model(source, torch.float32, CPU)
    for (name, a), (_, b) in zip(sharded.named_parameters(), whole.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_hf_overrides_change_the_model_as_an_edited_config_would(tiny_model_dir, tmp_path):
    """``--hf-overrides`` gives the prompt logprobs transformers gives for the folder with
    those entries written into its config.json (and others than without them)."""
    from kvpilot.engine import LLM, SamplingParams

    folder = tiny_model_dir("llama")
    overrides = {"rope_parameters": {"rope_theta": 37.0, "rope_type": "default"}}
    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, **overrides}))
    prompt = list(range(5, 40))

    def reference(model_dir: pathlib.Path) -> torch.Tensor:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1]
        return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]

    llm = LLM(str(folder), max_model_len=128, hf_overrides=json.dumps(overrides))
    assert llm.llm_engine.model_config.rope_parameters["rope_theta"] == 37.0
    (out,) = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    pairs = zip(out.prompt_logprobs[1:], prompt[1:], strict=True)
    got = torch.tensor([entry[token].logprob for entry, token in pairs])
    torch.testing.assert_close(got, reference(edited), atol=1e-4, rtol=0)
    assert (got - reference(folder)).abs().max() > 1e-3
    limited = LLM(str(folder), hf_overrides={"max_position_embeddings": 40})
    assert limited.llm_engine.scheduler_config.max_model_len == 40


def test_hf_overrides_update_a_nested_config_key_by_key(tiny_model_dir):
    folder = tiny_model_dir("llama")
    raw, _ = read_model_config(folder, {"max_position_embeddings": 96})
    assert raw["max_position_embeddings"] == 96
    with pytest.raises(ValueError, match="config.json with hf_overrides: .*num_hidden_layers"):
        read_model_config(folder, {"num_hidden_layers": "abc"})
    from kvpilot.engine.model_loader.weights import _override

    config = {"text_config": {"model_type": "llama", "a": 1, "b": 2}, "rope": {"x": 1, "y": 2}}
    assert _override(config, {"text_config": {"a": 5}, "rope": {"x": 3}}) == {
        "text_config": {"model_type": "llama", "a": 5, "b": 2},
        "rope": {"x": 3},  # a plain dict entry is replaced whole, as vLLM sets it
    }


def test_dummy_weights_need_no_checkpoint(tiny_model_dir, tmp_path):
    """``--load-format dummy``: a folder without weights serves, with small random
    parameters (vLLM's dummy format), the same on every load."""
    from kvpilot.engine import LLM

    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir("llama"), folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(folder))
    assert resolve_model(str(folder), weights=False) == folder

    params = list(load_model(folder, torch.float32, CPU, load_format="dummy").parameters())
    assert all(p.abs().max() <= 1e-3 for p in params)
    assert all(p.abs().max() > 9e-4 for p in params)  # every one filled, none left zero
    runs = []
    for _ in range(2):
        llm = LLM(str(folder), max_model_len=64, load_format="dummy")
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy_params(8))
        runs.append(out[0].outputs[0].token_ids)
    assert len(runs[0]) == 8 and runs[0] == runs[1]


def greedy_params(max_tokens: int):
    from kvpilot.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
