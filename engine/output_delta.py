"""Cumulative ``RequestOutput``s sent between processes as what changed since the last one.

The engine's outputs are cumulative (each holds the whole text, token ids and logprobs so far),
which is what the API wants to read, but sending them whole from the engine-core process to the
API process after every step would pickle every request's history again at each step: O(n^2)
bytes over a request's n tokens. :class:`OutputDeltaEncoder` (engine-core side) sends, per
request, only the tail of each list and of the text that the receiver has not seen, and the
prompt once; :class:`OutputDeltaDecoder` (API side) appends them to what it holds and hands out
``RequestOutput``s equal to the engine's. vLLM's engine core likewise returns only the new
token ids of each request per step (``EngineCoreOutput``), and its API process detokenizes;
here detokenization stays in the engine core, and its text travels as a delta too.

Lists only grow between two outputs of a request (the engine appends tokens, logprobs and
prompt logprobs), except that an output's text may in principle be revised; the encoder checks
that the new text starts with the one it sent, and sends it whole otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@dataclass(slots=True)
class SequenceDelta:
    """What one output sequence gained since the request's last delta.

    Attributes:
        index: the sequence's index among the request's ``n``.
        text_keep: characters of the previously sent text that stay (the rest is replaced).
        text_tail: the text after them.
        token_ids: the new output token ids.
        logprobs: the new per-token logprob entries, or None unless logprobs were asked.
        cumulative_logprob: the sum so far (not a delta), or None.
        finish_reason: as ``CompletionOutput.finish_reason``.
        stop_reason: as ``CompletionOutput.stop_reason``.
    """

    index: int
    text_keep: int
    text_tail: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class RequestOutputDelta:
    """What one request's output gained since its last delta (the first carries the prompt).

    Attributes:
        request_id: the request's id.
        prompt: the prompt text in the request's first delta, else None.
        prompt_token_ids: the prompt tokens in the request's first delta, else empty.
        prompt_logprobs: new prompt-logprob entries, or None when not asked.
        sequences: one delta per sequence.
        finished: as ``RequestOutput.finished``.
        num_cached_tokens: as ``RequestOutput.num_cached_tokens``.
        metrics: the request's timestamps, or None.
        lora_request: the request's LoRA adapter, in its first delta (else None).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    sequences: list[SequenceDelta]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics | None
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _Sent:
    """What one side holds of a request: the last full output sent or rebuilt."""

    prompt_logprobs: int = 0
    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, int] = field(default_factory=dict)


class OutputDeltaEncoder:
    """Engine-core side: turns each step's cumulative outputs into deltas.

    Holds, per unfinished request, how much of each list and which text it has sent; a
    request is forgotten once its finished output is encoded or :meth:`forget` is called (an
    abort, which emits no output).
    """

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, outputs: list[RequestOutput]) -> list[RequestOutputDelta]:
        """The deltas of one step's outputs, in their order."""
        return [self._encode(output) for output in outputs]

    def forget(self, request_ids: list[str]) -> None:
        """Drop what was sent of these requests (aborted; unknown ids are ignored)."""
        for request_id in request_ids:
            self._sent.pop(request_id, None)

    def _encode(self, output: RequestOutput) -> RequestOutputDelta:
        sent = self._sent.get(output.request_id)
        first = sent is None
        if sent is None:
            sent = self._sent[output.request_id] = _Sent()
        if output.finished:
            del self._sent[output.request_id]
        prompt_logprobs = None
        if output.prompt_logprobs is not None:
            prompt_logprobs = output.prompt_logprobs[sent.prompt_logprobs :]
            sent.prompt_logprobs = len(output.prompt_logprobs)
        sequences = []
        for seq in output.outputs:
            previous_text = sent.texts.get(seq.index, "")
            keep = len(previous_text) if seq.text.startswith(previous_text) else 0
            num_tokens = sent.token_ids.get(seq.index, 0)
            num_logprobs = sent.logprobs.get(seq.index, 0)
            sequences.append(
                SequenceDelta(
                    index=seq.index,
                    text_keep=keep,
                    text_tail=seq.text[keep:],
                    token_ids=seq.token_ids[num_tokens:],
                    logprobs=None if seq.logprobs is None else seq.logprobs[num_logprobs:],
                    cumulative_logprob=seq.cumulative_logprob,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
            sent.texts[seq.index] = seq.text
            sent.token_ids[seq.index] = len(seq.token_ids)
            sent.logprobs[seq.index] = 0 if seq.logprobs is None else len(seq.logprobs)
        return RequestOutputDelta(
            request_id=output.request_id,
            prompt=output.prompt if first else None,
            prompt_token_ids=output.prompt_token_ids if first else [],
            prompt_logprobs=prompt_logprobs,
            sequences=sequences,
            finished=output.finished,
            num_cached_tokens=output.num_cached_tokens,
            metrics=output.metrics,
            lora_request=output.lora_request if first else None,
        )


class OutputDeltaDecoder:
    """API side: rebuilds cumulative ``RequestOutput``s from :class:`OutputDeltaEncoder`'s
    deltas, for the requests registered with :meth:`add`. The lists of an output it returned
    are never changed afterwards (the next output of the request has new ones), so a consumer
    may keep them.
    """

    def __init__(self) -> None:
        # None: registered, no output yet.
        self._held: dict[str, RequestOutput | None] = {}

    def add(self, request_id: str) -> None:
        """Expect the deltas of a request about to be added to the engine."""
        self._held[request_id] = None

    def forget(self, request_id: str) -> None:
        """Drop a request (aborted, or refused by the engine); later deltas of it are dropped."""
        self._held.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._held)

    def decode(self, deltas: list[RequestOutputDelta]) -> list[RequestOutput]:
        """The cumulative outputs of one step's deltas; a delta of a request not registered
        (or forgotten while the step ran) is dropped."""
        outputs = []
        for delta in deltas:
            if delta.request_id in self._held:
                outputs.append(self._decode(delta))
        return outputs

    def _decode(self, delta: RequestOutputDelta) -> RequestOutput:
        held = self._held[delta.request_id]
        if held is None:
            held = RequestOutput(
                request_id=delta.request_id,
                prompt=delta.prompt,
                prompt_token_ids=delta.prompt_token_ids,
                outputs=[],
                finished=False,
                lora_request=delta.lora_request,
            )
        prompt_logprobs = held.prompt_logprobs
        if delta.prompt_logprobs is not None:
            prompt_logprobs = (prompt_logprobs or []) + delta.prompt_logprobs
        sequences = {seq.index: seq for seq in held.outputs}
        for seq_delta in delta.sequences:
            seq = sequences.get(seq_delta.index)
            text, token_ids, logprobs = (
                ("", [], None) if seq is None else (seq.text, seq.token_ids, seq.logprobs)
            )
            sequences[seq_delta.index] = CompletionOutput(
                index=seq_delta.index,
                text=text[: seq_delta.text_keep] + seq_delta.text_tail,
                token_ids=token_ids + seq_delta.token_ids,
                cumulative_logprob=seq_delta.cumulative_logprob,
                logprobs=(
                    None if seq_delta.logprobs is None else (logprobs or []) + seq_delta.logprobs
                ),
                finish_reason=seq_delta.finish_reason,
                stop_reason=seq_delta.stop_reason,
            )
        output = RequestOutput(
            request_id=held.request_id,
            prompt=held.prompt,
            prompt_token_ids=held.prompt_token_ids,
            outputs=[sequences[index] for index in sorted(sequences)],
            finished=delta.finished,
            num_cached_tokens=delta.num_cached_tokens,
            metrics=delta.metrics,
            prompt_logprobs=prompt_logprobs,
            lora_request=held.lora_request,
        )
        if delta.finished:
            del self._held[delta.request_id]
        else:
            self._held[delta.request_id] = output
        return output
