"""One sequence's state inside the engine: its tokens and how many of them are in the KV cache."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import RequestMetrics
from kvpilot.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life (vLLM V1's ``RequestStatus``)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` ("stop", "length", "abort"), None while unfinished."""
        return self.value if self.is_finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass(eq=False)
class Request:
    """A sequence being generated: ``num_computed_tokens`` chases ``num_tokens``.

    Every step the scheduler gives the request up to ``num_tokens - num_computed_tokens`` new
    tokens to compute (a whole prompt, a chunk of it, or the one token sampled last step); once
    all its tokens are computed the model runner samples the next one, which is appended to
    ``output_token_ids``. Preemption sets ``num_computed_tokens`` back to 0 (recompute).

    Attributes:
        request_id: unique among unfinished requests of the engine.
        prompt_token_ids: the prompt (tokens).
        sampling_params: how to sample.
        eos_token_ids: token ids that end generation unless ``ignore_eos``.
        max_tokens: output limit after clamping to the model length and KV capacity (tokens).
        cache_salt: isolates prefix-cache entries (tenants); part of the first block's hash.
        lora_request: the LoRA adapter applied to this sequence, or None (base model).
        lora_digest: the adapter's weight digest; with its name, part of the first block's
            hash, so different adapters (or new weights under one name) never share blocks.
        seed: the sampler seed of this sequence (``sampling_params.seed + index`` for fan-out).
        block_hashes: hashes of the full blocks of ``all_token_ids`` (prefix caching).
        num_cached_tokens: prompt tokens served from the prefix cache at first scheduling
            (-1 until then).
        spec_token_ids: draft tokens proposed for the next step (speculative decoding); they
            are not part of ``all_token_ids`` until the target model accepts them.
        priority: the request's priority under the ``priority`` scheduling policy (lower is
            served first; vLLM's).
        num_prompt_logprobs: top candidates to report with each prompt token's logprob
            (``SamplingParams.prompt_logprobs``), or None; set on the first sequence of a
            request only, since its ``n`` sequences share the prompt.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    arrival_time: float = field(default_factory=time.time)
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    lora_digest: str | None = None
    seed: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    block_hashes: list[bytes] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_prompt_logprobs: int | None = None
    priority: int = 0
    times: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.times = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter's name, or None for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether its prompt chunks must still be scored: prompt logprobs asked and no token
        sampled yet (the last prompt chunk samples the first one). Such a request computes its
        whole prompt: it never reads the prefix cache, whose prompt tokens have no logits."""
        return self.num_prompt_logprobs is not None and not self.output_token_ids

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token (its KV is computed next step)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens past the first ``num_output_tokens`` (a stop string matched
        inside a run of accepted draft tokens)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]

    def check_stop(self) -> bool:
        """Finish the request if its last token ends it; return whether it did.

        Order as in vLLM: EOS (unless ``ignore_eos``), then ``stop_token_ids``
        (``stop_reason`` = that id), then the length limit, so that a stop token sampled as
        the last allowed one still finishes with ``"stop"`` (and its text is left out). EOS and
        stop ids count only from ``min_tokens`` on. Stop strings are the detokenizer's.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        may_stop = self.num_output_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif may_stop and last in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
        elif self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return self.is_finished
