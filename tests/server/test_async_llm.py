"""AsyncLLM over a real LLMEngine on the default model: batching, aborts, failures, limits."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpilot.engine.async_llm import AsyncLLM, EngineError, QueueFullError
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.sampling_params import SamplingParams

PROMPT = {"prompt_token_ids": [504, 3575, 282, 4649, 314]}  # "The capital of France is"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(max_model_len=128, max_num_seqs=2))


@pytest.fixture
async def llm(engine):
    llm = AsyncLLM(engine, max_waiting_requests=1)
    llm.start()
    yield llm
    await llm.shutdown()
    assert not engine.has_unfinished_requests()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def eventually(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.05)


async def test_a_new_request_joins_the_running_batch(llm):
    long = await llm.add_request("long", PROMPT, params(24))
    first = await anext(long)
    assert not first.finished
    short_outputs = [o async for o in await llm.add_request("short", PROMPT, params(4))]
    assert short_outputs[-1].finished and len(short_outputs[-1].outputs[0].token_ids) == 4
    steps_when_short_finished = llm.num_steps
    rest = [o async for o in long]
    assert len(rest[-1].outputs[0].token_ids) == 24
    # The short request finished while the long one still ran, and added no steps of its own:
    # its prefill and decodes shared the long request's steps.
    assert steps_when_short_finished < 24
    assert llm.num_steps == 24


async def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(llm, engine):
    stream = await llm.add_request("gone", PROMPT, params(100))
    await anext(stream)
    stream.close()
    await eventually(lambda: not engine.has_unfinished_requests())
    await eventually(lambda: llm.stats.num_free_blocks == llm.stats.num_total_blocks)
    assert llm.stats.num_running_reqs == 0


async def test_a_failing_step_ends_requests_in_flight_but_not_the_loop(llm, engine, monkeypatch):
    execute_model = engine.model_runner.execute_model
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return execute_model(*args, **kwargs)

    monkeypatch.setattr(engine.model_runner, "execute_model", fail_once)
    with pytest.raises(EngineError, match="injected failure"):
        async for _ in await llm.add_request("victim", PROMPT, params(5)):
            pass
    await eventually(lambda: llm.stats.num_free_blocks == llm.stats.num_total_blocks)
    outputs = [o async for o in await llm.add_request("after", PROMPT, params(3))]
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3


async def test_waiting_queue_limit_raises_queue_full(llm):
    running = []
    for name in ("r1", "r2"):  # a new request counts as waiting until its first step
        running.append(await llm.add_request(name, PROMPT, params(60)))
        await anext(running[-1])
    waiting = await llm.add_request("w", PROMPT, params(60))
    assert llm.stats.num_waiting_reqs == 1
    with pytest.raises(QueueFullError, match="1 requests"):
        await llm.add_request("refused", PROMPT, params(60))
    for stream in [*running, waiting]:
        stream.close()
    await eventually(lambda: llm.stats.num_free_blocks == llm.stats.num_total_blocks)


async def test_a_burst_that_fits_the_free_slots_is_not_refused(llm):
    # max_num_seqs 2, max_waiting_requests 1: two requests take the two slots and a third may
    # wait, whether or not a step scheduled the first two in between; a fourth is refused.
    streams = [await llm.add_request(f"b{i}", PROMPT, params(60)) for i in range(3)]
    assert llm.num_queued() == 1
    with pytest.raises(QueueFullError, match="1 requests"):
        await llm.add_request("b3", PROMPT, params(60))
    for stream in streams:
        stream.close()
    await eventually(lambda: llm.stats.num_free_blocks == llm.stats.num_total_blocks)


async def test_bad_requests_raise_value_error_and_leave_no_trace(llm, engine):
    with pytest.raises(ValueError, match="empty"):
        await llm.add_request("empty", {"prompt_token_ids": []}, params(3))
    with pytest.raises(ValueError, match="max_model_len"):
        await llm.add_request("long", {"prompt_token_ids": [1] * 500}, params(3))
    stream = await llm.add_request("dup", PROMPT, params(3))
    with pytest.raises(ValueError, match="already in use"):
        await llm.add_request("dup", PROMPT, params(3))
    outputs = [o async for o in stream]
    assert outputs[-1].finished
    assert not engine.has_unfinished_requests()


async def test_generate_yields_cumulative_outputs_until_finished(llm):
    outputs = [o async for o in llm.generate(PROMPT, params(4), "gen")]
    token_counts = [len(o.outputs[0].token_ids) for o in outputs]
    assert token_counts == sorted(token_counts) and token_counts[-1] == 4
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert outputs[-1].outputs[0].finish_reason == "length"


async def test_a_late_add_reply_leaves_the_later_step_stats(llm, monkeypatch):
    """The reply to an add can reach the API process after the outputs of the step that
    finished the request (the router's CI run saw ``vllm:prompt_tokens_total`` miss a finished
    one-token request): the held stats stay the step's."""
    add_request = llm.client.add_request

    async def reply_after_the_step(request):
        stats = await add_request(request)
        steps = llm.num_steps
        await eventually(lambda: llm.num_steps > steps)
        return stats

    monkeypatch.setattr(llm.client, "add_request", reply_after_the_step)
    before = llm.stats.prompt_tokens_total
    outputs = [o async for o in await llm.add_request("late", PROMPT, params(1))]
    assert outputs[-1].finished
    assert llm.stats.prompt_tokens_total == before + len(PROMPT["prompt_token_ids"])
