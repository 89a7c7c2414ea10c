"""What the engine returns per request (vLLM's ``RequestOutput`` / ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.lora.request import LoRARequest


@dataclass
class Logprob:
    """Log probability of one candidate token.

    Attributes:
        logprob: natural log of the token's probability under the raw model logits.
        rank: 1 for the most likely token.
        decoded_token: the token's text, or None when not decoded.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Timestamps of one request (seconds since the epoch, ``time.time()``)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request; ``text`` and ``token_ids`` are cumulative.

    Attributes:
        index: the sequence's index among the request's ``n``.
        text: the output text safe to show so far.
        token_ids: the output tokens so far.
        cumulative_logprob: sum of the sampled tokens' logprobs, None unless logprobs asked.
        logprobs: per output token ``{token_id: Logprob}`` (top ones plus the sampled one), or
            None unless ``SamplingParams.logprobs`` is set.
        finish_reason: "stop", "length", "abort", or None while running.
        stop_reason: the stop string or stop token id that ended it (None for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step.

    Attributes:
        request_id: the id given to ``add_request``.
        prompt: the prompt text when one was given, else None.
        prompt_token_ids: the prompt tokens.
        outputs: one ``CompletionOutput`` per sequence (``n`` of them).
        finished: True once every sequence finished.
        num_cached_tokens: prompt tokens served from the prefix cache (first sequence).
        metrics: timestamps.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, one entry per prompt
            token: None for the first (nothing precedes it), then ``{token_id: Logprob}``
            holding the prompt token and the top ``prompt_logprobs`` candidates at its
            position, as ``CompletionOutput.logprobs``; in every output from the first on.
            None when not asked.
        lora_request: the LoRA adapter the request ran with, or None (the base model).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: LoRARequest | None = None
