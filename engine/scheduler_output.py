"""The scheduler's decision for one step: plain data the model runner turns into tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.engine.request import Request

if TYPE_CHECKING:  # the API process imports this module without torch
    import torch


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request (read-only for the model runner).
        num_computed_tokens: tokens already in the KV cache; the new tokens are
            ``request.all_token_ids[num_computed_tokens:num_computed_tokens + num_new_tokens]``
            at those positions.
        num_new_tokens: tokens to compute this step (> 0).
        block_ids: the request's block table after this step's allocation.
        sample: whether a token is due (the new tokens reach the end of the sequence); a partial
            prefill chunk samples nothing.
        spec_token_ids: draft tokens scored after the sequence's real tokens (speculative
            decoding); counted in ``num_new_tokens``, so the input tokens are
            ``all_token_ids[num_computed_tokens:] + spec_token_ids``.
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    sample: bool
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """Everything the model runner needs for one forward pass.

    Attributes:
        scheduled: requests in batch order (running ones first, then newly admitted).
        num_scheduled_tokens: sum of ``num_new_tokens`` (tokens).
        preempted_request_ids: requests preempted while building this step.
        finished_request_ids: requests that finished or were aborted since the last step
            (the model runner drops their per-request state).
        structured_output_request_ids: the constrained requests that sample this step, in the
            order of ``grammar_bitmask``'s rows (structured outputs; never speculated).
        grammar_bitmask: ``[len(structured_output_request_ids), ceil(vocab_size / 32)]`` int32
            on the CPU, bit ``j % 32`` of word ``j // 32`` set when token ``j`` is allowed next;
            None when no constrained request samples.
        forced_token_ids: request id -> per logits row of the request this step (its drafts,
            then the one after them) the token id forced there or None, for the sequences whose
            thinking token budget is spent (``thinking_budget.py``); empty when none is.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    forced_token_ids: dict[str, list[int | None]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class RequestDelta:
    """What one step added to a sequence (``Scheduler.update_from_output``'s answer).

    Attributes:
        request: the sequence (finished ones included; their blocks are freed).
        num_output_tokens_before: its output tokens before this step (tokens); 0 for its
            first tokens.
        new_token_ids: the tokens it got this step, ``[num_new]`` (several with accepted
            drafts), up to and including one that finished it.
    """

    request: Request
    num_output_tokens_before: int
    new_token_ids: list[int]
