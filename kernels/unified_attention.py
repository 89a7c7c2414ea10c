"""Paged attention over a mixed prefill/decode batch, as Triton kernels (reference:
``reference.unified_attention``).

One kernel serves prefill, chunked prefill on top of cached context, and decode. A program
owns one (sequence, KV head, query tile) and computes all the query heads of that KV head's
grouped-query group together, so every K/V tile loaded from the cache feeds ``BLOCK_M =
query tokens x group size`` rows of the ``tl.dot``. It walks the sequence's KV blocks through
its block table (PagedAttention, Kwon et al. 2023) with the online softmax of FlashAttention-2
(Dao 2023). Decode batches too small to fill the GPU are split along the KV axis
(Flash-Decoding, Dao et al. 2023): each split writes a partial output and its log-sum-exp and a
second kernel merges them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_contiguous,
    check_dot_dims,
    check_inner_contiguous,
    check_number,
    check_same_device,
    check_scales,
    check_tensor,
    interpreting,
    upcast_to_fp32,
)

_MAX_HEAD_DIM = 256
_MAX_KV_SPLITS = 16
# Bytes of one K (or V) tile: 64 keys x 128 dims in 16-bit, which an offline sm_90 compile
# (tests/kernels/gpu_compile.py) showed to fit without register spills; wider heads get fewer
# keys per tile. float32 (exact "ieee" dot products, no tensor cores) needs half the tile and
# 8 warps to stay spill-free.
_KV_TILE_BYTES = 16384
_FP32_KV_TILE_BYTES = 8192
_FP32_NUM_WARPS = 8


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one launch of the attention kernel.

    Attributes:
        block_m: query rows per program (tokens x GQA group), a power of two >= 16.
        tile_n: keys per KV tile, a power of two >= 16.
        num_warps: warps per program.
    """

    block_m: int
    tile_n: int
    num_warps: int


# Query rows of one program: few for decode, where one token per sequence would leave a large
# tile empty, more for prefill, where each K/V tile is reused by more rows (8 warps keep that
# tile spill-free on sm_80 and sm_90). Starting points for benchmarks/kernels_gpu.py, which
# sweeps alternatives on a GPU.
DECODE_CONFIG = LaunchConfig(block_m=16, tile_n=64, num_warps=4)
PREFILL_CONFIG = LaunchConfig(block_m=64, tile_n=64, num_warps=8)


def launch_config(decode_only: bool, group: int, head_pad: int, dtype: torch.dtype) -> LaunchConfig:
    """Tile sizes for a batch: ``decode_only`` picks the decode or prefill base, ``block_m``
    grows to hold a whole GQA ``group``, ``tile_n`` shrinks for ``head_pad``-wide or float32
    K/V tiles."""
    base = DECODE_CONFIG if decode_only else PREFILL_CONFIG
    block_m = max(base.block_m, triton.next_power_of_2(group))
    fp32 = dtype == torch.float32
    key_bytes = head_pad * dtype.itemsize
    budget = _FP32_KV_TILE_BYTES if fp32 else _KV_TILE_BYTES
    tile_n = max(16, min(base.tile_n, budget // key_bytes))
    num_warps = max(base.num_warps, _FP32_NUM_WARPS) if fp32 else base.num_warps
    return LaunchConfig(block_m=block_m, tile_n=tile_n, num_warps=num_warps)


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
    sliding_window: int | None = None,
    num_kv_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a mixed prefill/decode batch over the paged KV cache.

    The new tokens of sequence ``i`` are ``q[query_start_loc[i]:query_start_loc[i+1]]`` and are
    its last positions: with ``q_len`` new tokens and ``seq_lens[i]`` positions in all, new token
    ``j`` sits at position ``seq_lens[i] - q_len + j`` and (when ``causal``) attends to positions
    ``0 .. seq_lens[i] - q_len + j``. Their K/V must already be in the cache
    (``reshape_and_cache``). Grouped-query attention: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``. Rows of ``out`` past ``query_start_loc[-1]``
    (padding tokens) are left as they were.

    Beyond the reference, ``sliding_window`` restricts a token to the last ``sliding_window``
    positions up to its own (Mistral, Qwen2/3 sliding layers), and ``num_kv_splits`` selects
    the split-KV path; with both left at ``None`` the signature and result are the reference's.

    Softmax statistics and the output accumulator are float32; with float16/bfloat16 inputs the
    probabilities are rounded to that dtype before the ``P @ V`` product, as in FlashAttention.
    An fp8 cache is dequantized tile by tile as it is loaded (``stored * scale`` in float32,
    then ``q``'s dtype), as vLLM's Triton attention does; nothing else changes.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` float16, bfloat16 or float32, contiguous in
            the last dimension; ``head_dim <= 256``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one dtype:
            ``q``'s, or float8_e4m3fn / float8_e5m2; contiguous in the last dimension.
        query_start_loc: ``[num_seqs + 1]`` int32 (or int64), contiguous; cumulative new-token
            counts, starting at 0, at most ``num_tokens``.
        seq_lens: ``[num_seqs]`` int32 (or int64), contiguous; cached + new tokens per
            sequence, each at least its ``q_len``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 (or int64), contiguous in the
            last dimension; entries past a sequence's last block are never read.
        scale: softmax scale (> 0), usually ``head_dim ** -0.5``.
        causal: mask future positions (True for decoder models).
        out: optional ``[num_tokens, num_heads, head_dim]`` output buffer of ``q``'s dtype.
        sliding_window: when set (>= 1), position ``p`` attends only to positions
            ``> p - sliding_window``; KV tiles wholly before the window are not read.
        num_kv_splits: how many parts the KV axis of each sequence is split into (then merged);
            ``None`` chooses: more than 1 only for decode batches on a GPU that one split per
            (sequence, KV head) would leave idle.
        k_scale, v_scale: ``[]`` (or ``[1]``) float32 dequantization scales on the caches'
            device; required for an fp8 cache, ignored otherwise.

    Returns:
        ``out``: ``[num_tokens, num_heads, head_dim]``, ``q``'s dtype.

    Raises:
        ValueError: wrong dtype, shape, device or layout of an argument. For host (CPU)
            tensors the metadata values are checked too (sorted ``query_start_loc``,
            ``seq_lens >= q_len``, block ids in range); for CUDA tensors that would
            synchronise the device, so the model runner is trusted.
    """
    _check_inputs(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out,
        sliding_window, num_kv_splits, k_scale, v_scale,
    )  # fmt: skip
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    if not kv_fp8:
        k_scale = v_scale = seq_lens  # unused by the kernel (KV_FP8 is off): any pointer
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    decode_only = num_tokens == num_seqs
    head_pad = max(16, triton.next_power_of_2(head_dim))
    config = launch_config(decode_only, group, head_pad, q.dtype)
    block_m = config.block_m
    block_q = block_m // group
    check_dot_dims(
        "unified_attention", {"BLOCK_M": block_m, "TILE_N": config.tile_n, "HEAD_DIM": head_pad}
    )
    if num_tokens == 0 or num_seqs == 0:
        return out
    # Sequence i owns query blocks [qsl[i] // block_q + i, qsl[i+1] // block_q + i + 1); the
    # grid covers that bound without reading query_start_loc on the host.
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_kv_splits is None:
        num_kv_splits = choose_kv_splits(
            num_q_blocks * num_kv_heads, _num_sms(q.device), decode_only
        )

    if num_kv_splits == 1:
        part_out = part_lse = out  # unused: the kernel writes the final output directly
    else:
        part_out = torch.empty(
            (num_tokens, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_tokens, num_heads, num_kv_splits), dtype=torch.float32, device=q.device
        )
    _unified_attention_kernel[(num_q_blocks, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, out, part_out, part_lse,
        query_start_loc, seq_lens, block_tables, k_scale, v_scale,
        float(scale), num_seqs, head_dim, k_cache.shape[1], sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=config.tile_n, HEAD_PAD=head_pad,
        CAUSAL=bool(causal), SLIDING=sliding_window is not None, NUM_SPLITS=num_kv_splits,
        UPCAST=upcast_to_fp32(q.dtype), KV_FP8=kv_fp8,
        num_warps=config.num_warps,
    )  # fmt: skip
    if num_kv_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, query_start_loc, num_seqs, head_dim,
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_kv_splits, SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
            HEAD_PAD=head_pad,
        )  # fmt: skip
    return out


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    sliding_window: int | None,
    num_kv_splits: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` naming the first argument of ``unified_attention`` that is wrong."""
    fn = "unified_attention"
    check_tensor(fn, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    check_tensor(fn, "k_cache", k_cache, ndim=4, dtypes=(q.dtype, *FP8_DTYPES))
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    check_tensor(fn, "k_cache", k_cache, shape=(None, None, None, head_dim))
    check_tensor(fn, "v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape))
    if k_cache.dtype in FP8_DTYPES:
        check_scales(fn, k_scale, v_scale, k_cache.device)
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"{fn}: q's num_heads ({num_heads}) must be a multiple of the caches' "
            f"num_kv_heads ({num_kv_heads})"
        )
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head_dim must be <= {_MAX_HEAD_DIM}, got {head_dim}")
    check_tensor(fn, "query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError(f"{fn}: query_start_loc must have num_seqs + 1 >= 1 entries")
    check_tensor(fn, "seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(num_seqs,))
    check_tensor(fn, "block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor(fn, "block_tables", block_tables, shape=(num_seqs, None))
    check_number(fn, "scale", scale, positive=True)
    for name, value in (("sliding_window", sliding_window), ("num_kv_splits", num_kv_splits)):
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{fn}: {name} must be None or an int >= 1, got {value!r}")
    tensors = {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "block_tables": block_tables,
    }
    if out is not None:
        check_tensor(fn, "out", out, dtypes=(q.dtype,), shape=tuple(q.shape))
        tensors["out"] = out
    for name in ("q", "k_cache", "v_cache", "block_tables", "out"):
        if name in tensors:
            check_inner_contiguous(fn, name, tensors[name])
    check_contiguous(fn, "query_start_loc", query_start_loc)
    check_contiguous(fn, "seq_lens", seq_lens)
    check_same_device(fn, tensors)
    _check_metadata_values(
        fn, query_start_loc, seq_lens, block_tables, num_tokens, num_blocks, block_size
    )


def choose_kv_splits(num_programs: int, num_sms: int | None, decode_only: bool) -> int:
    """How many KV splits make a decode batch of ``num_programs`` (sequence, KV head, query
    tile) programs cover ``num_sms`` streaming multiprocessors about twice (at most 16); 1 for
    batches with prefills, which have work enough, and without a GPU (``num_sms`` None)."""
    if not decode_only or num_sms is None or num_programs == 0:
        return 1
    return max(1, min(_MAX_KV_SPLITS, cdiv(2 * num_sms, num_programs)))


def _num_sms(device: torch.device) -> int | None:
    if device.type != "cuda" or interpreting():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_metadata_values(
    fn: str,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
) -> None:
    """Check the batch description's values when they live on the host (free there)."""
    if query_start_loc.device.type != "cpu":
        return
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    if int(starts[0]) != 0 or bool((q_lens < 0).any()) or int(starts[-1]) > num_tokens:
        raise ValueError(
            f"{fn}: query_start_loc must start at 0, never decrease and end at most at "
            f"num_tokens={num_tokens}, got {query_start_loc.tolist()}"
        )
    if bool((seq_lens.long() < q_lens).any()):
        raise ValueError(
            f"{fn}: seq_lens must be >= each sequence's new-token count, got seq_lens "
            f"{seq_lens.tolist()} for query lengths {q_lens.tolist()}"
        )
    blocks_needed = (seq_lens.long() + block_size - 1) // block_size
    if bool((blocks_needed > block_tables.shape[1]).any()):
        raise ValueError(
            f"{fn}: block_tables has {block_tables.shape[1]} columns, fewer than the "
            f"{int(blocks_needed.max())} blocks seq_lens needs"
        )
    used = torch.arange(block_tables.shape[1])[None, :] < blocks_needed[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(
            f"{fn}: block_tables entries in use must lie in [0, {num_blocks}), got values in "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )


@triton.jit
def _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    # Sequence i owns query blocks [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): a
    # strictly increasing, gap-free bound that needs no host-side table. Binary search for the
    # last sequence whose first block is <= q_block.
    # Explicit int32 scalars: loop-carried values must keep one type in a GPU compile.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_block <= q_block, mid + 1, lo)
        hi = tl.where(first_block <= q_block, hi, mid)
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qsl_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    scale, num_seqs, head_dim, block_size, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    tile_q = q_block - (q_start // BLOCK_Q + seq)
    if tile_q * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r of the tile is query token tile_q * BLOCK_Q + r // GROUP, head r % GROUP of the group.
    rows = tl.arange(0, BLOCK_M)
    q_tok = tile_q * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
    token = (q_start + q_tok).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < head_dim
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    q_pos = context_len + q_tok

    if CAUSAL:
        num_keys = context_len + tl.minimum((tile_q + 1) * BLOCK_Q, q_len)
    else:
        num_keys = seq_len
    num_tiles = tl.cdiv(num_keys, TILE_N)
    first_tile = 0
    if SLIDING:
        # The tile's earliest query sees nothing before this key; skip whole tiles before it.
        first_tile = tl.maximum(context_len + tile_q * BLOCK_Q - sliding_window + 1, 0) // TILE_N
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    # exp2 with log2(e) folded into the scale: one multiply per score instead of one per exp.
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = keys < num_keys
        block = tl.load(block_tables_ptr + seq * stride_bt + keys // block_size, mask=key_ok,
                        other=0).to(tl.int64)  # fmt: skip
        slot_in_block = keys % block_size
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_ptr + block[:, None] * stride_kb + slot_in_block[:, None] * stride_ks
            + kv_head * stride_kh + dims[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        v = tl.load(
            v_ptr + block[:, None] * stride_vb + slot_in_block[:, None] * stride_vs
            + kv_head * stride_vh + dims[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        if KV_FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, TILE_N]
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (keys[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead keeps
        # exp2 finite (it yields 0) rather than NaN from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partials are [num_tokens, num_heads, NUM_SPLITS, head_dim] and
        # [num_tokens, num_heads, NUM_SPLITS], contiguous; lse is in log2 units.
        num_heads = tl.num_programs(1) * GROUP
        part = (token * num_heads + head) * NUM_SPLITS + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * head_dim + dims[None, :], o, mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, qsl_ptr, num_seqs, head_dim,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    # Merge the splits of one (token, head): out = sum_s 2^(lse_s - max) o_s / sum_s 2^(...).
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(qsl_ptr + num_seqs):
        return  # a padding token: no partials were written
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    part = (token * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + part, mask=splits < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.math.exp2(lse - lse_max)
    w_sum = tl.sum(w, axis=0)
    o = tl.load(
        part_out_ptr + part[:, None] * head_dim + dims[None, :],
        mask=(splits < NUM_SPLITS)[:, None] & (dims < head_dim)[None, :],
        other=0.0,
    )
    merged = tl.sum(o * w[:, None], axis=0) / tl.where(w_sum == 0.0, 1.0, w_sum)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )
