"""Iteration-level scheduling with chunked prefill and recompute preemption (vLLM V1 style).

Each step spends a token budget (``max_num_batched_tokens``) and a sequence budget
(``max_num_seqs``): running requests first, in admission order, then waiting ones. A request is
``num_computed_tokens`` chasing ``num_tokens``, so prefill, chunked prefill, decode and resumption
after preemption are one rule: schedule ``min(remaining, budget)`` tokens. When the KV cache has
no block left for a running request, the most recently admitted running request is preempted:
its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
(Orca, Yu et al. 2022, for iteration-level batching; vLLM's recompute preemption).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.scheduler_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    """Decides, every step, which requests compute how many tokens.

    Args:
        config: token and sequence budgets.
        kv_cache_manager: allocates the requests' blocks.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
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
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        """Build this step's batch; allocates blocks, preempting when they run out."""
        cfg = self.config
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = cfg.max_num_batched_tokens
        now = time.time()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            while self.kv_cache_manager.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                self._add_scheduled(out, request, request.num_computed_tokens, num_new)
                budget -= num_new
                index += 1
                continue
            break

        # Admitting new work right after a preemption would only preempt again.
        while (
            self.waiting
            and budget > 0
            and len(self.running) < cfg.max_num_seqs
            and not out.preempted_request_ids
        ):
            request = self.waiting[0]
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            remaining = request.num_tokens - num_hit_tokens
            if not cfg.enable_chunked_prefill and remaining > budget:
                break
            num_new = self._num_new_tokens(request, num_hit_tokens, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, hits, num_hit_tokens) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            self.prefix_cache_queries_total += request.num_tokens
            self.prefix_cache_hits_total += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.times.first_scheduled_time is None:
                request.times.first_scheduled_time = now
            self.running.append(request)
            self._add_scheduled(out, request, num_hit_tokens, num_new)
            budget -= num_new
        return out

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        if self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def _add_scheduled(
        self, out: SchedulerOutput, request: Request, num_computed: int, num_new: int
    ) -> None:
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                num_computed_tokens=num_computed,
                num_new_tokens=num_new,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                sample=num_computed + num_new == request.num_tokens,
            )
        )
        out.num_scheduled_tokens += num_new

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Advance the scheduled requests after the forward pass.

        Args:
            scheduler_output: the step that ran.
            sampled_token_ids: request id -> the token sampled for it (requests with
                ``sample`` set).

        Returns:
            The requests that got a token this step (finished ones included, blocks freed).
        """
        now = time.time()
        updated = []
        for sched in scheduler_output.scheduled:
            request = sched.request
            request.num_computed_tokens += sched.num_new_tokens
            if not sched.sample:
                continue
            request.append_output_token(sampled_token_ids[request.request_id])
            if request.times.first_token_time is None:
                request.times.first_token_time = now
            request.times.last_token_time = now
            if request.check_stop():
                self._remove_finished(request, now)
            updated.append(request)
        return updated

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
