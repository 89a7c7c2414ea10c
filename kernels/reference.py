"""PyTorch reference implementations of the engine's kernels.

Each function here is the specification of the Triton kernel of the same name: same signature,
same shapes, same in-place behaviour. They are written for clarity, not speed, and compute in
float32 whatever the input dtype (the result is cast back), so they are also the accuracy
reference for fp16/bf16 kernels.

Attention follows PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention"): the KV cache is split into fixed-size blocks and a
per-sequence block table maps logical blocks to physical ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The fp8 formats a KV cache may be stored in (vLLM's ``fp8_e4m3`` and ``fp8_e5m2``).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the fp8 KV cache formats (``FP8_DTYPES``)."""
    return dtype in FP8_DTYPES


def quantize_to_cache(
    x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``x`` in the cache's ``dtype``: a plain cast, or for fp8 ``x / scale`` saturated to the
    format's largest finite value and rounded to nearest even (per-tensor scaling, as vLLM's
    fp8 KV cache and the FP8 formats paper, Micikevicius et al. 2022).

    Args:
        x: any shape, a float dtype.
        scale: ``[]`` (or ``[1]``) float32 dequantization scale (``x ~ stored * scale``);
            needed for fp8, ignored otherwise.
        dtype: the cache's dtype.

    Returns:
        ``x``'s shape in ``dtype``.

    Raises:
        ValueError: an fp8 ``dtype`` without a ``scale``.
    """
    if not is_fp8(dtype):
        return x.to(dtype)
    if scale is None:
        raise ValueError(f"quantize_to_cache: a {dtype} cache needs a scale")
    limit = torch.finfo(dtype).max
    return (x.float() / scale.float()).clamp(-limit, limit).to(dtype)


def dequantize_from_cache(
    x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Cache values read back in the compute ``dtype``: fp8 ones times ``scale`` (in float32,
    then cast), others cast only (see :func:`quantize_to_cache`)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    if scale is None:
        raise ValueError(f"dequantize_from_cache: a {x.dtype} cache needs a scale")
    return (x.float() * scale.float()).to(dtype)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``cache[slots] = values`` along dim 0, in place, for any cache dtype: fp8 through a
    same-size ``uint8`` view, because PyTorch's CPU ``index_copy_`` has no fp8 kernel.

    Args:
        cache: ``[num_slots, ...]``.
        slots: ``[n]`` int64 row indices.
        values: ``[n, ...]``, ``cache``'s dtype.
    """
    if is_fp8(cache.dtype):
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    cache.index_copy_(0, slots, values)


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

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, a float dtype.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous;
            float16/bfloat16/float32 (a cast) or fp8 (quantized, :func:`quantize_to_cache`).
        slot_mapping: ``[num_tokens]`` int64; slot ``s`` is block ``s // block_size``, offset
            ``s % block_size``; ``-1`` skips that token.
        k_scale, v_scale: ``[]`` float32 dequantization scales of an fp8 cache.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        quantized = quantize_to_cache(x[valid], scale, cache.dtype)
        write_slots(cache.view(-1, num_kv_heads, head_dim), slots, quantized)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Read one sequence's first ``seq_len`` cached positions.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: ``[>= ceil(seq_len / block_size)]`` int32 physical block ids.
        seq_len: number of positions to read (tokens).

    Returns:
        ``[seq_len, num_kv_heads, head_dim]``, the cache's dtype.
    """
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    causal: bool = True,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a mixed prefill/decode batch over the paged KV cache.

    The new tokens of sequence ``i`` are ``q[query_start_loc[i]:query_start_loc[i+1]]`` and are
    its last positions: with ``q_len`` new tokens and ``seq_lens[i]`` positions in all, new token
    ``j`` sits at position ``seq_lens[i] - q_len + j`` and (when ``causal``) attends to positions
    ``0 .. seq_lens[i] - q_len + j``. Their K/V must already be in the cache
    (``reshape_and_cache``). Grouped-query attention: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; an fp8 cache
            is dequantized with ``k_scale`` / ``v_scale`` (:func:`dequantize_from_cache`).
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative new-token counts.
        seq_lens: ``[num_seqs]`` int32, cached + new tokens per sequence.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        causal: mask future positions (True for decoder models).
        out: optional ``[num_tokens, num_heads, head_dim]`` output buffer.
        k_scale, v_scale: ``[]`` float32 dequantization scales of an fp8 cache.

    Returns:
        ``out``: ``[num_tokens, num_heads, head_dim]``, ``q``'s dtype.
    """
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = dequantize_from_cache(
            gather_kv(k_cache, block_tables[i], seq_len), k_scale, torch.float32
        )
        v = dequantize_from_cache(
            gather_kv(v_cache, block_tables[i], seq_len), v_scale, torch.float32
        )
        qi = q[start:end].float()
        mask = None
        if causal:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(
            qi.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o.transpose(0, 1).to(out.dtype)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    weight_offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Root-mean-square layer norm (Zhang & Sennrich 2019), optionally fused with a residual add.

    ``weight_offset`` 0.0 matches Hugging Face's ``LlamaRMSNorm``: normalise in float32, cast
    back to the input dtype, then multiply by ``weight``. 1.0 matches ``GemmaRMSNorm``:
    normalise and scale by ``1 + weight`` in float32, cast to the input dtype once at the end.

    Args:
        x: ``[num_tokens, hidden_size]``.
        weight: ``[hidden_size]``.
        eps: added to the mean square before the reciprocal square root.
        residual: optional ``[num_tokens, hidden_size]``; when given, ``x + residual`` is
            normalised and also returned as the new residual.
        weight_offset: 0.0 (Llama's ``weight``) or 1.0 (Gemma's ``1 + weight``).

    Returns:
        ``out`` ``[num_tokens, hidden_size]`` (``x``'s dtype with ``weight_offset`` 1.0), or
        ``(out, x + residual)`` when ``residual`` is given.
    """
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_offset:
        out = (h * (weight_offset + weight.float())).to(dtype)
    else:
        out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Apply rotary position embeddings (Su et al. 2021, RoFormer) to ``q`` and ``k`` in place.

    Args:
        positions: ``[num_tokens]`` int64 absolute positions.
        q: ``[num_tokens, num_heads, head_dim]``.
        k: ``[num_tokens, num_kv_heads, head_dim]``.
        cos_sin_cache: ``[max_position, rot_dim]`` float32; ``cos`` in the first ``rot_dim/2``
            columns, ``sin`` in the rest (vLLM's layout). ``rot_dim <= head_dim``; dimensions
            past ``rot_dim`` are left unchanged.
        is_neox: True rotates the two halves of the rotary dims against each other (GPT-NeoX,
            Llama in Hugging Face layout); False rotates interleaved pairs (GPT-J).

    Raises:
        ValueError: when ``q`` or ``k`` is not 3-D.
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError("rotary_embedding: q and k must be [num_tokens, num_heads, head_dim]")
    rot_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [num_tokens, rot/2]
    c, s = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        xr = x[..., :rot_dim].float()
        if is_neox:
            x1, x2 = xr.chunk(2, dim=-1)
            rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        x[..., :rot_dim] = rotated.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer 2020): ``silu(x[..., :d]) * x[..., d:]``.

    Args:
        x: ``[..., 2 * d]`` (gate and up projections concatenated).

    Returns:
        ``[..., d]``, ``x``'s dtype.
    """
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU activation (Shazeer 2020): ``gelu(x[..., :d]) * x[..., d:]``, GELU exact
    (``approximate="none"``) or with PyTorch's tanh approximation (``"tanh"``: Gemma's
    ``gelu_pytorch_tanh``), as transformers' ``ACT2FN`` computes it in the activation dtype.

    Args:
        x: ``[..., 2 * d]`` (gate and up projections concatenated).
        approximate: ``"none"`` or ``"tanh"``, as ``F.gelu``'s argument.

    Returns:
        ``[..., d]``, ``x``'s dtype.
    """
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]
