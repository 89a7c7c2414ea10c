"""Tensor and pipeline parallelism: the process groups, the collectives, the stage split."""

from kvpilot.engine.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from kvpilot.engine.distributed.parallel_state import (
    PipelineParallelState,
    TensorParallelState,
    destroy_distributed_environment,
    divide,
    get_pp_state,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_state,
    init_distributed_environment,
)

__all__ = [
    "PipelineParallelState",
    "TensorParallelState",
    "destroy_distributed_environment",
    "divide",
    "get_pp_state",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_state",
    "init_distributed_environment",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
