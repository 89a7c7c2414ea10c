"""PyTorch references of the multi-LoRA kernels (``lora_shrink``, ``lora_expand``).

Punica (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") and S-LoRA (Sheng et al. 2023)
split the LoRA delta ``y += x A^T B^T`` of a batch that mixes adapters into two gathered
matmuls: *shrink* (``x A_s^T``, hidden -> rank) and *expand* (``... B_s^T``, rank -> hidden),
where ``s`` is each token's adapter slot. Here tokens of one slot are gathered and multiplied
together (one segment per slot); tokens with slot ``-1`` (the base model) are untouched.

These are the specification of the Triton kernels of the same names and the engine's CPU path:
computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """``out[t] = x[t] @ lora_a[token_slots[t]]^T`` for every token with a slot, 0 elsewhere.

    Args:
        x: ``[num_tokens, in_features]`` float16, bfloat16 or float32.
        lora_a: ``[num_slots, rank, in_features]``, any float dtype.
        token_slots: ``[num_tokens]`` int32/int64; a slot in ``[0, num_slots)``, or ``-1`` for
            a token of the base model.

    Returns:
        ``[num_tokens, rank]`` float32.
    """
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in _active_slots(token_slots):
        rows = token_slots == slot
        out[rows] = x[rows].float() @ lora_a[slot].float().T
    return out


def lora_expand(
    inp: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor
) -> None:
    """``y[t] += inp[t] @ lora_b[token_slots[t]]^T`` in place, for every token with a slot.

    The sum is formed in float32 and rounded once to ``y``'s dtype; base-model rows of ``y``
    (slot ``-1``) are not written.

    Args:
        inp: ``[num_tokens, rank]`` (the output of :func:`lora_shrink`), any float dtype.
        lora_b: ``[num_slots, out_features, rank]``, any float dtype.
        token_slots: ``[num_tokens]`` int32/int64; a slot or ``-1``.
        y: ``[num_tokens, out_features]``, float16, bfloat16 or float32; updated in place.
    """
    for slot in _active_slots(token_slots):
        rows = token_slots == slot
        delta = inp[rows].float() @ lora_b[slot].float().T
        y[rows] = (y[rows].float() + delta).to(y.dtype)


def _active_slots(token_slots: torch.Tensor) -> list[int]:
    return [s for s in torch.unique(token_slots).tolist() if s >= 0]
