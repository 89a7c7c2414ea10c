"""Penalties, logit_bias, min_tokens and logprobs against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.engine.logits_processors import apply_logits_processors, compute_logprobs
from kvpilot.engine.sampling_params import SamplingParams

EOS = 5


def run(logits, params, prompts, outputs, eos=frozenset({EOS})):
    return apply_logits_processors(
        torch.tensor(logits, dtype=torch.float32), params, prompts, outputs, set(eos)
    ).tolist()


def test_default_params_leave_logits_untouched():
    logits = [[1.0, -2.0, 0.5, 3.0, 0.0, 2.0]]
    assert run(logits, [SamplingParams()], [[0, 1]], [[3, 3]]) == logits


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = [[2.0, -1.0, 0.5, 3.0, -4.0, 1.0]]
    # token 0 and 1 in the prompt, 3 and 4 in the output; 2 and 5 unseen.
    out = run(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 1]], [[3, 4, 3]])
    assert out == [[1.0, -2.0, 0.5, 1.5, -8.0, 1.0]]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = [[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # token 0 appears in the prompt only: untouched. Token 2 twice, token 4 once.
    out = run(logits, [params], [[0, 0]], [[2, 4, 2]])
    assert out[0] == pytest.approx([1.0, 1.0, 1.0 - 2 * 0.5 - 0.25, 1.0, 1.0 - 0.5 - 0.25, 1.0])


def test_negative_penalties_encourage_repetition():
    params = SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5)
    out = run([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], [params], [[]], [[1, 1, 1]])
    assert out[0] == pytest.approx([0.0, 3.5, 0.0, 0.0, 0.0, 0.0])


def test_all_penalties_combine_repetition_first():
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.2, presence_penalty=0.1)
    out = run([[3.0, -3.0, 3.0, 3.0, 3.0, 3.0]], [params], [[1]], [[0, 0]])
    # token 0: 3 / 1.5 - 2 * 0.2 - 0.1 = 1.5; token 1 (prompt): -3 * 1.5 = -4.5
    assert out[0] == pytest.approx([1.5, -4.5, 3.0, 3.0, 3.0, 3.0])


def test_logit_bias_adds_per_token():
    params = SamplingParams(logit_bias={2: 5.0, 4: -100.0})
    out = run([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], [params], [[0]], [[]])
    assert out == [[1.0, 1.0, 6.0, 1.0, -99.0, 1.0]]


def test_allowed_token_ids_leave_only_those_tokens():
    logits = [[1.0, -2.0, 0.5, 3.0, 0.0, 2.0]]
    out = run(logits, [SamplingParams(allowed_token_ids=[1, 4])], [[0]], [[]])
    inf = float("-inf")
    assert out == [[inf, -2.0, inf, inf, 0.0, inf]]


def test_bad_words_ban_the_last_token_after_the_rest_of_their_sequence():
    logits = [[0.0] * 6, [0.0] * 6, [0.0] * 6]
    params = SamplingParams(bad_words=["x"], bad_words_token_ids=[[4], [2, 3]])
    # Token 4 (a one-token word) always; 3 only right after 2.
    out = run(logits, [params] * 3, [[0]] * 3, [[1, 2], [2, 1], []])
    inf = float("-inf")
    assert out == [
        [0.0, 0.0, 0.0, inf, inf, 0.0],
        [0.0, 0.0, 0.0, 0.0, inf, 0.0],
        [0.0, 0.0, 0.0, 0.0, inf, 0.0],
    ]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    logits = [[1.0] * 6, [1.0] * 6]
    out = run(logits, [params, params], [[0], [0]], [[1], [1, 2]])
    inf = -math.inf
    assert out[0] == [1.0, 1.0, 1.0, inf, 1.0, inf]  # one output so far: still masked
    assert out[1] == [1.0] * 6  # two outputs: free to stop


def test_min_tokens_with_ignore_eos_masks_only_stop_token_ids():
    params = SamplingParams(min_tokens=3, stop_token_ids=[1], ignore_eos=True)
    out = run([[0.0] * 6], [params], [[0]], [[]])
    assert out == [[0.0, -math.inf, 0.0, 0.0, 0.0, 0.0]]


def test_rows_are_independent():
    logits = [[2.0, 2.0, 2.0, 2.0, 2.0, 2.0]] * 3
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(presence_penalty=1.0),
    ]
    out = run(logits, params, [[0], [1], [2]], [[3], [3], [3]])
    assert out[0] == [2.0] * 6
    assert out[1] == [2.0, 1.0, 2.0, 1.0, 2.0, 2.0]
    assert out[2] == [2.0, 2.0, 2.0, 1.0, 2.0, 2.0]


def test_modifies_in_place_and_returns_the_same_tensor():
    logits = torch.ones(1, 6)
    result = apply_logits_processors(
        logits, [SamplingParams(logit_bias={1: 1.0})], [[0]], [[]], {EOS}
    )
    assert result is logits
    assert logits[0, 1].item() == 2.0


def test_mismatched_batch_sizes_are_an_error():
    with pytest.raises(ValueError, match="2 logits rows but 1 params"):
        run([[0.0] * 6] * 2, [SamplingParams()], [[0]], [[]])


def test_compute_logprobs_top_k_with_ranks_and_the_sampled_token():
    logits = torch.tensor([[math.log(4.0), math.log(2.0), math.log(1.0), math.log(1.0)]] * 3)
    sampled = torch.tensor([2, 0, 1])
    results = compute_logprobs(logits, sampled, [2, None, 0])
    lp = [math.log(4 / 8), math.log(2 / 8), math.log(1 / 8)]

    sampled_lp, top = results[0]
    assert sampled_lp == pytest.approx(lp[2])
    assert top.keys() == {0, 1, 2}
    assert top[0][0] == pytest.approx(lp[0]) and top[0][1] == 1
    assert top[1][0] == pytest.approx(lp[1]) and top[1][1] == 2
    # token 2 ties with token 3: rank counts strictly better tokens only.
    assert top[2][0] == pytest.approx(lp[2]) and top[2][1] == 3

    assert results[1] is None
    sampled_lp, top = results[2]
    assert sampled_lp == pytest.approx(lp[1])
    assert top.keys() == {1} and top[1][1] == 2


def test_compute_logprobs_uses_raw_logits_softmax():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    results = compute_logprobs(logits, torch.tensor([7, 11]), [5, 5])
    expected = torch.log_softmax(logits, dim=-1)
    for row, token in enumerate([7, 11]):
        sampled_lp, top = results[row]
        assert sampled_lp == pytest.approx(expected[row, token].item(), abs=1e-6)
        best = expected[row].topk(5)
        for rank, (value, token_id) in enumerate(zip(best.values, best.indices, strict=True)):
            assert top[int(token_id)] == (pytest.approx(value.item(), abs=1e-6), rank + 1)
        assert len(top) in (5, 6)
