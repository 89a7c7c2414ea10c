"""LoRA expand as a Triton kernel: ``y[t] += inp[t] @ lora_b[slot(t)]^T`` per slot segment, in
place (reference: ``lora_reference.lora_expand``; Punica's SGMV expand, Chen et al. 2023).

One program computes a ``BLOCK_M`` tokens x ``BLOCK_N`` output-feature tile of one slot's
segment, walking the rank in ``BLOCK_K`` steps, then adds it to its rows of ``y``. Every
``(token, feature)`` belongs to exactly one program, so the read-add-write needs no atomics;
base-model rows are never touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_dot_dims,
    check_inner_contiguous,
    check_same_device,
    check_tensor,
    interpreting,
)
from kvpilot.kernels.lora_segments import LoRASegments, lora_segments

BLOCK_M = 16
BLOCK_N = 64


def lora_expand(
    inp: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    segments: LoRASegments | None = None,
) -> None:
    """``y[t] += inp[t] @ lora_b[token_slots[t]]^T`` in place, for every token with a slot.

    Accumulates in float32 and rounds the sum with ``y`` once. On a GPU a 16-bit ``lora_b``
    uses the tensor cores (``inp`` cast to its dtype, as vLLM does); float32 weights, and
    everything under the interpreter, multiply in IEEE float32.

    Args:
        inp: ``[num_tokens, rank]`` float32 (from ``lora_shrink``), contiguous in the last
            dimension.
        lora_b: ``[num_slots, out_features, rank]`` float16, bfloat16 or float32, contiguous.
        token_slots: ``[num_tokens]`` int32/int64; a slot in ``[0, num_slots)`` or ``-1``.
        y: ``[num_tokens, out_features]``, ``lora_b``'s dtype, contiguous in the last
            dimension; updated in place.
        segments: ``lora_segments(token_slots, num_slots)``, or None to compute it here.

    Raises:
        ValueError: a wrong rank, dtype, shape or device, or a slot out of range.
    """
    fn = "lora_expand"
    check_tensor(fn, "inp", inp, ndim=2, dtypes=(torch.float32,))
    check_inner_contiguous(fn, "inp", inp)
    num_tokens, rank = inp.shape
    check_tensor(fn, "lora_b", lora_b, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, None, rank))
    check_contiguous(fn, "lora_b", lora_b)
    num_slots, out_features = lora_b.shape[0], lora_b.shape[1]
    check_tensor(fn, "y", y, ndim=2, dtypes=(lora_b.dtype,), shape=(num_tokens, out_features))
    check_inner_contiguous(fn, "y", y)
    check_tensor(fn, "token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens,))
    check_same_device(fn, {"inp": inp, "lora_b": lora_b, "token_slots": token_slots, "y": y})
    if segments is None:
        segments = lora_segments(token_slots, num_slots)
    if segments.max_tokens_per_slot == 0 or rank == 0 or out_features == 0:
        return
    block_k = max(16, min(triton.next_power_of_2(rank), 64))
    check_dot_dims(fn, {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": block_k})
    num_n = triton.cdiv(out_features, BLOCK_N)
    grid = (triton.cdiv(segments.max_tokens_per_slot, BLOCK_M) * num_n, num_slots)
    _lora_expand_kernel[grid](
        inp, lora_b, y,
        segments.token_indices, segments.slot_start, segments.slot_num_tokens,
        rank, out_features, num_n,
        inp.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        FP32_DOT=lora_b.dtype == torch.float32 or interpreting(),
    )  # fmt: skip


@triton.jit
def _lora_expand_kernel(
    inp_ptr, b_ptr, y_ptr,
    token_indices_ptr, slot_start_ptr, slot_num_tokens_ptr,
    rank, out_features, num_n,
    stride_it, stride_bs, stride_bo, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
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
    mask_n = offs_n < out_features
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < rank
        in_tile = tl.load(
            inp_ptr + tokens[:, None] * stride_it + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K] float32
        b_tile = tl.load(
            b_base + offs_n[None, :] * stride_bo + offs_k[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if FP32_DOT:
            acc += tl.dot(in_tile, b_tile.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(in_tile.to(b_tile.dtype), b_tile)
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y_old = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_old + acc).to(y_ptr.dtype.element_ty), mask=mask)
