"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): each prompt token's
log-probability given the tokens before it, with the top-k candidates at its position.

They come from the hidden states of the prefill rows: the row at position ``j`` scores prompt
token ``j + 1``, so every chunk of a chunked prefill scores the rows that have a next prompt
token, and the prompt's first token has no logprob (nothing precedes it). The logits are
computed a slice of rows at a time, so that a long prompt never holds
``[prompt_len, vocab_size]`` float32 logits at once (a 4k-token prompt over a 49k vocabulary
would need 800 MB, and as much again for the log-softmax).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpilot.engine.logits_processors import TokenLogprobs, compute_logprobs
from kvpilot.engine.scheduler_output import ScheduledRequest

# Float32 logits scored at once (bytes); the log-softmax and top-k take about as much again.
MAX_SLICE_BYTES = 64 * 2**20


def rows_per_slice(vocab_size: int, max_slice_bytes: int = MAX_SLICE_BYTES) -> int:
    """Prompt rows whose ``[rows, vocab_size]`` float32 logits fit ``max_slice_bytes`` (>= 1)."""
    return max(1, max_slice_bytes // (4 * vocab_size))


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    scheduled: list[ScheduledRequest],
    vocab_size: int,
    max_slice_bytes: int = MAX_SLICE_BYTES,
) -> dict[str, list[TokenLogprobs]]:
    """Score the prompt tokens that this step's rows predict, for requests that need it.

    Requests whose ``needs_prompt_logprobs`` is False cost one attribute check each.

    Args:
        compute_logits: the model's head, ``[n, hidden_size]`` -> ``[n, vocab_size]`` float32
            logits (gathered over tensor-parallel ranks: every rank gets the same values).
        hidden: ``[num_tokens, hidden_size]`` final hidden states of the step, request by
            request in ``scheduled`` order, ``num_new_tokens`` rows each.
        scheduled: the step's requests.
        vocab_size: columns of the logits (sizes the slices).
        max_slice_bytes: float32 logits computed at once (bytes); at least one row.

    Returns:
        request id -> one ``(logprob, {token_id: (logprob, rank)})`` per prompt token scored
        this step, in order, the first being prompt token ``num_computed_tokens + 1``; ranks
        are 1-based and the candidates are the top ``num_prompt_logprobs`` plus the prompt
        token (see ``compute_logprobs``). Requests with nothing to score are absent.
    """
    num_slice_rows = rows_per_slice(vocab_size, max_slice_bytes)
    results: dict[str, list[TokenLogprobs]] = {}
    first_row = 0
    for sched in scheduled:
        request = sched.request
        start, first_row = first_row, first_row + sched.num_new_tokens
        if not request.needs_prompt_logprobs:
            continue
        # Rows with a next prompt token: the last prompt position predicts the first output.
        position = sched.num_computed_tokens
        num_rows = min(sched.num_new_tokens, request.num_prompt_tokens - 1 - position)
        if num_rows <= 0:
            continue
        targets = torch.tensor(
            request.prompt_token_ids[position + 1 : position + 1 + num_rows], dtype=torch.long
        )
        scored: list[TokenLogprobs] = []
        for lo in range(0, num_rows, num_slice_rows):
            hi = min(lo + num_slice_rows, num_rows)
            logits = compute_logits(hidden[start + lo : start + hi])
            scored += compute_logprobs(
                logits, targets[lo:hi], [request.num_prompt_logprobs] * (hi - lo)
            )
        results[request.request_id] = scored
    return results
