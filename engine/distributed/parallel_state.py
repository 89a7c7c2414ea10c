"""The parallel groups of this process: its tensor-parallel and pipeline-parallel place, and
their setup and teardown.

One process per rank. The world is ``tensor_parallel_size x pipeline_parallel_size`` ranks,
numbered stage by stage: global rank ``pp_rank * tensor_parallel_size + tp_rank`` (vLLM's
layout), so a stage's tensor-parallel ranks are neighbours (one node's GPUs) and a stage's
rank ``t`` sends its activations to rank ``t`` of the next stage. Layers read the
tensor-parallel rank and size once, when they are built, to decide which shard of each weight
they hold (Megatron-LM, Shoeybi et al. 2019); models read the pipeline rank to decide which
layers they hold (GPipe, Huang et al. 2019). The collectives in
:mod:`kvpilot.engine.distributed.communication_op` run over the stage's tensor-parallel group
set up here. Without a call to :func:`init_distributed_environment` the process is rank 0 of a
group of 1 on a single stage, so the single-process engine builds exactly the whole model.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

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
        group: the ``torch.distributed`` group of this stage's ranks; None for the default
            (whole-world) group, which is the stage's group when there is one stage.
    """

    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    enable_expert_parallel: bool = False
    group: Any = None


@dataclass(frozen=True)
class PipelineParallelState:
    """This process's stage in the pipeline.

    Attributes:
        rank: the stage, 0 ... ``world_size - 1`` (0 holds the embedding, the last the norm
            and the LM head).
        world_size: number of stages (``pipeline_parallel_size``).
        prev_rank: global rank this process receives activations from (None on stage 0).
        next_rank: global rank it sends its activations to (None on the last stage).
    """

    rank: int = 0
    world_size: int = 1
    prev_rank: int | None = None
    next_rank: int | None = None

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1


_STATE = TensorParallelState()
_PP_STATE = PipelineParallelState()
# Seconds the ranks may take to all reach the rendezvous (start-up), whatever the collective
# timeout.
RENDEZVOUS_TIMEOUT_S = 600.0


def _parse_tcp_init_method(init_method: str) -> tuple[str, int]:
    """``"tcp://host:port"`` -> ``(host, port)``.

    Raises:
        ValueError: another form (named in the message).
    """
    if not init_method.startswith("tcp://") or ":" not in init_method[6:]:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    host, port = init_method[6:].rsplit(":", 1)
    return host, int(port)


def init_distributed_environment(
    rank: int,
    tensor_parallel_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float = 600.0,
    enable_expert_parallel: bool = False,
    pipeline_parallel_size: int = 1,
) -> TensorParallelState:
    """Join the world (``torch.distributed.init_process_group``) and this stage's
    tensor-parallel group.

    Args:
        rank: this process's global rank, ``pp_rank * tensor_parallel_size + tp_rank``.
        tensor_parallel_size: ranks per stage.
        init_method: rendezvous address shared by all ranks, e.g. ``"tcp://127.0.0.1:29500"``.
        device: where this rank computes; NCCL is used for CUDA devices, gloo otherwise.
        timeout_s: seconds a collective or a stage's receive may wait for the other ranks
            before it raises (a rank that died otherwise leaves the others blocked forever).
        enable_expert_parallel: mixture-of-experts layers place whole experts on this
            stage's ranks (``TensorParallelState.enable_expert_parallel``).
        pipeline_parallel_size: stages.

    Returns:
        The tensor-parallel state (also what :func:`get_tp_state` returns from now on;
        :func:`get_pp_state` returns the stage).

    Raises:
        ValueError: ``rank`` not in ``[0, world_size)`` or a group is already set up.
    """
    global _STATE, _PP_STATE
    world_size = tensor_parallel_size * pipeline_parallel_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size}) for world_size {world_size}")
    if _STATE.world_size != 1 or _PP_STATE.world_size != 1 or dist.is_initialized():
        raise ValueError("the parallel groups of this process are already initialised")
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = None
    if world_size > 1:
        # The rendezvous waits as long as ranks take to start (imports, a Ray actor's
        # placement); only the collectives are held to ``timeout_s``.
        host, port = _parse_tcp_init_method(init_method)
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S)),
        )
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if pipeline_parallel_size > 1:
        # Every rank creates every stage's group, in the same order (new_group's contract).
        for stage in range(pipeline_parallel_size):
            ranks = list(range(stage * tensor_parallel_size, (stage + 1) * tensor_parallel_size))
            stage_group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks:
                group = stage_group
    tp_rank, pp_rank = rank % tensor_parallel_size, rank // tensor_parallel_size
    _STATE = TensorParallelState(
        tp_rank,
        tensor_parallel_size,
        backend if tensor_parallel_size > 1 else None,
        enable_expert_parallel,
        group=group,
    )
    _PP_STATE = PipelineParallelState(
        pp_rank,
        pipeline_parallel_size,
        rank - tensor_parallel_size if pp_rank > 0 else None,
        rank + tensor_parallel_size if pp_rank < pipeline_parallel_size - 1 else None,
    )
    return _STATE


def destroy_distributed_environment() -> None:
    """Leave the groups (if any); the process is rank 0 of 1 on a single stage again."""
    global _STATE, _PP_STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TensorParallelState()
    _PP_STATE = PipelineParallelState()


def get_tp_state() -> TensorParallelState:
    """This process's rank, world size and backend."""
    return _STATE


def get_pp_state() -> PipelineParallelState:
    """This process's pipeline stage (stage 0 of 1 when not distributed)."""
    return _PP_STATE


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
