"""The tensor-parallel group of this process: its rank, its size, and its setup and teardown.

One process per rank (Megatron-LM, Shoeybi et al. 2019). Layers read the rank and size once,
when they are built, to decide which shard of each weight they hold; the collectives in
:mod:`kvpilot.engine.distributed.communication_op` run over the group set up here. Without a
call to :func:`init_distributed_environment` the process is rank 0 of a group of 1, so the
single-process engine builds exactly the unsharded model.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelState:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank: 0 ... ``world_size - 1``.
        world_size: number of ranks the model is sharded over (``tensor_parallel_size``).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA); ``None`` for a group of one.
        enable_expert_parallel: mixture-of-experts layers place whole experts on ranks
            instead of a slice of every expert (vLLM's ``--enable-expert-parallel``; the
            expert-parallel group is the tensor-parallel group).
    """

    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    enable_expert_parallel: bool = False


_STATE = TensorParallelState()


def init_distributed_environment(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float = 600.0,
    enable_expert_parallel: bool = False,
) -> TensorParallelState:
    """Join the tensor-parallel group (``torch.distributed.init_process_group``).

    Args:
        rank: this process's rank.
        world_size: number of ranks.
        init_method: rendezvous address shared by all ranks, e.g. ``"tcp://127.0.0.1:29500"``.
        device: where this rank computes; NCCL is used for CUDA devices, gloo otherwise.
        timeout_s: seconds a collective may wait for the other ranks before it raises (a rank
            that died otherwise leaves the others blocked forever), seconds.

    Returns:
        The new state (also what :func:`get_tp_state` returns from now on).

    Raises:
        ValueError: ``rank`` not in ``[0, world_size)`` or a group is already set up.
    """
    global _STATE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size}) for world_size {world_size}")
    if _STATE.world_size != 1 or dist.is_initialized():
        raise ValueError("the tensor-parallel group of this process is already initialised")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size > 1:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    _STATE = TensorParallelState(
        rank, world_size, backend if world_size > 1 else None, enable_expert_parallel
    )
    return _STATE


def destroy_distributed_environment() -> None:
    """Leave the group (if any); the process is rank 0 of 1 again."""
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TensorParallelState()


def get_tp_state() -> TensorParallelState:
    """This process's rank, world size and backend."""
    return _STATE


def get_tensor_model_parallel_rank() -> int:
    """This process's tensor-parallel rank (0 when not distributed)."""
    return _STATE.rank


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-parallel size (1 when not distributed)."""
    return _STATE.world_size


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when it is exact.

    Raises:
        ValueError: naming ``what`` and both numbers when it is not.
    """
    if numerator % denominator:
        raise ValueError(
            f"{what} {numerator} is not divisible by tensor_parallel_size {denominator}"
        )
    return numerator // denominator
