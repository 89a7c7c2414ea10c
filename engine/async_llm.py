"""AsyncLLM: the engine behind an asyncio server (vLLM V1's ``AsyncLLM``).

It reaches the engine through an engine-core client (``engine.core_client``): the engine on
a worker thread of this process (``InprocClient``), or in a process of its own
(``MPClient``, what ``kvpilot serve`` uses). Either way the engine steps whenever requests are
unfinished and each step's ``RequestOutput``s reach here, where each goes to the queue of the
request it belongs to. A request added during a step joins the batch at the next step
(continuous batching). A consumer that stops reading (a client that disconnected) aborts its
request, which frees its KV blocks before the next step. Compiling a structured-output
grammar (seconds for a large schema) runs beside the steps, not between them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from kvpilot.engine.core_client import EngineCoreClient, InprocClient
from kvpilot.engine.engine_core import EngineCoreRequest, EngineDeadError
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


class EngineShutdownError(EngineError):
    """The request was aborted because the server is shutting down (``abort_all``); the API
    answers 503, as for a server that is unavailable, not 500."""


class StatLogger(Protocol):
    """Receives what the engine loop observes (implemented by ``engine.metrics``)."""

    def record_step(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None:
        """Called after every step with its outputs, fresh stats and the time (seconds)."""

    def record_stats(self, stats: EngineStats) -> None:
        """Called when the engine state changed outside a step (a request added or aborted)."""

    def record_abort(self, request_id: str, num_sequences: int = 1) -> None:
        """Called when a request is aborted because its consumer went away (``num_sequences``:
        its ``n``)."""


@dataclass
class _Tracked:
    queue: asyncio.Queue[RequestOutput | BaseException]
    finished: bool = False
    num_sequences: int = 1  # the request's n


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
    """Serves one engine core to many concurrent asyncio consumers.

    Args:
        client: an engine-core client (``engine.core_client``), or a loaded ``LLMEngine``,
            served in this process (``InprocClient``).
        max_waiting_requests: the most requests allowed to wait for their first scheduling
            beyond the free sequence slots (``num_queued``); ``add_request`` raises
            ``QueueFullError`` beyond it. None: unbounded.
        stat_loggers: observers of every step (Prometheus metrics).

    Call ``start()`` from the event loop before adding requests and ``shutdown()`` at the end.
    """

    def __init__(
        self,
        client: EngineCoreClient | Any,
        max_waiting_requests: int | None = None,
        stat_loggers: Iterable[StatLogger] = (),
    ) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        is_engine = hasattr(client, "step")
        self.client: EngineCoreClient = InprocClient(client) if is_engine else client
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers = list(stat_loggers)
        self._requests: dict[str, _Tracked] = {}
        self._num_adding = 0
        self.stats: EngineStats = self.client.info.stats
        self.num_steps = 0
        # Set when the engine cannot run another step (a tensor-parallel worker or the
        # engine-core process died): new requests are refused and /health reports it.
        self.dead_error: EngineDeadError | None = None

    def start(self) -> None:
        """Start serving on the running event loop."""
        self.client.start(self._on_step, self._on_failure)

    async def shutdown(self) -> None:
        """Abort and end every open stream, then shut the engine core down."""
        await self.abort_all("the server is shutting down")
        await self.client.shutdown(engine_dead=self.dead_error is not None)

    async def abort_all(self, message: str) -> int:
        """Abort every request in flight in the engine (the server is shutting down) and end
        its stream with ``EngineShutdownError(message)``; returns how many there were. Requests
        added later are served as usual."""
        open_requests = dict(self._requests)
        self._requests.clear()
        if self.dead_error is None and open_requests:
            try:
                self._keep_stats(await self.client.abort(list(open_requests)))
            except EngineDeadError:
                pass
            self._notify_stats()
        for tracked in open_requests.values():
            tracked.queue.put_nowait(EngineShutdownError(message))
        return len(open_requests)

    @property
    def is_running(self) -> bool:
        return self.client.is_running

    async def add_request(
        self,
        request_id: str,
        prompt: str | dict[str, Any],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Hand a request to the engine; return its output stream once the engine accepted it.
        ``priority``: lower is served first under the ``priority`` scheduling policy.

        Raises:
            QueueFullError: ``max_waiting_requests`` requests are already waiting.
            ValueError: the engine rejected the request (empty or too long prompt, duplicate
                id, an adapter it cannot load); the message names the problem.
            EngineError: the engine is not running.
        """
        if self.dead_error is not None:
            raise EngineError(f"the engine is dead: {self.dead_error}")
        if not self.is_running:
            raise EngineError("the engine loop is not running")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.max_waiting_requests is not None and self.num_queued() >= self.max_waiting_requests:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_waiting_requests} requests); retry later"
            )
        tracked = _Tracked(asyncio.Queue(), num_sequences=params.n)
        self._requests[request_id] = tracked
        arrival_time = time.time() if arrival_time is None else arrival_time
        self._num_adding += 1
        try:
            stats = await self.client.add_request(
                EngineCoreRequest(
                    request_id, prompt, params, arrival_time, cache_salt, lora_request, priority
                )
            )
        except asyncio.CancelledError:
            # The caller went away while the add was queued behind a step: undo it.
            tracked.finished = True
            self.abort(request_id)
            raise
        except EngineDeadError as exc:
            self._requests.pop(request_id, None)
            raise EngineError(f"the engine is dead: {exc}") from None
        except BaseException:
            self._requests.pop(request_id, None)
            raise
        finally:
            self._num_adding -= 1
        self._keep_stats(stats)
        self._notify_stats()
        return RequestStream(self, request_id, tracked)

    def num_queued(self) -> int:
        """Sequences that will still wait after the next step has filled its free slots:
        those waiting (or being added) beyond ``max_num_seqs`` minus the running ones. A burst
        that fits the free slots is not a queue, so it is not refused."""
        free_slots = max(self.client.info.max_num_seqs - self.stats.num_running_reqs, 0)
        return max(self.stats.num_waiting_reqs + self._num_adding - free_slots, 0)

    async def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a structured-output constraint beside the steps (not between them) into the
        engine's cache, where ``add_request`` then finds it (a request added without this
        compiles between two steps and delays the second).

        Raises:
            ValueError: ``structured_outputs: ...`` naming what is invalid.
        """
        await self.client.call("compile_grammar", params)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter between steps (``LLMEngine.add_lora``).

        Raises:
            ValueError: LoRA is off, or the adapter cannot be loaded.
        """
        return await self.client.call("add_lora", lora_request)

    async def remove_lora(self, lora_name: str) -> bool:
        """Unregister a LoRA adapter between steps (``LLMEngine.remove_lora``).

        Raises:
            ValueError: LoRA is off, or unfinished requests use the adapter.
        """
        return await self.client.call("remove_lora", lora_name)

    async def generate(
        self,
        prompt: str | dict[str, Any],
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's ``AsyncLLM.generate``: add the request and yield its outputs until finished."""
        async with await self.add_request(
            request_id, prompt, params, arrival_time, priority=priority
        ) as stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str) -> None:
        """Abort a request (its KV blocks are freed before the next step); unknown ids are
        ignored. Safe to call from synchronous code on the event loop thread."""
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        for logger_ in self.stat_loggers:
            logger_.record_abort(request_id, tracked.num_sequences)
        self.client.abort([request_id]).add_done_callback(self._on_abort_done)

    def _on_abort_done(self, future: asyncio.Future[EngineStats]) -> None:
        if future.cancelled():
            return
        if future.exception() is not None:
            if not isinstance(future.exception(), EngineDeadError):
                logger.error("abort failed: %s", future.exception())
            return
        self._keep_stats(future.result())
        self._notify_stats()

    def _keep_stats(self, stats: EngineStats) -> None:
        """Keep ``stats`` unless a later snapshot is held already: the reply to an add can
        arrive after the outputs of the step that finished the request."""
        if stats.snapshot >= self.stats.snapshot:
            self.stats = stats

    def _notify_stats(self) -> None:
        for logger_ in self.stat_loggers:
            logger_.record_stats(self.stats)

    async def kv_events(self, since: int) -> KVEventBatch:
        """The engine's KV events numbered ``since`` and later, read between steps (the engine
        owns the block pool)."""
        return await self.client.call("get_kv_events", since)

    async def check_health(self) -> None:
        """Return when the engine can serve; raise ``EngineDeadError`` naming the cause if not.

        Asks the engine (every tensor-parallel worker alive) unless a step already found it dead.
        """
        if self.dead_error is not None:
            raise self.dead_error
        await self.client.call("check_health")

    def _on_step(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self.num_steps += 1
        self._keep_stats(stats)
        now = time.time()
        # Outputs of requests aborted while the step ran were counted as aborted already (the
        # engine-core process's client drops them itself).
        observed = [output for output in outputs if output.request_id in self._requests]
        for logger_ in self.stat_loggers:
            logger_.record_step(observed, self.stats, now)
        for output in outputs:
            tracked = self._requests.get(output.request_id)
            if tracked is None:
                continue  # aborted while the step ran
            tracked.queue.put_nowait(output)
            if output.finished:
                del self._requests[output.request_id]

    def _on_failure(self, exc: Exception, stats: EngineStats | None) -> None:
        """A step failed (its requests are aborted in the engine already) or the engine core
        died: end every request in flight with the error; new requests are still served
        unless the engine is dead."""
        logger.error(
            "engine step failed (%s: %s); ending %d requests",
            type(exc).__name__,
            exc,
            len(self._requests),
        )
        if isinstance(exc, EngineDeadError):
            self.dead_error = exc
        failed = dict(self._requests)
        self._requests.clear()
        if stats is not None:
            self._keep_stats(stats)
        self._notify_stats()
        if failed and self.dead_error is None:
            # Those the engine took after the failed step's aborts were not aborted there.
            self.client.abort(list(failed)).add_done_callback(self._on_abort_done)
        for tracked in failed.values():
            tracked.queue.put_nowait(
                EngineError(f"engine step failed: {type(exc).__name__}: {exc}")
            )
