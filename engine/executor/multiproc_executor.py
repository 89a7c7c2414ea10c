"""The multiprocessing executor (``--distributed-executor-backend mp``): one worker process per
rank on this node, ``tensor_parallel_size x pipeline_parallel_size`` of them.

The driver (the engine's process) keeps the scheduler and the KV block manager; each step it
encodes the ``SchedulerOutput`` as a :class:`~kvpilot.engine.executor.worker_input.WorkerInput`
(only what changed since the last step), pickles it once and writes it to every worker's pipe
(the broadcast), then waits for the replies while watching every worker's process sentinel. A
worker that exits, is killed or raises stops the whole executor at once with an
:class:`EngineDeadError` naming the rank and the cause, instead of leaving the driver waiting
on a reply that never comes (the other ranks would wait in their next all-reduce forever); a
worker that stops answering is declared dead once a step has waited
``distributed_timeout_s`` plus a margin (by then its peers' collectives have timed out too).
Workers, in turn, exit when the driver's end of their pipe closes. The ranks talk to each other
only through ``torch.distributed`` (gloo on CPU, NCCL on GPUs), set up with that timeout.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import time
import traceback
import weakref
from dataclasses import replace
from typing import Any

import torch

from kvpilot.engine.distributed import destroy_distributed_environment
from kvpilot.engine.distributed.pipeline import check_pipeline_parallel_size
from kvpilot.engine.executor.abstract import DistributedExecutor, EngineDeadError
from kvpilot.engine.executor.worker import Worker, WorkerConfig
from kvpilot.engine.executor.worker_input import WorkerInputEncoder
from kvpilot.engine.model_shape import ModelShape, check_tensor_parallel_size
from kvpilot.engine.startup_heap import freeze_startup_heap
from kvpilot.ports import free_port

logger = logging.getLogger("kvpilot.engine")

# How long a worker may take to exit after being asked to, before it is terminated (seconds).
_SHUTDOWN_GRACE_S = 5.0
# What a step may wait past the collective timeout for a silent rank, before the driver
# declares it dead itself (seconds): its peers' collectives report it first when they can.
STEP_TIMEOUT_MARGIN_S = 30.0
# Seconds to wait, once one rank failed, for the others to answer or be seen dead.
_ROOT_CAUSE_GRACE_S = 5.0


def check_parallel_config(config: WorkerConfig, *, local: bool = True) -> None:
    """Refuse a ``tensor_parallel_size`` / ``pipeline_parallel_size`` the model or the machine
    cannot honour.

    The divisor rule is the planner's own
    (:func:`kvpilot.engine.model_shape.check_tensor_parallel_size`), so the operator never plans
    a size the engine refuses.

    Args:
        config: the worker settings.
        local: every rank runs on this node (the ``mp`` executor), so the GPUs are counted here.

    Raises:
        ValueError: heads or MLP channels not divisible (the message names both numbers),
            fewer layers than stages, or more ranks than this node's CUDA devices.
    """
    spec = config.model_shape or ModelShape.from_hf_config(
        json.loads((config.model_dir / "config.json").read_text())
    )
    check_tensor_parallel_size(spec, config.tensor_parallel_size)
    check_pipeline_parallel_size(spec, config.pipeline_parallel_size)
    if local and config.device.type == "cuda":
        available = torch.cuda.device_count()
        if config.world_size > available:
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size} x pipeline_parallel_size "
                f"{config.pipeline_parallel_size} needs one GPU per rank; this node has "
                f"{available}"
            )


class MultiprocExecutor(DistributedExecutor):
    """Spawns ``tensor_parallel_size x pipeline_parallel_size`` worker processes and drives
    them step by step.

    Construction validates the size, starts the workers (``spawn``, so CUDA works in them),
    and returns once every rank has loaded its shard.

    Args:
        config: worker settings; on CPU, ``num_threads`` None splits this process's torch
            threads evenly between the ranks (at least one each).

    Raises:
        ValueError: an unshardable size (see :func:`check_parallel_config`).
        EngineDeadError: a worker failed to start (its traceback is in the message).
    """

    def __init__(self, config: WorkerConfig) -> None:
        check_parallel_config(config)
        if config.num_threads is None and config.device.type == "cpu":
            threads = max(1, torch.get_num_threads() // config.world_size)
            config = replace(config, num_threads=threads)
        self.config = config
        self._failure: str | None = None
        self._encoder = WorkerInputEncoder()
        context = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(config.world_size):
            driver_end, worker_end = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                args=(config, rank, init_method, worker_end),
                name=f"kvpilot-tp-worker-{rank}",
                daemon=True,
            )
            proc.start()
            worker_end.close()
            self._conns.append(driver_end)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        self._gather("start-up", reply_rank=None, timeout_s=None)
        logger.info(
            "Parallel workers: %d processes (pids %s), backend %s, %d weight bytes per rank",
            len(self._procs),
            ", ".join(str(p.pid) for p in self._procs),
            "nccl" if config.device.type == "cuda" else "gloo",
            max(self.collective_rpc("weight_bytes")),
        )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, by rank."""
        return [p.pid for p in self._procs]

    def collective_rpc(self, method: str, *args: Any, reply_rank: int | None = None) -> list[Any]:
        """Call ``Worker.method(*args)`` on every rank and wait for all of them.

        Args:
            method: a :class:`~kvpilot.engine.executor.worker.Worker` method name.
            args: its arguments (pickled once, sent to every rank).
            reply_rank: only this rank sends its result back (the others send None); None:
                every rank does.

        Returns:
            The results by rank.

        Raises:
            EngineDeadError: a worker died or raised, or gave no answer within
                ``distributed_timeout_s + STEP_TIMEOUT_MARGIN_S``; every worker is then
                stopped.
        """
        self.check_health()
        payload = pickle.dumps((method, args, reply_rank), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError as exc:
                self._fail(f"worker rank {rank} is unreachable during {method}: {exc}")
        return self._gather(
            method, reply_rank, self.config.distributed_timeout_s + STEP_TIMEOUT_MARGIN_S
        )

    def check_health(self) -> None:
        if self._failure is None:
            for rank, proc in enumerate(self._procs):
                if not proc.is_alive():
                    self._fail(_death_message(rank, proc, "idle"))
        if self._failure is not None:
            raise EngineDeadError(self._failure)

    def shutdown(self) -> None:
        self._finalizer()

    def _gather(self, method: str, reply_rank: int | None, timeout_s: float | None) -> list[Any]:
        """Wait for one reply per rank, failing as soon as a worker dies or raises, or when
        ``timeout_s`` (None: no limit) passes without every reply."""
        results: list[Any] = [None] * len(self._conns)
        pending = dict(enumerate(self._conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(
                [*pending.values(), *sentinels], timeout=remaining
            )
            if not ready:
                self._fail(
                    f"worker rank(s) {', '.join(map(str, pending))} stopped answering: no reply "
                    f"to {method} within {timeout_s:.0f} s"
                )
            # Replies first: a worker may reply and exit before the driver looks.
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        self._fail(_death_message(rank, self._procs[rank], method))
                    if status == "error":
                        others = {r: c for r, c in pending.items() if r != rank}
                        self._fail(self._failure_message(rank, value, method, others))
                    results[rank] = value
                    del pending[rank]
            for sentinel, rank in sentinels.items():
                if sentinel in ready and rank in pending:
                    self._fail(_death_message(rank, self._procs[rank], method))
        return results

    def _failure_message(
        self,
        rank: int,
        error: str,
        method: str,
        others: dict[int, multiprocessing.connection.Connection],
    ) -> str:
        """What failed, when rank ``rank`` raised ``error``: a peer's death surfaces in the
        survivors as a collective error ("connection reset"), a silent peer as a collective
        timeout, so a dead rank (the root cause) is named first, else the ranks still silent
        ``_ROOT_CAUSE_GRACE_S`` later beside the error."""
        dead = self._dead_worker_message(method)
        if dead is None and others:
            ready = multiprocessing.connection.wait(
                list(others.values()), timeout=_ROOT_CAUSE_GRACE_S
            )
            dead = self._dead_worker_message(method)
            silent = [r for r, conn in others.items() if conn not in ready]
            if dead is None and silent:
                return (
                    f"worker rank {rank} failed during {method}; rank(s) "
                    f"{', '.join(map(str, silent))} had not answered {_ROOT_CAUSE_GRACE_S:.0f} s "
                    f"later (stopped, or waiting on a collective with rank {rank}):\n{error}"
                )
        return dead or f"worker rank {rank} failed during {method}:\n{error}"

    def _dead_worker_message(self, method: str) -> str | None:
        """The death message of the first worker process that has exited, if any."""
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                return _death_message(rank, proc, method)
        return None

    def _fail(self, message: str) -> None:
        """Record the failure, stop every worker, raise."""
        if self._failure is None:
            self._failure = f"{message}\nThe engine is shut down."
            logger.error("%s", self._failure)
        # Killed, not asked: the survivors may be blocked in a collective with the dead rank.
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self._finalizer()
        raise EngineDeadError(self._failure)


def _death_message(rank: int, proc: multiprocessing.process.BaseProcess, method: str) -> str:
    proc.join(timeout=1.0)
    return f"worker rank {rank} (pid {proc.pid}) died during {method} (exit code {proc.exitcode})"


def _stop_workers(
    procs: list[multiprocessing.process.BaseProcess],
    conns: list[multiprocessing.connection.Connection],
) -> None:
    """Ask every worker to exit, then terminate the ones that do not."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
        conn.close()
    for proc in procs:
        proc.join(timeout=_SHUTDOWN_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _worker_main(
    config: WorkerConfig, rank: int, init_method: str, conn: multiprocessing.connection.Connection
) -> None:
    """A worker process: build the rank's shard, then serve calls until told to stop."""
    try:
        worker = Worker(config, rank, init_method)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    freeze_startup_heap()
    conn.send(("ok", None))
    try:
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the driver is gone
            if message is None:
                return
            method, args, reply_rank = message
            try:
                result = getattr(worker, method)(*args)
            except Exception:
                conn.send(("error", traceback.format_exc()))
                continue
            conn.send(("ok", result if reply_rank in (None, rank) else None))
    finally:
        destroy_distributed_environment()
