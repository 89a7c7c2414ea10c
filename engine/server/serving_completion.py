"""``POST /v1/completions``: text in, text out, streamed or not (OpenAI's legacy completions)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvpilot.engine.async_llm import EngineError
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import CompletionOutput, RequestOutput
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
    sse,
    sse_error,
)


@dataclass
class _Prompt:
    text: str
    token_ids: list[int]


class OpenAIServingCompletion(OpenAIServing):
    """Handles completions; a batch of prompts becomes one engine request per prompt, and
    choice ``i * n + j`` is sequence ``j`` of prompt ``i`` (as OpenAI and vLLM number them)."""

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
        if request.echo and request.logprobs is not None:
            raise bad_request(
                "echo: prompt logprobs (echo with logprobs) are not supported", "echo"
            )
        prompts = [await self._encode(p) for p in request.prompts()]
        params = [
            self.sampling_params(
                request,
                self.max_tokens_for(len(p.token_ids), request.max_tokens, "prompt"),
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
                    )
                )
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        if request.stream:
            return self._stream(request, request_id, prompts, streams, lora_request)
        try:
            finals = await asyncio.gather(*(self.final_output(s) for s in streams))
        finally:
            for stream in streams:
                stream.close()
        return self._response(request, request_id, prompts, finals, lora_request)

    async def _encode(self, prompt: str | list[int]) -> _Prompt:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt: must not be empty", "prompt")
            return _Prompt(prompt, await self.encode(prompt, "prompt"))
        if not prompt:
            raise bad_request("prompt: a token id list must not be empty", "prompt")
        self.check_token_ids(prompt, "prompt")
        return _Prompt(await self.tokenizer.decode(prompt), list(prompt))

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
                num_generated += len(seq.token_ids)
                choices.append(
                    CompletionChoice(
                        index=i * request.n + seq.index,
                        text=prefix + seq.text,
                        logprobs=self._logprobs(seq, 0, len(prefix), request.logprobs),
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=self.response_model(lora_request),
            choices=choices,
            usage=self.usage(sum(len(p.token_ids) for p in prompts), num_generated),
        )

    def _logprobs(
        self, seq: CompletionOutput, start: int, text_offset: int, num_logprobs: int | None
    ) -> CompletionLogprobs | None:
        """Logprobs of ``seq``'s tokens from index ``start`` on, offsets from ``text_offset``."""
        if num_logprobs is None or seq.logprobs is None:
            return None
        result = CompletionLogprobs()
        for token_id, candidates in zip(seq.token_ids[start:], seq.logprobs[start:], strict=False):
            sampled = candidates.get(token_id)
            text = self.token_text(token_id, sampled)
            result.tokens.append(text)
            result.token_logprobs.append(clamp_logprob(sampled.logprob) if sampled else None)
            result.text_offset.append(text_offset)
            text_offset += len(text)
            ranked = sorted(candidates.items(), key=lambda item: item[1].rank or 0)
            result.top_logprobs.append(
                {self.token_text(t, lp): clamp_logprob(lp.logprob) for t, lp in ranked}
            )
        return result

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        streams: list[RequestStream],
        lora_request: LoRARequest | None,
    ) -> AsyncIterator[str]:
        model = self.response_model(lora_request)
        n = request.n
        num_choices = len(prompts) * n
        sent_text = [0] * num_choices  # characters of each choice already sent
        sent_tokens = [0] * num_choices  # tokens whose logprobs were sent
        num_tokens = [0] * num_choices
        started = [False] * num_choices
        finished = [False] * num_choices
        text_offsets = [
            len(prompts[i // n].text) if request.echo else 0 for i in range(num_choices)
        ]
        try:
            async for i, output in merge_streams(streams):
                for seq in output.outputs:
                    index = i * n + seq.index
                    num_tokens[index] = len(seq.token_ids)
                    if finished[index]:
                        continue
                    delta = seq.text[sent_text[index] :]
                    if request.echo and not started[index]:
                        delta = prompts[i].text + delta
                    logprobs = self._logprobs(
                        seq, sent_tokens[index], text_offsets[index], request.logprobs
                    )
                    has_logprobs = logprobs is not None and bool(logprobs.tokens)
                    if not delta and not has_logprobs and seq.finish_reason is None:
                        continue
                    if has_logprobs:
                        text_offsets[index] += sum(len(t) for t in logprobs.tokens)
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
                    )
                    yield sse(CompletionResponse(id=request_id, model=model, choices=[choice]))
            if request.stream_options and request.stream_options.include_usage:
                usage = self.usage(sum(len(p.token_ids) for p in prompts), sum(num_tokens))
                yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
        except EngineError as exc:
            yield sse_error(str(exc))
        yield sse("[DONE]")
