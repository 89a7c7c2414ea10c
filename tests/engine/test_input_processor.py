"""The input processor's checks, the ones the engine and the OpenAI server share."""

import pytest

from kvpilot.engine.input_processor import (
    check_cache_salt,
    check_sampling_params,
    check_token_ids,
    sequence_ids,
)
from kvpilot.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(logit_bias={6: 1.0}), "logit_bias: token ids \\[6\\]"),
        (SamplingParams(min_tokens=1, stop_token_ids=[-1]), "stop_token_ids: token ids \\[-1\\]"),
        (SamplingParams(logprobs=7), "logprobs must be at most the vocabulary size \\(6\\)"),
        (SamplingParams(prompt_logprobs=7), "prompt_logprobs must be at most"),
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
