"""LoRA expand as a Triton kernel: ``y[t] += inp[t] @ lora_b[slot(t)]^T`` per slot segment, in
place (reference: ``lora_reference.lora_expand``; Punica's SGMV expand, Chen et al. 2023).

The kernel is ``lora_sgmv.sgmv_tile`` with ``K`` = the rank, ``N`` = out_features, adding its
tile to ``y``'s rows; base-model rows are never touched.
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
    # Float32 weights take twice the registers per tile: on sm_90 with Triton 3.7 a 64-wide
    # tile at a 64-wide rank block spills (tests/kernels/test_lora_kernels.py compiles it).
    block_n = BLOCK_N // 2 if lora_b.dtype == torch.float32 else BLOCK_N
    launch_sgmv(
        fn, _lora_expand_kernel, inp, lora_b, y, segments, block_n=block_n, block_k=rank_block(rank)
    )


@triton.jit
def _lora_expand_kernel(
    inp_ptr, b_ptr, y_ptr, token_indices_ptr, slot_start_ptr, slot_num_tokens_ptr,
    rank, out_features, num_n, stride_it, stride_bs, stride_bo, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    sgmv_tile(
        inp_ptr, b_ptr, y_ptr, token_indices_ptr, slot_start_ptr, slot_num_tokens_ptr,
        rank, out_features, num_n, stride_it, stride_bs, stride_bo, stride_yt,
        BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT, ADD_TO_OUT=True,
    )  # fmt: skip
