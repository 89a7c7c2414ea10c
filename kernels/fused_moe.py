"""Mixture-of-experts feed-forward as two grouped matmuls in Triton (reference:
``moe_reference.fused_experts``; vLLM's ``fused_moe`` kernel design).

The (token, expert) pairs are grouped by expert (:func:`~kvpilot.kernels.moe_segments.
expert_segments`, no host read). One program computes a ``BLOCK_M`` pairs x ``BLOCK_N`` tile of
one expert's run: it gathers its pairs' input rows (the token's hidden row for the gate/up
matmul, the pair's own activation row for the down matmul), walks ``K`` in ``BLOCK_K`` steps
against that expert's weights and writes each pair's row. The down matmul multiplies by the
pair's routing weight; the ``top_k`` rows of a token are then summed. The grid covers the
largest possible run (every pair on one expert); programs past their expert's run return at
once, so the grid needs no device-to-host read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_dot_dims,
    check_index_range,
    check_inner_contiguous,
    check_same_device,
    check_tensor,
    interpreting,
)
from kvpilot.kernels.gathered_dot import gathered_dot
from kvpilot.kernels.moe_segments import ExpertSegments, expert_segments

BLOCK_M = 16
_MAX_BLOCK_NK = 64


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * w2[e] @ act_and_mul(w13[e] @ hidden[t])``, ``e``
    the local expert of ``topk_ids[t, k]``; pairs of experts held by other ranks add nothing.

    Each matmul accumulates in float32 and rounds its output to ``hidden``'s dtype (the routed
    weight is applied before that rounding). On a GPU 16-bit inputs use the tensor cores;
    float32 inputs, and everything under the interpreter, multiply in IEEE float32.

    Args:
        hidden: ``[num_tokens, hidden_size]`` float16, bfloat16 or float32, contiguous in the
            last dimension.
        w13: ``[num_local_experts, 2 * intermediate, hidden_size]``, ``hidden``'s dtype,
            contiguous: each expert's gate rows, then its up rows.
        w2: ``[num_local_experts, hidden_size, intermediate]``, ``hidden``'s dtype, contiguous.
        topk_weights: ``[num_tokens, top_k]`` float routing weights.
        topk_ids: ``[num_tokens, top_k]`` int32/int64 global expert ids.
        expert_map: ``[num_experts]`` int32, global expert -> local index or ``-1``; None when
            every expert is local.
        act_and_mul: the gated activation on ``[rows, 2 * intermediate]`` -> ``[rows,
            intermediate]`` (e.g. ``kvpilot.kernels.activation.silu_and_mul``).

    Returns:
        ``[num_tokens, hidden_size]``, ``hidden``'s dtype.

    Raises:
        ValueError: a wrong rank, dtype, shape or device, or an expert id out of range.
    """
    fn = "fused_experts"
    check_tensor(fn, "hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_inner_contiguous(fn, "hidden", hidden)
    num_tokens, hidden_size = hidden.shape
    check_tensor(fn, "w13", w13, ndim=3, dtypes=(hidden.dtype,), shape=(None, None, hidden_size))
    num_local, two_i, _ = w13.shape
    if two_i % 2:
        raise ValueError(f"{fn}: w13 must have an even dim 1 (gate, then up), got {two_i}")
    check_tensor(fn, "w2", w2, dtypes=(hidden.dtype,), shape=(num_local, hidden_size, two_i // 2))
    check_contiguous(fn, "w13", w13)
    check_contiguous(fn, "w2", w2)
    check_tensor(fn, "topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, shape=(num_tokens, None))
    top_k = topk_ids.shape[1]
    check_tensor(fn, "topk_weights", topk_weights, dtypes=FLOAT_DTYPES, shape=(num_tokens, top_k))
    tensors = {"hidden": hidden, "w13": w13, "w2": w2, "topk_ids": topk_ids}
    num_experts = num_local
    if expert_map is not None:
        check_tensor(fn, "expert_map", expert_map, ndim=1, dtypes=INDEX_DTYPES)
        check_index_range(fn, "expert_map", expert_map, -1, num_local)
        num_experts = expert_map.shape[0]
        tensors["expert_map"] = expert_map
    check_same_device(fn, tensors)
    check_index_range(fn, "topk_ids", topk_ids, 0, num_experts)

    if num_tokens == 0 or top_k == 0 or num_local == 0:
        return torch.zeros(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    segments = expert_segments(topk_ids, num_local, expert_map)
    num_pairs = num_tokens * top_k
    weights = topk_weights.float().contiguous()
    gate_up = torch.empty(num_pairs, two_i, dtype=hidden.dtype, device=hidden.device)
    _grouped_matmul(fn, hidden, w13, gate_up, segments, weights, top_k, mul_routed_weight=False)
    activated = act_and_mul(gate_up)
    # Pairs of other ranks' experts are never written: zeros, summed into the token's row.
    down = torch.zeros(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _grouped_matmul(fn, activated, w2, down, segments, weights, 1, mul_routed_weight=True)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1)


def _block(size: int, largest: int = _MAX_BLOCK_NK) -> int:
    return max(16, min(triton.next_power_of_2(size), largest))


def _grouped_matmul(
    fn: str,
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    segments: ExpertSegments,
    weights: torch.Tensor,
    rows_per_input: int,
    mul_routed_weight: bool,
) -> None:
    """``out[p] = (weights[p] if mul_routed_weight) * a[p // rows_per_input] @ w[expert(p)]^T``
    for every pair ``p`` of a local expert; ``w`` is ``[experts, N, K]``."""
    num_local, n, k = w.shape
    num_pairs = out.shape[0]
    # float32 tiles take twice the registers: a shorter K step keeps them from spilling.
    block_n, block_k = _block(n), _block(k, 32 if w.dtype == torch.float32 else _MAX_BLOCK_NK)
    check_dot_dims(fn, {"BLOCK_M": BLOCK_M, "BLOCK_N": block_n, "BLOCK_K": block_k})
    num_n = triton.cdiv(n, block_n)
    grid = (triton.cdiv(num_pairs, BLOCK_M) * num_n, num_local)
    _fused_moe_kernel[grid](
        a, w, out, weights,
        segments.pair_indices, segments.expert_start, segments.expert_num_pairs,
        k, n, num_n, rows_per_input,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        FP32_DOT=w.dtype == torch.float32 or interpreting(),
    )  # fmt: skip


@triton.jit
def _fused_moe_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr,
    pair_indices_ptr, expert_start_ptr, expert_num_pairs_ptr,
    K, N, num_n, rows_per_input,
    stride_am, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_M pairs of one expert's run x BLOCK_N output columns, float32
    # accumulation; every (pair, column) belongs to exactly one program.
    expert = tl.program_id(1)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    num_pairs = tl.load(expert_num_pairs_ptr + expert)
    if pid_m * BLOCK_M >= num_pairs:
        return
    start = tl.load(expert_start_ptr + expert)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_pairs
    pairs = tl.load(pair_indices_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    rows = pairs // rows_per_input
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = gathered_dot(
        a_ptr, rows, mask_m, stride_am, w_base, stride_wn, offs_n, mask_n, K,
        BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT,
    )  # fmt: skip
    if MUL_ROUTED_WEIGHT:
        routed = tl.load(weights_ptr + pairs, mask=mask_m, other=0.0)
        acc = acc * routed[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
