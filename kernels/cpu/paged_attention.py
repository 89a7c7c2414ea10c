"""Paged attention on the CPU, reading K/V blocks in place (a C++ PyTorch extension).

PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"): each query token (a decode sequence's new token, or one token of
a prompt, whose context ends at its own position) attends to its context through its sequence's
block table, block by block, where the keys and values lie in the paged cache: no
gather into a contiguous copy, no padding to the longest sequence, and no slot past a
sequence's end is read (whatever it holds, NaN included, cannot reach an output). Per
(sequence, KV head) pair, in parallel over ATen's OpenMP threads (``torch.set_num_threads``),
the ``num_heads / num_kv_heads`` query heads that share the KV head (GQA) compute
``softmax(scale * q . k) . v`` with float32 accumulation: scores of every position, their
maximum subtracted before ``exp`` (numerically stable), then the weighted sum of the values.
A sliding window limits the context to its last ``sliding_window`` positions.
:func:`reshape_and_cache` writes a step's new keys and values into their slots first.

The source is ``paged_attention.cpp`` beside this file (package data); its library is loaded
from the prebuilt-kernel folder that ``python -m kvpilot.kernels.cpu`` fills (``make install``,
the engine image), or else compiled on first use by :func:`torch.utils.cpp_extension.load` into
torch's extension cache (see :mod:`kvpilot.kernels.cpu.extension`), which needs a C++ compiler
and the ``ninja`` executable on ``PATH``; later processes load the cached build. When the build
fails, :func:`load_extension` logs one warning and returns None, and callers keep their own
path (the engine's torch attention backend: ``index_select`` gather plus SDPA).
``KVPILOT_CPU_PAGED_ATTENTION=0`` turns the kernel off without trying to build it.
"""

from __future__ import annotations

import functools
import logging
import pathlib

import torch

from kvpilot.kernels._utils import rows_contiguous
from kvpilot.kernels.cpu import extension

ENV_VAR = "KVPILOT_CPU_PAGED_ATTENTION"
# Cache dtypes the kernel reads; the query and output share the cache's dtype.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SOURCE = pathlib.Path(__file__).with_name("paged_attention.cpp")
EXTENSION_NAME = "kvpilot_cpu_paged_attention"
CFLAGS = extension.CFLAGS
KERNEL = extension.Kernel(
    EXTENSION_NAME,
    SOURCE,
    "CPU paged attention kernel",
    "decode attention keeps the torch path (index_select gather + SDPA)",
)


def enabled() -> bool:
    """Whether ``$KVPILOT_CPU_PAGED_ATTENTION`` allows the kernel (unset or anything but
    ``0``/``false``/``off``/``no``)."""
    return extension.env_enabled(ENV_VAR)


load_extension = extension.loader(KERNEL)


def available() -> bool:
    """Whether :func:`paged_attention` can run: enabled and built (builds on first call)."""
    return enabled() and load_extension() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this query and cache: both on the CPU, one float32 or bfloat16
    dtype, a contiguous cache (fp8 caches and mixed dtypes are left to the caller's own path)."""
    return (
        query.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and k_cache.dtype in SUPPORTED_DTYPES
        and query.dtype == k_cache.dtype
        and k_cache.is_contiguous()
    )


def tiles_prompts(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_attention`, given a query and cache it :func:`supports`, takes their
    prompts in tiles of 16 rows (float32, ``head_dim`` a multiple of 16 and ``block_size`` a
    multiple of 8, an AVX-512 CPU). Elsewhere it runs a prompt one token at a time, slower than
    one SDPA call for the prompt, so callers keep prompts on their own path there."""
    return (
        k_cache.dtype == torch.float32
        and k_cache.shape[1] % 8 == 0
        and k_cache.shape[3] % 16 == 0
        and _cpu_tiles()
    )


@functools.cache
def _cpu_tiles() -> bool:
    """Whether the built kernel runs prompt tiles on this CPU (AVX-512F), asked once."""
    extension = load_extension()
    return extension is not None and extension.tiles_supported()


NO_PROMPT_SEQS = torch.empty(0, dtype=torch.bool)
"""The kernel's ``prompt_seqs`` when no sequence is marked a prompt (an empty bool tensor)."""


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    prompt_seqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a step's query tokens (decodes, prompts, prompt chunks, drafts) over
    their sequences' paged contexts.

    Sequence ``i``'s query tokens are rows ``query_start_loc[i]..query_start_loc[i + 1] - 1``,
    its last ``q_len`` positions: its token at position ``p`` attends to positions ``0..p``
    (the last ``sliding_window`` of them with a window). A one-token sequence (a decode) is one
    work item per KV head, or one for all its KV heads when the step has at least 4 such tokens
    a thread (whole blocks read on one thread); on an AVX-512 CPU with a float32 cache,
    ``head_dim`` a multiple of 16 and ``block_size`` a multiple of 8, a longer one is cut into
    tiles of 16 (token, head) rows that share each K/V load (else each of its tokens is an
    item as a decode is). A token's result does not depend on the step it is in: the same bits
    for a prompt prefilled whole or in chunks, for each of its tokens whatever the batch, and
    whatever the block size (a multiple of 8) without a sliding window.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float32 or bfloat16 on the CPU (copied
            first unless each ``[num_heads, head_dim]`` row is contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous,
            ``query``'s dtype; ``num_heads`` a multiple of ``num_kv_heads``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 physical block ids; only the
            first ``ceil(seq_len / block_size)`` of a row are read.
        seq_lens: ``[num_seqs]`` int32 context lengths after the step (tokens, the new ones
            included), at least each sequence's query tokens; a length of 0 (one query token)
            gives zeros.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: tokens a query attends to, its own included; None for all.
        out: ``query``'s shape and dtype, rows contiguous, written in place; None allocates.
        query_start_loc: ``[num_seqs + 1]`` int32, rising from 0: each sequence's first row;
            None for one token per sequence, row ``i`` of sequence ``i`` (decodes).
        prompt_seqs: ``[num_seqs]`` bool, True where a sequence's query tokens are prompt
            tokens (a prompt or a chunk of one), or None. A marked one-token query goes to a
            tile as a longer one does, so that a prompt token gets the same bits whether its
            chunk had one token (a one-token last chunk, the last prompt token recomputed after
            a prefix-cache hit) or more; an unmarked one (a decode) is an item.

    Returns:
        ``out``: ``[num_tokens, num_heads, head_dim]``, ``query``'s dtype (rows of no sequence
        are left as they were).

    Raises:
        RuntimeError: the extension could not be built (see :func:`available`), or a shape,
            dtype, layout, length or block id the kernel does not take (the message names it).
        ValueError: a ``sliding_window`` below 1.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the CPU paged attention extension could not be built")
    if query.dim() == 3 and (query.stride(2) != 1 or query.stride(1) != query.shape[2]):
        query = query.contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query_start_loc is None:
        query_start_loc = torch.arange(seq_lens.shape[0] + 1, device=seq_lens.device)
    extension.paged_attention(
        out,
        query,
        k_cache,
        v_cache,
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        query_start_loc.to(torch.int32).contiguous(),
        NO_PROMPT_SEQS if prompt_seqs is None else prompt_seqs.to(torch.bool).contiguous(),
        float(scale),
        0 if sliding_window is None else int(sliding_window),
    )
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's keys and values into its slot of the paged caches, in place
    (vLLM's ``reshape_and_cache``): one call for both caches, a row copy per token, where
    ``index_copy_`` costs a dispatch per cache and layer.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype, on the CPU
            (copied first unless each token's ``[num_kv_heads, head_dim]`` is contiguous; a
            view of a fused QKV output is fine as it is).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
        slot_mapping: ``[num_tokens]`` int64 flat slots (``block * block_size + offset``);
            a negative slot skips its token (``-1``: padding).

    Raises:
        RuntimeError: the extension could not be built, or a shape, dtype, layout or slot
            out of range (the message names it; nothing is written then).
    """
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the CPU paged attention extension could not be built")
    key, value = (t if rows_contiguous(t) else t.contiguous() for t in (key, value))
    extension.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping.to(torch.int64))


if __name__ == "__main__":
    # ``python -m kvpilot.kernels.cpu.paged_attention``: load the kernel now (building it into
    # torch's cache if the prebuilt folder lacks it); ``python -m kvpilot.kernels.cpu`` also
    # installs it into the prebuilt folder.
    logging.basicConfig(level=logging.INFO)
    print("CPU paged attention kernel:", "built" if available() else "unavailable (torch path)")
