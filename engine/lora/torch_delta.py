"""The per-token LoRA delta in PyTorch (the CPU path): slot-padded batched matmuls.

The kernels' reference (``kvpilot.kernels.lora_reference``) loops over slots with boolean masks:
clear, but a dozen small operations per slot and projection, which dominate a CPU decode step.
Here the batch's tokens are laid out once per forward pass as ``[num_active_slots,
max_tokens_per_slot]`` (Punica's segments, padded to the longest), so every projection costs one
gather, two ``bmm`` calls and one ``index_add_`` whatever the number of adapters. Padding rows
repeat a real token and are computed, then dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.kernels.lora_segments import LoRASegments


@dataclass(frozen=True)
class PaddedBatch:
    """The tokens of a pass that use an adapter, padded per slot.

    Attributes:
        slots: ``[num_active]`` int64 slot ids with tokens, ascending; None when every slot is
            active (the weights are then used without a gather).
        gather_index: ``[num_active * max_tokens]`` int64; the token read into each padded row.
        rows: ``[num_lora_tokens]`` int64; the tokens that use an adapter, grouped by slot.
        valid: ``[num_lora_tokens]`` int64; the padded row of each entry of ``rows``.
        num_active, max_tokens: the padded layout's sizes.
    """

    slots: torch.Tensor | None
    gather_index: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    num_active: int
    max_tokens: int


def padded_batch(segments: LoRASegments) -> PaddedBatch:
    """Lay out ``segments`` (host tensors) as padded per-slot rows.

    Raises:
        ValueError: no token uses an adapter (nothing to lay out).
    """
    counts = segments.slot_num_tokens.long()
    active = torch.nonzero(counts).flatten()
    if active.numel() == 0:
        raise ValueError("padded_batch: no token uses an adapter")
    max_tokens = segments.max_tokens_per_slot
    starts = segments.slot_start.long()[active]
    lengths = counts[active]
    offsets = torch.arange(max_tokens)
    # Padding positions read the slot's first token again.
    within = torch.where(offsets < lengths[:, None], offsets, 0)
    sorted_tokens = segments.token_indices.long()
    gather_index = sorted_tokens[starts[:, None] + within].flatten()
    is_real = (offsets < lengths[:, None]).flatten()
    num_slots = counts.numel()
    return PaddedBatch(
        slots=None if active.numel() == num_slots else active,
        gather_index=gather_index,
        rows=gather_index[is_real],
        valid=torch.nonzero(is_real).flatten(),
        num_active=int(active.numel()),
        max_tokens=max_tokens,
    )


def add_lora_delta(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    batch: PaddedBatch,
) -> None:
    """``out[t] += x[t] @ lora_a[s]^T @ lora_b[s]^T`` in place for every token ``t`` of slot ``s``.

    Computed in the weights' dtype (float32 accumulation inside the matmuls; ``x`` is cast to
    it, the delta back to ``out``'s); base-model rows of ``out`` are not touched.

    Args:
        x: ``[num_tokens, in_features]``.
        out: ``[num_tokens, out_features]``.
        lora_a: ``[num_slots, rank, in_features]``.
        lora_b: ``[num_slots, out_features, rank]``, ``lora_a``'s dtype.
        batch: the pass's layout (:func:`padded_batch`).
    """
    if batch.slots is not None:
        lora_a, lora_b = lora_a.index_select(0, batch.slots), lora_b.index_select(0, batch.slots)
    xs = x.index_select(0, batch.gather_index).view(batch.num_active, batch.max_tokens, -1)
    xs = xs.to(lora_a.dtype)
    delta = torch.bmm(torch.bmm(xs, lora_a.transpose(1, 2)), lora_b.transpose(1, 2))
    delta = delta.view(-1, delta.shape[-1]).index_select(0, batch.valid)
    out.index_add_(0, batch.rows, delta.to(out.dtype))
