"""Multi-LoRA on our model against transformers + peft on the same base and adapters.

Three PEFT adapters with random weights (different ranks, targets, rsLoRA, rank and alpha
patterns) are built with ``get_peft_model`` and ``save_pretrained``; one batch through the paged
KV cache mixes all three and the base model, and every sequence's logits must match
``PeftModel`` with that adapter (or the plain base model) to float32 rounding.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import shutil

import peft
import pytest
import torch
import transformers

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.config import EngineArgs, SchedulerConfig
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.lora import LoRARequest, parse_lora_modules
from kvpilot.engine.lora.adapter import LoRAAdapterError, load_adapter
from kvpilot.engine.lora.errors import LoRAAdapterGoneError
from kvpilot.engine.lora.manager import LoRAInUseError, LoRAManager, LoRASlotsBusyError
from kvpilot.engine.lora.torch_delta import add_lora_delta, padded_batch
from kvpilot.engine.model_loader import load_model
from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.scheduler import Scheduler
from kvpilot.kernels import lora_reference
from kvpilot.kernels.lora_segments import lora_segments
from tests.engine.helpers import hf_generate

ATOL = 1e-4
BLOCK_SIZE = 4

# name -> LoraConfig arguments; together they cover every target, rsLoRA and both patterns.
ADAPTER_CONFIGS = {
    "all-linear": dict(
        r=8,
        lora_alpha=16,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "qv-rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp-patterns": dict(
        r=16,
        lora_alpha=32,
        target_modules=["gate_proj", "up_proj", "down_proj", "k_proj"],
        rank_pattern={"layers.1.mlp.down_proj": 2},
        alpha_pattern={"up_proj": 5},
    ),
}


def build_adapter(base_dir: pathlib.Path, folder: pathlib.Path, seed: int, **config) -> None:
    """Save a PEFT adapter for ``base_dir`` with random A and B (PEFT's init zeroes B)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir) -> pathlib.Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapter_dirs(base_dir, tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, (name, config) in enumerate(ADAPTER_CONFIGS.items()):
        dirs[name] = root / name
        build_adapter(base_dir, dirs[name], seed, **config)
    return dirs


@functools.cache
def reference_model(base_dir: pathlib.Path, adapter_dir: pathlib.Path | None) -> torch.nn.Module:
    """transformers' model of ``base_dir``, with the adapter applied by ``PeftModel``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@torch.no_grad()
def peft_logits(base_dir, adapter_dir: pathlib.Path | None, token_ids: list[int]) -> torch.Tensor:
    return reference_model(base_dir, adapter_dir)(torch.tensor([token_ids])).logits[0].float()


def paged_forward(model, manager, batch: list[tuple[str | None, list[int]]]) -> torch.Tensor:
    """One prefill of every sequence (own blocks, in order) -> logits ``[num_tokens, vocab]``."""
    ids, positions, slots, starts, tables = [], [], [], [0], []
    next_block = 0
    for _, tokens in batch:
        num_blocks = -(-len(tokens) // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + num_blocks)))
        slots += [next_block * BLOCK_SIZE + p for p in range(len(tokens))]
        next_block += num_blocks
        ids += tokens
        positions += range(len(tokens))
        starts.append(starts[-1] + len(tokens))
    width = max(len(t) for t in tables)
    shape = (next_block, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([len(t) for _, t in batch], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(len(t) for _, t in batch),
        max_seq_len=max(len(t) for _, t in batch),
    )
    manager.set_batch([name for name, _ in batch], [len(t) for _, t in batch])
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.tensor(positions), kv_caches, metadata)
        return model.compute_logits(hidden)


def make_manager(base_dir, adapter_dirs, max_loras=4, max_lora_rank=16, **kwargs):
    model = load_model(base_dir, dtype=torch.float32, device="cpu")
    manager = LoRAManager(model, max_loras=max_loras, max_lora_rank=max_lora_rank, **kwargs)
    for i, (name, folder) in enumerate(adapter_dirs.items(), start=1):
        manager.add_adapter(LoRARequest(name, i, str(folder)))
    return model, manager


PROMPTS = [
    [5, 17, 300, 41, 9, 1200, 77],
    [8, 8, 19],
    [4000, 3, 52, 610, 2, 91, 33, 7, 15],
    [12, 99],
]


def check_mixed_batch(model, manager, base_dir, adapter_dirs, names, atol=ATOL) -> None:
    batch = list(zip(names, PROMPTS, strict=True))
    logits = paged_forward(model, manager, batch)
    start = 0
    for name, tokens in batch:
        want = peft_logits(base_dir, adapter_dirs.get(name), tokens)
        got = logits[start : start + len(tokens)]
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        start += len(tokens)


def test_mixed_batch_matches_peft(base_dir, adapter_dirs) -> None:
    model, manager = make_manager(base_dir, adapter_dirs)
    names = ["qv-rslora", None, "all-linear", "mlp-patterns"]
    check_mixed_batch(model, manager, base_dir, adapter_dirs, names)
    # The adapters really change the output: the base model's logits differ from each.
    for name in adapter_dirs:
        base = peft_logits(base_dir, None, PROMPTS[0])
        assert (peft_logits(base_dir, adapter_dirs[name], PROMPTS[0]) - base).abs().max() > 1e-2


def test_eviction_and_reload_keep_results(base_dir, adapter_dirs) -> None:
    # Two slots for three adapters: each batch evicts the least recently used one.
    model, manager = make_manager(base_dir, adapter_dirs, max_loras=2)
    check_mixed_batch(
        model, manager, base_dir, adapter_dirs, ["all-linear", None, None, "qv-rslora"]
    )
    assert manager.resident == ["all-linear", "qv-rslora"]
    check_mixed_batch(
        model, manager, base_dir, adapter_dirs, [None, "mlp-patterns", None, "qv-rslora"]
    )
    assert manager.resident == ["mlp-patterns", "qv-rslora"]  # all-linear was evicted
    check_mixed_batch(
        model, manager, base_dir, adapter_dirs, ["all-linear", None, "all-linear", None]
    )
    assert manager.resident == ["qv-rslora", "all-linear"]  # mlp-patterns was evicted


def test_no_eviction_of_adapters_in_use(base_dir, adapter_dirs) -> None:
    model, manager = make_manager(base_dir, adapter_dirs, max_loras=2)
    manager.set_batch(["all-linear", "qv-rslora"], [1, 1])
    with pytest.raises(LoRASlotsBusyError, match="all 2 slots hold adapters of running requests"):
        manager.set_batch(["mlp-patterns"], [1], in_use={"all-linear", "qv-rslora"})
    assert manager.resident == ["all-linear", "qv-rslora"]
    with pytest.raises(LoRASlotsBusyError, match="a batch uses 3 LoRA adapters; max_loras is 2"):
        manager.set_batch(["all-linear", "qv-rslora", "mlp-patterns"], [1, 1, 1])
    with pytest.raises(KeyError, match="'nope' is not loaded"):
        manager.set_batch(["nope"], [1])
    with pytest.raises(LoRAInUseError, match="used by unfinished requests"):
        manager.remove_adapter("all-linear", in_use={"all-linear"})
    assert manager.remove_adapter("all-linear")
    assert manager.resident == ["qv-rslora"]
    assert not manager.remove_adapter("all-linear")


def test_base_only_batch_is_the_base_model(base_dir, adapter_dirs) -> None:
    model, manager = make_manager(base_dir, adapter_dirs)
    logits = paged_forward(model, manager, [(None, PROMPTS[0])])
    assert not manager.mapping.active
    torch.testing.assert_close(logits, peft_logits(base_dir, None, PROMPTS[0]), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "slots",
    [
        [2, -1, 0, 2, 2, -1, 0, 1, 2],  # every slot active, uneven counts, base tokens between
        [3, 3, -1, 1],  # a subset of the slots (their weights are gathered)
        [1],
    ],
)
def test_torch_delta_matches_reference(slots: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    num_tokens = len(slots)
    x = torch.randn(num_tokens, 24, generator=g)
    lora_a = torch.randn(4 if max(slots) == 3 else 3, 8, 24, generator=g)
    lora_b = torch.randn(lora_a.shape[0], 40, 8, generator=g)
    out = torch.randn(num_tokens, 40, generator=g)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    want = out.clone()
    lora_reference.lora_expand(
        lora_reference.lora_shrink(x, lora_a, token_slots), lora_b, token_slots, want
    )
    got = out.clone()
    batch = padded_batch(lora_segments(token_slots, lora_a.shape[0]))
    add_lora_delta(x, got, lora_a, lora_b, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    base = token_slots < 0
    assert torch.equal(got[base], out[base])


def test_torch_delta_in_another_dtype_than_the_activations() -> None:
    # bfloat16 weights (--lora-dtype) on float32 activations: computed in bfloat16, added in
    # float32.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 24, generator=g)
    lora_a = torch.randn(2, 8, 24, generator=g).bfloat16()
    lora_b = torch.randn(2, 40, 8, generator=g).bfloat16()
    out = torch.randn(5, 40, generator=g)
    token_slots = torch.tensor([1, -1, 0, 1, 1], dtype=torch.int32)
    want = out.clone()
    rounded_x = x.bfloat16().float()
    lora_reference.lora_expand(
        lora_reference.lora_shrink(rounded_x, lora_a.float(), token_slots),
        lora_b.float(),
        token_slots,
        want,
    )
    got = out.clone()
    add_lora_delta(x, got, lora_a, lora_b, padded_batch(lora_segments(token_slots, 2)))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.25, rtol=2e-2)  # bfloat16's 8 mantissa bits
    assert torch.equal(got[1], out[1])


def test_adapter_reads_peft_names_and_scaling(adapter_dirs) -> None:
    from kvpilot.engine.models.llama import LlamaForCausalLM

    mapping = LlamaForCausalLM.stacked_params_mapping
    adapter = load_adapter("mlp-patterns", adapter_dirs["mlp-patterns"], mapping)
    assert adapter.rank == 16
    assert len(adapter.digest) == 64
    keys = set(adapter.weights)
    assert ("model.layers.0.mlp.gate_up_proj", 0) in keys
    assert ("model.layers.0.mlp.gate_up_proj", 1) in keys
    assert ("model.layers.1.self_attn.qkv_proj", "k") in keys
    assert ("model.layers.1.mlp.down_proj", None) in keys
    assert adapter.weights[("model.layers.1.mlp.down_proj", None)].rank == 2
    assert adapter.weights[("model.layers.1.mlp.down_proj", None)].scaling == 32 / 2
    assert adapter.weights[("model.layers.0.mlp.gate_up_proj", 1)].scaling == 5 / 16
    rs = load_adapter("qv-rslora", adapter_dirs["qv-rslora"], mapping)
    assert rs.weights[("model.layers.0.self_attn.qkv_proj", "v")].scaling == 8 / 2.0
    # Same files, same digest; different adapters, different digests.
    again = load_adapter("x", adapter_dirs["mlp-patterns"], mapping)
    assert again.digest == adapter.digest != rs.digest


def _copy_adapter(src: pathlib.Path, dst: pathlib.Path, **config_changes) -> pathlib.Path:
    dst.mkdir()
    (dst / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_dora": True}, "uses DoRA"),
        ({"bias": "all"}, "trains biases"),
        ({"peft_type": "IA3"}, "peft_type is 'IA3'"),
        ({"modules_to_save": ["lm_head"]}, "saves whole modules"),
        ({"lora_alpha": "x"}, "lora_alpha must be a number"),
    ],
)
def test_unsupported_configs_are_named(adapter_dirs, tmp_path, changes, message) -> None:
    from kvpilot.engine.models.llama import LlamaForCausalLM

    folder = _copy_adapter(adapter_dirs["qv-rslora"], tmp_path / "a", **changes)
    with pytest.raises(LoRAAdapterError, match=message):
        load_adapter("bad", folder, LlamaForCausalLM.stacked_params_mapping)


def test_bad_adapters_are_refused_and_change_nothing(
    base_dir, adapter_dirs, tiny_model_dir, tmp_path
) -> None:
    model = load_model(base_dir, dtype=torch.float32, device="cpu")
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8)
    manager.add_adapter(LoRARequest("qv-rslora", 1, str(adapter_dirs["qv-rslora"])))
    other_base = tiny_model_dir("llama", intermediate_size=96)
    build_adapter(other_base, tmp_path / "other", 0, r=4, lora_alpha=4, target_modules=["up_proj"])
    cases = [
        (
            LoRARequest("big", 2, str(adapter_dirs["mlp-patterns"])),
            "rank 16, above max_lora_rank 8",
        ),
        (LoRARequest("gone", 3, str(tmp_path / "missing")), "is not a folder"),
        (LoRARequest("other", 4, str(tmp_path / "other")), r"64 -> 96 features.*another base"),
        (LoRARequest("qv-rslora", 1, str(adapter_dirs["all-linear"])), "unload it before"),
    ]
    for request, message in cases:
        with pytest.raises(LoRAAdapterError, match=message):
            manager.add_adapter(request)
    assert set(manager.adapters) == {"qv-rslora"}
    assert manager.resident == []
    # Registering the same name and path again is a no-op returning the same adapter.
    first = manager.adapters["qv-rslora"]
    assert manager.add_adapter(LoRARequest("qv-rslora", 1, str(adapter_dirs["qv-rslora"]))) is first


# --- Host copies (--max-cpu-loras) and the LoRA weights' dtype (--lora-dtype), vLLM's. ---


def test_max_cpu_loras_keeps_the_most_recently_used_host_copies(base_dir, adapter_dirs) -> None:
    # One slot and two host copies for three adapters; each registration or batch makes its
    # adapter the most recently used (vLLM's LRU cache of registered adapters).
    model, manager = make_manager(base_dir, adapter_dirs, max_loras=1, max_cpu_loras=2)
    assert list(manager.requests) == ["all-linear", "qv-rslora", "mlp-patterns"]
    assert list(manager.adapters) == ["qv-rslora", "mlp-patterns"]  # all-linear was dropped
    # A dropped adapter still runs: read again from its path, with PEFT's results.
    names = ["all-linear", None, "all-linear", None]
    check_mixed_batch(model, manager, base_dir, adapter_dirs, names)
    assert list(manager.adapters) == ["mlp-patterns", "all-linear"]  # qv-rslora was dropped
    manager.set_batch(["mlp-patterns"], [1])
    assert list(manager.adapters) == ["all-linear", "mlp-patterns"]
    assert manager.resident == ["mlp-patterns"]
    # Registering a dropped adapter again (same name and path) reads it back.
    manager.add_adapter(LoRARequest("qv-rslora", 2, str(adapter_dirs["qv-rslora"])))
    assert list(manager.adapters) == ["mlp-patterns", "qv-rslora"]  # all-linear was dropped
    check_mixed_batch(model, manager, base_dir, adapter_dirs, [None, "qv-rslora", None, None])
    assert manager.remove_adapter("all-linear")  # registered, though its copy was dropped
    assert list(manager.requests) == ["qv-rslora", "mlp-patterns"]


def test_adapters_of_running_requests_keep_their_host_copies(base_dir, adapter_dirs) -> None:
    model, manager = make_manager(base_dir, adapter_dirs, max_loras=2)
    assert manager.max_cpu_loras == 2  # vLLM's default: max_loras
    assert list(manager.adapters) == ["qv-rslora", "mlp-patterns"]
    # all-linear is read again; the least recently used copy, qv-rslora's, is kept for its
    # running requests, so mlp-patterns' goes.
    manager.set_batch(["all-linear"], [1], in_use={"qv-rslora"})
    assert list(manager.adapters) == ["qv-rslora", "all-linear"]


def test_a_dropped_adapter_whose_files_changed_is_refused(base_dir, adapter_dirs, tmp_path):
    folder = _copy_adapter(adapter_dirs["qv-rslora"], tmp_path / "qv")
    model = load_model(base_dir, dtype=torch.float32, device="cpu")
    manager = LoRAManager(model, max_loras=1, max_lora_rank=16)
    manager.add_adapter(LoRARequest("qv", 1, str(folder)))
    manager.add_adapter(LoRARequest("all", 2, str(adapter_dirs["all-linear"])))
    assert list(manager.adapters) == ["all"]
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 99}))
    # Its prefix-cache blocks are keyed by the registered files' digest: never other weights.
    for attempt in (
        lambda: manager.set_batch(["qv"], [1]),
        lambda: manager.add_adapter(LoRARequest("qv", 1, str(folder))),
    ):
        with pytest.raises(LoRAAdapterError, match="'qv': the files in .* changed since"):
            attempt()
    assert list(manager.adapters) == ["all"]


@pytest.mark.parametrize("named_by", ["request", "batch"])
def test_a_dropped_adapter_whose_files_are_gone_is_unregistered(
    base_dir, adapter_dirs, tmp_path, named_by
):
    # Its folder deleted while its host copy was dropped: it can no longer be read, so it is
    # unregistered (the server lists it no more) and its name can be loaded again, from
    # another folder. "request": the engine registers a request's adapter (add_adapter).
    folder = _copy_adapter(adapter_dirs["qv-rslora"], tmp_path / "qv")
    model = load_model(base_dir, dtype=torch.float32, device="cpu")
    manager = LoRAManager(model, max_loras=1, max_lora_rank=16)
    qv = LoRARequest("qv", 1, str(folder))
    manager.add_adapter(qv)
    manager.add_adapter(LoRARequest("all", 2, str(adapter_dirs["all-linear"])))
    assert list(manager.adapters) == ["all"]
    shutil.rmtree(folder)
    use = {
        "request": lambda: manager.add_adapter(qv),
        "batch": lambda: manager.set_batch(["qv"], [1]),
    }
    with pytest.raises(LoRAAdapterGoneError) as gone:
        use[named_by]()
    assert str(gone.value) == (
        f"LoRA adapter 'qv': its files are gone from {folder} (adapter_config.json, "
        "adapter_model.safetensors deleted since it was loaded), so it was unloaded; load it "
        "again to use it"
    )
    assert list(manager.requests) == ["all"]
    manager.add_adapter(LoRARequest("qv", 3, str(adapter_dirs["qv-rslora"])))
    names = ["qv", None, None, None]
    check_mixed_batch(model, manager, base_dir, {"qv": adapter_dirs["qv-rslora"]}, names)


def test_max_cpu_loras_below_max_loras_is_refused(base_dir) -> None:
    model = load_model(base_dir, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"^max_cpu_loras \(1\) must be >= max_loras \(2\)$"):
        LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=1)


def test_lora_dtype_is_the_dtype_of_host_copies_and_slots(base_dir, adapter_dirs) -> None:
    model, manager = make_manager(base_dir, adapter_dirs, lora_dtype=torch.bfloat16)
    assert manager.lora_dtype == torch.bfloat16
    for adapter in manager.adapters.values():
        for weights in adapter.weights.values():
            assert weights.lora_a.dtype == weights.lora_b.dtype == torch.bfloat16
    for layer in manager.layers.values():
        assert layer.lora_a.dtype == layer.lora_b.dtype == torch.bfloat16
        assert layer.base_layer.weight.dtype == torch.float32  # the model keeps its dtype
    # PEFT's float32 logits to bfloat16 rounding (each adapter moves them by about 1).
    names = ["qv-rslora", None, "all-linear", "mlp-patterns"]
    check_mixed_batch(model, manager, base_dir, adapter_dirs, names, atol=0.05)
    _, auto = make_manager(base_dir, {"qv-rslora": adapter_dirs["qv-rslora"]})
    weights = next(iter(auto.adapters["qv-rslora"].weights.values()))
    assert auto.lora_dtype == weights.lora_a.dtype == torch.float32  # auto: the model's


def test_the_engine_takes_max_cpu_loras_and_lora_dtype(base_dir, adapter_dirs) -> None:
    llm = lora_llm(base_dir, adapter_dirs, max_loras=1, max_cpu_loras=3, lora_dtype="bfloat16")
    manager = llm.llm_engine.lora_manager
    assert (manager.max_cpu_loras, manager.lora_dtype) == (3, torch.bfloat16)
    assert list(manager.adapters) == list(adapter_dirs)  # room for all three
    (tokens,) = generate_ids(llm, [PROMPTS[0]], lora_requests(llm, ["all-linear"]))
    assert len(tokens) == NEW_TOKENS
    defaults = lora_llm(base_dir, adapter_dirs, max_loras=1).llm_engine.lora_manager
    assert (defaults.max_cpu_loras, defaults.lora_dtype) == (1, torch.float32)
    assert list(defaults.adapters) == ["mlp-patterns"]


# --- The whole engine: LLM.generate with adapters, eviction, prefix caching. ---

NEW_TOKENS = 6


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def reference_greedy(base_dir, adapter_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers (+ ``PeftModel``) greedy ``generate()``, EOS ignored."""
    return hf_generate(reference_model(base_dir, adapter_dir), prompt, max_new_tokens)


def lora_llm(base_dir, adapter_dirs, max_loras: int, **kwargs) -> LLM:
    modules = [f"{name}={folder}" for name, folder in adapter_dirs.items()]
    return LLM(
        str(base_dir),
        max_model_len=128,
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=16,
        lora_modules=modules,
        **kwargs,
    )


def lora_requests(llm: LLM, names: list[str | None]) -> list[LoRARequest | None]:
    registered = {r.lora_name: r for r in llm.llm_engine.list_loras()}
    return [None if n is None else registered[n] for n in names]


def generate_ids(llm: LLM, prompts, loras, max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), False, lora_request=loras
    )
    return [o.outputs[0].token_ids for o in outputs]


def test_an_admitted_request_keeps_its_adapters_host_copy(base_dir, adapter_dirs, tmp_path):
    # One host copy (max_cpu_loras = max_loras = 1) and two adapters in flight: the first
    # request's copy, read again at its admission, is kept while it is unfinished, so its
    # folder deleted afterwards cannot fail a step (it would be read again there otherwise).
    folder = _copy_adapter(adapter_dirs["qv-rslora"], tmp_path / "qv")
    llm = lora_llm(base_dir, {"qv": folder, "all": adapter_dirs["all-linear"]}, max_loras=1)
    engine, manager = llm.llm_engine, llm.llm_engine.lora_manager
    assert list(manager.adapters) == ["all"]
    qv, all_linear = lora_requests(llm, ["qv", "all"])
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, greedy(), lora_request=qv)
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, greedy(), lora_request=all_linear)
    assert list(manager.adapters) == ["qv", "all"]  # over its bound while both are in use
    shutil.rmtree(folder)
    tokens = {}
    while engine.has_unfinished_requests():
        tokens |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert tokens == {
        "a": reference_greedy(base_dir, adapter_dirs["qv-rslora"], PROMPTS[0], NEW_TOKENS),
        "b": reference_greedy(base_dir, adapter_dirs["all-linear"], PROMPTS[1], NEW_TOKENS),
    }


def test_greedy_per_adapter_matches_peft_with_eviction(base_dir, adapter_dirs) -> None:
    # Two slots for three adapters: the scheduler runs at most two adapters at once, and later
    # requests evict the least recently used idle adapter and load theirs.
    llm = lora_llm(base_dir, adapter_dirs, max_loras=2)
    names = ["all-linear", None, "qv-rslora", "mlp-patterns", "all-linear", "mlp-patterns"]
    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 3] for i in range(len(names))]
    want = [
        reference_greedy(base_dir, adapter_dirs.get(n), p, NEW_TOKENS)
        for n, p in zip(names, prompts, strict=True)
    ]
    got = generate_ids(llm, prompts, lora_requests(llm, names))
    assert got == want
    manager = llm.llm_engine.lora_manager
    assert len(manager.resident) == 2
    # Again, in another order: adapters are evicted and reloaded, outputs do not change.
    order = [3, 0, 5, 2, 1, 4]
    again = generate_ids(
        llm, [prompts[i] for i in order], lora_requests(llm, [names[i] for i in order])
    )
    assert again == [want[i] for i in order]
    stats = llm.llm_engine.get_stats()
    assert stats.max_lora == 2
    assert stats.running_lora_adapters == stats.waiting_lora_adapters == ()


def test_adapters_never_share_kv(base_dir, adapter_dirs, tmp_path) -> None:
    prompt = list(range(100, 140))  # 40 tokens: two full 16-token blocks to reuse
    folder = tmp_path / "swap"
    shutil.copytree(adapter_dirs["qv-rslora"], folder)
    llm = lora_llm(base_dir, {}, max_loras=2)
    engine = llm.llm_engine
    swap = LoRARequest("swap", 1, str(folder))

    def run(lora: LoRARequest | None) -> tuple[list[int], int]:
        (out,) = llm.generate({"prompt_token_ids": prompt}, greedy(4), False, lora_request=lora)
        assert out.lora_request == lora  # vLLM's RequestOutput.lora_request
        return out.outputs[0].token_ids, out.num_cached_tokens

    first, cached = run(swap)
    assert cached == 0
    assert run(swap) == (first, 32)  # same adapter, same weights: two blocks reused
    base_tokens, cached = run(None)
    assert cached == 0  # the base model never reads the adapter's blocks
    # Reload under the same name and path with other weights: no block of the old ones is read.
    assert engine.remove_lora("swap")
    build_adapter(base_dir, folder, 7, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    tokens, cached = run(swap)
    assert cached == 0
    assert tokens == reference_greedy(base_dir, folder, prompt, 4)
    assert tokens != first and base_tokens != first


def test_lora_errors_are_clear(base_dir, adapter_dirs, tmp_path) -> None:
    plain = LLM(str(base_dir), max_model_len=64)
    request = LoRARequest("a", 1, str(adapter_dirs["all-linear"]))
    with pytest.raises(ValueError, match="not enabled.*--enable-lora"):
        plain.generate("hi", lora_request=request, use_tqdm=False)
    assert not plain.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        LLM(str(base_dir), lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="above max_lora_rank 8"):
        LLM(str(base_dir), enable_lora=True, max_lora_rank=8, lora_modules=[
            f"big={adapter_dirs['mlp-patterns']}"
        ])  # fmt: skip
    llm = lora_llm(base_dir, {"qv": adapter_dirs["qv-rslora"]}, max_loras=1)
    missing = LoRARequest("missing", 9, str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="'missing'.*is not a folder"):
        llm.generate(["hi", "there"], lora_request=[None, missing], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert [r.lora_name for r in llm.llm_engine.list_loras()] == ["qv"]
    assert not llm.llm_engine.remove_lora("missing")


def test_scheduler_keeps_running_adapters_within_max_loras() -> None:
    config = SchedulerConfig(
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
        max_loras=1,
    )
    scheduler = Scheduler(config, KVCacheManager(16, 4, enable_caching=True))
    params = SamplingParams(max_tokens=4)
    x, y = LoRARequest("x", 1, "/x"), LoRARequest("y", 2, "/y")

    def request(rid: str, lora: LoRARequest | None) -> Request:
        return Request(rid, [5, 6, 7], params, frozenset(), 4, lora_request=lora, lora_digest="d")

    for rid, lora in (("a", x), ("b", y), ("c", None), ("d", x)):
        scheduler.add_request(request(rid, lora))
    out = scheduler.schedule()
    # "b" would be a second adapter: it waits, the requests behind it still run.
    assert [s.request.request_id for s in out.scheduled] == ["a", "c", "d"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    for rid in ("a", "d"):
        scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    assert [s.request.request_id for s in scheduler.schedule().scheduled] == ["c", "b"]


def test_lora_engine_args_and_flags() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    cli = parser.parse_args(
        ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "64", "--lora-modules",
         "a=/adapters/a", '{"name": "b", "path": "org/b"}', "--max-cpu-loras", "8",
         "--lora-dtype", "float16"]
    )  # fmt: skip
    args = EngineArgs.from_cli_args(cli)
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 3, 64)
    assert (args.max_cpu_loras, args.lora_dtype) == (8, "float16")
    assert [(m.name, m.path) for m in parse_lora_modules(args.lora_modules)] == [
        ("a", "/adapters/a"),
        ("b", "org/b"),
    ]
    assert EngineArgs().enable_lora is False
    assert (EngineArgs().max_cpu_loras, EngineArgs().lora_dtype) == (None, "auto")
    # As vLLM: 0 or less is the default (max_loras); no rule without LoRA (no LoRA config).
    assert EngineArgs(enable_lora=True, max_cpu_loras=-1).max_cpu_loras is None
    assert EngineArgs(max_loras=2, max_cpu_loras=1).max_cpu_loras == 1
    for kwargs, message in [
        ({"enable_lora": True, "max_loras": 0}, "max_loras must be a positive integer"),
        ({"enable_lora": True, "max_lora_rank": -1}, "max_lora_rank must be a positive"),
        ({"enable_lora": True, "lora_modules": ["a"]}, "must be name=path"),
        ({"enable_lora": True, "lora_modules": ["a=/x", "a=/y"]}, "names the adapter 'a' twice"),
        ({"enable_lora": True, "lora_modules": "a=/x"}, "must be a list of name=path"),
        ({"enable_lora": True, "tensor_parallel_size": 2}, "not supported with tensor_parallel"),
        (
            {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1},
            r"^max_cpu_loras \(1\) must be >= max_loras \(2\)$",
        ),
        ({"max_cpu_loras": "4"}, "max_cpu_loras must be an integer .*, got '4'"),
        ({"lora_dtype": "int8"}, "lora_dtype must be one of auto, float16, bfloat16, float32"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineArgs(**kwargs)
