"""PagedAttention in plain PyTorch: the CPU path, and a readable second opinion for kernels.

Follows Kwon et al. 2023 ("Efficient Memory Management for Large Language Model Serving with
PagedAttention"): keys/values live in fixed-size blocks reached through each sequence's block
table. Decode sequences (one new token each) are attended in one batched call over their
gathered context, padded to the longest; every sequence with several new tokens (a prefill or a
prefill chunk, attending to its cached context and causally to itself) gets its own call.
Scores are computed by ``scaled_dot_product_attention`` in the activation dtype, as
transformers' default ("sdpa") attention does, so results agree with it to float rounding.

An fp8 cache (``--kv-cache-dtype fp8``) holds ``x / scale`` per layer and tensor; keys and
values are quantized as they are written and dequantized to the activation dtype as they are
gathered (``reference.quantize_to_cache`` / ``dequantize_from_cache``), so attention itself
runs as with a float cache.

On the CPU, with a float32 or bfloat16 cache, decode sequences skip the gather and SDPA: the C++
kernel ``kvpilot.kernels.cpu.paged_attention`` reads their blocks in place through the block
tables, one call per layer for all of them, sliding windows included. Where the kernel tiles
prompts (a float32 cache, head size a multiple of 16, block size a multiple of 8, AVX-512:
``paged_attention.tiles_prompts``) the prompts, prompt chunks and drafts go to it too, the
whole step in one call: a prompt's token at position ``p`` attends to positions ``0..p`` of its
sequence, computed on its own, so its result does not depend on the other sequences of the step
nor on how the prompt is chunked (1.9-3.2x faster than the per-sequence SDPA calls on 16
prompts of 128 tokens, 1.8x on one of 2,048). Elsewhere each prompt keeps its SDPA call, which
beats the kernel's token-by-token path. The gather + SDPA path
stays the reference and the fallback: for fp8 caches, when the kernel cannot be built (one
warning), and when ``KVPILOT_CPU_PAGED_ATTENTION=0`` or ``TorchAttentionBackend(
paged_decode_kernel=False)`` turns it off.

Everything derived from the batch layout alone (which rows decode, the flat cache slots to read,
the masks) is computed once per forward pass, in :func:`plan_step`, and reused by every layer:
the same :class:`AttentionMetadata` object is passed to all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.kernels.cpu import paged_attention
from kvpilot.kernels.reference import dequantize_from_cache, quantize_to_cache, write_slots


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask, broadcast from ``q_pos[..., None]`` vs ``k_pos``."""
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (k_pos > q_pos - sliding_window)
    return mask


# Cost of one more decode group, in padded context positions: a group costs a few
# microseconds of calls per layer, about what attending to ~100 positions of one sequence costs.
GROUP_OVERHEAD_TOKENS = 128


@dataclass
class DecodePlan:
    """A group of decode sequences (one new token each) attended in one call.

    Attributes:
        rows: ``[num_decodes]`` int64 token rows of the group's sequences, or None when the
            group is every token of the step, in order (rows ``0..num_tokens-1``).
        seq_lens: ``[num_decodes]`` int64 context lengths (tokens).
        slots: ``[num_decodes * max_len]`` int64 flat cache slots (``block * block_size +
            offset``) of each sequence's positions ``0..max_len-1``. Positions past a sequence's
            end repeat its last slot, so the padding reads only that sequence's own K/V: the
            output never depends on what other or freed blocks hold (even NaN), although the
            mask already gives those positions a weight of exactly 0.
        max_len: the group's longest context (tokens).
    """

    rows: torch.Tensor | None
    seq_lens: torch.Tensor
    slots: torch.Tensor
    max_len: int


@dataclass
class PagedQueryPlan:
    """Query tokens for the in-place kernel (no slots, no padding): every token of the step, or
    the decode sequences' alone.

    Attributes:
        seq_lens: ``[num_seqs]`` int32 context lengths after the step (tokens).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32, contiguous.
        query_start_loc: ``[num_seqs + 1]`` int32 first row of each sequence in the kernel's
            query.
        rows: ``[num_decodes]`` int64 token rows of the decode sequences when the kernel takes
            them alone (the prompts go to SDPA); None when it takes every token of the step.
        prompt_seqs: ``[num_seqs]`` bool, the sequences whose tokens are prompt tokens
            (``AttentionMetadata.prompt_seqs``), or None.
    """

    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    rows: torch.Tensor | None = None
    prompt_seqs: torch.Tensor | None = None


@dataclass
class PrefillPlan:
    """One sequence with several new tokens (a prompt, a prompt chunk, or draft tokens).

    Attributes:
        start: its first token row.
        q_len: its new tokens.
        seq_len: its context length after this step (tokens).
        slots: ``[seq_len]`` int64 flat cache slots of its positions ``0..seq_len-1``.
    """

    start: int
    q_len: int
    seq_len: int
    slots: torch.Tensor


@dataclass
class StepPlan:
    """What every layer of one forward pass reuses; masks are built per sliding window.

    Attributes:
        write_rows: ``[n]`` int64 rows whose K/V are cached, or None for all rows.
        write_slots: ``[n]`` int64 their flat slots. (Both for ``index_copy_`` writes; where
            the in-place kernel attends, ``reshape_and_cache`` reads the metadata's
            ``slot_mapping`` and skips its -1 slots itself.)
        decodes: the decode sequences, in groups of similar length (empty when ``in_place``
            holds them).
        prefills: the other sequences (empty when ``in_place`` holds them).
        in_place: every token of the step for the in-place kernel, or None (the gather
            path).
        masks: sliding window (None: full attention) -> (one ``[num_decodes, 1, 1, max_len]``
            bool mask per decode group, one ``[q_len, seq_len]`` bool mask per prefill, None
            for a whole prompt without a window: plain causal attention).
    """

    write_rows: torch.Tensor | None
    write_slots: torch.Tensor
    decodes: list[DecodePlan]
    prefills: list[PrefillPlan]
    in_place: PagedQueryPlan | None = None
    masks: dict[int | None, tuple[list[torch.Tensor], list[torch.Tensor | None]]] = field(
        default_factory=dict
    )

    def masks_for(
        self, sliding_window: int | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The decode and prefill masks (True: attend) for one sliding window, built once."""
        if sliding_window not in self.masks:
            decode_masks = []
            for d in self.decodes:
                k_pos = torch.arange(d.max_len, device=d.seq_lens.device)[None, :]
                last = (d.seq_lens - 1)[:, None]
                decode_masks.append(_allowed(last, k_pos, sliding_window)[:, None, None, :])
            prefill_masks: list[torch.Tensor | None] = []
            for p in self.prefills:
                if p.q_len == p.seq_len and sliding_window is None:
                    # A whole prompt: SDPA's own causal mask, which also skips masked tiles.
                    prefill_masks.append(None)
                    continue
                positions = torch.arange(p.seq_len, device=p.slots.device)
                q_pos = positions[p.seq_len - p.q_len :, None]
                prefill_masks.append(_allowed(q_pos, positions[None, :], sliding_window))
            self.masks[sliding_window] = (decode_masks, prefill_masks)
        return self.masks[sliding_window]


def group_by_length(lengths: list[int], overhead: int = GROUP_OVERHEAD_TOKENS) -> list[list[int]]:
    """Split sequences into groups that are each padded to their longest member.

    Minimises ``sum(group size x group's longest length) + overhead x number of groups``: the
    padded positions a batched attention call computes plus a per-call cost. The optimum
    groups consecutive lengths in sorted order, so a dynamic programme over the sorted lengths
    finds it (O(n^2)).

    Args:
        lengths: context length of each sequence (tokens).
        overhead: cost of one more group, in positions.

    Returns:
        Indices into ``lengths``, one list per group, shortest group first.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    n = len(order)
    best = [0] + [float("inf")] * n  # best[j]: cost of grouping the j shortest
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + (j - i) * longest + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


def plan_step(
    attn_metadata: AttentionMetadata,
    block_size: int,
    in_place: bool = False,
    prompts_in_place: bool = False,
) -> StepPlan:
    """Derive the per-step tensors of :class:`StepPlan` from the batch layout (one host sync).

    Args:
        attn_metadata: the batch layout.
        block_size: tokens per cache block.
        in_place: plan the decode sequences for the in-place kernel (``StepPlan.in_place``)
            instead of gathered groups (``StepPlan.decodes``).
        prompts_in_place: with ``in_place``, the sequences of several new tokens too (where
            the kernel tiles them), instead of one SDPA call each (``StepPlan.prefills``).
    """
    device = attn_metadata.seq_lens.device
    starts = attn_metadata.query_start_loc.tolist()
    seq_lens = attn_metadata.seq_lens.tolist()
    slot_mapping = attn_metadata.slot_mapping.long()
    write_rows = None
    if bool((slot_mapping < 0).any()):
        write_rows = torch.nonzero(slot_mapping >= 0).flatten()
        slot_mapping = slot_mapping[write_rows]

    decode = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
    if in_place and (prompts_in_place or len(decode) == len(seq_lens)):
        # Every token to the kernel (most steps: decodes only): no slot of any position needed.
        return StepPlan(write_rows, slot_mapping, [], [], _paged_queries(attn_metadata))
    max_len = max(seq_lens)
    positions = torch.arange(max_len, device=device)
    tables = attn_metadata.block_tables[:, : -(-max_len // block_size)].long()
    # [num_seqs, max_len]: slot of every position of every sequence (garbage past the end).
    all_slots = tables[:, positions // block_size] * block_size + positions % block_size
    prefills = [
        PrefillPlan(starts[i], starts[i + 1] - starts[i], n, all_slots[i, :n])
        for i, n in enumerate(seq_lens)
        if starts[i + 1] - starts[i] > 1
    ]
    if in_place:
        paged = _paged_decodes(attn_metadata, decode) if decode else None
        return StepPlan(write_rows, slot_mapping, [], prefills, paged)
    decode_plans = []
    for group in group_by_length([seq_lens[i] for i in decode], GROUP_OVERHEAD_TOKENS):
        seqs = [decode[g] for g in group]
        index = torch.tensor(seqs, device=device)
        lens = attn_metadata.seq_lens[index].long()
        group_len = max(seq_lens[i] for i in seqs)
        slots = all_slots[index, :group_len]
        last = slots.gather(1, (lens - 1)[:, None])
        slots = torch.where(positions[None, :group_len] < lens[:, None], slots, last)
        in_order = seqs == list(range(len(seq_lens))) and starts[-1] == len(seqs)
        rows = None if in_order else torch.tensor([starts[i] for i in seqs], device=device)
        decode_plans.append(DecodePlan(rows, lens, slots.flatten(), group_len))
    return StepPlan(write_rows, slot_mapping, decode_plans, prefills)


def _paged_queries(attn_metadata: AttentionMetadata) -> PagedQueryPlan:
    """The kernel's plan for every token of the step: its layout in the kernel's dtypes."""
    md = attn_metadata
    return PagedQueryPlan(
        md.seq_lens.to(torch.int32).contiguous(),
        md.block_tables.to(torch.int32).contiguous(),
        md.query_start_loc.to(torch.int32).contiguous(),
        prompt_seqs=md.prompt_seqs,
    )


def _paged_decodes(attn_metadata: AttentionMetadata, decode: list[int]) -> PagedQueryPlan:
    """The kernel's plan for the decode sequences ``decode`` alone (indices, at least one)."""
    device = attn_metadata.seq_lens.device
    index = torch.tensor(decode, device=device)
    return PagedQueryPlan(
        attn_metadata.seq_lens[index].to(torch.int32),
        attn_metadata.block_tables[index].to(torch.int32).contiguous(),
        torch.arange(len(decode) + 1, dtype=torch.int32, device=device),
        rows=attn_metadata.query_start_loc[index].long(),
    )


class TorchAttentionBackend:
    """The ``"torch"`` attention backend (see :class:`~kvpilot.engine.attention.backends.AttentionBackend`).

    Keeps the :class:`StepPlan` of the last metadata object it saw; a forward pass must not
    mutate its metadata between layers (the model runner builds a new one every step).

    Args:
        paged_decode_kernel: attend every token of a step (decodes and prompts) with the
            in-place C++ kernel where it applies (CPU, float32/bfloat16 cache, query of the
            cache's dtype) and builds; False keeps the gather + SDPA path; None (default) follows
            ``$KVPILOT_CPU_PAGED_ATTENTION`` (on unless ``0``).
    """

    name = "torch"

    def __init__(self, paged_decode_kernel: bool | None = None) -> None:
        self._plan: tuple[AttentionMetadata, bool, StepPlan] | None = None
        self.paged_decode_kernel = (
            paged_attention.enabled() if paged_decode_kernel is None else paged_decode_kernel
        )

    def plan(
        self,
        attn_metadata: AttentionMetadata,
        block_size: int,
        in_place: bool = False,
        prompts_in_place: bool = False,
    ) -> StepPlan:
        """The step plan of ``attn_metadata``, computed on its first layer and then reused."""
        key = (in_place, prompts_in_place)
        if self._plan is None or self._plan[0] is not attn_metadata or self._plan[1] != key:
            plan = plan_step(attn_metadata, block_size, in_place, prompts_in_place)
            self._plan = (attn_metadata, key, plan)
        return self._plan[2]

    def uses_kernel(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether decode sequences of this query and cache go to the in-place kernel (builds
        it on the first call that could use it)."""
        return (
            self.paged_decode_kernel
            and paged_attention.supports(query, k_cache)
            and paged_attention.load_extension() is not None
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cache the new K/V, then attend; shapes as in ``AttentionBackend.forward``."""
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        in_place = self.uses_kernel(query, k_cache)
        prompts_in_place = in_place and paged_attention.tiles_prompts(query, k_cache)
        plan = self.plan(attn_metadata, k_cache.shape[1], in_place, prompts_in_place)
        paged = plan.in_place
        if in_place:  # the cache in the query's dtype: rows copied as they are, -1 slots skipped
            paged_attention.reshape_and_cache(
                key, value, k_cache, v_cache, attn_metadata.slot_mapping
            )
            if paged is not None and paged.rows is None:
                return _in_place(query, k_cache, v_cache, paged, scale, sliding_window)
        else:
            _write(key, value, k_cache, v_cache, plan, k_scale, v_scale)
        k_flat = _Gather(k_cache.view(-1, num_kv_heads, head_dim), k_scale, query.dtype)
        v_flat = _Gather(v_cache.view(-1, num_kv_heads, head_dim), v_scale, query.dtype)
        decode_masks, prefill_masks = plan.masks_for(sliding_window)
        if len(plan.decodes) == 1 and plan.decodes[0].rows is None:
            return self._decode(query, k_flat, v_flat, plan.decodes[0], decode_masks[0], scale)
        out = torch.empty_like(query)
        if paged is not None:
            out[paged.rows] = _in_place(
                query[paged.rows], k_cache, v_cache, paged, scale, sliding_window
            )
        for d, mask in zip(plan.decodes, decode_masks, strict=True):
            out[d.rows] = self._decode(query[d.rows], k_flat, v_flat, d, mask, scale)
        for p, mask in zip(plan.prefills, prefill_masks, strict=True):
            k = k_flat(p.slots)  # [seq_len, num_kv_heads, head_dim]
            v = v_flat(p.slots)
            # 4-D inputs: with 3-D ones PyTorch's CPU dispatch takes the unfused math kernel,
            # ~3x slower on long prompts.
            o = F.scaled_dot_product_attention(
                query[p.start : p.start + p.q_len].transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[p.start : p.start + p.q_len] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(
        query: torch.Tensor,
        k_flat: _Gather,
        v_flat: _Gather,
        d: DecodePlan,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """``query`` ``[num_decodes, num_heads, head_dim]`` -> attention output, same shape."""
        batch, num_kv_heads, head_dim = len(d.seq_lens), k_flat.num_kv_heads, k_flat.head_dim
        # [batch, num_kv_heads, max_len, head_dim], one index_select per cache.
        k = k_flat(d.slots).view(batch, d.max_len, num_kv_heads, head_dim)
        v = v_flat(d.slots).view(batch, d.max_len, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            query[:, :, None, :],  # [batch, num_heads, 1, head_dim]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return o[:, :, 0, :]


def _write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: StepPlan,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Cache the step's new K/V (``[num_tokens, num_kv_heads, head_dim]``) at the plan's
    slots, quantized first for an fp8 cache."""
    if plan.write_rows is not None:
        key, value = key[plan.write_rows], value[plan.write_rows]
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        flat = cache.view(-1, cache.shape[2], cache.shape[3])
        write_slots(flat, plan.write_slots, quantize_to_cache(new, scale, cache.dtype))


def _in_place(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    paged: PagedQueryPlan,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The kernel's attention for the tokens of ``paged`` (``query`` holds just their rows)."""
    return paged_attention.paged_attention(
        query,
        k_cache,
        v_cache,
        paged.block_tables,
        paged.seq_lens,
        scale,
        sliding_window,
        query_start_loc=paged.query_start_loc,
        prompt_seqs=paged.prompt_seqs,
    )


class _Gather:
    """Reads slots of one flat cache ``[num_slots, num_kv_heads, head_dim]`` in the compute
    dtype: an ``index_select``, then for an fp8 cache the dequantization by ``scale``."""

    def __init__(self, flat: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.flat, self.scale, self.dtype = flat, scale, dtype
        self.num_kv_heads, self.head_dim = flat.shape[1], flat.shape[2]

    def __call__(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` ``[n]`` int64 -> ``[n, num_kv_heads, head_dim]`` in the compute dtype."""
        rows = self.flat.index_select(0, slots)
        return (
            rows
            if rows.dtype == self.dtype
            else dequantize_from_cache(rows, self.scale, self.dtype)
        )
