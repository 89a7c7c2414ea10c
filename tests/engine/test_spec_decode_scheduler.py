"""Draft tokens in the scheduler, with plain values: they take budget and KV slots, are capped
by max_tokens, and rejected ones roll back num_computed_tokens and the block table."""

from __future__ import annotations

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.request import Request
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler

BS = 4


def make_scheduler(budget: int = 64, lookahead: int = 0, num_blocks: int = 32) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BS, True), num_lookahead_tokens=lookahead)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 16) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
        eos_token_ids=frozenset({99}),
        max_tokens=max_tokens,
    )


def prefill(scheduler: Scheduler, request: Request) -> None:
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {request.request_id: 50})


def test_drafts_are_scheduled_and_rejected_ones_roll_back():
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=6)
    prefill(scheduler, request)
    assert (request.num_tokens, request.num_computed_tokens) == (7, 6)
    request.spec_token_ids = [51, 52, 53, 54]
    out = scheduler.schedule()
    (sched,) = out.scheduled
    assert sched.sample and sched.spec_token_ids == [51, 52, 53, 54]
    assert sched.num_new_tokens == 5 and out.num_scheduled_tokens == 5
    # 6 computed + 5 new tokens: 11 slots, 3 blocks of 4.
    assert len(sched.block_ids) == 3
    # Two drafts accepted, then the target's own token: 3 tokens out, 2 drafts rolled back.
    scheduler.update_from_output(out, {"a": [51, 52, 60]})
    assert request.output_token_ids == [50, 51, 52, 60]
    assert request.num_computed_tokens == 9  # 6 + the last token + 2 accepted drafts
    assert request.num_tokens == 10
    assert request.spec_token_ids == []
    # 10 tokens need 3 blocks: nothing to free here; the stats saw 2 of 4 accepted.
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 3
    stats = scheduler.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0, 0]


def test_rejection_frees_blocks_past_the_accepted_tokens():
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=7)
    prefill(scheduler, request)  # 8 tokens, 7 computed, 2 blocks
    request.spec_token_ids = [1, 2, 3, 4, 5]
    out = scheduler.schedule()
    assert len(out.scheduled[0].block_ids) == 4  # 7 + 6 = 13 slots
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    scheduler.update_from_output(out, {"a": [9]})  # every draft rejected
    assert request.num_computed_tokens == 8
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 3  # 9 tokens
    assert pool.get_num_free_blocks() == free_before + 1


def test_drafts_are_capped_by_budget_and_max_tokens():
    scheduler = make_scheduler(budget=3)
    request = make_request("a", prompt_len=2, max_tokens=4)
    prefill(scheduler, request)
    request.spec_token_ids = [1, 2, 3, 4]
    out = scheduler.schedule()
    # Budget 3: the real token and 2 drafts.
    assert out.scheduled[0].spec_token_ids == [1, 2]
    scheduler.update_from_output(out, {"a": [1, 2, 7]})
    assert request.num_output_tokens == 4 and request.is_finished
    # Finished and freed: every block is back.
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks

    scheduler = make_scheduler()
    request = make_request("b", prompt_len=2, max_tokens=3)
    prefill(scheduler, request)
    request.spec_token_ids = [1, 2, 3, 4]
    # One output exists and max_tokens is 3: one draft plus the target's token at most.
    assert scheduler.schedule().scheduled[0].spec_token_ids == [1]


def test_stop_token_inside_an_accepted_run_truncates():
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=3)
    prefill(scheduler, request)
    request.spec_token_ids = [5, 99, 6]
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": [5, 99, 6, 7]})
    assert request.output_token_ids == [50, 5, 99]
    assert request.is_finished and request.status.finish_reason == "stop"


def test_drafts_wait_until_the_prompt_is_computed():
    scheduler = make_scheduler(budget=4)
    request = make_request("a", prompt_len=10)
    request.spec_token_ids = [1, 2]
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.scheduled[0].spec_token_ids == [] and not out.scheduled[0].sample
    scheduler.update_from_output(out, {})
    out = scheduler.schedule()
    assert out.scheduled[0].spec_token_ids == []


def test_lookahead_slots_are_reserved_for_a_draft_model():
    scheduler = make_scheduler(lookahead=3)
    request = make_request("a", prompt_len=4)
    scheduler.add_request(request)
    out = scheduler.schedule()
    # 4 prompt tokens + 3 lookahead slots: 2 blocks.
    assert len(out.scheduled[0].block_ids) == 2
    scheduler.update_from_output(out, {"a": 50})
    request.spec_token_ids = [1, 2, 3]
    out = scheduler.schedule()
    # 4 computed + 4 new + 3 lookahead = 11 slots: 3 blocks.
    assert len(out.scheduled[0].block_ids) == 3
    scheduler.update_from_output(out, {"a": [8]})
    # Rolled back to 6 tokens; 6 + 3 lookahead slots still need 3 blocks.
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 3


def test_preemption_drops_drafts():
    scheduler = make_scheduler(num_blocks=4)
    first, second = make_request("a", prompt_len=7), make_request("b", prompt_len=7)
    scheduler.add_request(first)
    scheduler.add_request(second)
    scheduler.update_from_output(scheduler.schedule(), {"a": 50, "b": 50})
    second.spec_token_ids = [1, 2, 3]
    first.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8]
    out = scheduler.schedule()
    assert "b" in out.preempted_request_ids
    assert second.spec_token_ids == []
