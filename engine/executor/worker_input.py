"""The per-step message from the driver to the workers: plain data, and only what changed.

vLLM V1's split of its ``SchedulerOutput`` (``NewRequestData`` / ``CachedRequestData``): the
first time the workers see a request they get its prompt, sampling settings and block table
(:class:`NewRequestData`); from then on, each step carries only the tokens the request gained
since the workers last heard of it (the ones sampled last step, or accepted drafts) and the
blocks added to its table (:class:`CachedRequestData`). The driver's
:class:`WorkerInputEncoder` remembers what it has sent; each worker's
:class:`CachedRequestStates` keeps its copy of every request and rebuilds from a
:class:`WorkerInput` the very ``SchedulerOutput`` the driver scheduled, so the model runner
runs unchanged behind either executor.

A request that was preempted (recompute: its blocks freed, ``num_preemptions`` incremented), or
whose tokens were cut back, is sent whole again, as new; finished ones are forgotten on both
sides through ``finished_request_ids``. A decode step of ``B`` requests thus costs about
``B * (request id + 1 token + 1 block id every block_size steps)`` instead of every request's
whole token list, sampling parameters and block table (docs/benchmarks.md, "Driver to worker
messages").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass
class NewRequestData:
    """A request the workers have not seen (or must see again whole), sent once.

    Attributes:
        req_id: the request id.
        prompt_token_ids: its prompt (tokens).
        output_token_ids: tokens it already generated (non-empty when resumed after a
            preemption).
        sampling_params: how to sample.
        seed: its sampler seed, or None.
        max_tokens: its output limit (tokens).
        num_prompt_logprobs: top candidates with each prompt token's logprob, or None.
        lora_request: its LoRA adapter, or None.
        block_ids: its whole block table after this step's allocation.
        num_computed_tokens: tokens already in the KV cache.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int | None
    max_tokens: int
    num_prompt_logprobs: int | None
    lora_request: LoRARequest | None
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """The requests the workers already hold, as parallel lists (vLLM's layout).

    Attributes:
        req_ids: the requests, in batch order.
        new_token_ids: per request, the tokens appended since the last step it was sent in.
        new_block_ids: per request, the blocks appended to its table.
        num_computed_tokens: per request, tokens already in the KV cache.
    """

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class WorkerInput:
    """One step for the workers (the diff form of a ``SchedulerOutput``).

    The batch order is the scheduler's: the running (cached) requests first, then the newly
    admitted ones, which is how ``Scheduler.schedule`` lays a step out.

    Attributes:
        scheduled_new_reqs: requests sent whole this step.
        scheduled_cached_reqs: the others, as deltas.
        num_scheduled_tokens: per scheduled request in batch order, tokens to compute.
        sample: per scheduled request, whether a token is due.
        spec_token_ids: draft tokens of the requests that have some (request id -> drafts).
        finished_request_ids: requests to forget (finished or aborted since the last step).
        structured_output_request_ids, grammar_bitmask, forced_token_ids: as in
            ``SchedulerOutput``.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_request_ids: list[str] = field(default_factory=list)
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    forced_token_ids: dict[str, list[int | None]] = field(default_factory=dict)


@dataclass
class _SentState:
    """What the workers know of one request (the driver's record)."""

    num_tokens: int
    num_blocks: int
    num_preemptions: int


class WorkerInputEncoder:
    """The driver's side: turns each ``SchedulerOutput`` into a :class:`WorkerInput`.

    Every encoded message must reach every worker, in order (the executors send each one to
    all ranks or fail the engine).

    Raises:
        ValueError: from :meth:`encode`, when a step lists an admitted request before a
            running one (the order the workers rebuild would differ).
    """

    def __init__(self) -> None:
        self._sent: dict[str, _SentState] = {}

    def encode(self, scheduler_output: SchedulerOutput) -> WorkerInput:
        """The step as deltas against what the workers were sent before."""
        for request_id in scheduler_output.finished_request_ids:
            self._sent.pop(request_id, None)
        message = WorkerInput(
            finished_request_ids=list(scheduler_output.finished_request_ids),
            structured_output_request_ids=list(scheduler_output.structured_output_request_ids),
            grammar_bitmask=scheduler_output.grammar_bitmask,
            forced_token_ids=scheduler_output.forced_token_ids,
        )
        cached = message.scheduled_cached_reqs
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            request_id = request.request_id
            sent = self._sent.get(request_id)
            resent = sent is None or (
                sent.num_preemptions != request.num_preemptions
                or sent.num_tokens > request.num_tokens
                or sent.num_blocks > len(scheduled.block_ids)
            )
            if resent:
                message.scheduled_new_reqs.append(_new_request_data(scheduled))
            else:
                if message.scheduled_new_reqs:
                    raise ValueError(
                        f"request {request_id} is running but follows a newly admitted one; "
                        "the workers rebuild cached requests first"
                    )
                cached.req_ids.append(request_id)
                cached.new_token_ids.append(request.all_token_ids[sent.num_tokens :])
                cached.new_block_ids.append(scheduled.block_ids[sent.num_blocks :])
                cached.num_computed_tokens.append(scheduled.num_computed_tokens)
            self._sent[request_id] = _SentState(
                request.num_tokens, len(scheduled.block_ids), request.num_preemptions
            )
            message.num_scheduled_tokens.append(scheduled.num_new_tokens)
            message.sample.append(scheduled.sample)
            if scheduled.spec_token_ids:
                message.spec_token_ids[request_id] = list(scheduled.spec_token_ids)
        return message


def _new_request_data(scheduled: ScheduledRequest) -> NewRequestData:
    request = scheduled.request
    return NewRequestData(
        req_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=list(request.output_token_ids),
        sampling_params=request.sampling_params,
        seed=request.seed,
        max_tokens=request.max_tokens,
        num_prompt_logprobs=request.num_prompt_logprobs,
        lora_request=request.lora_request,
        block_ids=list(scheduled.block_ids),
        num_computed_tokens=scheduled.num_computed_tokens,
    )


@dataclass
class _CachedRequestState:
    """A worker's copy of one request: the request as the model runner reads it, and its
    block table (vLLM's ``CachedRequestState``)."""

    request: Request
    block_ids: list[int]


class CachedRequestStates:
    """The worker's side: the requests it holds, updated by each :class:`WorkerInput`.

    Raises:
        KeyError: from :meth:`apply`, a delta for a request this worker never got whole (a
            lost message: the executors never let that happen).
    """

    def __init__(self) -> None:
        self._states: dict[str, _CachedRequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def apply(self, message: WorkerInput) -> SchedulerOutput:
        """Update the copies and return the step as the driver scheduled it."""
        for request_id in message.finished_request_ids:
            self._states.pop(request_id, None)
        states = []
        cached = message.scheduled_cached_reqs
        for request_id, new_tokens, new_blocks in zip(
            cached.req_ids, cached.new_token_ids, cached.new_block_ids, strict=True
        ):
            state = self._states[request_id]
            for token in new_tokens:
                state.request.append_output_token(token)
            state.block_ids.extend(new_blocks)
            states.append(state)
        for new in message.scheduled_new_reqs:
            request = Request(
                request_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params,
                eos_token_ids=frozenset(),  # the worker's sampler holds the model's EOS ids
                max_tokens=new.max_tokens,
                lora_request=new.lora_request,
                seed=new.seed,
                status=RequestStatus.RUNNING,
                num_prompt_logprobs=new.num_prompt_logprobs,
            )
            for token in new.output_token_ids:
                request.append_output_token(token)
            state = _CachedRequestState(request, list(new.block_ids))
            self._states[new.req_id] = state
            states.append(state)
        num_computed = cached.num_computed_tokens + [
            new.num_computed_tokens for new in message.scheduled_new_reqs
        ]
        scheduled = [
            ScheduledRequest(
                request=state.request,
                num_computed_tokens=computed,
                num_new_tokens=num_new,
                block_ids=state.block_ids,
                sample=sample,
                spec_token_ids=message.spec_token_ids.get(state.request.request_id, []),
            )
            for state, computed, num_new, sample in zip(
                states, num_computed, message.num_scheduled_tokens, message.sample, strict=True
            )
        ]
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=sum(message.num_scheduled_tokens),
            finished_request_ids=list(message.finished_request_ids),
            structured_output_request_ids=list(message.structured_output_request_ids),
            grammar_bitmask=message.grammar_bitmask,
            forced_token_ids=message.forced_token_ids,
        )
