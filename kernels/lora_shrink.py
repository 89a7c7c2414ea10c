"""LoRA shrink as a Triton kernel: ``out[t] = x[t] @ lora_a[slot(t)]^T`` per slot segment
(reference: ``lora_reference.lora_shrink``; Punica's SGMV shrink, Chen et al. 2023).

The kernel is ``lora_sgmv.sgmv_tile`` with ``K`` = in_features, ``N`` = the rank, storing into a
zeroed float32 buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_inner_contiguous,
    check_same_device,
    check_tensor,
)
from kvpilot.kernels.lora_segments import LoRASegments, lora_segments
from kvpilot.kernels.lora_sgmv import launch_sgmv, rank_block, sgmv_tile

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
    launch_sgmv(
        fn, _lora_shrink_kernel, x, lora_a, out, segments, block_n=rank_block(rank), block_k=BLOCK_K
    )
    return out


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr, token_indices_ptr, slot_start_ptr, slot_num_tokens_ptr,
    in_features, rank, num_n, stride_xt, stride_as, stride_ar, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    sgmv_tile(
        x_ptr, a_ptr, out_ptr, token_indices_ptr, slot_start_ptr, slot_num_tokens_ptr,
        in_features, rank, num_n, stride_xt, stride_as, stride_ar, stride_ot,
        BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT, ADD_TO_OUT=False,
    )  # fmt: skip
