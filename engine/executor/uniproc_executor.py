"""The single-rank executor: one worker in the driver's process (``tensor_parallel_size`` 1)."""

from __future__ import annotations

from kvpilot.engine.executor.abstract import Executor
from kvpilot.engine.executor.worker import Worker, WorkerConfig
from kvpilot.engine.model_runner import ModelRunner, ModelRunnerOutput
from kvpilot.engine.scheduler_output import SchedulerOutput


class UniProcExecutor(Executor):
    """Runs the whole model in this process; nothing to die apart from the process itself.

    Args:
        config: worker settings with ``tensor_parallel_size`` 1.

    Raises:
        ValueError: ``tensor_parallel_size`` is not 1, or from model loading.
    """

    def __init__(self, config: WorkerConfig) -> None:
        if config.world_size != 1:
            raise ValueError(
                f"UniProcExecutor runs one rank, got tensor_parallel_size "
                f"{config.tensor_parallel_size} x pipeline_parallel_size "
                f"{config.pipeline_parallel_size}; use MultiprocExecutor"
            )
        self.config = config
        self.worker = Worker(config)

    @property
    def model_runner(self) -> ModelRunner | None:
        """The worker's model runner (None before ``initialize_cache``)."""
        return self.worker.model_runner

    def profile_peak_memory(self, num_tokens: int, max_model_len: int) -> int:
        return self.worker.profile_peak_memory(num_tokens, max_model_len)

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
