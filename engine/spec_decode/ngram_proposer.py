"""Prompt lookup decoding: draft the tokens that followed an earlier copy of the sequence's end.

Saxena 2023, "Prompt Lookup Decoding" (vLLM's ``ngram`` method): when an answer repeats its
prompt (code editing, quoting), the last few tokens usually occurred before, and what followed
them then is a good guess of what follows now. No model runs: the proposer costs one pass over
the sequence's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpilot.engine.request import Request
from kvpilot.engine.scheduler_output import SchedulerOutput


def propose_ngram(
    token_ids: Sequence[int] | np.ndarray, min_n: int, max_n: int, num_tokens: int
) -> list[int]:
    """Draft up to ``num_tokens`` tokens by the longest suffix match.

    Finds the longest ``n`` in ``[min_n, max_n]`` for which the last ``n`` tokens also occur
    earlier in ``token_ids`` (an occurrence that is followed by at least one token), choosing
    the most recent occurrence of that length, and returns the tokens that followed it.

    Vectorised: for every candidate end position ``j`` it computes the length of the common
    suffix of ``token_ids[:j + 1]`` and ``token_ids`` (capped at ``max_n``) with ``max_n``
    array comparisons, ``O(len(token_ids) * max_n)``.

    Args:
        token_ids: the sequence so far (prompt then output), ``[seq_len]`` integers.
        min_n: shortest suffix to match (tokens, >= 1).
        max_n: longest suffix to match (tokens, >= min_n).
        num_tokens: the most tokens to propose (k).

    Returns:
        The drafted token ids, between 0 and ``num_tokens`` of them (fewer when the match sits
        near the end of the sequence, none when no suffix of ``min_n`` tokens recurs).

    Raises:
        ValueError: when ``1 <= min_n <= max_n`` or ``num_tokens >= 0`` does not hold.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    seq_len = tokens.shape[0]
    # Candidate occurrences end at j <= seq_len - 2, so that a token follows them.
    num_candidates = seq_len - 1
    if num_tokens == 0 or num_candidates < min_n:
        return []
    ends = np.arange(num_candidates)
    # match_len[j]: how many tokens ending at j equal the sequence's last tokens (<= max_n).
    match_len = np.zeros(num_candidates, dtype=np.int64)
    still_matching = np.ones(num_candidates, dtype=bool)
    for offset in range(min(max_n, num_candidates)):
        starts = ends - offset
        valid = starts >= 0
        equal = np.zeros(num_candidates, dtype=bool)
        equal[valid] = tokens[starts[valid]] == tokens[seq_len - 1 - offset]
        still_matching &= equal
        if not still_matching.any():
            break
        match_len += still_matching
    best = int(match_len.max())
    if best < min_n:
        return []
    # The most recent occurrence of the longest match.
    end = int(np.flatnonzero(match_len == best)[-1])
    return tokens[end + 1 : end + 1 + num_tokens].tolist()


class NgramProposer:
    """Drafts tokens for requests from their own prompt and output (the ``ngram`` method).

    Args:
        prompt_lookup_min: shortest suffix matched (tokens).
        prompt_lookup_max: longest suffix matched (tokens).
        num_speculative_tokens: the most tokens drafted per request and step (k).
    """

    def __init__(
        self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int
    ) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens

    def draft(self, token_ids: Sequence[int], max_num_tokens: int | None = None) -> list[int]:
        """Drafts for one sequence (prompt + output tokens so far), at most
        ``min(k, max_num_tokens)`` of them."""
        limit = self.k if max_num_tokens is None else min(self.k, max_num_tokens)
        return propose_ngram(token_ids, self.min_n, self.max_n, max(limit, 0))

    def propose(self, scheduler_output: SchedulerOutput, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` of ``requests`` (unfinished, sampled this step), each at
        most the tokens it may still emit after the target's own next token."""
        del scheduler_output  # the proposer reads nothing but the requests' tokens
        for request in requests:
            request.spec_token_ids = self.draft(
                request.all_token_ids, request.max_tokens - request.num_output_tokens - 1
            )
