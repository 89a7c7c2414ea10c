"""The input processor's checks, the ones the engine and the OpenAI server share."""

import pytest

from kvpilot.engine.input_processor import (
    bad_words_token_ids,
    check_cache_salt,
    check_sampling_params,
    check_token_ids,
    sequence_ids,
)
from kvpilot.engine.model_loader import load_tokenizer
from kvpilot.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(logit_bias={6: 1.0}), "logit_bias: token ids \\[6\\]"),
        (SamplingParams(min_tokens=1, stop_token_ids=[-1]), "stop_token_ids: token ids \\[-1\\]"),
        (SamplingParams(logprobs=7), "logprobs must be at most the vocabulary size \\(6\\)"),
        (SamplingParams(prompt_logprobs=7), "prompt_logprobs must be at most"),
        (SamplingParams(allowed_token_ids=[0, 6]), "allowed_token_ids: token ids \\[6\\]"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_named(params, match):
    with pytest.raises(ValueError, match=match):
        check_sampling_params(params, vocab_size=6)


def test_ids_inside_the_vocabulary_pass():
    check_sampling_params(
        SamplingParams(logit_bias={0: 1.0, 5: -1.0}, stop_token_ids=[5], logprobs=6), vocab_size=6
    )
    check_token_ids([0, 5], 6, "prompt")


def test_the_first_five_offenders_are_listed():
    with pytest.raises(ValueError, match=r"^prompt: token ids \[6, 7, 8, 9, 10\] are outside the "):
        check_token_ids([1, 6, 7, 8, 9, 10, 11], 6, "prompt")


@pytest.mark.parametrize("salt", ["", 3, b"x"])
def test_a_salt_must_be_a_non_empty_string(salt):
    with pytest.raises(ValueError, match="cache_salt: must be a non-empty string"):
        check_cache_salt(salt)


def test_n_fans_out_into_numbered_sequence_ids():
    assert sequence_ids("r", 1) == ["r"]
    assert sequence_ids("r", 3) == ["r:0", "r:1", "r:2"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"bad_words": ["ok", " "]}, "bad_words must be non-blank strings"),
    ],
)
def test_vllms_token_restrictions_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_vllms_seed_minus_one_means_no_seed_and_extra_args_are_carried():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(extra_args={"k": 1}).extra_args == {"k": 1}


def test_a_bad_word_is_banned_alone_and_after_a_space(default_model_dir):
    # As vLLM tokenizes bad words: the word as at a text's start, and with a leading space
    # (another first token, as many tokens) as after another word.
    tokenizer = load_tokenizer(default_model_dir)
    [alone, spaced] = bad_words_token_ids(tokenizer, ["Paris"])
    assert tokenizer.decode(alone) == "Paris"
    assert tokenizer.decode(spaced) == " Paris"
    assert alone != spaced
