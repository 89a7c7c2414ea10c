"""``fused_experts`` (Triton, interpreter on CPU) against its per-token PyTorch reference, and the
MoE layer's Triton path against its torch path."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import activation
from kvpilot.kernels.fused_moe import fused_experts
from kvpilot.kernels.moe_reference import fused_experts as reference_fused_experts
from kvpilot.kernels.moe_segments import expert_segments
from tests.kernels.compile_check import assert_compiled_cleanly, compiled_launches

pytestmark = pytest.mark.kernel


def _case(num_tokens, num_experts, top_k, hidden, intermediate, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=g) * 0.1).to(dtype)
    # Expert 0 gets most pairs (over one BLOCK_M run), the last expert none.
    scores = torch.rand(num_tokens, num_experts, generator=g)
    scores[:, 0] += 0.5
    scores[:, -1] = -1.0
    weights, ids = torch.softmax(scores, -1).topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


def test_segments_group_pairs_by_expert() -> None:
    ids = torch.tensor([[2, 0], [0, 1], [2, 3]])
    seg = expert_segments(ids, 4)
    assert seg.pair_indices.tolist() == [1, 2, 3, 0, 4, 5]
    assert seg.expert_start.tolist() == [0, 2, 3, 5]
    assert seg.expert_num_pairs.tolist() == [2, 1, 2, 1]
    # Expert parallelism: this rank holds experts 2 and 3 (local 0 and 1).
    seg = expert_segments(ids, 2, torch.tensor([-1, -1, 0, 1], dtype=torch.int32))
    assert seg.pair_indices.tolist()[:3] == [0, 4, 5]
    assert seg.expert_num_pairs.tolist() == [2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "intermediate"),
    [
        (21, 4, 2, 64, 32),  # expert 0's run spans two BLOCK_M tiles
        (3, 6, 3, 80, 24),  # decode-sized; nothing a multiple of a block: every mask matters
    ],
)
def test_fused_experts_match_reference(
    num_tokens, num_experts, top_k, hidden, intermediate, dtype
) -> None:
    x, w13, w2, weights, ids = _case(num_tokens, num_experts, top_k, hidden, intermediate, dtype)
    got = fused_experts(x, w13, w2, weights, ids, None, activation.silu_and_mul)
    expected = reference_fused_experts(x, w13, w2, weights, ids)
    assert got.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}
    torch.testing.assert_close(got, expected, **tol)


def test_expert_parallel_rank_adds_only_its_experts() -> None:
    x, w13, w2, weights, ids = _case(9, 4, 2, 64, 32, torch.float32, seed=1)
    # This rank holds experts 2 and 3 of 4 (local 0 and 1).
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    got = fused_experts(x, w13[2:], w2[2:], weights, ids, expert_map, activation.silu_and_mul)
    expected = reference_fused_experts(x, w13[2:], w2[2:], weights, ids, expert_map)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    local = (ids >= 2).any(-1)
    assert got[~local].abs().max() == 0 and got[local].abs().min() > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "w13": a["w13"].half()}, "w13 must have dtype"),
        (lambda a: {**a, "w2": a["w2"][:, :, :8]}, "w2 must have shape"),
        (lambda a: {**a, "topk_ids": a["topk_ids"] + 3}, r"topk_ids entries must lie in \[0, 4\)"),
        (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, "topk_weights must have shape"),
        (lambda a: {**a, "w13": a["w13"].transpose(1, 2)}, "w13 must be contiguous"),
    ],
)
def test_bad_input_is_named(change, message: str) -> None:
    x, w13, w2, weights, ids = _case(5, 4, 2, 32, 16, torch.float32)
    args = {"hidden": x, "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids}
    with pytest.raises(ValueError, match=f"fused_experts: {message}"):
        fused_experts(**change(args), expert_map=None, act_and_mul=activation.silu_and_mul)


def test_moe_block_triton_path_matches_torch_path() -> None:
    from kvpilot.engine.layers.fused_moe import SparseMoeBlock

    g = torch.Generator().manual_seed(2)
    blocks = [
        SparseMoeBlock(4, 2, 64, 32, renormalize=True, kernel_backend=b)
        for b in ("torch", "triton")
    ]
    for name, param in blocks[0].named_parameters():
        value = torch.randn(param.shape, generator=g) * 0.2
        for block in blocks:
            dict(block.named_parameters())[name].data = value.clone()
    hidden = torch.randn(11, 64, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(blocks[1](hidden), blocks[0](hidden), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("capability", [90, 80])
def test_launches_compile_for_gpus(capability: int) -> None:
    """The interpreter never compiles: this catches tl.dot shapes, shared memory overruns and
    register spills of the real launch configurations, without a GPU."""
    results = compiled_launches("moe_gpu_compile.py", capability)
    # Five cases, two grouped matmuls each (gate/up, then down).
    assert len(results) == 10 and {r["kernel"] for r in results} == {"_fused_moe_kernel"}
    assert_compiled_cleanly(results, capability)
