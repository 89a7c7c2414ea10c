"""Executors: how the driver runs each step on one rank (in process) or many (processes on this
node, or Ray actors)."""

from kvpilot.engine.executor.abstract import EngineDeadError, Executor
from kvpilot.engine.executor.multiproc_executor import MultiprocExecutor, check_parallel_config
from kvpilot.engine.executor.uniproc_executor import UniProcExecutor
from kvpilot.engine.executor.worker import Worker, WorkerConfig


def create_executor(config: WorkerConfig, distributed_executor_backend: str = "mp") -> Executor:
    """The executor for ``config``'s world size and the backend (vLLM's
    ``--distributed-executor-backend``).

    ``"mp"``: in process for a world of one rank, else one process per rank on this node.
    ``"ray"``: one Ray actor per rank, in a placement group (any world size); Ray is imported
    only then.

    Raises:
        ValueError: a size the model or machine cannot honour, or an unknown backend (named in
            the message).
        EngineDeadError: a worker failed to start.
    """
    if distributed_executor_backend == "ray":
        from kvpilot.engine.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if distributed_executor_backend != "mp":
        raise ValueError(
            f"distributed_executor_backend must be 'mp' or 'ray', got "
            f"{distributed_executor_backend!r}"
        )
    if config.world_size == 1:
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
