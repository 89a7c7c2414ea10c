"""Tokens of a mixed multi-LoRA batch grouped by adapter slot, for the shrink/expand kernels.

Punica's segmented gather-matmul (SGMV, Chen et al. 2023) multiplies each adapter's tokens as
one segment. Tokens arrive in request order, so a stable sort by slot gives every slot one
contiguous run of token indices (vLLM's ``LoRAKernelMeta`` holds the same three arrays).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.kernels._utils import INDEX_DTYPES, check_index_range, check_tensor


@dataclass(frozen=True)
class LoRASegments:
    """Where each slot's tokens are.

    Attributes:
        token_indices: ``[num_tokens]`` int32; token indices sorted by slot (stable), base-model
            tokens (slot -1) last.
        slot_start: ``[num_slots]`` int32; where slot ``s``'s run starts in ``token_indices``.
        slot_num_tokens: ``[num_slots]`` int32; tokens of slot ``s`` (0 for an idle slot).
        max_tokens_per_slot: the largest ``slot_num_tokens`` entry (python int: sizes the grid
            without reading the device).
    """

    token_indices: torch.Tensor
    slot_start: torch.Tensor
    slot_num_tokens: torch.Tensor
    max_tokens_per_slot: int

    def to(self, device: torch.device | str) -> LoRASegments:
        """The same segments with tensors on ``device`` (copied without blocking)."""
        return LoRASegments(
            self.token_indices.to(device, non_blocking=True),
            self.slot_start.to(device, non_blocking=True),
            self.slot_num_tokens.to(device, non_blocking=True),
            self.max_tokens_per_slot,
        )


def lora_segments(token_slots: torch.Tensor, num_slots: int) -> LoRASegments:
    """Group tokens by slot.

    Args:
        token_slots: ``[num_tokens]`` int32/int64; each token's slot in ``[0, num_slots)`` or
            ``-1`` for the base model. Build it on the host: the largest segment is read back.
        num_slots: slots in the weight tensors (``max_loras``).

    Returns:
        The segments, on ``token_slots``' device.

    Raises:
        ValueError: ``token_slots`` is not a 1-D integer tensor with entries in
            ``[-1, num_slots)``, or ``num_slots`` is not positive.
    """
    fn = "lora_segments"
    check_tensor(fn, "token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES)
    if not isinstance(num_slots, int) or num_slots <= 0:
        raise ValueError(f"{fn}: num_slots must be a positive integer, got {num_slots!r}")
    check_index_range(fn, "token_slots", token_slots, -1, num_slots)
    # Base-model tokens sort after every slot's run.
    key = torch.where(token_slots < 0, num_slots, token_slots).long()
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_slots + 1)[:num_slots]
    starts = torch.cumsum(counts, 0) - counts
    return LoRASegments(
        token_indices=order.to(torch.int32),
        slot_start=starts.to(torch.int32),
        slot_num_tokens=counts.to(torch.int32),
        max_tokens_per_slot=int(counts.max()),
    )
