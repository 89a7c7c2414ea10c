"""Collectives over the stage's tensor-parallel group; each is the identity in a group of one.

Every rank receives bitwise the same result (gloo's and NCCL's all-reduce reduce each element
once and send that sum to every rank; checked for gloo with 2 and 3 ranks), so the ranks never
drift apart, and the same inputs give the same result on every run for a given
``tensor_parallel_size``. The sum's order differs from one matmul's, so results agree with a
single rank's to rounding, not bitwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvpilot.engine.distributed.parallel_state import (
    get_tensor_model_parallel_world_size,
    get_tp_state,
)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` (any shape and dtype) over all ranks; every rank gets the sum.

    The row-parallel layers' partial products and the vocabulary-parallel embedding's partial
    lookups are combined with it. Reduces in place and returns ``x``.
    """
    if get_tensor_model_parallel_world_size() == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=get_tp_state().group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order; every rank gets the result.

    Args:
        x: this rank's piece; same shape on every rank.
        dim: the dimension to concatenate along.

    Returns:
        A tensor whose ``dim`` is ``world_size`` times longer than ``x``'s.
    """
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return x
    pieces = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(pieces, x.contiguous(), group=get_tp_state().group)
    return torch.cat(pieces, dim=dim)
