"""Executors: how the driver runs each step on one rank (in process) or many (processes)."""

from kvpilot.engine.executor.abstract import EngineDeadError, Executor
from kvpilot.engine.executor.multiproc_executor import MultiprocExecutor, check_parallel_config
from kvpilot.engine.executor.uniproc_executor import UniProcExecutor
from kvpilot.engine.executor.worker import Worker, WorkerConfig


def create_executor(config: WorkerConfig) -> Executor:
    """The executor for ``config.tensor_parallel_size``: in process for 1, else one process
    per rank.

    Raises:
        ValueError: a size the model or machine cannot honour (named in the message).
        EngineDeadError: a worker failed to start.
    """
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    return MultiprocExecutor(config)


__all__ = [
    "EngineDeadError",
    "Executor",
    "MultiprocExecutor",
    "UniProcExecutor",
    "Worker",
    "WorkerConfig",
    "check_parallel_config",
    "create_executor",
]
