"""Engine-core clients: how ``AsyncLLM`` reaches the engine (vLLM V1's ``EngineCoreClient``).

Two clients, one interface (:class:`EngineCoreClient`):

- :class:`InprocClient`: the engine in this process; every engine call, steps included, runs on
  one worker thread (never two at once), driven by a task on the event loop. Tests, offline
  tools and ``kvpilot serve --no-engine-core-process`` use it.
- :class:`MPClient`: the engine in a process of its own (``engine.core_proc``), which steps
  on its own and sends outputs as they come; this process only sends calls and reads outputs,
  each on a thread of its own so that the event loop never blocks on the pipe. What
  ``kvpilot serve`` uses by default, as vLLM V1 does.

Both deliver each step's outputs and stats to ``on_step`` and a failed step to ``on_failure``
(its requests already aborted in the engine), on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.util
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from kvpilot.engine import engine_core
from kvpilot.engine.engine_core import EngineDeadError
from kvpilot.engine.output_delta import OutputDeltaDecoder
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.stats import EngineStats

logger = logging.getLogger(__name__)

OnStep = Callable[[list[RequestOutput], EngineStats], None]
OnFailure = Callable[[Exception, EngineStats | None], None]

# How long a stopping engine-core process gets to shut its engine down (seconds).
SHUTDOWN_TIMEOUT_S = 30.0


class EngineCoreClient(Protocol):
    """What ``AsyncLLM`` needs of an engine core; all methods are called on the event loop."""

    info: engine_core.EngineCoreInfo

    def start(self, on_step: OnStep, on_failure: OnFailure) -> None:
        """Start delivering outputs (from the running event loop)."""

    @property
    def is_running(self) -> bool:
        """Whether outputs are being delivered (started and not shut down or dead)."""

    async def add_request(self, request: engine_core.EngineCoreRequest) -> EngineStats:
        """Add a request; the engine's stats after it. Raises the engine's ``ValueError``."""

    def abort(self, request_ids: list[str]) -> asyncio.Future[EngineStats]:
        """Abort requests (their later outputs are dropped); a future of the stats after."""

    async def call(self, name: str, *args: Any) -> Any:
        """Run ``engine_core.CALLS[name]`` on the engine; its result or its exception."""

    async def shutdown(self, engine_dead: bool) -> None:
        """Stop delivering and shut the engine down (not a dead one, which may hang)."""


class InprocClient:
    """The engine in this process, on one worker thread (see the module docstring).

    Args:
        engine: a loaded ``LLMEngine``.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        info = engine_core.EngineCoreInfo.from_engine(engine)
        # A tokenizer of the API's own: the engine's is busy on the engine thread.
        self.info = dataclasses.replace(info, tokenizer=copy.deepcopy(engine.tokenizer))
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, on_step: OnStep, on_failure: OnFailure) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(on_step, on_failure), name="engine-loop"
            )

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def add_request(self, request: engine_core.EngineCoreRequest) -> EngineStats:
        stats = await self._on_engine_thread(engine_core.add_request, request)
        self._work.set()
        return stats

    def abort(self, request_ids: list[str]) -> asyncio.Future[EngineStats]:
        return asyncio.get_running_loop().run_in_executor(
            self._executor, engine_core.abort, self.engine, request_ids
        )

    async def call(self, name: str, *args: Any) -> Any:
        function = engine_core.CALLS[name]
        if name in engine_core.CONCURRENT_CALLS:
            return await asyncio.to_thread(function, self.engine, *args)
        return await self._on_engine_thread(function, *args)

    async def shutdown(self, engine_dead: bool) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if not engine_dead:
            await self._on_engine_thread(lambda engine: engine.shutdown())
        self._executor.shutdown(wait=True)

    async def _on_engine_thread(self, function: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, function, self.engine, *args
        )

    async def _run(self, on_step: OnStep, on_failure: OnFailure) -> None:
        has_unfinished = type(self.engine).has_unfinished_requests
        while True:
            await self._work.wait()
            self._work.clear()
            while await self._on_engine_thread(has_unfinished):
                try:
                    outputs, stats = await self._on_engine_thread(engine_core.step)
                except Exception as exc:
                    logger.exception("engine step failed; aborting every unfinished request")
                    on_failure(exc, await self._abort_all())
                    break
                on_step(outputs, stats)

    async def _abort_all(self) -> EngineStats | None:
        try:
            await self._on_engine_thread(engine_core.abort_all)
            return await self._on_engine_thread(lambda engine: engine.get_stats())
        except Exception:
            logger.exception("aborting the failed requests failed too")
            return None


class MPClient:
    """The engine in a process of its own (``engine.core_proc``; see the module docstring).

    ``MPClient(engine_args)`` starts the process and blocks until the engine is loaded (call it
    off the event loop).

    Args:
        engine_args: the ``EngineArgs`` to load the engine from (pickled to the process).
        log_config: the process's logging configuration (``--log-config-file``, a
            ``logging.config.dictConfig`` dict), as the API process's; None: INFO to stderr.

    Raises:
        Whatever loading raised in the engine-core process (``FileNotFoundError``,
        ``ValueError``, ...), or ``RuntimeError`` when the process died while loading.
    """

    def __init__(self, engine_args: Any, log_config: dict[str, Any] | None = None) -> None:
        from kvpilot.engine.core_proc import run_engine_core

        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        # Not daemonic: the engine core starts processes of its own (tensor-parallel workers).
        self._process = context.Process(
            target=run_engine_core,
            args=(engine_args, child_conn, log_config),
            name="kvpilot-engine-core",
            daemon=False,
        )
        self._process.start()
        child_conn.close()
        # Closed at interpreter exit before multiprocessing joins its children, so that an
        # engine core never outlives a server that exited without shutting it down.
        multiprocessing.util.Finalize(self, self._conn.close, exitpriority=10)
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(
                f"the engine-core process exited while loading (exit code {self._process.exitcode})"
            ) from None
        if kind == "load_failed":
            self._process.join()
            raise value
        self.info: engine_core.EngineCoreInfo = value
        self._decoder = OutputDeltaDecoder()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: EngineDeadError | None = None
        self._closing = False
        # Both the receiving thread and shutdown wait for the process; two threads reaping it at
        # once race in waitpid, and the loser sees a live process that is gone.
        self._join_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The engine-core process's id."""
        return self._process.pid

    def start(self, on_step: OnStep, on_failure: OnFailure) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._on_step, self._on_failure = on_step, on_failure
        threading.Thread(target=self._send_loop, name="core-send", daemon=True).start()
        threading.Thread(target=self._receive_loop, name="core-receive", daemon=True).start()

    @property
    def is_running(self) -> bool:
        return self._loop is not None and self._dead is None and not self._closing

    async def add_request(self, request: engine_core.EngineCoreRequest) -> EngineStats:
        self._decoder.add(request.request_id)
        try:
            return await self.call("add_request", request)
        except BaseException:
            self._decoder.forget(request.request_id)
            raise

    def abort(self, request_ids: list[str]) -> asyncio.Future[EngineStats]:
        for request_id in request_ids:
            self._decoder.forget(request_id)
        return self._submit("abort", list(request_ids))

    async def call(self, name: str, *args: Any) -> Any:
        return await self._submit(name, *args)

    async def shutdown(self, engine_dead: bool) -> None:
        if self._closing:
            return
        self._closing = True
        self._outbox.put(("shutdown",))
        self._outbox.put(None)
        await asyncio.to_thread(self._stop_process)

    def _submit(self, name: str, *args: Any) -> asyncio.Future[Any]:
        future = asyncio.get_running_loop().create_future()
        if self._dead is not None or self._closing:
            future.set_exception(self._dead or EngineDeadError("the engine core is shutting down"))
            return future
        call_id = next(self._call_ids)
        self._pending[call_id] = future
        self._outbox.put(("call", call_id, name, args))
        return future

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                return  # the process is gone; the receiving thread reports it

    def _receive_loop(self) -> None:
        assert self._loop is not None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if not self._call_on_loop(self._dispatch, message):
                return
        self._join_process()
        self._call_on_loop(self._on_exit, self._process.exitcode)

    def _call_on_loop(self, function: Callable[..., None], *args: Any) -> bool:
        """Run ``function(*args)`` on the event loop; False when the loop is closed."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:
            return False
        return True

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "reply":
            _, call_id, ok, value = message
            future = self._pending.pop(call_id, None)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
        elif kind == "outputs":
            _, deltas, stats = message
            self._on_step(self._decoder.decode(deltas), stats)
        elif kind == "step_failed":
            _, exc, stats = message
            self._on_failure(exc, stats)

    def _on_exit(self, exitcode: int | None) -> None:
        if self._closing:
            dead = EngineDeadError("the engine core was shut down")
        else:
            dead = EngineDeadError(f"the engine-core process exited (exit code {exitcode})")
            logger.error("%s", dead)
        self._dead = dead
        for future in self._pending.values():
            if not future.done():
                future.set_exception(dead)
        self._pending.clear()
        if not self._closing:
            self._on_failure(dead, None)

    def _join_process(self, timeout: float | None = SHUTDOWN_TIMEOUT_S) -> None:
        with self._join_lock:
            self._process.join(timeout)

    def _stop_process(self) -> None:
        self._join_process()
        if self._process.is_alive():
            logger.warning("the engine-core process did not stop; killing it")
            self._process.kill()
            self._join_process(timeout=None)
