"""Tensor parallelism's process group: rank and world size state, and the collectives."""

from kvpilot.engine.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from kvpilot.engine.distributed.parallel_state import (
    TensorParallelState,
    destroy_distributed_environment,
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_state,
    init_distributed_environment,
)

__all__ = [
    "TensorParallelState",
    "destroy_distributed_environment",
    "divide",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_state",
    "init_distributed_environment",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
