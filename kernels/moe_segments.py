"""(token, expert) pairs of a mixture-of-experts layer grouped by expert, for the grouped matmul.

Each token is routed to ``top_k`` experts: pair ``p = token * top_k + k`` goes to expert
``topk_ids[token, k]``. A stable sort of the pairs by expert gives every expert one contiguous
run, so one grouped matmul multiplies each expert's rows by that expert's weights (vLLM's
``moe_align_block_size`` does the same sort, padded to its block size). Pure PyTorch, and no
value is read back to the host: the CPU path and the Triton kernel share it, and on a GPU it
never synchronises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertSegments:
    """Where each local expert's (token, expert) pairs are.

    Attributes:
        pair_indices: ``[num_tokens * top_k]`` int32; pair indices sorted by local expert
            (stable), pairs of experts held by other ranks (expert parallelism) last.
        expert_start: ``[num_local_experts]`` int32; where expert ``e``'s run starts.
        expert_num_pairs: ``[num_local_experts]`` int32; pairs routed to expert ``e``.
    """

    pair_indices: torch.Tensor
    expert_start: torch.Tensor
    expert_num_pairs: torch.Tensor


def expert_segments(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None = None
) -> ExpertSegments:
    """Group the pairs of ``topk_ids`` by the local expert they go to.

    Args:
        topk_ids: ``[num_tokens, top_k]`` int32/int64; global expert ids.
        num_local_experts: experts whose weights this rank holds.
        expert_map: ``[num_experts]`` int32; global expert -> local index, or ``-1`` for an
            expert held by another rank; None when every expert is local (ids are local).

    Returns:
        The segments, on ``topk_ids``' device.
    """
    local = topk_ids.flatten().long()
    if expert_map is not None:
        local = expert_map.long()[local]
    # Pairs of other ranks' experts sort after every local run.
    key = torch.where(local < 0, num_local_experts, local)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_local_experts + 1)[:num_local_experts]
    return ExpertSegments(
        pair_indices=order.to(torch.int32),
        expert_start=(torch.cumsum(counts, 0) - counts).to(torch.int32),
        expert_num_pairs=counts.to(torch.int32),
    )
