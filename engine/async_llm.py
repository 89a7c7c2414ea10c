"""AsyncLLM: the engine behind an asyncio server (vLLM V1's ``AsyncLLM``, in one process).

One background task drives the engine: whenever requests are unfinished it runs
``LLMEngine.step()`` and hands each ``RequestOutput`` to the queue of the request it belongs to.
Every engine call (add, step, abort, stats) runs on one dedicated worker thread, so the engine
is never touched by two threads at once and the event loop stays free to serve HTTP while a step
computes. A request added during a step is queued behind it on that thread and joins the batch
at the next step (continuous batching). A consumer that stops reading (a client that
disconnected) aborts its request, which frees its KV blocks before the next step. The one
exception is compiling a structured-output grammar (thread-safe, seconds for a large schema):
it runs on another worker thread, so that it neither blocks the loop nor delays a step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from kvpilot.engine.executor.abstract import EngineDeadError
from kvpilot.engine.kv_events import KVEventBatch
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvpilot.engine.stats import EngineStats

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue already holds ``max_waiting_requests`` requests (HTTP 503)."""


class EngineError(RuntimeError):
    """The request could not finish: a step failed (every request in flight gets this error,
    the loop goes on serving new ones), or the server is shutting down."""


class StatLogger(Protocol):
    """Receives what the engine loop observes (implemented by ``engine.metrics``)."""

    def record_step(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None:
        """Called after every step with its outputs, fresh stats and the time (seconds)."""

    def record_stats(self, stats: EngineStats) -> None:
        """Called when the engine state changed outside a step (a request added or aborted)."""

    def record_abort(self, request_id: str) -> None:
        """Called when a request is aborted because its consumer went away."""


@dataclass
class _Tracked:
    queue: asyncio.Queue[RequestOutput | BaseException]
    finished: bool = False


class RequestStream:
    """The outputs of one request, in order: ``async for output in stream`` (or ``anext``).

    Each item is the request's cumulative ``RequestOutput``; when the consumer falls behind,
    only the newest is returned (outputs are cumulative, so nothing is lost). Iteration ends
    after the output with ``finished=True``; an engine failure raises ``EngineError``.
    A consumer that stops early must ``close()`` the stream (or use ``async with``), which
    aborts the request; being cancelled while waiting for an output closes it too.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, tracked: _Tracked) -> None:
        self.request_id = request_id
        self._llm = llm
        self._tracked = tracked

    @property
    def finished(self) -> bool:
        return self._tracked.finished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._tracked.finished:
            raise StopAsyncIteration
        queue = self._tracked.queue
        try:
            item = await queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        while not queue.empty() and not isinstance(item, BaseException):
            item = queue.get_nowait()
        if isinstance(item, BaseException):
            self._tracked.finished = True
            raise item
        self._tracked.finished = item.finished
        return item

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self._tracked.finished:
            self._tracked.finished = True
            self._llm.abort(self.request_id)


class AsyncLLM:
    """Serves one ``LLMEngine`` to many concurrent asyncio consumers.

    Args:
        engine: an ``LLMEngine``: what is used of it is ``add_request``, ``step``,
            ``abort_request``, ``has_unfinished_requests``, ``get_stats`` and the thread-safe
            ``compile_grammar``.
        max_waiting_requests: the most requests allowed to wait for their first scheduling;
            ``add_request`` raises ``QueueFullError`` beyond it. None: unbounded.
        stat_loggers: observers of every step (Prometheus metrics).

    Call ``start()`` from the event loop before adding requests and ``shutdown()`` at the end.
    """

    def __init__(
        self,
        engine: Any,
        max_waiting_requests: int | None = None,
        stat_loggers: Iterable[StatLogger] = (),
    ) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers = list(stat_loggers)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._requests: dict[str, _Tracked] = {}
        self._num_adding = 0
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.stats: EngineStats = engine.get_stats()
        self.num_steps = 0
        # Set when a step fails with EngineDeadError (a tensor-parallel worker died): the engine
        # cannot run another step, so new requests are refused and /health reports it.
        self.dead_error: EngineDeadError | None = None

    def start(self) -> None:
        """Start the background loop on the running event loop."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run_loop(), name="engine-loop"
            )

    async def shutdown(self) -> None:
        """Stop the loop, abort and end every open stream, and release the worker thread."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        if self.dead_error is None:
            await self._call(self.engine.shutdown)
        open_requests = dict(self._requests)
        self._requests.clear()
        # Pending aborts run before this one (one worker thread, first in first out).
        self.stats = await self._call(_abort_and_stats, self.engine, list(open_requests))
        for tracked in open_requests.values():
            tracked.queue.put_nowait(EngineError("the server is shutting down"))
        self._executor.shutdown(wait=True)

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def add_request(
        self,
        request_id: str,
        prompt: str | dict[str, Any],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Hand a request to the engine; return its output stream once the engine accepted it.

        Raises:
            QueueFullError: ``max_waiting_requests`` requests are already waiting.
            ValueError: the engine rejected the request (empty or too long prompt, duplicate
                id, an adapter it cannot load); the message names the problem.
            EngineError: the loop is not running.
        """
        if self.dead_error is not None:
            raise EngineError(f"the engine is dead: {self.dead_error}")
        if not self.is_running:
            raise EngineError("the engine loop is not running")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if (
            self.max_waiting_requests is not None
            and self.stats.num_waiting_reqs + self._num_adding >= self.max_waiting_requests
        ):
            raise QueueFullError(
                f"the waiting queue is full ({self.max_waiting_requests} requests); retry later"
            )
        tracked = _Tracked(asyncio.Queue())
        self._requests[request_id] = tracked
        arrival_time = time.time() if arrival_time is None else arrival_time
        self._num_adding += 1
        try:
            self.stats = await self._call(
                _add_and_stats,
                self.engine,
                request_id,
                prompt,
                params,
                arrival_time,
                cache_salt,
                lora_request,
            )
        except asyncio.CancelledError:
            # The caller went away while the add was queued behind a step: undo it.
            tracked.finished = True
            self.abort(request_id)
            raise
        except BaseException:
            del self._requests[request_id]
            raise
        finally:
            self._num_adding -= 1
        self._notify_stats()
        self._work.set()
        return RequestStream(self, request_id, tracked)

    async def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a structured-output constraint on a worker thread, neither the event loop
        nor the engine thread, into the cache where ``add_request`` then finds it (a request
        added without this compiles on the engine thread and delays the step behind it).

        Raises:
            ValueError: ``structured_outputs: ...`` naming what is invalid.
        """
        await asyncio.to_thread(self.engine.compile_grammar, params)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter on the engine thread (``LLMEngine.add_lora``).

        Raises:
            ValueError: LoRA is off, or the adapter cannot be loaded.
        """
        return await self._call(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_name: str) -> bool:
        """Unregister a LoRA adapter on the engine thread (``LLMEngine.remove_lora``).

        Raises:
            ValueError: LoRA is off, or unfinished requests use the adapter.
        """
        return await self._call(self.engine.remove_lora, lora_name)

    async def generate(
        self,
        prompt: str | dict[str, Any],
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's ``AsyncLLM.generate``: add the request and yield its outputs until finished."""
        async with await self.add_request(request_id, prompt, params, arrival_time) as stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str) -> None:
        """Abort a request (its KV blocks are freed before the next step); unknown ids are
        ignored. Safe to call from synchronous code on the event loop thread."""
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        for logger_ in self.stat_loggers:
            logger_.record_abort(request_id)
        future = asyncio.get_running_loop().run_in_executor(
            self._executor, _abort_and_stats, self.engine, request_id
        )
        future.add_done_callback(self._on_abort_done)

    def _on_abort_done(self, future: asyncio.Future[EngineStats]) -> None:
        if future.cancelled():
            return
        if future.exception() is not None:
            logger.error("abort failed: %s", future.exception())
            return
        self.stats = future.result()
        self._notify_stats()

    def _notify_stats(self) -> None:
        for logger_ in self.stat_loggers:
            logger_.record_stats(self.stats)

    async def kv_events(self, since: int) -> KVEventBatch:
        """The engine's KV events numbered ``since`` and later, read on the engine thread (which
        owns the block pool), after the step in progress."""
        return await self._call(self.engine.get_kv_events, since)

    async def check_health(self) -> None:
        """Return when the engine can serve; raise ``EngineDeadError`` naming the cause if not.

        Asks the engine (every tensor-parallel worker alive) unless a step already found it dead.
        """
        if self.dead_error is not None:
            raise self.dead_error
        await self._call(self.engine.check_health)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _run_loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while await self._call(self.engine.has_unfinished_requests):
                try:
                    outputs, self.stats = await self._call(_step_and_stats, self.engine)
                except Exception as exc:
                    await self._fail_all(exc)
                    break
                self.num_steps += 1
                now = time.time()
                for logger_ in self.stat_loggers:
                    logger_.record_step(outputs, self.stats, now)
                self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            tracked = self._requests.get(output.request_id)
            if tracked is None:
                continue  # aborted while the step ran
            tracked.queue.put_nowait(output)
            if output.finished:
                del self._requests[output.request_id]

    async def _fail_all(self, exc: Exception) -> None:
        """A step raised: end every request in flight with the error, keep the loop alive."""
        logger.exception("engine step failed; ending %d requests", len(self._requests))
        if isinstance(exc, EngineDeadError):
            self.dead_error = exc
        failed = {request_id: self._requests.pop(request_id) for request_id in list(self._requests)}
        try:
            # Aborted before the consumers hear of it, so that they see a clean engine.
            self.stats = await self._call(_abort_and_stats, self.engine, list(failed))
        except Exception:
            logger.exception("aborting the failed requests failed too")
        self._notify_stats()
        for tracked in failed.values():
            tracked.queue.put_nowait(
                EngineError(f"engine step failed: {type(exc).__name__}: {exc}")
            )


def _add_and_stats(
    engine: Any,
    request_id: str,
    prompt: str | dict[str, Any],
    params: SamplingParams,
    arrival_time: float,
    cache_salt: str | None,
    lora_request: LoRARequest | None,
) -> EngineStats:
    engine.add_request(
        request_id,
        prompt,
        params,
        arrival_time=arrival_time,
        cache_salt=cache_salt,
        lora_request=lora_request,
    )
    return engine.get_stats()


def _step_and_stats(engine: Any) -> tuple[list[RequestOutput], EngineStats]:
    outputs = engine.step()
    return outputs, engine.get_stats()


def _abort_and_stats(engine: Any, request_ids: str | list[str]) -> EngineStats:
    engine.abort_request(request_ids)
    return engine.get_stats()
