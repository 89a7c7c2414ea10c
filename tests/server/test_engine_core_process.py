"""AsyncLLM over the engine core in a process of its own (``MPClient``), on the default model:
the same tokens as the engine in this process, aborts that free blocks there, load errors with
their own type, a core process that dies, and a shutdown that ends it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from kvpilot.engine.async_llm import AsyncLLM, EngineError
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.core_client import MPClient
from kvpilot.engine.executor.abstract import EngineDeadError
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.sampling_params import SamplingParams

ARGS = EngineArgs(max_model_len=256, max_num_seqs=4)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def params(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


async def eventually(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.05)


@pytest.fixture
async def llm():
    client = await asyncio.to_thread(MPClient, ARGS)
    llm = AsyncLLM(client)
    llm.start()
    yield llm
    await llm.shutdown()
    assert not client._process.is_alive()


async def collect(llm: AsyncLLM, request_id: str, prompt, sampling: SamplingParams):
    return [o async for o in await llm.add_request(request_id, prompt, sampling)]


async def test_tokens_and_text_equal_the_in_process_engine(llm):
    sampling = params(16, logprobs=1)
    answers = await asyncio.gather(
        *(collect(llm, f"r{i}", prompt, sampling) for i, prompt in enumerate(PROMPTS))
    )
    engine = LLMEngine.from_engine_args(ARGS)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, sampling)
    expected = {}
    while engine.has_unfinished_requests():
        expected.update({o.request_id: o for o in engine.step() if o.finished})
    for i, outputs in enumerate(answers):
        last = outputs[-1]
        assert last.finished and len(outputs) > 1
        want = expected[f"r{i}"].outputs[0]
        assert last.outputs[0].token_ids == want.token_ids
        assert last.outputs[0].text == want.text
        assert [set(lp) for lp in last.outputs[0].logprobs] == [set(lp) for lp in want.logprobs]
    assert llm.stats.num_free_blocks == llm.stats.num_total_blocks


async def test_a_closed_stream_aborts_in_the_core_process(llm):
    stream = await llm.add_request("gone", PROMPTS[0], params(200, ignore_eos=True))
    await anext(stream)
    assert llm.stats.num_free_blocks < llm.stats.num_total_blocks
    stream.close()
    await eventually(lambda: llm.stats.num_free_blocks == llm.stats.num_total_blocks)
    assert llm.stats.num_running_reqs == 0
    outputs = await collect(llm, "after", PROMPTS[1], params(3, ignore_eos=True))
    assert len(outputs[-1].outputs[0].token_ids) == 3


async def test_a_bad_request_raises_the_engines_value_error(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        await llm.add_request("long", {"prompt_token_ids": [1] * 500}, params(3))
    outputs = await collect(llm, "ok", PROMPTS[0], params(2))
    assert outputs[-1].finished


async def test_a_load_error_keeps_its_type():
    with pytest.raises(FileNotFoundError):
        await asyncio.to_thread(MPClient, EngineArgs(model="/nonexistent/model"))


async def test_a_dead_core_process_ends_requests_and_fails_health(llm):
    stream = await llm.add_request("victim", PROMPTS[0], params(200, ignore_eos=True))
    await anext(stream)
    os.kill(llm.client.pid, signal.SIGKILL)
    with pytest.raises(EngineError, match="exited"):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError, match="exit code -9"):
        await llm.check_health()
    with pytest.raises(EngineError, match="dead"):
        await llm.add_request("refused", PROMPTS[0], params(2))


def test_the_api_process_imports_no_torch(tmp_path):
    """The API side (server, AsyncLLM, the client) stays free of torch and the model code: the
    engine-core process holds those (here 127 MiB resident for the API against 660 MiB with
    torch imported)."""
    code = (
        "import sys, kvpilot.engine.server.app, kvpilot.engine.core_client; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvpilot.engine.executor')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
