"""Write new keys and values into the paged KV cache, as a Triton kernel (reference:
``reference.reshape_and_cache``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import (
    CACHE_DTYPES,
    FLOAT_DTYPES,
    FP8_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_index_range,
    check_inner_contiguous,
    check_same_device,
    check_scales,
    check_tensor,
)
from kvpilot.kernels.fp8 import fp8_format, quantize_fp8

# Elements one program copies per tensor; bounds register use for wide (many-head) layers.
_MAX_ELEMENTS = 4096


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new keys and values into their slots of the paged cache, in place.

    The paged layout follows PagedAttention (Kwon et al. 2023): slot ``s`` is offset
    ``s % block_size`` of physical block ``s // block_size``. One program copies a group of
    heads of one token; a token whose slot is ``-1`` (padding) is skipped. An fp8 cache stores
    ``x / scale`` saturated and rounded to nearest even (``kvpilot.kernels.fp8``), bit for bit
    what ``reference.reshape_and_cache`` stores.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` float16, bfloat16 or float32;
            any strides with the last dimension contiguous. Cast to the cache's dtype.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous,
            one dtype: float16, bfloat16, float32, float8_e4m3fn or float8_e5m2.
        slot_mapping: ``[num_tokens]`` int64 (or int32); entries in
            ``[-1, num_blocks * block_size)`` (checked for host tensors only: reading a CUDA
            tensor would synchronise the device).
        k_scale, v_scale: ``[]`` (or ``[1]``) float32 dequantization scales, on the caches'
            device; required for an fp8 cache, ignored otherwise. Read on the device (no sync).

    Raises:
        ValueError: wrong dtype, shape, device or layout of an argument, a slot out of range,
            or a missing scale for an fp8 cache.
    """
    fn = "reshape_and_cache"
    check_tensor(fn, "k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    check_tensor(fn, "v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape))
    check_tensor(fn, "key", key, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, num_kv_heads, head_dim))
    num_tokens = key.shape[0]
    check_tensor(fn, "value", value, dtypes=FLOAT_DTYPES, shape=tuple(key.shape))
    check_tensor(fn, "slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, shape=(num_tokens,))
    check_contiguous(fn, "k_cache", k_cache)
    check_contiguous(fn, "v_cache", v_cache)
    check_inner_contiguous(fn, "key", key)
    check_inner_contiguous(fn, "value", value)
    check_same_device(
        fn,
        {
            "key": key,
            "value": value,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "slot_mapping": slot_mapping,
        },
    )
    check_index_range(fn, "slot_mapping", slot_mapping, -1, num_blocks * block_size)
    fp8 = k_cache.dtype in FP8_DTYPES
    if fp8:
        check_scales(fn, k_scale, v_scale, k_cache.device)
        fmt = fp8_format(k_cache.dtype)
    else:
        # Unused by the kernel (FP8 is off): any pointer will do.
        k_scale = v_scale = slot_mapping
        fmt = fp8_format(torch.float8_e4m3fn)
    if num_tokens == 0:
        return
    dim_block = triton.next_power_of_2(head_dim)
    heads_block = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_ELEMENTS // dim_block))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_block))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        num_kv_heads,
        head_dim,
        k_scale,
        v_scale,
        HEADS_BLOCK=heads_block,
        DIM_BLOCK=dim_block,
        FP8=fp8,
        MANTISSA_BITS=fmt.mantissa_bits,
        FP8_MAX=fmt.max_value,
        FP8_MIN_NORMAL=fmt.min_normal,
    )


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_kv_heads,
    head_dim,
    k_scale_ptr,
    v_scale_ptr,
    HEADS_BLOCK: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)[:, None]
    dims = tl.arange(0, DIM_BLOCK)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    # The caches are contiguous, so a slot is a flat row of num_kv_heads * head_dim elements.
    dst = slot * num_kv_heads * head_dim + heads * head_dim + dims
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if FP8:
        k = quantize_fp8(k, tl.load(k_scale_ptr), MANTISSA_BITS, FP8_MAX, FP8_MIN_NORMAL)
        v = quantize_fp8(v, tl.load(v_scale_ptr), MANTISSA_BITS, FP8_MAX, FP8_MIN_NORMAL)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
