"""Speculative decoding in the engine: greedy output identical to plain decoding with n-gram
and draft-model proposers, whatever the batch, stop conditions, preemption or prefix-cache
hits; rejected drafts roll back without leaking blocks; counters read back; bad configs are
refused at start-up."""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.llm_engine import LLMEngine
from tests.engine.helpers import NEW_TOKENS, assert_no_leak, generate_ids, greedy

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def repetitive_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so prompt lookup finds matches, plus random ones of
    lengths around block boundaries (8)."""
    generator = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, 49152, (6,), generator=generator).tolist()
    prompts = [phrase * 3, phrase * 2 + phrase[:3], phrase[:2] * 4 + [7]]
    prompts += [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (1, 8, 17)]
    return prompts


def assert_counters_consistent(engine: LLMEngine) -> None:
    stats = engine.get_stats().spec_decode
    assert stats is not None
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    per_pos = stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens
    # A draft is accepted only after every draft before it.
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir) -> pathlib.Path:
    # Untied embeddings: a tied tiny random model mostly repeats its last token forever, which
    # every proposer guesses; untied, its output varies, loops now and then, and drafts are
    # both accepted and rejected.
    return tiny_model_dir("llama", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return repetitive_prompts()


@pytest.fixture(scope="module")
def reference(llama_dir, prompts) -> list[list[int]]:
    """Plain greedy decoding (itself checked against transformers by test_llm_engine)."""
    llm = LLM(str(llama_dir), block_size=8, enable_prefix_caching=False)
    return generate_ids(llm, prompts, greedy())


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_ngram_greedy_matches_plain_decoding(llama_dir, prompts, reference, max_num_seqs):
    llm = LLM(str(llama_dir), block_size=8, max_num_seqs=max_num_seqs, speculative_config=NGRAM)
    assert generate_ids(llm, prompts, greedy()) == reference
    assert_no_leak(llm.llm_engine)
    assert_counters_consistent(llm.llm_engine)


def test_ngram_mixed_with_sampled_requests_and_budget_pressure(llama_dir, prompts, reference):
    """Greedy requests share steps with sampled ones (their own drafts, other k) and a small
    token budget that trims drafts; the greedy ones still match."""
    llm = LLM(
        str(llama_dir),
        block_size=8,
        max_num_batched_tokens=10,
        speculative_config={**NGRAM, "num_speculative_tokens": 5},
    )
    sampled = SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=NEW_TOKENS, seed=3, ignore_eos=True
    )
    params = [greedy() if i % 2 == 0 else sampled for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, output in enumerate(outputs):
        if i % 2 == 0:
            assert output.outputs[0].token_ids == reference[i]
        else:
            assert len(output.outputs[0].token_ids) == NEW_TOKENS
    assert_no_leak(llm.llm_engine)


def test_ngram_under_preemption_and_prefix_cache_hits(llama_dir, prompts, reference):
    # 2 layers x 2 KV heads x 16 x K,V x float32 = 512 bytes a token: 12 blocks of 8 tokens,
    # fewer than the batch needs, so requests are preempted and recomputed.
    llm = LLM(
        str(llama_dir),
        block_size=8,
        kv_cache_memory=12 * 8 * 512,
        enable_prefix_caching=True,
        speculative_config=NGRAM,
    )
    assert generate_ids(llm, prompts, greedy()) == reference
    assert llm.llm_engine.get_stats().num_preemptions_total > 0
    # Again: the prompts' blocks are now cached.
    assert generate_ids(llm, prompts, greedy()) == reference
    assert llm.llm_engine.get_stats().prefix_cache_hits_total > 0
    assert_no_leak(llm.llm_engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stop_conditions_inside_an_accepted_run(llama_dir, prompts, reference, method):
    """max_tokens, stop_token_ids and stop strings cut a run of accepted drafts exactly where
    plain decoding stops. The target drafting for itself (k = 3) accepts everything, so after
    the first token every step emits 4 (tokens 1-4, 5-8, 9-12, ...) and the stops below fall
    inside those runs."""
    config = (
        {**NGRAM, "num_speculative_tokens": 4}
        if method == "ngram"
        else {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3}
    )
    plain = LLM(str(llama_dir), block_size=8)
    spec = LLM(str(llama_dir), block_size=8, speculative_config=config)
    tokenizer = plain.get_tokenizer()
    answer = reference[1]
    first_index = {token: answer.index(token) for token in answer}
    # A token first seen mid-run, and its text (assumed not to appear earlier in the text).
    stop_token = next(t for t in answer[10:] if first_index[t] % 4 != 0 and first_index[t] >= 10)
    stop_text = tokenizer.decode([stop_token])
    cases = [
        greedy(max_tokens=7),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop=[stop_text]),
        SamplingParams(
            temperature=0, max_tokens=NEW_TOKENS, stop=[stop_text], include_stop_str_in_output=True
        ),
    ]
    inputs = [{"prompt_token_ids": p} for p in prompts[:3]]
    for params in cases:
        expected = plain.generate(inputs, params, use_tqdm=False)
        got = spec.generate(inputs, params, use_tqdm=False)
        for e, g in zip(expected, got, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            assert g.outputs[0].text == e.outputs[0].text
            assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
            assert g.outputs[0].stop_reason == e.outputs[0].stop_reason
        num_tokens = len(got[1].outputs[0].token_ids)
        assert num_tokens < NEW_TOKENS
        if method == "draft_model":
            # Not the last token of a run (runs end at tokens 4, 8, 12, ...).
            assert num_tokens % 4 != 1
    assert_no_leak(spec.llm_engine)


def test_logprobs_of_accepted_tokens_match_plain_decoding(llama_dir, prompts):
    params = greedy(logprobs=2)
    plain = LLM(str(llama_dir), block_size=8).generate(
        [{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False
    )
    spec = LLM(str(llama_dir), block_size=8, speculative_config=NGRAM).generate(
        [{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False
    )
    for e, g in zip(plain, spec, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert le.keys() == lg.keys()
            for token in le:
                assert lg[token].rank == le[token].rank
                assert lg[token].logprob == pytest.approx(le[token].logprob, abs=1e-4)
        assert g.outputs[0].cumulative_logprob == pytest.approx(
            e.outputs[0].cumulative_logprob, abs=1e-3
        )


def test_draft_model_identical_to_target_accepts_everything(llama_dir, prompts, reference):
    llm = LLM(
        str(llama_dir),
        block_size=8,
        speculative_config={
            "method": "draft_model",
            "model": str(llama_dir),
            "num_speculative_tokens": 3,
        },
    )
    assert generate_ids(llm, prompts, greedy()) == reference
    stats = llm.llm_engine.get_stats().spec_decode
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert_no_leak(llm.llm_engine)


def test_draft_model_with_other_weights_under_preemption(
    llama_dir, tiny_model_dir, prompts, reference
):
    """A different (random) draft sharing the tokenizer: most drafts are rejected and rolled
    back, including while requests are preempted; the output is still plain greedy."""
    draft_dir = tiny_model_dir("llama", seed=1, num_hidden_layers=1, tie_word_embeddings=False)
    llm = LLM(
        str(llama_dir),
        block_size=8,
        # Target 512 + draft 256 bytes a token: 14 blocks of 8 tokens.
        kv_cache_memory=14 * 8 * 768,
        speculative_config={
            "method": "draft_model",
            "model": str(draft_dir),
            "num_speculative_tokens": 2,
        },
    )
    assert llm.llm_engine.cache_config.num_blocks == 14
    assert generate_ids(llm, prompts, greedy()) == reference
    assert llm.llm_engine.get_stats().num_preemptions_total > 0
    stats = llm.llm_engine.get_stats().spec_decode
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    assert_no_leak(llm.llm_engine)


def test_speculation_off_reports_no_counters(llama_dir):
    llm = LLM(str(llama_dir), block_size=8)
    assert llm.llm_engine.get_stats().spec_decode is None


def test_draft_with_another_vocabulary_is_refused_at_start_up(llama_dir, tiny_model_dir):
    draft_dir = tiny_model_dir("llama", vocab_size=1000)
    with pytest.raises(ValueError, match="vocab_size 1000"):
        LLM(
            str(llama_dir),
            speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2},
        )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "unknown method 'eagle3'"),
        ('{"method": "ngram", "num_speculative_tokens": 2', "not valid JSON"),
    ],
)
def test_bad_speculative_config_is_refused_before_loading(config, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=config)


def test_cli_flag_parses_vllm_json():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(
        parser.parse_args(
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
        )
    )
    assert args.speculative_config.method == "ngram"
    assert args.speculative_config.num_speculative_tokens == 4


SMOLLM2_PROMPTS = [
    "Repeat this sentence exactly: the cat sat on the mat and the dog sat on the log.",
    "def add(a, b):\n    return a + b\n\nRewrite the function above with type hints.",
    "What is the capital of France?",
]


def smollm2_outputs(speculative_config: dict | None) -> list[list[int]]:
    llm = LLM(kv_cache_memory=64 * 1024**2, speculative_config=speculative_config)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for text in SMOLLM2_PROMPTS
    ]
    params = SamplingParams(temperature=0, max_tokens=32)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_no_leak(llm.llm_engine)
    if speculative_config is not None:
        assert_counters_consistent(llm.llm_engine)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def smollm2_reference() -> list[list[int]]:
    return smollm2_outputs(None)


@pytest.mark.slow
def test_smollm2_ngram_greedy_matches_plain_decoding(smollm2_reference):
    assert smollm2_outputs({**NGRAM, "prompt_lookup_min": 2}) == smollm2_reference


@pytest.mark.slow
def test_smollm2_draft_model_greedy_matches_plain_decoding(smollm2_reference):
    """SmolLM2 drafting for itself (the only same-tokenizer pair on this machine): every
    draft is accepted, and the mechanics (own cache, lookahead slots, catch-up) are exercised
    on real weights."""
    config = {
        "method": "draft_model",
        "model": "SmolLM2-135M-Instruct",
        "num_speculative_tokens": 3,
    }
    assert smollm2_outputs(config) == smollm2_reference


def test_counters_are_exported_with_vllm_names(llama_dir, prompts):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvpilot.engine.metrics import PrometheusStatLogger

    llm = LLM(str(llama_dir), block_size=8, speculative_config=NGRAM)
    generate_ids(llm, prompts, greedy())
    stats = llm.llm_engine.get_stats()
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("tiny", registry, 2048, {"block_size": 8})
    logger.record_stats(stats)
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if s.name.startswith("vllm:spec_decode")
    }
    spec = stats.spec_decode
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == spec.num_drafts
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == spec.num_draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == spec.num_accepted_tokens
    per_pos = [
        samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))]
        for i in range(len(spec.num_accepted_tokens_per_pos))
    ]
    assert per_pos == spec.num_accepted_tokens_per_pos
    assert spec.num_accepted_tokens > 0


def test_ngram_with_tensor_parallelism(llama_dir, prompts, reference):
    """Two ranks (gloo on CPU): each rank verifies the same drafts with the same generators."""
    llm = LLM(str(llama_dir), block_size=8, tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        assert generate_ids(llm, prompts, greedy()) == reference
        assert_counters_consistent(llm.llm_engine)
    finally:
        llm.llm_engine.shutdown()


def test_draft_model_with_tensor_parallelism_is_refused(llama_dir):
    config = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="needs tensor_parallel_size 1"):
        LLM(str(llama_dir), tensor_parallel_size=2, speculative_config=config)
