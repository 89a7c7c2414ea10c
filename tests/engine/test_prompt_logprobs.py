"""Prompt logprobs against transformers: every prompt token's logprob, rank and top-k candidates
equal ``log_softmax`` of transformers' logits on the same prompt, whatever the chunking, the
prefix cache, preemption, fan-out, speculative decoding or tensor parallelism."""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.outputs import Logprob
from tests.engine.helpers import assert_no_leak, greedy, tokens

ATOL = 1e-4
# K and V of the tiny test model: 2 layers x 2 KV heads x head_dim 16, float32.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
TOP_K = 5
TEXT = (
    "Kubernetes schedules pods onto nodes; the kubelet on each node starts their containers "
    "and reports their status back to the API server."
)


def reference_logprobs(model_dir: pathlib.Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 ``log_softmax`` over each prompt: ``[prompt_len, vocab_size]``,
    row ``j`` scoring token ``j + 1``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [
            torch.log_softmax(
                model(
                    torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long)
                ).logits[0],
                dim=-1,
            )
            for p in prompts
        ]


def assert_matches(
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
    prompt: list[int],
    reference: torch.Tensor,
    k: int = TOP_K,
    tokenizer=None,
    exact_ids: bool = False,
) -> None:
    """Each entry holds the prompt token (logprob and 1-based rank as in ``reference``) and
    the top ``k`` (ranks 1..k, values and ids as in ``reference``, ties within ``ATOL``
    aside); ``exact_ids``: the top-k ids in order wherever ``reference`` separates them."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for row, token, entry in zip(reference, prompt[1:], prompt_logprobs[1:], strict=False):
        own = entry[token]
        assert own.logprob == pytest.approx(float(row[token]), abs=ATOL)
        # Ranks count strictly better tokens; a tie within ATOL may go either way.
        assert int((row > row[token] + ATOL).sum()) + 1 <= own.rank
        assert own.rank <= int((row > row[token] - ATOL).sum()) + 1
        best = sorted(entry.items(), key=lambda item: item[1].rank)[:k]
        assert [lp.rank for _, lp in best] == list(range(1, k + 1))
        assert len(entry) == k + (own.rank > k)
        expected = row.topk(k + 1)
        for token_id, lp in best:
            assert lp.logprob == pytest.approx(float(expected.values[lp.rank - 1]), abs=ATOL)
            assert lp.logprob == pytest.approx(float(row[token_id]), abs=ATOL)
        if exact_ids:
            gaps = expected.values[:-1] - expected.values[1:]
            for rank, (token_id, _) in enumerate(best):
                if gaps[rank] > 10 * ATOL and (rank == 0 or gaps[rank - 1] > 10 * ATOL):
                    assert token_id == int(expected.indices[rank])
        if tokenizer is not None:
            for token_id, lp in entry.items():
                assert lp.decoded_token == tokenizer.decode([token_id])


def prompt_logprobs_of(llm: LLM, prompts: list[list[int]], **params) -> list:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        greedy(**{"max_tokens": 1, "prompt_logprobs": TOP_K, **params}),
        use_tqdm=False,
    )
    return outputs


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    """A sentence and random tokens, both longer than a few 16-token blocks."""
    return [llm.get_tokenizer().encode(TEXT), tokens(41, seed=3)]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir) -> pathlib.Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts) -> list[torch.Tensor]:
    return reference_logprobs(default_model_dir, prompts)


def test_prompt_logprobs_equal_transformers(llm, prompts, reference):
    outputs = prompt_logprobs_of(llm, prompts)
    for output, prompt, ref in zip(outputs, prompts, reference, strict=True):
        assert_matches(
            output.prompt_logprobs, prompt, ref, tokenizer=llm.get_tokenizer(), exact_ids=True
        )
        # The prefill sampled the one token asked for, from its last row.
        [sample] = output.outputs
        assert sample.finish_reason == "length"
        assert sample.token_ids == [int(ref[-1].argmax())]
    # No top candidates: the prompt token alone.
    [output] = prompt_logprobs_of(llm, prompts[:1], prompt_logprobs=0)
    for token, entry in zip(prompts[0][1:], output.prompt_logprobs[1:], strict=True):
        assert list(entry) == [token]
    assert_no_leak(llm.llm_engine)


def test_chunked_prefill_scores_every_chunk(prompts, reference):
    # 16-token chunks: every chunk scores its rows, the last one also samples.
    chunked = LLM(max_model_len=256, max_num_batched_tokens=16)
    outputs = prompt_logprobs_of(chunked, prompts)
    for output, prompt, ref in zip(outputs, prompts, reference, strict=True):
        assert_matches(output.prompt_logprobs, prompt, ref)
    assert_no_leak(chunked.llm_engine)


def test_a_cached_prompt_is_recomputed_and_still_cached_for_others(llm, prompts, reference):
    prompt = prompts[1]
    engine = llm.llm_engine
    assert engine.kv_cache_manager.enable_caching
    for _ in range(2):
        [warm] = llm.generate([{"prompt_token_ids": prompt}], greedy(max_tokens=2), use_tqdm=False)
    block_size = engine.block_size
    assert warm.num_cached_tokens == (len(prompt) - 1) // block_size * block_size > 0
    queries = engine.scheduler.prefix_cache_queries_total
    [scored] = prompt_logprobs_of(llm, [prompt])
    assert scored.num_cached_tokens == 0
    assert engine.scheduler.prefix_cache_queries_total == queries  # not a lookup
    assert_matches(scored.prompt_logprobs, prompt, reference[1])
    # A fresh prompt scored first is then served from the cache it wrote.
    fresh = tokens(40, seed=11)
    prompt_logprobs_of(llm, [fresh])
    [after] = llm.generate([{"prompt_token_ids": fresh}], greedy(max_tokens=2), use_tqdm=False)
    assert after.num_cached_tokens == (len(fresh) - 1) // block_size * block_size
    assert_no_leak(engine)


def test_preemption_neither_duplicates_nor_loses_entries(llama_dir):
    # 12 blocks of 16 for prompts of 60, 60 and 100 tokens growing by 60 each, in 16-token
    # chunks: the 100-token prompt is preempted in the middle of its prefill (its scored
    # chunks are scored again when it is recomputed), the others after their prefill.
    small = LLM(
        str(llama_dir),
        max_model_len=256,
        block_size=16,
        kv_cache_memory=12 * 16 * TINY_KV_BYTES_PER_TOKEN,
        max_num_batched_tokens=16,
    )
    assert small.llm_engine.cache_config.num_blocks == 12
    prompts = [tokens(n, seed=20 + i) for i, n in enumerate([60, 60, 100])]
    outputs = small.generate(
        [{"prompt_token_ids": p} for p in prompts],
        greedy(max_tokens=60, prompt_logprobs=TOP_K),
        use_tqdm=False,
    )
    assert small.llm_engine.get_stats().num_preemptions_total > 0
    for output, prompt, ref in zip(
        outputs, prompts, reference_logprobs(llama_dir, prompts), strict=True
    ):
        assert_matches(output.prompt_logprobs, prompt, ref)
        assert len(output.outputs[0].token_ids) == 60
    assert_no_leak(small.llm_engine)


def test_fan_out_scores_the_prompt_once_and_reports_it_first(llm, prompts, reference):
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, prompt_logprobs=TOP_K)
    hits = engine.scheduler.prefix_cache_hits_total
    engine.add_request("fan", {"prompt_token_ids": prompts[0]}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert_matches(outputs[0].prompt_logprobs, prompts[0], reference[0])
    assert all(o.prompt_logprobs is outputs[0].prompt_logprobs for o in outputs)
    assert [len(s.token_ids) for s in outputs[-1].outputs] == [4, 4, 4]
    # The first sequence scored the prompt; the other two read its full blocks from the cache.
    assert outputs[0].num_cached_tokens == 0
    full_blocks = (len(prompts[0]) - 1) // engine.block_size
    assert (
        engine.scheduler.prefix_cache_hits_total - hits == 2 * engine.block_size * full_blocks > 0
    )
    assert_no_leak(engine)


def test_one_token_prompt_and_limits(llm):
    [output] = prompt_logprobs_of(llm, [[42]])
    assert output.prompt_logprobs == [None]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"prompt_logprobs must be at most the vocabulary"):
        engine.add_request("big", {"prompt_token_ids": [5, 6]}, greedy(prompt_logprobs=49153))
    assert not engine.has_unfinished_requests()


def test_speculative_decoding_keeps_prompt_logprobs_and_tokens(llama_dir):
    # Repetitive prompts, so that n-gram lookup drafts.
    prompts = [(tokens(6, seed=i) * 5)[:29] for i in range(3)]
    params = greedy(max_tokens=12, prompt_logprobs=TOP_K)
    plain = LLM(str(llama_dir), block_size=8).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    spec_llm = LLM(
        str(llama_dir),
        block_size=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    spec = spec_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, q, prompt, ref in zip(
        plain, spec, prompts, reference_logprobs(llama_dir, prompts), strict=True
    ):
        assert q.outputs[0].token_ids == p.outputs[0].token_ids
        assert_matches(q.prompt_logprobs, prompt, ref)
    assert spec_llm.llm_engine.get_stats().spec_decode.num_drafts > 0
    assert_no_leak(spec_llm.llm_engine)


def test_two_tensor_parallel_ranks_match_transformers(llama_dir):
    prompts = [tokens(n, seed=30 + n) for n in (9, 23)]
    llm = LLM(str(llama_dir), tensor_parallel_size=2, dtype="float32", max_model_len=64)
    try:
        outputs = prompt_logprobs_of(llm, prompts)
        for output, prompt, ref in zip(
            outputs, prompts, reference_logprobs(llama_dir, prompts), strict=True
        ):
            assert_matches(output.prompt_logprobs, prompt, ref)
        assert_no_leak(llm.llm_engine)
    finally:
        llm.llm_engine.shutdown()
