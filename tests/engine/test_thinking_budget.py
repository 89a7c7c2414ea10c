"""The thinking token budget (vLLM's ``thinking_token_budget``) on the default model (SmolLM2,
whose tokenizer spells ``<think>`` and ``</think>`` in three tokens each): the end sequence
forced after exactly N thinking tokens, then free decoding again; budget 0; thinking tokens of
the prompt counted; a closed block not forced; requests without a budget unchanged; ``n > 1``,
speculative decoding, preemption and the prefix cache; the reasoning config and its errors;
the tracker's rules on made-up token ids."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.reasoning_config import ReasoningConfig, ThinkingTokenIds
from kvpilot.engine.request import Request
from kvpilot.engine.sampling_params import StructuredOutputsParams
from kvpilot.engine.thinking_budget import ThinkingBudgetTracker
from tests.engine.helpers import assert_no_leak, generate_ids

QUESTIONS = [
    "What is 2 + 2?",
    "Name a primary colour.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
]
MAX_TOKENS = 20


def greedy(budget: int | None = None, max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        thinking_token_budget=budget,
        **kwargs,
    )


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The default model with ``deepseek_r1``'s markers (``<think>``, ``</think>``)."""
    return LLM(reasoning_parser="deepseek_r1", max_model_len=512)


@pytest.fixture(scope="module")
def plain() -> LLM:
    """The default model without a reasoning config."""
    return LLM(max_model_len=512)


@pytest.fixture(scope="module")
def tokenizer(plain):
    return plain.get_tokenizer()


@pytest.fixture(scope="module")
def end(tokenizer) -> list[int]:
    return tokenizer.encode("</think>", add_special_tokens=False)


def chat_prompt(tokenizer, question: str | list[dict], suffix: str) -> list[int]:
    """The chat prompt of ``question`` (or of a conversation) with ``suffix`` after the
    generation prompt."""
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text + suffix, add_special_tokens=False)


@pytest.fixture(scope="module")
def thinking(tokenizer) -> list[list[int]]:
    """Prompts that end right after ``<think>``: every generated token is a thinking token."""
    return [chat_prompt(tokenizer, q, "<think>") for q in QUESTIONS]


@pytest.fixture(scope="module")
def free(plain, thinking) -> list[list[int]]:
    """Greedy outputs without a budget (SmolLM2 never closes a think block by itself)."""
    return generate_ids(plain, thinking, greedy())


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_the_end_is_forced_after_exactly_budget_thinking_tokens(
    llm, plain, thinking, free, end, budget
):
    outputs = generate_ids(llm, thinking, greedy(budget))
    for prompt, output, reference in zip(thinking, outputs, free, strict=True):
        assert reference[: budget + len(end)] != reference[:budget] + end
        assert output[: budget + len(end)] == reference[:budget] + end
        # Then decoding is free again: the rest is the plain greedy continuation.
        head = output[: budget + len(end)]
        [rest] = generate_ids(plain, [prompt + head], greedy(max_tokens=MAX_TOKENS - len(head)))
        assert output == head + rest
    assert_no_leak(llm.llm_engine)


def test_thinking_tokens_of_the_prompt_count(llm, tokenizer, thinking, end):
    # "<think>\nLet me see." leaves 5 thinking tokens in the prompt: a budget of 7 allows 2 more.
    prompt = chat_prompt(tokenizer, QUESTIONS[0], "<think>\nLet me see.")
    assert prompt[: len(thinking[0])] == thinking[0] and len(prompt) == len(thinking[0]) + 5
    [output] = generate_ids(llm, [prompt], greedy(7))
    [reference] = generate_ids(llm, [prompt], greedy())
    assert output[:5] == reference[:2] + end
    # A prompt over its budget is forced from its first token.
    [over] = generate_ids(llm, [prompt], greedy(3))
    assert over[:3] == end


def test_a_prompt_that_closed_its_think_block_is_not_forced(llm, plain, tokenizer):
    closed = [chat_prompt(tokenizer, q, "<think>\nEasy.\n</think>\n\n") for q in QUESTIONS[:2]]
    free = generate_ids(plain, closed, greedy())
    assert generate_ids(llm, closed, greedy(0)) == free


def test_requests_without_a_budget_are_unchanged(llm, plain, tokenizer, thinking, free):
    """Same tokens as on an engine without a reasoning config, in batches shared with
    budgeted requests (the CPU engine is batch invariant)."""
    others = [chat_prompt(tokenizer, q, "") for q in QUESTIONS]
    expected = generate_ids(plain, others, greedy())
    prompts = [{"prompt_token_ids": p} for p in thinking + others]
    params = [greedy(2)] * len(thinking) + [greedy()] * len(others)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[len(thinking) :]] == expected
    assert generate_ids(llm, thinking, greedy()) == free


def test_every_sequence_of_n_has_its_own_budget(llm, thinking, end):
    params = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, thinking_token_budget=4
    )
    [output] = llm.generate([{"prompt_token_ids": thinking[3]}], params, use_tqdm=False)
    sequences = [c.token_ids for c in output.outputs]
    assert len({tuple(s[:4]) for s in sequences}) > 1  # they did sample
    assert all(s[4:7] == end for s in sequences)


def test_a_constrained_request_is_not_forced(llm, thinking):
    """kvpilot constrains the whole output (vLLM starts the grammar after the reasoning): a
    forced end would break the grammar, so the budget does not apply."""
    choice = StructuredOutputsParams(choice=["Four."])
    [output] = llm.generate(
        [{"prompt_token_ids": thinking[0]}],
        SamplingParams(
            temperature=0, max_tokens=8, thinking_token_budget=0, structured_outputs=choice
        ),
        use_tqdm=False,
    )
    assert output.outputs[0].text == "Four."


@pytest.mark.slow
@pytest.mark.parametrize(
    "speculative_config",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 3},
    ],
    ids=["ngram", "draft_model"],
)
def test_speculative_decoding_forces_the_same_tokens(llm, tokenizer, end, speculative_config):
    # An earlier turn that closed its block gives the n-gram proposer "</think>" to propose.
    history = [
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nFour."},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    prompts = [chat_prompt(tokenizer, history, "<think>\n")]
    prompts += [chat_prompt(tokenizer, q, "<think>") for q in QUESTIONS[1:]]
    params = [greedy(3), greedy(0), greedy(6), greedy()]
    spec = LLM(
        reasoning_parser="deepseek_r1", max_model_len=512, speculative_config=speculative_config
    )
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = llm.generate(requests, params, use_tqdm=False)
    outputs = spec.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert spec.llm_engine.get_stats().spec_decode.num_drafts > 0
    # A sampled request's drafts are checked against the forced token as well.
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=10, thinking_token_budget=2)
    [output] = spec.generate(requests[1:2], sampled, use_tqdm=False)
    assert output.outputs[0].token_ids[2:5] == end
    assert_no_leak(spec.llm_engine)


def test_preemption_and_prefix_cache_hits_neither_reset_nor_double_count(llm, thinking):
    """Preempted sequences are recomputed from their tokens: the count is read from the
    tokens, so a recomputed sequence is forced where it would have been."""
    params = [greedy(b, max_tokens=24) for b in (2, 6, 9, 13)]
    requests = [{"prompt_token_ids": p} for p in thinking]
    expected = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    # 4 sequences of ~45 tokens in 20 blocks of 8: some are preempted, several times.
    small = LLM(
        reasoning_parser="deepseek_r1", max_model_len=128, block_size=8, num_gpu_blocks_override=20
    )
    for _ in range(2):  # the second time, the prompts' blocks are in the prefix cache
        outputs = small.generate(requests, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = small.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert_no_leak(small.llm_engine)


def test_a_budget_without_a_reasoning_config_is_refused(plain, thinking):
    with pytest.raises(ValueError, match="thinking_token_budget needs .* --reasoning-parser"):
        plain.generate([{"prompt_token_ids": thinking[0]}], greedy(4), use_tqdm=False)
    assert_no_leak(plain.llm_engine)


def test_a_longer_end_is_forced_whole_then_decoding_is_free(plain, tokenizer, thinking, free):
    """``reasoning_end_str`` may put a phrase before the parser's end tag: the whole text is
    forced, and nothing once the tag is there."""
    forced = "\nTime to answer.</think>"
    llm = LLM(
        max_model_len=512,
        reasoning_parser="deepseek_r1",
        reasoning_config={"reasoning_end_str": forced},
    )
    end = tokenizer.encode(forced, add_special_tokens=False)
    [output] = generate_ids(llm, thinking[:1], greedy(2))
    head = free[0][:2] + end
    assert output[: len(head)] == head
    [rest] = generate_ids(plain, [thinking[0] + head], greedy(max_tokens=MAX_TOKENS - len(head)))
    assert output == head + rest


def test_sampling_params_take_vllms_values():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    for bad in (-2, 1.5, 3.0, True, "3"):
        with pytest.raises(ValueError, match=r"^thinking_token_budget: must be an integer >= 0"):
            SamplingParams(thinking_token_budget=bad)


def test_the_reasoning_config_defaults_to_the_parsers_tags(tokenizer):
    think, close = (tokenizer.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    config = EngineArgs(reasoning_parser="qwen3").reasoning_config
    assert config == ReasoningConfig(reasoning_parser="qwen3")
    assert config.thinking_token_ids(tokenizer) == ThinkingTokenIds(
        tuple(think), tuple(close), tuple(close)
    )
    # The flag's parser wins over the JSON's (vLLM's rule); the JSON's strings win over its tags.
    config = EngineArgs(
        reasoning_parser="deepseek_r1",
        reasoning_config='{"reasoning_parser": "qwen3", "reasoning_end_str": "Done.</think>"}',
    ).reasoning_config
    assert config.reasoning_parser == "deepseek_r1"
    ids = config.thinking_token_ids(tokenizer)
    assert ids.end == tuple(tokenizer.encode("Done.</think>", add_special_tokens=False))
    assert ids.natural_end == tuple(close)
    # Strings alone, without a parser: the end is also the one watched for.
    ids = ReasoningConfig("", "[T]", "[/T]").thinking_token_ids(tokenizer)
    assert ids.end == ids.natural_end == tuple(tokenizer.encode("[/T]", add_special_tokens=False))
    # Nothing to tell where a block ends: no markers (a budget is then refused).
    assert ReasoningConfig(reasoning_start_str="<think>").thinking_token_ids(tokenizer) is None
    assert EngineArgs().reasoning_config is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"reasoning_start": "<think>"}', "unknown key"),
        ("[1]", "must be a JSON object"),
        ("{", "not valid JSON"),
        ({"reasoning_end_str": 5}, '"reasoning_end_str" must be a string'),
        ({"reasoning_parser": "nope"}, "unknown \"reasoning_parser\" 'nope'"),
    ],
)
def test_bad_reasoning_configs_are_refused_before_loading(value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(reasoning_config=value)


def test_the_cli_flag_parses_vllms_json():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--reasoning-config", '{"reasoning_start_str": "<t>"}'])
    assert EngineArgs.from_cli_args(args).reasoning_config == ReasoningConfig(
        reasoning_start_str="<t>"
    )
    # The JSON keys keep their names (not --reasoning-parser): they are what a user writes.
    with pytest.raises(ValueError) as error:
        EngineArgs.from_cli_args(parser.parse_args(["--reasoning-config", '{"x": 1}']))
    assert str(error.value) == (
        '--reasoning-config: unknown key(s) "x"; accepted: "reasoning_parser", '
        '"reasoning_start_str", "reasoning_end_str"'
    )


# The tracker's rules on made-up ids: start [1, 2], end [3, 4, 5].
MARKERS = ThinkingTokenIds(start=(1, 2), end=(3, 4, 5), natural_end=(3, 4, 5))


def tracked(
    prompt: list[int], output: list[int], budget: int
) -> tuple[ThinkingBudgetTracker, Request]:
    tracker = ThinkingBudgetTracker(MARKERS)
    request = Request("r", prompt, SamplingParams(thinking_token_budget=budget), frozenset(), 99)
    for token in output:
        request.append_output_token(token)
    tracker.add_request("r")
    return tracker, request


@pytest.mark.parametrize(
    ("prompt", "output", "budget", "drafts", "expected"),
    [
        ([9, 1, 2], [7, 7], 3, [], [None]),  # 2 thinking tokens of 3
        ([9, 1, 2], [7, 7, 7], 3, [], [3]),  # spent: the end's first token
        ([9, 1, 2], [7, 7, 7, 3], 3, [], [4]),  # then the next one
        ([9, 1, 2], [7, 7, 7, 3, 4, 5], 3, [], [None]),  # closed: free again
        ([9, 1, 2, 7, 7], [3], 3, [], [4]),  # the model began the end itself
        ([9, 1, 2, 3, 4, 5], [], 0, [], [None]),  # the prompt closed its block
        ([9, 1, 2, 3, 4, 5], [1, 2], 0, [], [3]),  # a block the model opens counts
        ([9], [7, 7], 0, [], [None]),  # no block at all
        # Row j follows the first j drafts: 1 thinking token, then 2 (spent), then the end's
        # first token drafted (its second is due), then a draft that broke the end off.
        ([1, 2], [7], 2, [7, 3, 8], [None, 3, 4, 3]),
    ],
)
def test_forced_rows_follow_the_tokens(prompt, output, budget, drafts, expected):
    tracker, request = tracked(prompt, output, budget)
    assert tracker.forced_rows(request, drafts) == expected


def test_markers_are_scanned_again_after_the_output_is_cut_back():
    tracker, request = tracked([1, 2], [7, 3, 4, 5, 7], 1)
    assert tracker.forced_rows(request, []) == [None]
    request.truncate_output(1)  # a stop string inside accepted drafts
    assert tracker.forced_rows(request, []) == [3]
