"""The executor interface: how the engine's driver runs a step on however many workers."""

from __future__ import annotations

import abc

from kvpilot.engine.model_runner import ModelRunnerOutput
from kvpilot.engine.scheduler_output import SchedulerOutput


class EngineDeadError(RuntimeError):
    """A worker died or failed: the engine cannot run another step (vLLM's name)."""


class Executor(abc.ABC):
    """Runs the model for the driver, which keeps the scheduler and the KV block manager.

    Implementations: :class:`~kvpilot.engine.executor.UniProcExecutor` (one rank, in this
    process) and :class:`~kvpilot.engine.executor.MultiprocExecutor` (one process per
    tensor-parallel rank). Both are built from a
    :class:`~kvpilot.engine.executor.WorkerConfig` and load the model on construction.
    """

    @abc.abstractmethod
    def profile_peak_memory(self, num_tokens: int, max_model_len: int) -> int:
        """Peak GPU bytes of a ``num_tokens`` forward pass, the largest over ranks."""

    @abc.abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV cache blocks on every rank (each holds its KV heads)."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step on every rank; the sampled tokens.

        Raises:
            EngineDeadError: a worker died or failed (the message names the rank and cause).
        """

    @abc.abstractmethod
    def check_health(self) -> None:
        """Return when every worker is alive.

        Raises:
            EngineDeadError: naming the dead worker.
        """

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their memory; idempotent."""
