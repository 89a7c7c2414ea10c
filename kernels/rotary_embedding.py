"""Rotary position embedding applied in place, as a Triton kernel (reference:
``reference.rotary_embedding``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_index_range,
    check_inner_contiguous,
    check_same_device,
    check_tensor,
)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Apply rotary position embeddings (Su et al. 2021, RoFormer) to ``q`` and ``k`` in place.

    One program rotates every head of ``q`` and ``k`` for one token, in float32, and rounds
    the result to the tensors' dtype as the reference does.

    Args:
        positions: ``[num_tokens]`` int64 or int32 absolute positions, each in
            ``[0, max_position)`` (checked for host tensors only: reading a CUDA tensor would
            synchronise the device).
        q: ``[num_tokens, num_heads, head_dim]`` float16, bfloat16 or float32; any strides
            with the last dimension contiguous (a view of a fused QKV projection is fine).
        k: ``[num_tokens, num_kv_heads, head_dim]``, ``q``'s dtype, same layout rules.
        cos_sin_cache: ``[max_position, rot_dim]`` float; ``cos`` in the first ``rot_dim/2``
            columns, ``sin`` in the rest (vLLM's layout); ``rot_dim`` even and
            ``<= head_dim``; dimensions past ``rot_dim`` are left unchanged.
        is_neox: True rotates the two halves of the rotary dims against each other (GPT-NeoX,
            Llama in Hugging Face layout); False rotates interleaved pairs (GPT-J).

    Raises:
        ValueError: wrong dtype, shape, device or layout of an argument, or a position out of
            range.
    """
    fn = "rotary_embedding"
    check_tensor(fn, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    check_tensor(fn, "k", k, ndim=3, dtypes=(q.dtype,), shape=(num_tokens, None, head_dim))
    check_tensor(fn, "positions", positions, dtypes=INDEX_DTYPES, shape=(num_tokens,))
    check_tensor(fn, "cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    max_position, rot_dim = cos_sin_cache.shape
    if rot_dim % 2 or not 0 < rot_dim <= head_dim:
        raise ValueError(
            f"{fn}: cos_sin_cache's rot_dim must be even and in (0, head_dim={head_dim}], "
            f"got {rot_dim}"
        )
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_inner_contiguous(fn, name, t)
    check_same_device(fn, {"positions": positions, "q": q, "k": k, "cos_sin_cache": cos_sin_cache})
    check_index_range(fn, "positions", positions, 0, max_position)
    if num_tokens == 0:
        return
    _rotary_embedding_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        k.shape[1],
        rot_dim // 2,
        IS_NEOX=bool(is_neox),
        HEADS_Q=triton.next_power_of_2(num_heads),
        HEADS_K=triton.next_power_of_2(k.shape[1]),
        HALF=triton.next_power_of_2(rot_dim // 2),
    )


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_h,
    num_heads,
    cos,
    sin,
    half,
    IS_NEOX: tl.constexpr,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    # x_ptr points at this token's row; cos/sin are [HALF] float32.
    heads = tl.arange(0, HEADS)[:, None]
    i = tl.arange(0, HALF)[None, :]
    if IS_NEOX:
        first, second = i, i + half
    else:
        first, second = 2 * i, 2 * i + 1
    mask = (heads < num_heads) & (i < half)
    p1 = x_ptr + heads * stride_h + first
    p2 = x_ptr + heads * stride_h + second
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    dtype = x_ptr.dtype.element_ty
    tl.store(p1, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(p2, (x2 * c + x1 * s).to(dtype), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_heads,
    num_kv_heads,
    half,
    IS_NEOX: tl.constexpr,
    HEADS_Q: tl.constexpr,
    HEADS_K: tl.constexpr,
    HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i < half, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + half + i, mask=i < half, other=0.0)
    sin = sin.to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt, stride_qh, num_heads, cos, sin, half, IS_NEOX, HEADS_Q, HALF
    )
    _rotate_heads(
        k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, half, IS_NEOX, HEADS_K, HALF
    )
