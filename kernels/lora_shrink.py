"""LoRA shrink as a Triton kernel: ``out[t] = x[t] @ lora_a[slot(t)]^T`` per slot segment
(reference: ``lora_reference.lora_shrink``; Punica's SGMV shrink, Chen et al. 2023).

One program computes a ``BLOCK_M`` tokens x ``BLOCK_N`` rank tile of one slot's segment: it
gathers its tokens' rows of ``x`` through ``LoRASegments.token_indices`` and walks the input
features in ``BLOCK_K`` steps. Programs past the end of a slot's segment return at once, so the
grid (``max_tokens_per_slot`` x slots) costs little when adapters are unevenly used.
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
BLOCK_K = 64


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    segments: LoRASegments | None = None,
) -> torch.Tensor:
    """``out[t] = x[t] @ lora_a[token_slots[t]]^T`` for every token with a slot, 0 elsewhere.

    Accumulates in float32. On a GPU 16-bit inputs use the tensor cores (float32 accumulate);
    float32 inputs, and everything under the interpreter, multiply in IEEE float32.

    Args:
        x: ``[num_tokens, in_features]`` float16, bfloat16 or float32, contiguous in the last
            dimension.
        lora_a: ``[num_slots, rank, in_features]``, ``x``'s dtype, contiguous.
        token_slots: ``[num_tokens]`` int32/int64; a slot in ``[0, num_slots)`` or ``-1``
            (base model).
        segments: ``lora_segments(token_slots, num_slots)`` when the caller already has it
            (one per forward pass, shared by every layer); computed here otherwise.

    Returns:
        ``[num_tokens, rank]`` float32.

    Raises:
        ValueError: a wrong rank, dtype, shape or device, or a slot out of range.
    """
    fn = "lora_shrink"
    check_tensor(fn, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_inner_contiguous(fn, "x", x)
    num_tokens, in_features = x.shape
    check_tensor(fn, "lora_a", lora_a, ndim=3, dtypes=(x.dtype,), shape=(None, None, in_features))
    check_contiguous(fn, "lora_a", lora_a)
    check_tensor(fn, "token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens,))
    check_same_device(fn, {"x": x, "lora_a": lora_a, "token_slots": token_slots})
    num_slots, rank = lora_a.shape[0], lora_a.shape[1]
    if segments is None:
        segments = lora_segments(token_slots, num_slots)
    out = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    if segments.max_tokens_per_slot == 0 or rank == 0:
        return out
    block_n = max(16, min(triton.next_power_of_2(rank), 64))
    check_dot_dims(fn, {"BLOCK_M": BLOCK_M, "BLOCK_N": block_n, "BLOCK_K": BLOCK_K})
    num_n = triton.cdiv(rank, block_n)
    grid = (triton.cdiv(segments.max_tokens_per_slot, BLOCK_M) * num_n, num_slots)
    _lora_shrink_kernel[grid](
        x, lora_a, out,
        segments.token_indices, segments.slot_start, segments.slot_num_tokens,
        in_features, rank, num_n,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        FP32_DOT=x.dtype == torch.float32 or interpreting(),
    )  # fmt: skip
    return out


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr,
    token_indices_ptr, slot_start_ptr, slot_num_tokens_ptr,
    in_features, rank, num_n,
    stride_xt, stride_as, stride_ar, stride_ot,
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
    mask_n = offs_n < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < in_features
        x_tile = tl.load(
            x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        a_tile = tl.load(
            a_base + offs_n[None, :] * stride_ar + offs_k[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if FP32_DOT:
            acc += tl.dot(x_tile.to(tl.float32), a_tile.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x_tile, a_tile)
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + offs_n[None, :],
        acc,
        mask=mask_m[:, None] & mask_n[None, :],
    )
