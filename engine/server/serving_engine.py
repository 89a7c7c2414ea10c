"""What the completions and chat endpoints share: model check, prompt limits, engine calls, SSE.

Named after vLLM's ``OpenAIServing`` base class.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from kvpilot.engine.async_llm import (
    AsyncLLM,
    EngineError,
    EngineShutdownError,
    QueueFullError,
    RequestStream,
)
from kvpilot.engine.input_processor import check_token_ids
from kvpilot.engine.lora.errors import LoRAAdapterError
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import Logprob, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams, is_int
from kvpilot.engine.server.async_tokenizer import AsyncTokenizer
from kvpilot.engine.server.errors import OpenAIError, bad_request, error_body
from kvpilot.engine.server.protocol import (
    MAX_LOGPROBS,
    PromptLogprobs,
    PromptTokenUsageInfo,
    UsageInfo,
)
from kvpilot.engine.server.reasoning_parsers import ReasoningParser
from kvpilot.engine.server.serving_models import OpenAIServingModels

logger = logging.getLogger("kvpilot.server")

# JSON has no -inf; vLLM reports impossible tokens with this floor.
MIN_LOGPROB = -9999.0
# Seconds a client is told to wait after a 503 for a full queue.
RETRY_AFTER_SECONDS = 1


class OpenAIServing:
    """Base of the endpoint handlers.

    Args:
        engine: the running ``AsyncLLM``.
        tokenizer: the model's tokenizer behind its own worker thread, so that tokenizing a
            long prompt never blocks the event loop. Not the engine's own object: the engine
            detokenizes on its worker thread, and a Rust tokenizer used from two threads at once
            can fail with "Already borrowed".
        served_model_names: names ``model`` may take; the first is reported in responses.
        max_model_len: longest prompt + output in tokens.
        vocab_size: the model's vocabulary size (bounds for token ids).
        models: the served names and LoRA adapters (default: ``served_model_names`` alone).
        default_sampling_params: what a request's unset sampling fields take (the engine's
            ``get_default_sampling_params()``; default ``SamplingParams()``).
        log_requests: log each request as it is submitted (id, prompt length, sampling
            parameters) at INFO, and its prompt text and token ids at DEBUG, as vLLM's
            ``--enable-log-requests``.
        max_log_len: the most characters of a logged prompt or output text, and the most of
            its token ids (vLLM's ``--max-log-len``); None: all.
        log_outputs: with ``log_requests``, log each output as it finishes (and, with
            ``log_deltas``, each streamed delta) at INFO, its token ids at DEBUG (vLLM's
            ``--enable-log-outputs``).
        log_deltas: log streamed deltas too (vLLM's ``--enable-log-deltas``, on by default).
        enable_prompt_tokens_details: report ``usage.prompt_tokens_details`` (vLLM's
            ``--enable-prompt-tokens-details``).
        enable_force_include_usage: streams carry the usage as if every request asked for
            ``stream_options.include_usage`` and ``continuous_usage_stats`` (vLLM's
            ``--enable-force-include-usage``).
        prefix_cache_block_size: tokens per KV block when the engine caches prefixes, else
            None (for ``prompt_tokens_details.created_cache_tokens``).
        max_logprobs: the most top logprobs a request may ask for (``logprobs``,
            ``top_logprobs``, ``prompt_logprobs``; vLLM's ``--max-logprobs``, 20); None: up to
            the vocabulary.
        return_tokens_as_token_ids: name logprobs' tokens ``token_id:<id>`` for every request
            (vLLM's ``--return-tokens-as-token-ids``; a request may also ask for it).
        default_max_tokens: the output limit of a request that sets none (the model's
            generation config ``max_new_tokens``, as vLLM); None: the rest of the context.
        override_max_tokens: the cap on every request's output (vLLM's: ``max_new_tokens`` of
            ``--override-generation-config``, or of a ``--generation-config`` folder); None:
            none.
    """

    def __init__(
        self,
        engine: AsyncLLM,
        tokenizer: AsyncTokenizer,
        served_model_names: list[str],
        max_model_len: int,
        vocab_size: int,
        models: OpenAIServingModels | None = None,
        default_sampling_params: SamplingParams | None = None,
        log_requests: bool = False,
        max_logprobs: int | None = MAX_LOGPROBS,
        return_tokens_as_token_ids: bool = False,
        default_max_tokens: int | None = None,
        override_max_tokens: int | None = None,
        max_log_len: int | None = None,
        log_outputs: bool = False,
        log_deltas: bool = True,
        enable_prompt_tokens_details: bool = False,
        enable_force_include_usage: bool = False,
        prefix_cache_block_size: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_log_len = max_log_len
        self.log_outputs = log_requests and log_outputs
        self.log_deltas = log_deltas
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.enable_force_include_usage = enable_force_include_usage
        self.prefix_cache_block_size = prefix_cache_block_size
        self.default_max_tokens = default_max_tokens
        self.override_max_tokens = override_max_tokens
        self.log_requests = log_requests
        self.max_logprobs = max_logprobs
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.default_sampling_params = default_sampling_params or SamplingParams()
        self.models = models or OpenAIServingModels(engine, served_model_names, max_model_len, [])
        self.tokenizer = tokenizer
        self.served_model_names = served_model_names
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names, or None for the base model.

        Raises:
            OpenAIError: 404 for a model this server does not serve.
        """
        return self.models.resolve(model)

    def response_model(self, lora_request: LoRARequest | None) -> str:
        """The ``model`` reported in a response: the adapter's name or the base model's."""
        return self.model_name if lora_request is None else lora_request.lora_name

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Raises a 400 naming ``param`` when a token id lies outside the vocabulary."""
        try:
            check_token_ids(token_ids, self.vocab_size, param)
        except ValueError as exc:
            raise bad_request(exc, param) from None

    async def encode(self, text: str, param: str) -> list[int]:
        """Tokenize ``text`` from the request on the tokenizer thread.

        Raises:
            OpenAIError: 400 naming ``param`` when ``text`` is not valid Unicode (a lone
                surrogate such as ``"\\ud800"``, which JSON allows and the tokenizer refuses).
        """
        try:
            return await self.tokenizer.encode(text, param)
        except ValueError as exc:
            raise bad_request(exc, param) from None

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None, param: str) -> int:
        """The output limit, as vLLM sets it: ``requested`` (None: the generation config's
        ``max_new_tokens``, else no limit) cut to the room the prompt leaves in
        ``max_model_len``, so that generation ends with ``"length"`` at the end of the context
        instead of the request being refused, and to ``override_max_tokens``.

        Raises:
            OpenAIError: 400 when the prompt alone (``param``) fills ``max_model_len``, or when
                ``max_tokens`` alone exceeds it, with vLLM's wording.
        """
        room = self.max_model_len - num_prompt_tokens
        if room <= 0:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your {param} contains {num_prompt_tokens} input tokens, which leaves no room "
                f"for output tokens. Please reduce the length of the {param}.",
                param,
            )
        if requested is not None and requested > self.max_model_len:
            raise bad_request(
                f"max_tokens={requested} cannot be greater than max_model_len="
                f"{self.max_model_len}. Please request fewer output tokens.",
                "max_tokens",
            )
        if requested is None:
            requested = self.default_max_tokens
        limits = (room, requested, self.override_max_tokens)
        return min(limit for limit in limits if limit is not None)

    def sampling_params(
        self, request: Any, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        """``request.to_sampling_params`` with its ``ValueError`` turned into a 400.

        Raises:
            OpenAIError: 400 for an invalid value, or top logprobs beyond ``max_logprobs``.
        """
        for name in LOGPROB_FIELDS:
            value = getattr(request, name, None)
            if self.max_logprobs is not None and is_int(value) and value > self.max_logprobs:
                raise bad_request(
                    f"{name}: must be at most {self.max_logprobs} (the server's --max-logprobs), "
                    f"got {value}",
                    name,
                )
        try:
            return request.to_sampling_params(
                max_tokens, logprobs, self.vocab_size, self.default_sampling_params
            )
        except ValueError as exc:
            raise bad_request(exc) from None

    async def compile_grammar(self, request: Any, params: SamplingParams) -> None:
        """Compile the request's structured-output constraint before it reaches the engine
        (off the event loop and the engine thread; xgrammar caches it for the engine).

        Raises:
            OpenAIError: 400 naming ``response_format`` (or ``structured_outputs``) when the
                schema, regex or grammar is invalid.
        """
        if params.structured_outputs is None:
            return
        try:
            await self.engine.compile_grammar(params.structured_outputs)
        except ValueError as exc:
            param = request.structured_outputs_param
            reason = str(exc).removeprefix("structured_outputs: ")
            raise bad_request(f"{param}: {reason}", param) from None

    @property
    def logs_prompt_details(self) -> bool:
        """Whether a request's prompt text and token ids are logged (``log_requests`` with the
        server's logger enabled for DEBUG): a caller computes the text only then."""
        return self.log_requests and logger.isEnabledFor(logging.DEBUG)

    def log_inputs(
        self,
        request_id: str,
        prompt_text: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None,
    ) -> None:
        """Log a request as vLLM's request logger does: its prompt text (None when it came as
        token ids) and token ids at DEBUG, cut to ``max_log_len`` characters and ids; then its
        id, prompt length, adapter and sampling parameters at INFO."""
        if self.logs_prompt_details:
            logger.debug(
                "Request %s details: prompt: %r, prompt_token_ids: %s, prompt_embeds shape: %s.",
                request_id,
                None if prompt_text is None else prompt_text[: self.max_log_len],
                prompt_token_ids[: self.max_log_len],
                None,
            )
        logger.info(
            "request %s: %d prompt tokens, lora %s, %s",
            request_id,
            len(prompt_token_ids),
            None if lora_request is None else lora_request.lora_name,
            params,
        )

    def log_output(
        self,
        request_id: str,
        text: str,
        token_ids: list[int] | None,
        finish_reason: str | None,
        streaming: bool = False,
        delta: bool = False,
    ) -> None:
        """Log an output as vLLM's request logger does (``--enable-log-outputs``): its token
        ids at DEBUG, then its text and finish reason at INFO, each cut to ``max_log_len``
        (characters, ids); a stream's lines say ``(streaming delta)`` or
        ``(streaming complete)``."""
        stream_info = ""
        if streaming:
            stream_info = " (streaming delta)" if delta else " (streaming complete)"
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "Generated response %s%s details: output_token_ids: %s",
                request_id,
                stream_info,
                None if token_ids is None else list(token_ids)[: self.max_log_len],
            )
        logger.info(
            "Generated response %s%s: output: %r, finish_reason: %s",
            request_id,
            stream_info,
            text[: self.max_log_len],
            finish_reason,
        )

    def stream_usage(self, request: Any) -> tuple[bool, bool]:
        """``(include_usage, continuous)`` of a stream: whether it ends with a usage chunk and
        whether every chunk carries the usage so far; both with
        ``--enable-force-include-usage``, as vLLM forces them."""
        if self.enable_force_include_usage:
            return True, True
        options = request.stream_options
        if options is None:
            return False, False
        return options.include_usage, options.every_chunk()

    def prompt_tokens_details(
        self, output: RequestOutput | None, num_prompt_tokens: int, created: bool
    ) -> PromptTokenUsageInfo | None:
        """``usage.prompt_tokens_details`` with ``--enable-prompt-tokens-details``, else None.

        Args:
            output: an output of the request, for the engine's ``num_cached_tokens`` (the
                prompt tokens read from the prefix cache, whole blocks); None: no details.
            num_prompt_tokens: the request's prompt length in tokens.
            created: also report ``created_cache_tokens`` (vLLM's chat completions do): the
                prompt tokens in full blocks the request computed and added to the cache (0
                when prefix caching is off).
        """
        if not self.enable_prompt_tokens_details or output is None:
            return None
        cached = output.num_cached_tokens
        details = PromptTokenUsageInfo(cached_tokens=cached)
        if created:
            details.created_cache_tokens = self.created_cache_tokens(num_prompt_tokens, cached)
        return details

    def created_cache_tokens(self, num_prompt_tokens: int, num_cached_tokens: int) -> int:
        """The prompt tokens in full blocks a request computed and added to the prefix cache
        (0 when prefix caching is off)."""
        block = self.prefix_cache_block_size
        full = 0 if block is None else num_prompt_tokens // block * block
        return max(0, full - num_cached_tokens)

    async def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        cache_salt: str | None,
        lora_request: LoRARequest | None = None,
        prompt_text: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Submit to the engine, mapping refusals to HTTP errors (400, 503 + Retry-After; an
        adapter the engine cannot use is a 400 naming ``model``, ``models.adapter_error``);
        logged first with ``log_requests`` (``prompt_text``: the prompt as text for the DEBUG
        line, None when the request gave token ids). ``priority``: the request's, for the
        engine's ``priority`` scheduling policy (a non-zero one under ``fcfs`` is a 400)."""
        if self.log_requests:
            self.log_inputs(request_id, prompt_text, prompt_token_ids, params, lora_request)
        try:
            return await self.engine.add_request(
                request_id,
                {"prompt_token_ids": prompt_token_ids},
                params,
                arrival_time=arrival_time,
                cache_salt=cache_salt,
                lora_request=lora_request,
                priority=priority,
            )
        except QueueFullError as exc:
            raise OpenAIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                str(exc),
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from None
        except LoRAAdapterError as exc:
            raise self.models.adapter_error(lora_request, exc) from None
        except ValueError as exc:
            raise bad_request(exc) from None
        except EngineError as exc:
            raise OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from None

    @staticmethod
    async def final_output(stream: RequestStream) -> RequestOutput:
        """Wait for a request to finish and return its last output."""
        final = None
        try:
            async for output in stream:
                final = output
        except EngineError as exc:
            raise OpenAIError(engine_error_status(exc), str(exc)) from None
        if final is None or not final.finished:
            raise OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, "the request ended unfinished")
        return final

    @staticmethod
    def token_ids(
        request: Any, prompt_token_ids: list[int] | None, token_ids: list[int]
    ) -> dict[str, list[int]]:
        """vLLM's ``return_token_ids`` fields of a choice (or a chunk of one): ``{}`` unless the
        request asked; ``prompt_token_ids`` only where given."""
        if not request.return_token_ids:
            return {}
        fields = {"token_ids": list(token_ids)}
        if prompt_token_ids is not None:
            fields["prompt_token_ids"] = list(prompt_token_ids)
        return fields

    def truncate_prompt(self, token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (vLLM's
        tokenizers truncate on the left); -1 keeps ``max_model_len - 1``; None keeps all.

        Raises:
            OpenAIError: 400 for 0 (no prompt left) or more than ``max_model_len``.
        """
        if keep is None:
            return token_ids
        if keep == 0 or keep > self.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens: must be -1 or between 1 and max_model_len "
                f"({self.max_model_len}), got {keep}",
                "truncate_prompt_tokens",
            )
        keep = self.max_model_len - 1 if keep == -1 else keep
        return token_ids[-keep:] if len(token_ids) > keep else token_ids

    @staticmethod
    def token_text(token_id: int, logprob: Logprob | None, as_token_id: bool = False) -> str:
        """The text of one token on its own, as logprobs report it: decoded by the engine, or
        vLLM's ``token_id:<id>`` when it was not decoded (the event loop never tokenizes) or
        the request asked for ids (``return_tokens_as_token_ids``)."""
        if not as_token_id and logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return f"token_id:{token_id}"

    @staticmethod
    def prompt_logprobs(
        request: Any, prompt_token_ids: list[int], output: RequestOutput
    ) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` of a response: the ``request.prompt_logprobs`` top
        candidates plus the prompt token, with logprobs JSON can carry; None unless asked."""
        if request.prompt_logprobs is None or output.prompt_logprobs is None:
            return None
        return [
            None
            if top is None
            else {
                t: Logprob(clamp_logprob(lp.logprob), lp.rank, lp.decoded_token)
                for t, lp in top_candidates(top, token_id, request.prompt_logprobs)
            }
            for token_id, top in zip(prompt_token_ids, output.prompt_logprobs, strict=True)
        ]

    @staticmethod
    def usage(
        num_prompt_tokens: int,
        num_completion_tokens: int,
        prompt_tokens_details: PromptTokenUsageInfo | None = None,
        reasoning_tokens: int | None = None,
    ) -> UsageInfo:
        """A response's ``usage`` (``prompt_tokens_details`` where the server reports it,
        ``completion_tokens_details.reasoning_tokens`` unless ``reasoning_tokens`` is None)."""
        return UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=prompt_tokens_details,
            completion_tokens_details=(
                None if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens}
            ),
        )

    async def reasoning_tokens(
        self,
        make_parser: Callable[[], ReasoningParser] | None,
        outputs: Sequence[Sequence[int]],
        params: SamplingParams,
    ) -> int | None:
        """The reasoning tokens of whole outputs (``ReasoningParser.count_reasoning_tokens``,
        their prefixes decoded on the tokenizer thread as the engine decoded them); None
        without a reasoning parser.

        Args:
            make_parser: makes a choice's reasoning parser, or None.
            outputs: each output's ``[num_output_tokens]`` token ids.
            params: the request's sampling (how special tokens were decoded).
        """
        if make_parser is None:
            return None

        def count(tokenizer: Any) -> int:
            def decode(token_ids: Sequence[int]) -> str:
                return tokenizer.decode(
                    list(token_ids),
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    clean_up_tokenization_spaces=False,
                )

            return sum(make_parser().count_reasoning_tokens(ids, decode) for ids in outputs)

        return await self.tokenizer.call(count)


LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
"""Request fields that ask for top logprobs (chat's boolean ``logprobs`` asks for none)."""


def new_request_id(prefix: str) -> str:
    """An id like OpenAI's: ``cmpl-<32 hex>`` / ``chatcmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def response_id(prefix: str, engine_request_id: str, requested: str | None) -> str:
    """The ``id`` of a response: ``<prefix>-<requested>`` when the client named the request
    (its ``request_id``, or the ``X-Request-Id`` header), as vLLM names it; else the
    engine's own id (which stays unique either way)."""
    return engine_request_id if requested is None else f"{prefix}-{requested}"


def now() -> float:
    """Arrival timestamps are ``time.time()`` seconds, as the engine's ``RequestMetrics``."""
    return time.time()


def clamp_logprob(value: float) -> float:
    """A log-probability JSON can carry (``-inf`` becomes ``MIN_LOGPROB``)."""
    return max(value, MIN_LOGPROB)


def top_candidates(
    candidates: dict[int, Logprob], token_id: int, num_logprobs: int
) -> list[tuple[int, Logprob]]:
    """The candidates within the top ``num_logprobs`` ranks, and ``token_id``'s own entry (the
    engine may have computed more: echo's and ``prompt_logprobs``' counts share one pass)."""
    return [
        (t, lp)
        for t, lp in candidates.items()
        if t == token_id or (lp.rank is not None and lp.rank <= num_logprobs)
    ]


def sse(payload: BaseModel | str, exclude_none: bool = False) -> str:
    """One Server-Sent Event carrying a JSON body (or the final ``[DONE]``); ``exclude_none``
    leaves out the body's null fields (as vLLM sends a stream's last usage chunk)."""
    if isinstance(payload, str):
        data = payload
    else:
        data = payload.model_dump_json(exclude_none=exclude_none)
    return f"data: {data}\n\n"


def named_sse(type_: str, body: dict[str, Any]) -> str:
    """One Server-Sent Event named ``type_`` (``event: <type>``) carrying ``body`` as JSON, as
    the Responses and Anthropic Messages APIs stream their events."""
    return f"event: {type_}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def engine_error_status(exc: EngineError) -> HTTPStatus:
    """The status of a request the engine could not finish: 503 when the server is shutting
    down, 500 when a step failed."""
    if isinstance(exc, EngineShutdownError):
        return HTTPStatus.SERVICE_UNAVAILABLE
    return HTTPStatus.INTERNAL_SERVER_ERROR


def sse_error(exc: EngineError) -> str:
    """An error that happens after the stream started (status 200 already sent): one event
    with OpenAI's error body, as vLLM sends it (its code as :func:`engine_error_status`)."""
    return sse(error_body(engine_error_status(exc), str(exc)))


async def merge_streams(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as outputs arrive: ``(stream index, output)``.

    Every stream is closed (its request aborted if unfinished) when the consumer stops early.
    """

    async def next_item(i: int) -> tuple[int, RequestOutput | None]:
        try:
            return i, await anext(streams[i])
        except StopAsyncIteration:
            return i, None

    pending = {asyncio.ensure_future(next_item(i)) for i in range(len(streams))}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i, output = task.result()
                if output is None:
                    continue
                yield i, output
                pending.add(asyncio.ensure_future(next_item(i)))
    finally:
        for task in pending:
            task.cancel()
        for stream in streams:
            stream.close()
