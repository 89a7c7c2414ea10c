"""Iteration-level scheduling with chunked prefill and recompute preemption (vLLM V1 style).

Each step spends a token budget (``max_num_batched_tokens``) and a sequence budget
(``max_num_seqs``): running requests first, in admission order, then waiting ones. A request is
``num_computed_tokens`` chasing ``num_tokens``, so prefill, chunked prefill, decode and resumption
after preemption are one rule: schedule ``min(remaining, budget)`` tokens. When the KV cache has
no block left for a running request, the most recently admitted running request is preempted:
its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
(Orca, Yu et al. 2022, for iteration-level batching; vLLM's recompute preemption).

With the ``priority`` policy (vLLM's ``--scheduling-policy priority``) both queues are kept in
the order of ``(priority, arrival_time)``, lower first: waiting requests are admitted in that
order, running ones are served in it, and the preempted one is the last, the lowest priority
that arrived latest.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.scheduler_output import RequestDelta, ScheduledRequest, SchedulerOutput
from kvpilot.engine.spec_decode.metrics import SpecDecodingStats
from kvpilot.engine.stats import SchedulerStats


class Scheduler:
    """Decides, every step, which requests compute how many tokens.

    Args:
        config: token and sequence budgets.
        kv_cache_manager: allocates the requests' blocks.
        num_lookahead_tokens: slots reserved past a sampling request's tokens for a draft
            model's proposals (speculative decoding; 0 otherwise).
        policy: ``fcfs`` (arrival order) or ``priority`` (``Request.priority``, then arrival).

    Speculative decoding: a request whose ``spec_token_ids`` hold drafts and whose real tokens
    all fit this step also gets its drafts scheduled (they take budget and KV slots like any
    token); ``update_from_output`` keeps the accepted ones and rolls the rest back.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        num_lookahead_tokens: int = 0,
        policy: str = "fcfs",
    ) -> None:
        self.config = config
        self.policy = policy
        self.kv_cache_manager = kv_cache_manager
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_decoding_stats = SpecDecodingStats()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self.num_preemptions_total = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0

    def add_request(self, request: Request) -> None:
        """Queue a request; it is considered from the next ``schedule()`` on.

        Raises:
            ValueError: when its id is already in use by an unfinished request.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if self.policy == "priority":
            bisect.insort_right(self.waiting, request, key=_priority)
        else:
            self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        """Build this step's batch; allocates blocks, preempting when they run out."""
        cfg = self.config
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = cfg.max_num_batched_tokens
        now = time.time()
        if self.policy == "priority":
            # Served in priority order, so that the last one (the preemption victim) is the
            # lowest priority, and never one already scheduled this step.
            self.running.sort(key=_priority)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            spec = self._schedulable_drafts(request, num_new, budget - num_new)
            lookahead = self._lookahead(request, request.num_computed_tokens, num_new)
            while (
                self.kv_cache_manager.allocate_slots(
                    request, num_new + len(spec), num_lookahead_tokens=lookahead
                )
                is None
            ):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                num_new += len(spec)
                self._add_scheduled(out, request, request.num_computed_tokens, num_new, spec)
                budget -= num_new
                index += 1
                continue
            break

        # Admitting new work right after a preemption would only preempt again.
        skipped: deque[Request] = deque()
        while (
            self.waiting
            and budget > 0
            and len(self.running) < cfg.max_num_seqs
            and not out.preempted_request_ids
        ):
            request = self.waiting[0]
            if not self._lora_fits(request):
                # Its adapter would exceed max_loras: later requests may still fit (vLLM).
                skipped.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            remaining = request.num_tokens - num_hit_tokens
            if not cfg.enable_chunked_prefill and remaining > budget:
                break
            num_new = self._num_new_tokens(request, num_hit_tokens, budget)
            lookahead = self._lookahead(request, num_hit_tokens, num_new)
            if (
                self.kv_cache_manager.allocate_slots(
                    request, num_new, hits, num_hit_tokens, num_lookahead_tokens=lookahead
                )
                is None
            ):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if not request.needs_prompt_logprobs:
                # A request scoring its prompt skips the lookup; vLLM does not count it.
                self.prefix_cache_queries_total += request.num_tokens
                self.prefix_cache_hits_total += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.times.first_scheduled_time is None:
                request.times.first_scheduled_time = now
            self.running.append(request)
            self._add_scheduled(out, request, num_hit_tokens, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return out

    def _lora_fits(self, request: Request) -> bool:
        """Whether running ``request`` keeps the running adapters within ``max_loras``."""
        if request.lora_name is None or not self.config.max_loras:
            return True
        active = {r.lora_name for r in self.running if r.lora_name is not None}
        return request.lora_name in active or len(active) < self.config.max_loras

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        if self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def _schedulable_drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafts that follow its real tokens this step: none unless all its
        real tokens are scheduled, at most ``budget``, and never more than the tokens it may
        still emit after the one the target samples anyway."""
        if request.num_computed_tokens + num_new < request.num_tokens:
            return []
        limit = min(budget, request.max_tokens - request.num_output_tokens - 1)
        return request.spec_token_ids[: max(limit, 0)]

    def _lookahead(self, request: Request, num_computed: int, num_new: int) -> int:
        """Slots to reserve for a draft model's proposals: only when a token is due."""
        return self.num_lookahead_tokens if num_computed + num_new >= request.num_tokens else 0

    def _add_scheduled(
        self,
        out: SchedulerOutput,
        request: Request,
        num_computed: int,
        num_new: int,
        spec_token_ids: list[int] | None = None,
    ) -> None:
        spec_token_ids = spec_token_ids or []
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                num_computed_tokens=num_computed,
                num_new_tokens=num_new,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                sample=num_computed + num_new - len(spec_token_ids) == request.num_tokens,
                spec_token_ids=list(spec_token_ids),
            )
        )
        out.num_scheduled_tokens += num_new

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if self.policy == "priority":
            bisect.insort_left(self.waiting, request, key=_priority)
        else:
            self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, int | list[int]]
    ) -> list[RequestDelta]:
        """Advance the scheduled requests after the forward pass.

        With draft tokens, the tokens of a request are its accepted drafts followed by one
        token from the target; the rejected drafts' slots roll back (``num_computed_tokens``
        and the block table shrink). Tokens after one that finishes the request (EOS, a stop
        token id, ``max_tokens``) are dropped.

        Args:
            scheduler_output: the step that ran.
            sampled_token_ids: request id -> the token (or tokens, with drafts) sampled for it
                (requests with ``sample`` set).

        Returns:
            What each request that got tokens this step got (finished ones included, blocks
            freed), in batch order.
        """
        now = time.time()
        deltas = []
        for sched in scheduler_output.scheduled:
            request = sched.request
            if not sched.sample:
                request.num_computed_tokens += sched.num_new_tokens
                continue
            token_ids = sampled_token_ids[request.request_id]
            token_ids = [token_ids] if isinstance(token_ids, int) else token_ids
            num_drafts = len(sched.spec_token_ids)
            num_rejected = num_drafts + 1 - len(token_ids)
            request.num_computed_tokens += sched.num_new_tokens - num_rejected
            request.spec_token_ids = []
            if num_drafts:
                self.spec_decoding_stats.observe(num_drafts, len(token_ids) - 1)
            before = request.num_output_tokens
            for token_id in token_ids:
                request.append_output_token(token_id)
                if request.check_stop():
                    break
            if request.times.first_token_time is None:
                request.times.first_token_time = now
            request.times.last_token_time = now
            if request.is_finished:
                self._remove_finished(request, now)
            elif num_rejected:
                self.kv_cache_manager.free_tail(
                    request, request.num_tokens + self.num_lookahead_tokens
                )
            deltas.append(RequestDelta(request, before, request.output_token_ids[before:]))
        return deltas

    def stop_request(self, request: Request, num_output_tokens: int, stop_reason: str) -> None:
        """Stop a sequence at a stop string: keep its first ``num_output_tokens`` output tokens,
        finish it (``finish_reason`` "stop", ``stop_reason`` the string), free its blocks.

        A sequence that the same token already finished (a length limit) is finished again as
        stopped: the stop string wins, as in vLLM.
        """
        request.truncate_output(num_output_tokens)
        if request.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop_reason
        else:
            self.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED, stop_reason)

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the queues, the KV cache and the scheduler's counters."""
        pool = self.kv_cache_manager.block_pool
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=pool.get_usage(),
            num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.get_num_free_blocks(),
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries_total=self.prefix_cache_queries_total,
            prefix_cache_hits_total=self.prefix_cache_hits_total,
            running_lora_adapters=_lora_names(self.running),
            waiting_lora_adapters=_lora_names(self.waiting),
        )

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus,
        stop_reason: str | None = None,
    ) -> None:
        """Finish unfinished requests (stop string matched, or aborted); frees their blocks now.

        Unknown or already finished ids are ignored.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        now = time.time()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            request.stop_reason = stop_reason
            self._remove_finished(request, now, dequeued=True)

    def _remove_finished(self, request: Request, now: float, dequeued: bool = False) -> None:
        if not dequeued:
            self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.times.finished_time = now
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)


def _priority(request: Request) -> tuple[int, float]:
    """The ``priority`` policy's order: lower ``priority`` first, then earlier arrival."""
    return request.priority, request.arrival_time


def _lora_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))
