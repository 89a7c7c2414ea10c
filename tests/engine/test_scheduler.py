"""The scheduler with plain values: token budget, chunked prefill, preemption, finish/abort.

A fake model "samples" token ``100 + number of output tokens so far``, so every request's
output is known in advance and must come out the same whatever the scheduling.
"""

from __future__ import annotations

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import SchedulerOutput

BS = 4


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    chunked: bool = True,
    threshold: int = 0,
    caching: bool = True,
    policy: str = "fcfs",
) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BS, caching), policy=policy)


def make_request(
    request_id: str, prompt_len: int, max_tokens: int = 4, first: int = 0, **kwargs
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(first, first + prompt_len)),
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
        eos_token_ids=frozenset(),
        max_tokens=max_tokens,
        **kwargs,
    )


def fake_step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = {
        s.request.request_id: 100 + s.request.num_output_tokens for s in out.scheduled if s.sample
    }
    scheduler.update_from_output(out, sampled)
    return out


def run_all(scheduler: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    steps = []
    while scheduler.has_unfinished_requests():
        steps.append(fake_step(scheduler))
        assert len(steps) < max_steps, "scheduler made no progress"
    return steps


def assert_idle_without_leak(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert not scheduler.kv_cache_manager.req_to_blocks


def test_prefill_and_decode_share_a_step_within_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    a = make_request("a", 6)
    scheduler.add_request(a)
    first = fake_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens, s.sample) for s in first.scheduled] == [
        ("a", 6, True)
    ]
    b = make_request("b", 20, first=50)
    scheduler.add_request(b)
    second = fake_step(scheduler)
    # "a" decodes one token, "b" gets the other 15 of the budget: a partial chunk, no sample.
    assert [(s.request.request_id, s.num_new_tokens, s.sample) for s in second.scheduled] == [
        ("a", 1, True),
        ("b", 15, False),
    ]
    assert second.num_scheduled_tokens == 16
    assert b.num_computed_tokens == 15 and b.num_output_tokens == 0
    third = fake_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens, s.sample) for s in third.scheduled] == [
        ("a", 1, True),
        ("b", 5, True),
    ]
    run_all(scheduler)
    assert a.output_token_ids == [100, 101, 102, 103]
    assert b.output_token_ids == [100, 101, 102, 103]
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_idle_without_leak(scheduler)


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 3, first=10 * i))
    out = fake_step(scheduler)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert len(scheduler.waiting) == 3
    run_all(scheduler)
    assert_idle_without_leak(scheduler)


def test_long_prefill_token_threshold_caps_one_request_per_step():
    scheduler = make_scheduler(max_num_batched_tokens=64, threshold=8)
    scheduler.add_request(make_request("a", 20))
    chunks = [s.num_new_tokens for out in run_all(scheduler) for s in out.scheduled]
    assert chunks[:3] == [8, 8, 4]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10, chunked=False)
    scheduler.add_request(make_request("a", 6))
    fake_step(scheduler)
    scheduler.add_request(make_request("b", 10, first=40))
    out = fake_step(scheduler)
    # 9 tokens left after "a"'s decode: "b" (10) is not split, it waits for the next step.
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    out = fake_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1)]
    run_all(scheduler)
    assert_idle_without_leak(scheduler)


def test_preemption_recomputes_and_every_request_completes():
    # 6 blocks of 4 = 24 slots; three requests of 8 prompt + 8 output tokens need 45.
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64, caching=False)
    requests = [make_request(f"r{i}", 8, max_tokens=8, first=10 * i) for i in range(3)]
    for r in requests:
        scheduler.add_request(r)
    steps = run_all(scheduler)
    assert scheduler.num_preemptions_total > 0
    preempted = [rid for out in steps for rid in out.preempted_request_ids]
    # The most recently admitted request goes first.
    assert preempted[0] == "r2"
    for r in requests:
        assert r.output_token_ids == list(range(100, 108))
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_idle_without_leak(scheduler)


def test_preempted_request_goes_back_to_the_front_and_recomputes_its_outputs():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64, caching=False)
    a = make_request("a", 7, max_tokens=6)
    b = make_request("b", 7, max_tokens=6, first=30)
    c = make_request("c", 2, max_tokens=6, first=60)
    for r in (a, b, c):
        scheduler.add_request(r)
    fake_step(scheduler)  # a and b admitted (2 blocks each), c waits: no block left
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    assert fake_step(scheduler).preempted_request_ids == []  # position 7: still block 2
    out = fake_step(scheduler)  # both need a third block: b is preempted
    assert out.preempted_request_ids == ["b"]
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 2
    while b.status != RequestStatus.RUNNING:
        fake_step(scheduler)
    # On resumption b recomputes prompt and outputs so far in one chunk.
    run_all(scheduler)
    assert b.output_token_ids == list(range(100, 106))
    assert_idle_without_leak(scheduler)


def test_priority_policy_admits_serves_and_preempts_by_priority_then_arrival():
    """vLLM's priority scheduling: lower ``priority`` first, ties by arrival; the preempted
    request is the lowest priority that arrived latest, and it waits ahead of lower
    priorities only."""
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=2, policy="priority")
    low = make_request("low", 7, max_tokens=6, priority=5, arrival_time=1.0)
    high = make_request("high", 7, max_tokens=6, first=30, priority=-1, arrival_time=2.0)
    mid_late = make_request("mid-late", 2, max_tokens=6, first=60, priority=0, arrival_time=4.0)
    mid = make_request("mid", 2, max_tokens=6, first=70, priority=0, arrival_time=3.0)
    for r in (low, high, mid_late, mid):
        scheduler.add_request(r)
    assert [r.request_id for r in scheduler.waiting] == ["high", "mid", "mid-late", "low"]
    out = fake_step(scheduler)  # two slots: the two best, in order
    assert [s.request.request_id for s in out.scheduled] == ["high", "mid"]
    # high needs a third block while mid holds one; mid (priority 0) is preempted, not high.
    preempted = [rid for step in run_all(scheduler) for rid in step.preempted_request_ids]
    assert "high" not in preempted
    for r in (low, high, mid_late, mid):
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.output_token_ids == list(range(100, 106))
    # The first to finish is high, the last low: its turn came after both mids.
    assert high.times.finished_time <= mid.times.finished_time <= low.times.finished_time
    assert_idle_without_leak(scheduler)


def test_preempted_requests_wait_by_priority():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64, policy="priority")
    a = make_request("a", 7, max_tokens=6, priority=0, arrival_time=1.0)
    b = make_request("b", 7, max_tokens=6, first=30, priority=1, arrival_time=2.0)
    c = make_request("c", 2, max_tokens=6, first=60, priority=0, arrival_time=3.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    fake_step(scheduler)  # a and b admitted, two blocks each
    scheduler.add_request(c)
    fake_step(scheduler)  # c waits: no block left
    out = fake_step(scheduler)  # both need a third block: b, the lower priority, goes
    assert out.preempted_request_ids == ["b"]
    # c (priority 0) now waits ahead of the preempted b (priority 1), unlike fcfs.
    assert [r.request_id for r in scheduler.waiting] == ["c", "b"]
    run_all(scheduler)
    assert b.output_token_ids == list(range(100, 106))
    assert_idle_without_leak(scheduler)


def test_finish_and_abort_free_blocks_at_once():
    scheduler = make_scheduler()
    a, b, c = make_request("a", 9), make_request("b", 9, first=20), make_request("c", 5, first=40)
    for r in (a, b, c):
        scheduler.add_request(r)
    fake_step(scheduler)
    used = scheduler.kv_cache_manager.block_pool.num_blocks - (
        scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    )
    assert used == 3 + 3 + 2
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and b.status.finish_reason == "abort"
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 64 - 5
    scheduler.finish_requests(["a", "c", "unknown"], RequestStatus.FINISHED_STOPPED, "###")
    assert a.stop_reason == "###"
    assert_idle_without_leak(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert fake_step(scheduler).finished_request_ids == ["b", "a", "c"]


def test_prefix_hits_counted_once_at_admission():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 9))
    run_all(scheduler)
    scheduler.add_request(make_request("b", 9))
    fake_step(scheduler)
    assert scheduler.prefix_cache_queries_total == 18
    assert scheduler.prefix_cache_hits_total == 8
    assert scheduler.requests["b"].num_cached_tokens == 8


def test_aborting_a_preempted_request_removes_it_from_the_queue():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64, caching=False)
    a, b = make_request("a", 7, max_tokens=6), make_request("b", 7, max_tokens=6, first=30)
    for r in (a, b):
        scheduler.add_request(r)
    while b.status != RequestStatus.PREEMPTED:
        fake_step(scheduler)
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert list(scheduler.waiting) == [] and b.is_finished
    run_all(scheduler)
    assert a.output_token_ids == list(range(100, 106))
    assert_idle_without_leak(scheduler)
