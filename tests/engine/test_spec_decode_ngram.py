"""Prompt lookup: the longest recent suffix match between prompt_lookup_min and _max."""

from __future__ import annotations

import numpy as np
import pytest

from kvpilot.engine.spec_decode.ngram_proposer import NgramProposer, propose_ngram


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, spelled out: longest n first, then the latest earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_copies_what_followed_the_earlier_occurrence():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert propose_ngram(tokens, 1, 3, 3) == [8, 9, 1]
    # Fewer tokens than k follow the match near the end.
    assert propose_ngram([1, 2, 3, 1, 2], 1, 2, 5) == [3, 1, 2]


def test_prefers_the_longest_match_over_a_more_recent_shorter_one():
    # Suffix [3, 4]: the 2-gram occurs at 0..1 (followed by 10), the 1-gram 4 also at 5 (then 11).
    tokens = [3, 4, 10, 0, 0, 4, 11, 3, 4]
    assert propose_ngram(tokens, 1, 2, 1) == [10]
    # With max_n = 1 only the latest occurrence of [4] counts.
    assert propose_ngram(tokens, 1, 1, 1) == [11]


def test_prefers_the_most_recent_of_equally_long_matches():
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert propose_ngram(tokens, 2, 2, 1) == [8]


def test_no_match_below_min_n():
    tokens = [1, 2, 3, 9, 2, 3]
    assert propose_ngram(tokens, 3, 4, 2) == []
    assert propose_ngram(tokens, 2, 4, 2) == [9, 2]
    assert propose_ngram([4], 1, 3, 2) == []
    assert propose_ngram([], 1, 3, 2) == []


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force_on_random_sequences(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        length = int(rng.integers(1, 60))
        tokens = rng.integers(0, 4, size=length).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        assert propose_ngram(tokens, min_n, max_n, k) == brute_force(tokens, min_n, max_n, k)


def test_proposer_caps_drafts_at_k_and_the_callers_limit():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=2)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer.draft(tokens) == [3, 4]
    assert proposer.draft(tokens, max_num_tokens=1) == [3]
    assert proposer.draft(tokens, max_num_tokens=0) == []


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(0, 2, 1), (3, 2, 1), (1, 2, -1)])
def test_bad_arguments_are_refused(min_n, max_n, k):
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1], min_n, max_n, k)
