"""Sampling through the whole engine: seeds reproduce whatever shares the batch, truncation
limits that reduce to greedy do, ``n > 1`` fans out, logprobs are consistent."""

from __future__ import annotations

import math

import pytest

from kvpilot.engine import LLM, SamplingParams
from tests.engine.helpers import tokens

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir("llama")), max_model_len=128, block_size=8)


@pytest.fixture(scope="module")
def prompt() -> dict:
    return {"prompt_token_ids": tokens(12, seed=0)}


def sample(llm: LLM, prompts: list, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_request_is_reproducible_whatever_the_batch(llm, prompt):
    params = SamplingParams(
        temperature=1.5, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    alone = sample(llm, [prompt], params)[0]
    others = [{"prompt_token_ids": tokens(5 + 3 * i, seed=10 + i)} for i in range(4)]
    other_params = [
        SamplingParams(
            temperature=1.0, max_tokens=3 + i, seed=None if i % 2 else i, ignore_eos=True
        )
        for i in range(4)
    ]
    mixed = sample(
        llm,
        [others[0], others[1], prompt, others[2], others[3]],
        [other_params[0], other_params[1], params, other_params[2], other_params[3]],
    )
    assert mixed[2] == alone
    greedy = sample(
        llm, [prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )[0]
    assert alone != greedy
    different_seed = SamplingParams(
        temperature=1.5, top_p=0.95, seed=99, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    assert sample(llm, [prompt], different_seed)[0] != alone


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
    ids=["top_k=1", "tiny top_p", "min_p=1"],
)
def test_truncation_to_one_token_equals_greedy(llm, prompt, params):
    params.max_tokens, params.ignore_eos = MAX_TOKENS, True
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert sample(llm, [prompt], params) == sample(llm, [prompt], greedy)


def test_n_fans_out_into_seeded_sequences(llm):
    prompt = {"prompt_token_ids": tokens(12, seed=42)}
    fan = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    hits_before = llm.llm_engine.get_stats().prefix_cache_hits_total
    (out,) = llm.generate(prompt, fan, use_tqdm=False)
    # Children 1 and 2 read the prompt's full block (8 tokens) that child 0 computes.
    assert llm.llm_engine.get_stats().prefix_cache_hits_total - hits_before == 16
    assert out.num_cached_tokens == 0
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.outputs)
    for i, completion in enumerate(out.outputs):
        single = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert completion.token_ids == sample(llm, [prompt], single)[0][0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_logprobs_of_greedy_tokens(llm, prompt):
    params = SamplingParams(temperature=0, logprobs=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    completion = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == MAX_TOKENS
    total = 0.0
    for token_id, top in zip(completion.token_ids, completion.logprobs, strict=True):
        assert len(top) == 3 and top[token_id].rank == 1
        assert top[token_id].logprob == max(lp.logprob for lp in top.values()) <= 0.0
        assert top[token_id].decoded_token == llm.get_tokenizer().decode([token_id])
        total += top[token_id].logprob
    assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-6)
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert plain[0].outputs[0].logprobs is None and plain[0].outputs[0].cumulative_logprob is None


def test_mismatched_prompts_and_params_are_refused(llm, prompt):
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        llm.generate([prompt, prompt], [SamplingParams()] * 3, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (dict(allowed_token_ids=[True]), "allowed_token_ids must be token ids"),
        (dict(allowed_token_ids=["a"]), "allowed_token_ids must be token ids"),
        (dict(bad_words=["\ud800"]), "bad_words the text is not valid Unicode"),
        # OpenAI's JSON keys are strings; offline they must be ids (the server converts them).
        (dict(logit_bias={"13": 1.0}), "logit_bias keys must be token ids \\(int\\), got '13'"),
    ],
)
def test_bad_token_restrictions_are_refused_and_the_llm_keeps_working(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=3, **params), use_tqdm=False)
    [after] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(after.outputs[0].token_ids) == 3
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_bad_words_string_is_one_word(llm, prompt):
    # As stop: a string is one entry, not its characters.
    assert SamplingParams(bad_words=" the end").bad_words == [" the end"]


def test_a_failed_step_leaves_no_request_behind(llm, prompt, monkeypatch):
    # Fault injection (a stand-in for a kernel or device error): the first step raises.
    runner = llm.llm_engine.model_runner
    real = runner.execute_model
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute_model", fail_once)
    with pytest.raises(RuntimeError, match="injected step failure"):
        llm.generate([prompt, prompt], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    [after] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(llm.llm_engine.model_dir), max_model_len=128, block_size=8).generate(
            prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
        )
    ]
    assert [after.outputs[0].token_ids] == expected
