"""The segment tile both LoRA kernels run: ``out[t, :N] (+)= x[t, :K] @ w[slot(t)]^T`` over the
tokens of one slot (Punica's SGMV, Chen et al. 2023), and its launch.

``lora_shrink`` multiplies by ``lora_a`` (``K`` = in_features, ``N`` = rank) into a zeroed
float32 buffer; ``lora_expand`` multiplies by ``lora_b`` (``K`` = rank, ``N`` = out_features)
and adds to ``y``. One program computes a ``BLOCK_M`` tokens x ``BLOCK_N`` tile of one slot's
segment: it gathers its tokens' rows of ``x`` through ``LoRASegments.token_indices`` and walks
``K`` in ``BLOCK_K`` steps. Programs past the end of a slot's segment return at once, so the
grid (``max_tokens_per_slot`` x slots) costs little when adapters are unevenly used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import check_dot_dims, interpreting
from kvpilot.kernels.gathered_dot import gathered_dot
from kvpilot.kernels.lora_segments import LoRASegments

BLOCK_M = 16


def rank_block(rank: int) -> int:
    """The tile size along the LoRA rank: its power of two, clamped to [16, 64]."""
    return max(16, min(triton.next_power_of_2(rank), 64))


def launch_sgmv(
    fn: str,
    kernel: triton.runtime.jit.JITFunction,
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    segments: LoRASegments,
    *,
    block_n: int,
    block_k: int,
) -> None:
    """Run ``kernel`` (a ``sgmv_tile`` caller) on checked ``x`` ``[num_tokens, K]``, ``w``
    ``[num_slots, N, K]`` and ``out`` ``[num_tokens, N]``; nothing to do for an empty problem.

    On a GPU 16-bit weights use the tensor cores (``x`` cast to their dtype); float32 weights,
    and everything under the interpreter, multiply in IEEE float32.
    """
    num_slots, n, k = w.shape
    if segments.max_tokens_per_slot == 0 or n == 0 or k == 0:
        return
    check_dot_dims(fn, {"BLOCK_M": BLOCK_M, "BLOCK_N": block_n, "BLOCK_K": block_k})
    num_n = triton.cdiv(n, block_n)
    grid = (triton.cdiv(segments.max_tokens_per_slot, BLOCK_M) * num_n, num_slots)
    kernel[grid](
        x, w, out,
        segments.token_indices, segments.slot_start, segments.slot_num_tokens,
        k, n, num_n,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        FP32_DOT=w.dtype == torch.float32 or interpreting(),
    )  # fmt: skip


@triton.jit
def sgmv_tile(
    x_ptr, w_ptr, out_ptr,
    token_indices_ptr, slot_start_ptr, slot_num_tokens_ptr,
    K, N, num_n,
    stride_xt, stride_ws, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr, ADD_TO_OUT: tl.constexpr,
):  # fmt: skip
    """This program's tile, accumulated in float32; stored into ``out`` (``ADD_TO_OUT``: added
    to its old values, rounded once to ``out``'s dtype). Every ``(token, column)`` belongs to
    exactly one program, so the read-add-write needs no atomics."""
    slot = tl.program_id(1)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    num_tokens = tl.load(slot_num_tokens_ptr + slot)
    if pid_m * BLOCK_M >= num_tokens:
        return
    start = tl.load(slot_start_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_tokens
    tokens = tl.load(token_indices_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_base = w_ptr + slot.to(tl.int64) * stride_ws
    acc = gathered_dot(
        x_ptr, tokens, mask_m, stride_xt, w_base, stride_wn, offs_n, mask_n, K,
        BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT,
    )  # fmt: skip
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if ADD_TO_OUT:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
