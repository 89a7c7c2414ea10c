"""The CPU's greedy head in the engine: which rows take it (greedy, no logprobs, no logits
processor at that step, no grammar, no forced token) and that they get the tokens the full
logits give (transformers' greedy tokens; the same request with logprobs, which computes every
logit). The kernel's own exactness is tested in ``tests/kernels/test_cpu_greedy_head.py``."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.kernels.cpu import greedy_head
from tests.engine.helpers import hf_greedy, tokens

pytestmark = pytest.mark.skipif(
    not greedy_head.available(), reason="the greedy head needs AVX-512 BF16 and the GEMM kernel"
)

NEW = 10


def test_only_rows_that_need_nothing_but_the_argmax_take_the_greedy_head(
    default_model_dir, monkeypatch
):
    llm = LLM(str(default_model_dir), max_model_len=256, block_size=8)
    model = llm.llm_engine.model_runner.model
    real = model.greedy_tokens
    rows_seen: list[int] = []

    def spy(hidden):  # records what reaches the real greedy head, and returns its answer
        rows_seen.append(hidden.shape[0])
        return real(hidden)

    monkeypatch.setattr(model, "greedy_tokens", spy)
    prompt = tokens(37, seed=1)
    other = tokens(21, seed=2)
    requests = [
        (prompt, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)),
        (prompt, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)),
        (other, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, min_tokens=4)),
        (other, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True,
                               logit_bias={13: 1.0})),
        (other, SamplingParams(temperature=0.8, max_tokens=NEW, ignore_eos=True, seed=3)),
    ]  # fmt: skip
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False
    )
    plain, with_logprobs, min_tokens, _, _ = [o.outputs[0] for o in outputs]
    # The plain request every step; min_tokens once it has 4 tokens (EOS is masked before).
    assert sum(rows_seen) == NEW + (NEW - 4)
    # The same tokens as every logit's argmax: the request that asked for logprobs computed
    # them all, and each of its tokens is its own top-1.
    assert plain.token_ids == with_logprobs.token_ids
    steps = zip(with_logprobs.token_ids, with_logprobs.logprobs, strict=True)
    assert all(step[t].rank == 1 for t, step in steps)
    assert [plain.token_ids, min_tokens.token_ids] == hf_greedy(
        default_model_dir, [prompt, other], NEW
    )


def test_switched_off_it_gives_the_same_tokens(default_model_dir, monkeypatch):
    prompts = [{"prompt_token_ids": tokens(n, seed=n)} for n in (9, 40, 77)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    on = LLM(str(default_model_dir), max_model_len=256, block_size=8, enable_prefix_caching=False)
    monkeypatch.setattr(on.llm_engine.model_runner.model, "greedy_tokens", lambda hidden: None)
    off = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    monkeypatch.undo()
    with_head = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    assert with_head == off


def test_draft_rows_of_greedy_requests_are_verified_by_the_greedy_head(
    default_model_dir, monkeypatch
):
    # n-gram drafts on a prompt that repeats itself: a greedy request's draft rows and the row
    # after them take the greedy head, and it keeps the drafts up to the first the argmax
    # disagrees with; the tokens are those of plain greedy decoding (transformers') and of the
    # same request with logprobs, whose rows go through the rejection sampler's full logits.
    phrase = tokens(7, seed=5)
    prompt = phrase * 4
    llm = LLM(
        str(default_model_dir),
        max_model_len=256,
        block_size=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    model = llm.llm_engine.model_runner.model
    real = model.greedy_tokens
    rows_seen: list[int] = []

    def spy(hidden):
        rows_seen.append(hidden.shape[0])
        return real(hidden)

    monkeypatch.setattr(model, "greedy_tokens", spy)
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    [head] = llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)
    assert max(rows_seen) > 1  # a step verified drafts with the head
    calls = len(rows_seen)
    with_logprobs = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    [full] = llm.generate([{"prompt_token_ids": prompt}], with_logprobs, use_tqdm=False)
    assert len(rows_seen) == calls  # a request with logprobs never reaches the head
    stats = llm.llm_engine.get_stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0
    assert head.outputs[0].token_ids == full.outputs[0].token_ids
    assert [head.outputs[0].token_ids] == hf_greedy(default_model_dir, [prompt], NEW)
