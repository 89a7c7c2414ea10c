"""Outputs out: detokenization, stop strings, logprobs and ``RequestOutput`` (vLLM V1's output
processor).

The scheduler hands over, per step, the tokens each sequence got (:class:`RequestDelta`); this
module turns them into text, finds stop strings (the scheduler then stops those sequences,
:meth:`Scheduler.stop_request`), records logprobs with each token's text, counts prompt and
generation tokens, and gathers a user request's ``n`` sequences into one ``RequestOutput``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpilot.engine.detokenizer import IncrementalDetokenizer, logprob_token_text
from kvpilot.engine.logits_processors import TokenLogprobs
from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.scheduler_output import RequestDelta, ScheduledRequest


@dataclass
class SequenceState:
    """Engine-side state of one output sequence: its request, text and logprobs."""

    parent_id: str
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def to_output(self) -> CompletionOutput:
        request = self.request
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.get_text(finished=request.is_finished),
            token_ids=list(request.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )


@dataclass
class ParentRequestState:
    """A user request: its ``n`` sequences share the prompt (and, cached, its blocks).

    ``prompt_logprobs`` (when asked) grows chunk by chunk as the first sequence's prefill
    scores the prompt: ``[None]`` for the first token, then one dict per scored token.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)

    @property
    def prompt_logprobs_ready(self) -> bool:
        """Whether the prompt logprobs, if asked, cover every prompt token."""
        return self.prompt_logprobs is None or len(self.prompt_logprobs) == len(
            self.prompt_token_ids
        )

    def to_output(self) -> RequestOutput:
        first = self.sequences[0].request
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.to_output() for s in self.sequences],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=RequestMetrics(**vars(first.times)),
            lora_request=first.lora_request,
        )


@dataclass(frozen=True)
class StopStringMatch:
    """A stop string found in a sequence's new text: keep ``num_output_tokens`` tokens (the
    match's last token included) and stop with ``stop_reason`` (the string)."""

    request: Request
    num_output_tokens: int
    stop_reason: str


class OutputProcessor:
    """The unfinished user requests and their sequences, from arrival to their last output.

    Args:
        tokenizer: the model's Hugging Face tokenizer (token texts for logprobs).

    Attributes:
        prompt_tokens_total: prompt tokens of sequences that produced a first token (tokens).
        generation_tokens_total: output tokens produced, up to a matched stop string (tokens).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequestState] = {}
        self.sequences: dict[str, SequenceState] = {}
        # Token id -> its text on its own, for logprobs (at most the vocabulary).
        self._token_texts: dict[int, str] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def add_request(self, parent: ParentRequestState) -> None:
        """Track a user request and its sequences (ids checked free by the caller)."""
        self.parents[parent.request_id] = parent
        for seq in parent.sequences:
            self.sequences[seq.request.request_id] = seq

    def is_taken(self, request_id: str) -> bool:
        """Whether ``request_id`` names an unfinished request or one of its sequences."""
        return request_id in self.parents or request_id in self.sequences

    def abort_request(self, request_id: str) -> list[str]:
        """Forget an unfinished user request; its sequence ids (none if it is unknown)."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        seq_ids = [s.request.request_id for s in parent.sequences]
        for seq_id in seq_ids:
            self.sequences.pop(seq_id, None)
        return seq_ids

    def lora_names_in_use(self) -> set[str | None]:
        """The adapters of the unfinished sequences (None for the base model)."""
        return {s.request.lora_name for s in self.sequences.values()}

    def add_prompt_logprobs(
        self, scheduled: Iterable[ScheduledRequest], scored: dict[str, list[TokenLogprobs]]
    ) -> None:
        """Record the prompt tokens one step scored (``scored``: request id -> per token).

        A chunk scored again after a preemption (recompute) is skipped where already recorded,
        so entries are never duplicated.

        Raises:
            RuntimeError: a chunk starts past the recorded ones (a prompt chunk went unscored,
                which the scheduler never allows).
        """
        for sched in scheduled:
            chunk = scored.get(sched.request.request_id)
            if not chunk:
                continue
            parent = self.parents[self.sequences[sched.request.request_id].parent_id]
            recorded = parent.prompt_logprobs
            first = sched.num_computed_tokens + 1
            if first > len(recorded):
                raise RuntimeError(
                    f"prompt logprobs of {sched.request.request_id!r}: got tokens from {first} "
                    f"on, only {len(recorded)} recorded"
                )
            prompt = sched.request.prompt_token_ids
            for _, top in chunk[len(recorded) - first :]:
                position = len(recorded)
                recorded.append(self._logprob_dict(top, prompt[max(position - 4, 0) : position]))

    def detokenize(
        self, deltas: Iterable[RequestDelta], logprobs: dict[str, list[TokenLogprobs]]
    ) -> list[StopStringMatch]:
        """Feed each sequence's new tokens (and their logprobs) to its detokenizer.

        With speculative decoding a step brings several tokens: a stop string inside an
        accepted run ends the output there (the tokens after it are not counted). As in vLLM,
        a token that stopped the request (EOS, a stop token id) is kept in ``token_ids`` but
        not in the text unless ``include_stop_str_in_output``; a stop string wins over a length
        limit reached by the same token.

        Returns:
            The stop strings matched, for the scheduler to stop those sequences.
        """
        matches = []
        for delta in deltas:
            request = delta.request
            seq = self.sequences[request.request_id]
            if delta.num_output_tokens_before == 0:
                self.prompt_tokens_total += request.num_prompt_tokens
            token_logprobs = logprobs.get(request.request_id, [])
            last = len(delta.new_token_ids) - 1
            for i, token_id in enumerate(delta.new_token_ids):
                self.generation_tokens_total += 1
                if i < len(token_logprobs) and seq.logprobs is not None:
                    sampled_logprob, top = token_logprobs[i]
                    context = seq.detokenizer.recent_output_token_ids
                    seq.logprobs.append(self._logprob_dict(top, context))
                    seq.cumulative_logprob += sampled_logprob
                stopped_by_token = i == last and request.status == RequestStatus.FINISHED_STOPPED
                if stopped_by_token and not request.sampling_params.include_stop_str_in_output:
                    continue
                stop_string = seq.detokenizer.update([token_id])
                if stop_string is not None:
                    matches.append(
                        StopStringMatch(
                            request, delta.num_output_tokens_before + i + 1, stop_string
                        )
                    )
                    break
        return matches

    def make_outputs(self, deltas: Iterable[RequestDelta]) -> tuple[list[RequestOutput], list[str]]:
        """The ``RequestOutput`` of every user request that advanced, and the sequence ids of
        those that finished (forgotten here).

        A request whose prompt logprobs are still incomplete (another sequence got ahead of
        the one scoring the prompt) waits: outputs are cumulative, nothing is lost.
        """
        touched = {self.sequences[d.request.request_id].parent_id: None for d in deltas}
        outputs, finished = [], []
        for parent_id in touched:
            parent = self.parents[parent_id]
            if not parent.prompt_logprobs_ready:
                continue
            outputs.append(parent.to_output())
            if parent.finished:
                finished += self.abort_request(parent_id)
        return outputs, finished

    def _logprob_dict(
        self, top: dict[int, tuple[float, int]], context: list[int]
    ) -> dict[int, Logprob]:
        """``{token_id: Logprob}`` with each token's text (decoded once per token id; a part of
        a UTF-8 character completed from ``context``, the tokens before it, by
        ``logprob_token_text``)."""
        texts = self._token_texts
        for token_id in top.keys() - texts.keys():
            texts[token_id] = self.tokenizer.decode([token_id])
        return {
            t: Logprob(lp, rank, logprob_token_text(self.tokenizer, t, texts[t], context))
            for t, (lp, rank) in top.items()
        }
