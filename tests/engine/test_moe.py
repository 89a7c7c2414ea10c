"""Mixture of experts: routing as transformers routes, the grouped CPU path against the per-token
reference, both checkpoint layouts, each rank's expert shard, and two ranks (experts sliced, or
placed whole with expert parallelism) reproducing one rank.

Logits and greedy tokens of whole tiny Mixtral / Qwen3-MoE models against transformers are in
``test_models.py`` (cases ``mixtral``, ``qwen3-moe``, ``qwen3-moe-unnormalised``).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.distributed import parallel_state
from kvpilot.engine.executor import EngineDeadError
from kvpilot.engine.layers.fused_moe import FusedMoE, SparseMoeBlock, fused_topk
from kvpilot.engine.model_loader import load_model
from kvpilot.kernels.moe_reference import fused_experts
from tests.engine.test_models import MIXTRAL, PROMPT_A, QWEN3_MOE, PagedBatch, hf_logits
from tests.engine.test_tensor_parallel import (
    assert_same_generation,
    generate,
    make_llm,
    random_prompts,
    tp_workers,
)

MODELS = {
    "mixtral": ("mixtral", MIXTRAL),
    "qwen3_moe": ("qwen3_moe", {**QWEN3_MOE, "mlp_only_layers": [1], "norm_topk_prob": True}),
}


def use_ranks(monkeypatch, rank: int, world_size: int, expert_parallel: bool) -> None:
    """Layers built from now on hold ``rank``'s shard (no process group needed to build)."""
    state = parallel_state.TensorParallelState(rank, world_size, None, expert_parallel)
    monkeypatch.setattr(parallel_state, "_STATE", state)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe-normalised", "qwen3_moe"])
def test_top_k_routing_is_transformers_routers(model_type):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 64, generator=g)
    weight = torch.randn(8, 64, generator=g) * 0.1
    if model_type == "mixtral":
        config = transformers.MixtralConfig(hidden_size=64, num_local_experts=8)
        router, renormalize = MixtralTopKRouter(config), True
    else:
        normalised = model_type.endswith("normalised")
        config = transformers.Qwen3MoeConfig(
            hidden_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=normalised
        )
        router, renormalize = Qwen3MoeTopKRouter(config), normalised
    router.weight.data = weight
    _, hf_weights, hf_ids = router(hidden)
    weights, ids = fused_topk(hidden @ weight.T, 2, renormalize)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=1e-7, rtol=1e-6)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) is renormalize


def random_experts(layer: FusedMoE, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for param in (layer.w13_weight, layer.w2_weight):
        param.data = torch.randn(param.shape, generator=g) * 0.2


@pytest.mark.parametrize("expert_parallel_rank", [None, 0, 1])
def test_grouped_cpu_path_is_the_per_token_formula(monkeypatch, expert_parallel_rank):
    """6 experts, top 2, 13 tokens, expert 5 never chosen; under expert parallelism (rank 0 or 1
    of 2) only the pairs of the rank's 3 experts count."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(13, 32, generator=g)
    topk_ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(13)])
    topk_weights = torch.rand(13, 2, generator=g)
    if expert_parallel_rank is not None:
        use_ranks(monkeypatch, expert_parallel_rank, 2, expert_parallel=True)
    layer = FusedMoE(num_experts=6, hidden_size=32, intermediate_size=24)
    random_experts(layer)
    # No process group: forward_native is this rank's partial sum, before the all-reduce.
    got = layer.forward_native(hidden, topk_weights, topk_ids)
    expected = fused_experts(
        hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.expert_map
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if expert_parallel_rank is not None:
        assert layer.local_experts == [3 * expert_parallel_rank + i for i in range(3)]
        local = (topk_ids // 3 == expert_parallel_rank).any(-1)
        assert got[~local].abs().max() == 0 and got[local].abs().min() > 0


def test_unshardable_experts_are_refused(monkeypatch):
    use_ranks(monkeypatch, 0, 2, expert_parallel=True)
    with pytest.raises(
        ValueError, match="num_experts 3 is not divisible by tensor_parallel_size 2"
    ):
        FusedMoE(num_experts=3, hidden_size=32, intermediate_size=24)
    use_ranks(monkeypatch, 0, 2, expert_parallel=False)
    with pytest.raises(ValueError, match="intermediate_size 25 is not divisible by tensor_para"):
        FusedMoE(num_experts=4, hidden_size=32, intermediate_size=25)
    with pytest.raises(ValueError, match=r"num_experts_per_tok 5 must be in \[1, 4\]"):
        SparseMoeBlock(4, 5, 32, 24, renormalize=True)
    with pytest.raises(ValueError, match="enable_expert_parallel must be a boolean"):
        EngineArgs(enable_expert_parallel="yes")


@pytest.mark.parametrize("model", list(MODELS))
def test_stacked_expert_checkpoints_load_as_per_expert_ones(tiny_model_dir, tmp_path, model):
    """transformers' ``save_pretrained`` writes one tensor per expert and projection (what
    public checkpoints hold); with ``save_original_format=False`` it writes transformers 5's
    stacked ``experts.gate_up_proj`` / ``experts.down_proj``. Both load the same weights."""
    architecture, overrides = MODELS[model]
    per_expert = tiny_model_dir(architecture, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    hf.save_pretrained(tmp_path, save_original_format=False)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    ours = dict(load_model(per_expert, torch.float32, "cpu").named_parameters())
    stacked = dict(load_model(tmp_path, torch.float32, "cpu").named_parameters())
    assert ours.keys() == stacked.keys()
    assert all(torch.equal(ours[name], stacked[name]) for name in ours)
    assert "model.layers.0.mlp.experts.w13_weight" in ours


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "expert-parallel"])
@pytest.mark.parametrize("model", list(MODELS))
def test_each_rank_loads_its_expert_shard(tiny_model_dir, monkeypatch, model, expert_parallel):
    """Sliced: rank r holds rows r of every expert's gate and up, columns r of its down.
    Expert parallel: rank r holds experts 2r, 2r + 1 whole. The router is replicated."""
    architecture, overrides = MODELS[model]
    model_dir = tiny_model_dir(architecture, **overrides)
    full = load_model(model_dir, torch.float32, "cpu").model.layers[0].mlp
    size = full.experts.intermediate_size
    gate, up = full.experts.w13_weight.split(size, dim=1)
    for rank in range(2):
        use_ranks(monkeypatch, rank, 2, expert_parallel)
        shard = load_model(model_dir, torch.float32, "cpu").model.layers[0].mlp
        experts = shard.experts
        assert torch.equal(shard.gate.weight, full.gate.weight)
        if expert_parallel:
            kept = slice(2 * rank, 2 * rank + 2)
            assert torch.equal(experts.w13_weight, full.experts.w13_weight[kept])
            assert torch.equal(experts.w2_weight, full.experts.w2_weight[kept])
            assert experts.expert_map.tolist() == ([0, 1, -1, -1] if rank == 0 else [-1, -1, 0, 1])
        else:
            rows = slice(rank * size // 2, (rank + 1) * size // 2)
            expected = torch.cat([gate[:, rows], up[:, rows]], dim=1)
            assert torch.equal(experts.w13_weight, expected)
            assert torch.equal(experts.w2_weight, full.experts.w2_weight[:, :, rows])
            assert experts.expert_map is None


def test_model_predicts_differently_without_its_router(tiny_model_dir):
    """A guard on the tests above: the experts matter to the logits (routing to other experts
    moves them far beyond the tolerance the comparisons use)."""
    architecture, overrides = MODELS["mixtral"]
    model = load_model(tiny_model_dir(architecture, **overrides), torch.float32, "cpu")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(architecture, **overrides), dtype=torch.float32
    )
    reference = hf_logits(theirs, PROMPT_A)
    torch.testing.assert_close(
        PagedBatch(model).forward(model, [("a", PROMPT_A)]), reference, atol=1e-4, rtol=0
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.neg_()
    moved = PagedBatch(model).forward(model, [("a", PROMPT_A)])
    assert (moved - reference).abs().max() > 1e-2


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "expert-parallel"])
@pytest.mark.parametrize("model", list(MODELS))
def test_two_ranks_match_one(tiny_model_dir, model, expert_parallel):
    """Greedy tokens identical and top-2 logprobs equal to float32 rounding, under batching and
    preemption (5 requests needing 31 blocks share 16)."""
    architecture, overrides = MODELS[model]
    model_dir = tiny_model_dir(architecture, **overrides)
    prompts, num_blocks = random_prompts([1, 7, 9, 17, 33]), 16
    expected = generate(make_llm(model_dir, 1, num_blocks), prompts, max_tokens=12)
    llm = make_llm(model_dir, 2, num_blocks, enable_expert_parallel=expert_parallel)
    try:
        assert_same_generation(expected, generate(llm, prompts, max_tokens=12))
    finally:
        llm.llm_engine.shutdown()


def test_expert_parallel_reaches_the_workers(tiny_model_dir):
    """3 experts cannot be placed whole on 2 ranks: the ranks building them say so, so the flag
    reached them."""
    model_dir = tiny_model_dir("mixtral", num_local_experts=3, num_experts_per_tok=2)
    message = "num_experts 3 is not divisible by tensor_parallel_size 2"
    with pytest.raises(EngineDeadError, match=message):
        make_llm(model_dir, 2, 16, enable_expert_parallel=True)
    assert tp_workers() == []


@pytest.mark.parametrize("model", list(MODELS))
def test_bfloat16_model_tracks_float32(tiny_model_dir, model):
    architecture, overrides = MODELS[model]
    folder = tiny_model_dir(architecture, **overrides)
    fp32 = load_model(folder, torch.float32, "cpu")
    bf16 = load_model(folder, torch.bfloat16, "cpu")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    ref = PagedBatch(fp32).forward(fp32, [("a", PROMPT_A)])
    got = PagedBatch(bf16).forward(bf16, [("a", PROMPT_A)])
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.05)


def test_sparse_layers_are_transformers_choice():
    """``decoder_sparse_step`` 2 and ``mlp_only_layers`` [3] of 6 layers: the MoE layers are
    the ones transformers builds as such."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from kvpilot.engine.models.qwen3_moe import Qwen3MoeForCausalLM

    config = transformers.Qwen3MoeConfig(
        hidden_size=64, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
    )  # fmt: skip
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
        ours = [Qwen3MoeForCausalLM.mlp(config, i, "torch") for i in range(6)]
    expected = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    assert [isinstance(mlp, SparseMoeBlock) for mlp in ours] == expected
    assert expected == [False, True, False, False, False, True]
