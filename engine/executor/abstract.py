"""The executor interface: how the engine's driver runs a step on however many workers."""

from __future__ import annotations

import abc
from typing import Any

from kvpilot.engine.engine_core import EngineDeadError
from kvpilot.engine.executor.worker_input import WorkerInputEncoder
from kvpilot.engine.model_runner import ModelRunnerOutput
from kvpilot.engine.scheduler_output import SchedulerOutput

__all__ = ["DistributedExecutor", "EngineDeadError", "Executor"]


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


class DistributedExecutor(Executor):
    """An executor whose ranks run elsewhere (processes or Ray actors): every call goes to
    every rank through :meth:`collective_rpc`, and each step as a
    :class:`~kvpilot.engine.executor.worker_input.WorkerInput` (only what changed).

    Subclasses set ``config`` (a ``WorkerConfig``) and implement :meth:`collective_rpc`.
    """

    config: Any
    _encoder: WorkerInputEncoder

    @abc.abstractmethod
    def collective_rpc(self, method: str, *args: Any, reply_rank: int | None = None) -> list[Any]:
        """Call ``Worker.method(*args)`` on every rank; the results by rank (None from the
        ranks other than ``reply_rank`` when it is set).

        Raises:
            EngineDeadError: a rank died, raised or stopped answering.
        """

    def profile_peak_memory(self, num_tokens: int, max_model_len: int) -> int:
        return max(self.collective_rpc("profile_peak_memory", num_tokens, max_model_len))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # The last stage's ranks sample the same tokens from the same gathered logits; its
        # first rank reports them.
        message = self._encoder.encode(scheduler_output)
        output_rank = self.config.output_rank
        return self.collective_rpc("execute_step", message, reply_rank=output_rank)[output_rank]
