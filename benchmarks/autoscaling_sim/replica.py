"""One engine replica, simulated step by step: continuous batching over a paged KV cache.

The model follows the kvpilot engine's scheduler (vLLM V1's): every step decodes one token for
each running request that finished its prefill and spends the rest of the
``max_num_batched_tokens`` budget on prefill chunks, oldest request first (chunked prefill);
a waiting request is admitted when a sequence slot is free and the KV cache holds its prompt;
when a step needs more KV than is free, the newest running request is preempted (its blocks
freed, recomputed later from the waiting queue's head). Time to first token is the end of the
step that finishes the prompt.

Step time is affine in the work, ``step_base + per_batch_token * tokens + per_context_token *
cached tokens`` (weights read once per step; matmul cost per scheduled token; attention reads of
the KV cache). Steps in which only decodes run and nothing can change the batch are advanced
in closed form, so an hour of traffic costs a few seconds.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from traces import Request


@dataclass(frozen=True)
class ReplicaModel:
    """What one replica can do.

    Attributes:
        kv_capacity_tokens: tokens the KV cache holds (from the planner).
        max_num_seqs: most running requests.
        max_num_batched_tokens: tokens per step (decode + prefill chunks).
        step_base: seconds per step regardless of work.
        per_batch_token: seconds per scheduled token.
        per_context_token: seconds per cached token attended to in a step.
        startup_seconds: pod start to ready (image present; weights loaded).
    """

    kv_capacity_tokens: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    step_base: float = 0.006
    per_batch_token: float = 35e-6
    per_context_token: float = 0.06e-6
    startup_seconds: float = 120.0

    def step_time(self, batch_tokens: int, context_tokens: int) -> float:
        return (
            self.step_base
            + self.per_batch_token * batch_tokens
            + self.per_context_token * context_tokens
        )


@dataclass(eq=False)
class _Running:
    request: Request
    seq: int
    prefill_target: int  # tokens to (re)compute before decoding: prompt, or prompt + output
    computed: int = 0
    join: int = 0  # decode-step counter when decoding started
    generated_at_join: int = 0
    epoch: int = 0  # bumped on preemption, so finish-heap entries of an earlier run go stale

    def generated(self, counter: int) -> int:
        return self.generated_at_join + counter - self.join

    def kv_tokens(self, counter: int) -> int:
        """KV held while decoding: the prefilled tokens plus one per decode step since."""
        return self.prefill_target + counter - self.join


@dataclass
class Replica:
    """A replica's queues and counters; :meth:`advance` runs it forward in time."""

    model: ReplicaModel
    time: float = 0.0
    waiting: deque[_Running] = field(default_factory=deque)
    prefilling: list[_Running] = field(default_factory=list)
    decoding: dict[int, _Running] = field(default_factory=dict)
    kv_used: int = 0
    counter: int = 0
    busy_seconds: float = 0.0
    preemptions: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    _finish_heap: list[tuple[int, int, int]] = field(default_factory=list)
    _seq: int = 0

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.model.kv_capacity_tokens

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    def add(self, request: Request) -> None:
        """Queue ``request`` (it arrives at the replica's current time)."""
        self._seq += 1
        self.waiting.append(_Running(request, self._seq, request.prompt_tokens))

    def advance(self, until: float) -> None:
        """Run steps until ``until`` (seconds); the last step may end a little after it."""
        while self.time < until:
            if self.idle:
                self.time = until
                return
            self._admit()
            if not self.prefilling and self.decoding and not self._admissible():
                self._decode_run(until)
            else:
                self._step()

    def _admissible(self) -> bool:
        if not self.waiting or self.num_running >= self.model.max_num_seqs:
            return False
        head = self.waiting[0]
        return self.kv_used + head.prefill_target <= self.model.kv_capacity_tokens

    def _admit(self) -> None:
        while self._admissible():
            entry = self.waiting.popleft()
            entry.computed = 0
            self.prefilling.append(entry)
        if self.waiting and not self.prefilling and not self.decoding:
            # A prompt larger than the whole cache can never run: drop it (the engine rejects
            # prompts over max_model_len up front; this guards the trace, not the policy).
            dropped = self.waiting.popleft()
            dropped.request.finished = math.inf

    def _step(self) -> None:
        budget = self.model.max_num_batched_tokens - len(self.decoding)
        chunks: list[tuple[_Running, int]] = []
        for entry in self.prefilling:
            if budget <= 0:
                break
            take = min(entry.prefill_target - entry.computed, budget)
            chunks.append((entry, take))
            budget -= take
        needed = len(self.decoding) + sum(take for _, take in chunks)
        if self.kv_used + needed > self.model.kv_capacity_tokens:
            self._preempt_newest()
            return
        dt = self.model.step_time(needed, self.kv_used)
        self.time += dt
        self.busy_seconds += dt
        self.counter += 1
        self.generated_tokens += len(self.decoding)
        self.kv_used += needed
        for entry, take in chunks:
            entry.computed += take
            self.prompt_tokens += take
            if entry.computed >= entry.prefill_target:
                self.prefilling.remove(entry)
                if entry.request.first_token is None:
                    entry.request.first_token = self.time
                    self.generated_tokens += 1
                entry.join = self.counter
                entry.generated_at_join = max(1, entry.prefill_target - entry.request.prompt_tokens)
                self._start_decoding(entry)
        self._finish_done()

    def _start_decoding(self, entry: _Running) -> None:
        self.decoding[entry.seq] = entry
        remaining = entry.request.output_tokens - entry.generated_at_join
        heapq.heappush(self._finish_heap, (self.counter + remaining, entry.seq, entry.epoch))

    def _decode_run(self, until: float) -> None:
        n = len(self.decoding)
        steps_to_finish = max(1, self._finish_heap[0][0] - self.counter)
        steps_to_full = (self.model.kv_capacity_tokens - self.kv_used) // n
        if steps_to_full < 1:
            self._preempt_newest()
            return
        first = self.model.step_time(n, self.kv_used)
        growth = self.model.per_context_token * n
        # Steps that fit before ``until``: k*first + growth*k(k-1)/2 <= until - time.
        budget = until - self.time
        if growth > 0:
            a, b = growth / 2, first - growth / 2
            steps_in_time = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
        else:
            steps_in_time = int(budget / first)
        k = max(1, min(steps_to_finish, steps_to_full, steps_in_time))
        dt = k * first + growth * k * (k - 1) / 2
        self.time += dt
        self.busy_seconds += dt
        self.counter += k
        self.generated_tokens += n * k
        self.kv_used += n * k
        self._finish_done()

    def _finish_done(self) -> None:
        while self._finish_heap and self._finish_heap[0][0] <= self.counter:
            _, seq, epoch = heapq.heappop(self._finish_heap)
            entry = self.decoding.get(seq)
            if entry is None or entry.epoch != epoch:
                continue  # preempted since: this heap entry is stale
            del self.decoding[seq]
            entry.request.finished = self.time
            self.kv_used -= entry.kv_tokens(self.counter)
            self.finished += 1

    def _preempt_newest(self) -> None:
        candidates = list(self.decoding.values()) + self.prefilling
        victim = max(candidates, key=lambda e: e.seq)
        if victim.seq in self.decoding:
            del self.decoding[victim.seq]
            self.kv_used -= victim.kv_tokens(self.counter)
            victim.prefill_target = victim.request.prompt_tokens + victim.generated(self.counter)
            victim.epoch += 1
        else:
            self.prefilling.remove(victim)
            self.kv_used -= victim.computed
        victim.computed = 0
        self.preemptions += 1
        self.waiting.appendleft(victim)
