"""Chunked prefill changes nothing but the schedule: every chunk size from one token to the
whole prompt, mixed with other requests' decodes in the same steps, gives the same tokens.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.llm_engine import LLMEngine
from tests.engine.helpers import tokens

PROMPT_LEN = 20
DECODERS = 2
LONG = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# The decoders outlive the slowest prefill (one-token chunks).
DECODE = SamplingParams(temperature=0, max_tokens=PROMPT_LEN + 4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLM(
        str(tiny_model_dir("llama")), block_size=8, max_model_len=128, enable_prefix_caching=False
    ).llm_engine


def run_with_budget(engine: LLMEngine, budget: int) -> tuple[dict[str, list[int]], list[list]]:
    """Two requests start decoding, then the long prompt arrives; each step's token budget
    leaves ``budget - DECODERS`` tokens for it. Returns outputs and, per step, the
    ``(request id, num_new_tokens, sample)`` triples scheduled."""
    engine.scheduler.config = dataclasses.replace(
        engine.scheduler.config, max_num_batched_tokens=budget
    )
    for i in range(DECODERS):
        engine.add_request(f"d{i}", {"prompt_token_ids": tokens(3, seed=i)}, DECODE)
    schedule = engine.scheduler.schedule
    steps: list[list] = []

    def recording_schedule():
        out = schedule()
        steps.append([(s.request.request_id, s.num_new_tokens, s.sample) for s in out.scheduled])
        return out

    engine.scheduler.schedule = recording_schedule
    outputs: dict[str, list[int]] = {}
    try:
        while engine.has_unfinished_requests():
            if len(steps) == 2:
                engine.add_request("long", {"prompt_token_ids": tokens(PROMPT_LEN, seed=9)}, LONG)
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
    finally:
        del engine.scheduler.schedule
    return outputs, steps


def test_every_chunk_size_gives_the_same_tokens(engine):
    whole_budget = PROMPT_LEN + DECODERS
    expected, steps = run_with_budget(engine, whole_budget)
    assert ("long", PROMPT_LEN, True) in steps[2]
    for chunk in range(1, PROMPT_LEN):
        outputs, steps = run_with_budget(engine, chunk + DECODERS)
        assert outputs == expected, f"chunk size {chunk}"
        long_chunks = [n for step in steps for rid, n, _ in step if rid == "long"]
        assert long_chunks[: -(-PROMPT_LEN // chunk)] == [chunk] * (PROMPT_LEN // chunk) + (
            [PROMPT_LEN % chunk] if PROMPT_LEN % chunk else []
        )
        # While the prompt is chunked, both decoders advance in the very same steps, and only
        # the step that completes the prompt samples from it.
        prefill_steps = [step for step in steps if any(rid == "long" for rid, _, _ in step)]
        prefill_steps = prefill_steps[: -(-PROMPT_LEN // chunk)]
        for step in prefill_steps:
            assert [(rid, n) for rid, n, _ in step if rid != "long"] == [("d0", 1), ("d1", 1)]
        assert [s for step in prefill_steps for rid, _, s in step if rid == "long"][-1]
        assert not any(s for step in prefill_steps[:-1] for rid, _, s in step if rid == "long")


def test_long_prefill_token_threshold_caps_a_prompt_per_step(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")),
        max_model_len=128,
        long_prefill_token_threshold=7,
        enable_prefix_caching=False,
    )
    reference = LLM(str(tiny_model_dir("llama")), max_model_len=128, enable_prefix_caching=False)
    prompt = {"prompt_token_ids": tokens(PROMPT_LEN, seed=9)}
    capped = llm.generate(prompt, LONG, use_tqdm=False)[0].outputs[0].token_ids
    assert capped == reference.generate(prompt, LONG, use_tqdm=False)[0].outputs[0].token_ids
