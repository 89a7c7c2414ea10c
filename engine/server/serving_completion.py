"""``POST /v1/completions``: text in, text out, streamed or not (OpenAI's legacy completions)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from kvpilot.engine.async_llm import EngineError
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvpilot.engine.server.serving_engine import (
    OpenAIServing,
    RequestStream,
    clamp_logprob,
    merge_streams,
    new_request_id,
    response_id,
    sse,
    sse_error,
    top_candidates,
)


@dataclass
class _Prompt:
    """One prompt of the batch; ``first_token_text`` is its first token's text when echoed
    logprobs need it (that token has no logprob entry to carry it)."""

    text: str
    token_ids: list[int]
    first_token_text: str | None = None
    given_as_text: bool = True


class OpenAIServingCompletion(OpenAIServing):
    """Handles completions; a batch of prompts becomes one engine request per prompt, and
    choice ``i * n + j`` is sequence ``j`` of prompt ``i`` (as OpenAI and vLLM number them).

    ``echo`` with ``logprobs`` (how lm-evaluation-harness scores text) puts the prompt tokens'
    logprobs before the generated ones: ``null`` for the first prompt token, then each one's
    logprob given the tokens before it (the engine's prompt logprobs). ``max_tokens`` 0 with
    ``echo`` returns the prompt alone with ``finish_reason`` "length": as in vLLM, the engine
    samples one token after the prefill, which is dropped.
    """

    async def create_completion(
        self, request: CompletionRequest, arrival_time: float
    ) -> CompletionResponse | AsyncIterator[str]:
        """Run a completion request.

        Returns:
            The response, or for ``stream=true`` an iterator of Server-Sent Events.

        Raises:
            OpenAIError: 400 for invalid parameters or prompts, 404 for an unknown model, 503
                when the waiting queue is full.
        """
        lora_request = self.check_model(request.model)
        prompts = [await self._encode(p, request.truncate_prompt_tokens) for p in request.prompts()]
        if request.echo and request.logprobs is not None:
            for prompt in prompts:
                prompt.first_token_text = await self.tokenizer.decode(prompt.token_ids[:1])
        params = [
            self.sampling_params(
                request,
                # At least the one token vLLM samples (and drops) for echo without generation.
                max(1, self.max_tokens_for(len(p.token_ids), request.max_tokens, "prompt")),
                request.logprobs,
            )
            for p in prompts
        ]
        await self.compile_grammar(request, params[0])
        request_id = new_request_id("cmpl")
        streams: list[RequestStream] = []
        try:
            for i, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
                streams.append(
                    await self.add(
                        f"{request_id}-{i}",
                        prompt.token_ids,
                        prompt_params,
                        arrival_time,
                        request.cache_salt,
                        lora_request,
                        # As vLLM logs it: the text of a text prompt, none for token ids.
                        prompt_text=prompt.text if prompt.given_as_text else None,
                        priority=request.priority,
                    )
                )
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        shown_id = response_id("cmpl", request_id, request.request_id)
        if request.stream:
            return self._stream(request, shown_id, request_id, prompts, streams, lora_request)
        try:
            finals = await asyncio.gather(*(self.final_output(s) for s in streams))
        finally:
            for stream in streams:
                stream.close()
        response = self._response(request, shown_id, prompts, finals, lora_request)
        if self.log_outputs:
            for choice in response.choices:
                seq = finals[choice.index // request.n].outputs[choice.index % request.n]
                self.log_output(
                    f"{request_id}-{choice.index // request.n}",
                    choice.text,
                    self._shown(request, seq).token_ids,
                    choice.finish_reason,
                )
        return response

    async def _encode(self, prompt: str | list[int], truncate: int | None) -> _Prompt:
        """One prompt's text and token ids, cut to ``truncate_prompt_tokens`` (the text then
        is the kept tokens', for ``echo``)."""
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt: must not be empty", "prompt")
            token_ids = await self.encode(prompt, "prompt")
        else:
            if not prompt:
                raise bad_request("prompt: a token id list must not be empty", "prompt")
            self.check_token_ids(prompt, "prompt")
            token_ids = list(prompt)
        kept = self.truncate_prompt(token_ids, truncate)
        if isinstance(prompt, str) and kept is token_ids:
            return _Prompt(prompt, token_ids)
        return _Prompt(
            await self.tokenizer.decode(kept), kept, given_as_text=isinstance(prompt, str)
        )

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        finals: list[RequestOutput],
        lora_request: LoRARequest | None,
    ) -> CompletionResponse:
        choices = []
        num_generated = 0
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            prefix = prompt.text if request.echo else ""
            for seq in final.outputs:
                seq = self._shown(request, seq)
                num_generated += len(seq.token_ids)
                choices.append(
                    CompletionChoice(
                        index=i * request.n + seq.index,
                        text=prefix + seq.text,
                        logprobs=self._choice_logprobs(
                            request, prompt, final, seq, 0, 0, echo_prompt=request.echo
                        ),
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                        prompt_logprobs=self.prompt_logprobs(request, prompt.token_ids, final),
                        **self.token_ids(request, prompt.token_ids, seq.token_ids),
                    )
                )
        # As vLLM reports it: the last prompt's cached tokens.
        details = self.prompt_tokens_details(finals[-1], len(prompts[-1].token_ids), False)
        return CompletionResponse(
            id=request_id,
            model=self.response_model(lora_request),
            choices=choices,
            usage=self.usage(sum(len(p.token_ids) for p in prompts), num_generated, details),
        )

    @staticmethod
    def _shown(request: CompletionRequest, seq: CompletionOutput) -> CompletionOutput:
        """The part of a sequence a choice shows: none of it for echo without generation (the
        one token the engine sampled is dropped; the choice ends with "length")."""
        if request.max_tokens != 0:
            return seq
        return replace(
            seq,
            text="",
            token_ids=[],
            logprobs=None if seq.logprobs is None else [],
            finish_reason=None if seq.finish_reason is None else "length",
            stop_reason=None,
        )

    def _choice_logprobs(
        self,
        request: CompletionRequest,
        prompt: _Prompt,
        output: RequestOutput,
        seq: CompletionOutput,
        start: int,
        text_offset: int,
        echo_prompt: bool,
    ) -> CompletionLogprobs | None:
        """OpenAI's logprobs of ``seq``'s tokens from index ``start`` on, after the prompt's
        tokens when ``echo_prompt``; offsets count from ``text_offset``; None unless asked."""
        if request.logprobs is None or seq.logprobs is None:
            return None
        token_ids = seq.token_ids[start:]
        candidates: list[dict[int, Logprob] | None] = seq.logprobs[start:]
        if echo_prompt:
            if output.prompt_logprobs is None:
                raise RuntimeError("the engine returned no prompt logprobs for an echo")
            token_ids = prompt.token_ids + token_ids
            candidates = output.prompt_logprobs + candidates
        result = CompletionLogprobs()
        as_id = request.return_tokens_as_token_ids or self.return_tokens_as_token_ids
        for token_id, top in zip(token_ids, candidates, strict=False):
            own = None if top is None else top.get(token_id)
            text = prompt.first_token_text if top is None else self.token_text(token_id, own, as_id)
            result.tokens.append(text)
            result.text_offset.append(text_offset)
            text_offset += len(text)
            result.token_logprobs.append(None if own is None else clamp_logprob(own.logprob))
            if top is None:
                result.top_logprobs.append(None)
                continue
            ranked = sorted(
                top_candidates(top, token_id, request.logprobs), key=lambda t: t[1].rank or 0
            )
            result.top_logprobs.append(
                {self.token_text(t, lp, as_id): clamp_logprob(lp.logprob) for t, lp in ranked}
            )
        return result

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        engine_request_id: str,
        prompts: list[_Prompt],
        streams: list[RequestStream],
        lora_request: LoRARequest | None,
    ) -> AsyncIterator[str]:
        model = self.response_model(lora_request)
        include_usage, every = self.stream_usage(request)
        created = int(time.time())  # one timestamp for every chunk, as OpenAI's and vLLM's
        first_output: RequestOutput | None = None  # vLLM's cached tokens: the first output's
        texts = [""] * (len(prompts) * request.n)  # each choice's generated text, for the log
        n = request.n
        num_choices = len(prompts) * n
        sent_text = [0] * num_choices  # characters of each choice already sent
        sent_tokens = [0] * num_choices  # tokens whose logprobs were sent
        num_tokens = [0] * num_choices
        started = [False] * num_choices
        finished = [False] * num_choices
        # Echoed logprobs start with the prompt's tokens, so every choice's offsets start at 0.
        text_offsets = [0] * num_choices
        # The usage so far on every chunk counts the prompts as the last chunk does.
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        try:
            async for i, output in merge_streams(streams):
                first_output = first_output or output
                for seq in output.outputs:
                    seq = self._shown(request, seq)
                    index = i * n + seq.index
                    num_tokens[index] = len(seq.token_ids)
                    if finished[index]:
                        continue
                    echo_prompt = request.echo and not started[index]
                    delta = seq.text[sent_text[index] :]
                    if echo_prompt:
                        delta = prompts[i].text + delta
                    logprobs = self._choice_logprobs(
                        request,
                        prompts[i],
                        output,
                        seq,
                        sent_tokens[index],
                        text_offsets[index],
                        echo_prompt,
                    )
                    has_logprobs = logprobs is not None and bool(logprobs.tokens)
                    if not delta and not has_logprobs and seq.finish_reason is None:
                        continue
                    if has_logprobs:
                        text_offsets[index] += sum(len(t) for t in logprobs.tokens)
                    ids = self.token_ids(
                        request,
                        None if started[index] else prompts[i].token_ids,
                        seq.token_ids[sent_tokens[index] :],
                    )
                    if self.log_outputs and self.log_deltas and seq.text[sent_text[index] :]:
                        self.log_output(
                            f"{engine_request_id}-{i}",
                            seq.text[sent_text[index] :],
                            seq.token_ids[sent_tokens[index] :],
                            seq.finish_reason,
                            streaming=True,
                            delta=True,
                        )
                    texts[index] = seq.text
                    started[index] = True
                    sent_text[index] = len(seq.text)
                    sent_tokens[index] = len(seq.token_ids)
                    finished[index] = seq.finish_reason is not None
                    choice = CompletionChoice(
                        index=index,
                        text=delta,
                        logprobs=logprobs,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                        **ids,
                    )
                    usage = self.usage(num_prompt_tokens, sum(num_tokens)) if every else None
                    yield sse(
                        CompletionResponse(
                            id=request_id,
                            created=created,
                            model=model,
                            choices=[choice],
                            usage=usage,
                        )
                    )
            if include_usage:
                details = self.prompt_tokens_details(first_output, num_prompt_tokens, False)
                usage = self.usage(num_prompt_tokens, sum(num_tokens), details)
                response = CompletionResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                )
                yield sse(response, exclude_none=True)  # as vLLM sends it
            if self.log_outputs:
                for index, text in enumerate(texts):
                    self.log_output(
                        f"{engine_request_id}-{index // n}",
                        text,
                        None,
                        "streaming_complete",
                        streaming=True,
                    )
        except EngineError as exc:
            yield sse_error(exc)
        yield sse("[DONE]")
