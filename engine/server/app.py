"""The FastAPI application: OpenAI routes (completions, chat completions, responses),
Anthropic's ``/v1/messages``, ``/health``, ``/metrics``, ``/version``, ``/kv_events``,
vLLM's ``/tokenize``, ``/detokenize`` and ``/load``.

The model loads in the background after the server starts listening, so ``/health`` answers
503 while it loads (a Kubernetes readiness probe holds traffic back) and 200 once requests can
be served; an orchestrator sees a live process that is not ready yet, not a closed port.

``GET /kv_events?since=N`` publishes the prefix cache's KV events (``engine/kv_events.py``) for
the router: ``{"next": M, "events": [{"seq", "type", "block_hash"}, ...], "truncated": bool,
"block_size": tokens per block, "root_hash": hex of the first block's parent}``. Poll it with
``since`` = the last answer's ``next``; ``truncated`` says the log no longer holds event ``N``:
drop what was built from the older events and rebuild from these. It needs the API key when the
server has one (the hashes tell which prompts were sent).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from kvpilot import __version__
from kvpilot.engine.async_llm import AsyncLLM
from kvpilot.engine.chat_content_format import CHAT_TEMPLATE_CONTENT_FORMATS
from kvpilot.engine.engine_core import EngineDeadError
from kvpilot.engine.metrics import PrometheusStatLogger
from kvpilot.engine.server import invocations
from kvpilot.engine.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvpilot.engine.server.async_tokenizer import AsyncTokenizer
from kvpilot.engine.server.auth import APIKeyMiddleware
from kvpilot.engine.server.errors import OpenAIError, install_error_handlers, read_body
from kvpilot.engine.server.protocol import (
    MAX_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from kvpilot.engine.server.reasoning_parsers import REASONING_PARSERS
from kvpilot.engine.server.request_id_header import RequestIdHeaderMiddleware
from kvpilot.engine.server.responses_protocol import ResponsesRequest, ResponsesResponse
from kvpilot.engine.server.server_load import ServerLoad
from kvpilot.engine.server.serving_chat import (
    OpenAIServingChat,
    check_default_chat_template_kwargs,
)
from kvpilot.engine.server.serving_completion import OpenAIServingCompletion
from kvpilot.engine.server.serving_engine import RETRY_AFTER_SECONDS, now
from kvpilot.engine.server.serving_messages import AnthropicServingMessages, anthropic_error
from kvpilot.engine.server.serving_models import OpenAIServingModels
from kvpilot.engine.server.serving_responses import OpenAIServingResponses, ResponseStore
from kvpilot.engine.server.serving_tokenization import (
    OpenAIServingTokenization,
    tokenize_request_type,
)
from kvpilot.engine.server.tool_parsers import TOOL_PARSERS
from kvpilot.engine.startup_heap import freeze_startup_heap

logger = logging.getLogger("kvpilot.server")


@dataclass
class ServerConfig:
    """Settings of the HTTP layer.

    Attributes:
        served_model_names: names clients may put in ``model``; the first is reported.
        api_keys: when any, ``/v1/*`` requires ``Authorization: Bearer <one of them>``.
        max_waiting_requests: queue bound; beyond it requests get 503 + ``Retry-After``.
        enable_auto_tool_choice: allow ``tool_choice`` ``"auto"`` (vLLM's
            ``--enable-auto-tool-choice``); needs ``tool_call_parser``.
        tool_call_parser: the ``TOOL_PARSERS`` name that finds tool calls in free text.
        reasoning_parser: the ``REASONING_PARSERS`` name that splits chat outputs into
            reasoning and content (vLLM's ``--reasoning-parser``); None: all content.
        chat_template: the Jinja text of vLLM's ``--chat-template`` (see
            ``tokenization.load_chat_template``): the chat template of every request, in place
            of the model's (or for a model without one); None keeps the model's.
        trust_request_chat_template: accept a request's own ``chat_template`` (vLLM's
            ``--trust-request-chat-template``); otherwise such a request is a 400.
        cors: Starlette ``CORSMiddleware`` keyword arguments (vLLM's ``--allowed-origins``, ...);
            None: no CORS headers.
        log_requests: log each request's id, prompt length and sampling parameters at INFO,
            its prompt text and token ids at DEBUG (vLLM's ``--enable-log-requests``).
        max_logprobs: the most top logprobs a request may ask for (vLLM's ``--max-logprobs``);
            None: up to the vocabulary.
        response_role: the role of chat replies (vLLM's ``--response-role``).
        return_tokens_as_token_ids: logprobs name tokens ``token_id:<id>`` unless a request
            says otherwise (vLLM's ``--return-tokens-as-token-ids``).
        request_id_headers: every response carries ``X-Request-Id`` (vLLM's
            ``--enable-request-id-headers``).
        max_log_len: with ``log_requests``, the most characters of a logged prompt or output
            text and the most of its token ids (vLLM's ``--max-log-len``); None: all.
        log_outputs: with ``log_requests``, log each chat or completion output (vLLM's
            ``--enable-log-outputs``).
        log_deltas: with ``log_outputs``, log each streamed delta too (vLLM's
            ``--enable-log-deltas``).
        disable_fastapi_docs: serve no ``/docs``, ``/redoc`` or ``/openapi.json`` (vLLM's
            ``--disable-fastapi-docs``).
        enable_prompt_tokens_details: report ``usage.prompt_tokens_details.cached_tokens``
            (vLLM's ``--enable-prompt-tokens-details``).
        enable_force_include_usage: streams carry the usage as if every request set
            ``stream_options.include_usage`` and ``continuous_usage_stats`` (vLLM's
            ``--enable-force-include-usage``).
        chat_template_content_format: ``auto``, ``string`` or ``openai`` (vLLM's
            ``--chat-template-content-format``; ``chat_content_format.resolve_content_format``).
        default_chat_template_kwargs: template variables of every chat request, under its own
            ``chat_template_kwargs`` (vLLM's ``--default-chat-template-kwargs``).
        exclude_tools_when_tool_choice_none: render ``tool_choice: "none"`` requests without
            their tools (vLLM's ``--exclude-tools-when-tool-choice-none``).
        enable_responses_store: keep ``/v1/responses`` responses in memory (the newest
            ``MAX_STORED_RESPONSES``), for ``previous_response_id`` and
            ``GET /v1/responses/{id}``; off: a request's ``store`` is ignored (vLLM's
            ``VLLM_ENABLE_RESPONSES_API_STORE``).
        enable_server_load_tracking: count the requests in flight on the routes that run the
            model, for ``GET /load`` (vLLM's ``--enable-server-load-tracking``;
            ``server_load.py``).

    Raises:
        ValueError: ``enable_auto_tool_choice`` without ``tool_call_parser``, an unknown
            tool or reasoning parser name, ``log_outputs`` without ``log_requests``, an
            unknown content format, or a ``default_chat_template_kwargs`` key that is no
            template variable (``serving_chat.check_default_chat_template_kwargs``).
    """

    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    max_waiting_requests: int | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    cors: dict[str, Any] | None = None
    log_requests: bool = False
    max_logprobs: int | None = MAX_LOGPROBS
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    request_id_headers: bool = False
    max_log_len: int | None = None
    log_outputs: bool = False
    log_deltas: bool = True
    disable_fastapi_docs: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    chat_template_content_format: str = "auto"
    default_chat_template_kwargs: dict[str, Any] | None = None
    exclude_tools_when_tool_choice_none: bool = False
    enable_responses_store: bool = False
    enable_server_load_tracking: bool = False

    def __post_init__(self) -> None:
        if self.log_outputs and not self.log_requests:
            # vLLM's rule and wording.
            raise ValueError("--enable-log-outputs requires --enable-log-requests")
        if self.chat_template_content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ValueError(
                f"--chat-template-content-format: unknown format "
                f"{self.chat_template_content_format!r} "
                f"(choose from: {', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)})"
            )
        self.default_chat_template_kwargs = check_default_chat_template_kwargs(
            self.default_chat_template_kwargs
        )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser: unknown parser {self.tool_call_parser!r} "
                f"(choose from: {', '.join(TOOL_PARSERS)})"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser: unknown parser {self.reasoning_parser!r} "
                f"(choose from: {', '.join(REASONING_PARSERS)})"
            )


def _server_registry() -> CollectorRegistry:
    """A registry of the server's own (tests start several servers in one process), with
    ``prometheus_client``'s process, platform and garbage-collector metrics
    (``process_resident_memory_bytes``, ``python_info``, ...) as vLLM's ``/metrics`` has them;
    they describe the API process."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


@dataclass
class _State:
    engine: AsyncLLM | None = None
    tokenizer: AsyncTokenizer | None = None
    completion: OpenAIServingCompletion | None = None
    chat: OpenAIServingChat | None = None
    responses: OpenAIServingResponses | None = None
    messages: AnthropicServingMessages | None = None
    models: OpenAIServingModels | None = None
    tokenization: OpenAIServingTokenization | None = None
    max_model_len: int | None = None
    block_size: int = 0
    root_hash: str = ""
    load_error: BaseException | None = None
    registry: CollectorRegistry = field(default_factory=_server_registry)


def create_app(
    load_engine: Callable[[], Any],
    config: ServerConfig,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """Build the app; the engine is built by ``load_engine()`` in a worker thread at startup.

    Args:
        load_engine: returns a ready ``LLMEngine`` or engine-core client (``MPClient``); may
            take long (loads weights).
        config: HTTP settings.
        on_load_error: called if ``load_engine`` raises (the CLI stops the server); ``/health``
            then keeps answering 503 with the error.
    """
    state = _State()

    async def load() -> None:
        try:
            engine = await asyncio.to_thread(load_engine)
            _install_engine(state, engine, config)
        except Exception as exc:
            if isinstance(exc, (FileNotFoundError, ValueError)):
                # What the user named cannot be served (no such model, a bad setting): the
                # message says why, a traceback would bury it.
                logger.error("loading the model failed: %s", exc)
            else:
                logger.exception("loading the model failed")
            state.load_error = exc
            if on_load_error is not None:
                on_load_error(exc)
            return
        # The engine client, tokenizer and app live as long as the process (startup_heap).
        freeze_startup_heap()
        logger.info("model %s ready", config.served_model_names[0])

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(load())
        try:
            yield
        finally:
            loader.cancel()
            if state.engine is not None:
                await state.engine.shutdown()
            if state.tokenizer is not None:
                state.tokenizer.shutdown()

    docs: dict[str, Any] = {}
    if config.disable_fastapi_docs:
        docs = {"openapi_url": None, "docs_url": None, "redoc_url": None}  # vLLM's flag
    app = FastAPI(title="kvpilot", version=__version__, lifespan=lifespan, **docs)
    install_error_handlers(app)

    async def abort_all(message: str) -> int:
        return 0 if state.engine is None else await state.engine.abort_all(message)

    # For the server's bounded drain (engine/server/shutdown.py): AsyncLLM.abort_all.
    app.state.abort_all = abort_all

    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    if config.request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if config.cors is not None:
        # Added last, so outermost: a browser's preflight is answered before the key check.
        app.add_middleware(CORSMiddleware, **config.cors)

    v1 = APIRouter(prefix="/v1")

    def ready_state() -> _State:
        if state.engine is None:
            message = (
                f"the model failed to load: {state.load_error}"
                if state.load_error is not None
                else "the model is still loading"
            )
            raise OpenAIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                message,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        return state

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) name for it
    async def health() -> Response:
        try:
            await ready_state().engine.check_health()
        except EngineDeadError as exc:
            raise OpenAIError(
                HTTPStatus.SERVICE_UNAVAILABLE, f"the engine is dead: {exc}"
            ) from None
        return Response(status_code=200)

    server_load = ServerLoad(config.enable_server_load_tracking)

    @app.get("/load")
    async def load_metrics() -> dict[str, int]:
        return {"server_load": server_load.in_flight}  # vLLM's /load, 0 without the flag

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv_events")
    async def kv_events(since: int = Query(0, ge=0)) -> dict[str, Any]:
        ready = ready_state()
        batch = await ready.engine.kv_events(since)
        return {
            "next": batch.next,
            "events": [
                {
                    "seq": e.seq,
                    "type": e.type,
                    "block_hash": None if e.block_hash is None else e.block_hash.hex(),
                }
                for e in batch.events
            ],
            "truncated": batch.truncated,
            "block_size": ready.block_size,
            "root_hash": ready.root_hash,
        }

    @v1.get("/models")
    async def models() -> ModelList:
        return ready_state().models.model_list()

    @v1.get("/models/{model:path}")
    async def model(model: str) -> ModelCard:
        return ready_state().models.model_card(model)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> TokenizeResponse:
        body = read_body(await raw.body(), raw.headers.get("content-type"), tokenize_request_type)
        return await ready_state().tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await ready_state().tokenization.detokenize(body)

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await ready_state().models.load_lora_adapter(body))

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await ready_state().models.unload_lora_adapter(body))

    @v1.post("/completions")
    @server_load.track
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        serving = ready_state().completion
        body = _from_headers(body, raw)
        return await _respond(raw, serving.create_completion(body, now()))

    @v1.post("/chat/completions")
    @server_load.track
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        serving = ready_state().chat
        body = _from_headers(body, raw)
        return await _respond(raw, serving.create_chat_completion(body, now()))

    @app.post(invocations.PATH)  # vLLM's (SageMaker's) route for either of the two above
    async def invoke(raw: Request) -> Response:
        kind = raw.headers.get("content-type")
        body = read_body(await raw.body(), kind, invocations.invocation_request_type)
        if isinstance(body, ChatCompletionRequest):
            return await chat_completions(body, raw)
        return await completions(body, raw)

    @v1.post("/messages")
    @server_load.track
    async def messages(raw: Request) -> Response:
        try:
            kind = raw.headers.get("content-type")
            body = read_body(await raw.body(), kind, lambda _: MessagesRequest)
            body = _from_headers(body, raw)
            serving = ready_state().messages
            return await _respond(raw, serving.create_message(body, now()))
        except OpenAIError as exc:
            return anthropic_error(exc)

    @v1.post("/messages/count_tokens")
    @server_load.track
    async def count_message_tokens(raw: Request) -> Response:
        try:
            kind = raw.headers.get("content-type")
            body = read_body(await raw.body(), kind, lambda _: CountTokensRequest)
            return JSONResponse(await ready_state().messages.count_tokens(body))
        except OpenAIError as exc:
            return anthropic_error(exc)

    @v1.post("/responses")
    @server_load.track
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        serving = ready_state().responses
        body = _from_headers(body, raw)
        return await _respond(raw, serving.create_response(body, now()))

    @v1.get("/responses/{response_id}")
    @server_load.track
    async def retrieve_response(response_id: str) -> ResponsesResponse:
        return ready_state().responses.retrieve_stored(response_id).response

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return ready_state().responses.delete(response_id)

    @v1.post("/responses/{response_id}/cancel")
    @server_load.track
    async def cancel_response(response_id: str) -> ResponsesResponse:
        return ready_state().responses.cancel(response_id)

    app.include_router(v1)
    return app


def _install_engine(state: _State, engine: Any, config: ServerConfig) -> None:
    """Serve a freshly loaded engine (an ``LLMEngine``, or an engine-core client such as
    ``MPClient``) through ``AsyncLLM`` with metrics."""
    async_llm = AsyncLLM(engine, config.max_waiting_requests)
    info = async_llm.client.info
    stat_logger = PrometheusStatLogger(
        config.served_model_names[0],
        state.registry,
        info.max_model_len,
        cache_config={
            "block_size": info.block_size,
            "num_gpu_blocks": info.num_blocks,
            "enable_prefix_caching": info.enable_prefix_caching,
            "cache_dtype": info.cache_dtype,
            "gpu_memory_utilization": info.gpu_memory_utilization,
        },
    )
    async_llm.stat_loggers.append(stat_logger)
    stat_logger.record_stats(async_llm.stats)
    async_llm.start()
    tokenizer = info.tokenizer
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    server_chat_template = getattr(tokenizer, "chat_template", None)
    tokenizer = AsyncTokenizer(tokenizer, max_prompt_tokens=info.max_model_len)
    models = OpenAIServingModels(
        async_llm, config.served_model_names, info.max_model_len, info.loras
    )
    args = (
        async_llm,
        tokenizer,
        config.served_model_names,
        info.max_model_len,
        info.vocab_size,
        models,
        info.default_sampling_params,
    )
    shared = {
        "log_requests": config.log_requests,
        "max_logprobs": config.max_logprobs,
        "return_tokens_as_token_ids": config.return_tokens_as_token_ids,
        "default_max_tokens": info.default_max_tokens,
        "override_max_tokens": info.override_max_tokens,
        "max_log_len": config.max_log_len,
        "log_outputs": config.log_outputs,
        "log_deltas": config.log_deltas,
        "enable_prompt_tokens_details": config.enable_prompt_tokens_details,
        "enable_force_include_usage": config.enable_force_include_usage,
        "prefix_cache_block_size": info.block_size if info.enable_prefix_caching else None,
    }
    state.completion = OpenAIServingCompletion(*args, **shared)
    state.chat = OpenAIServingChat(
        *args,
        **shared,
        response_role=config.response_role,
        auto_tool_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
        reasoning_parser=config.reasoning_parser,
        trust_request_chat_template=config.trust_request_chat_template,
        chat_template=server_chat_template,
        content_format=config.chat_template_content_format,
        default_chat_template_kwargs=config.default_chat_template_kwargs,
        exclude_tools_when_tool_choice_none=config.exclude_tools_when_tool_choice_none,
    )
    store = ResponseStore() if config.enable_responses_store else None
    state.responses = OpenAIServingResponses(state.chat, store)
    state.messages = AnthropicServingMessages(state.chat)
    state.models = models
    state.tokenization = OpenAIServingTokenization(
        tokenizer, models, state.chat, info.max_model_len, info.vocab_size
    )
    state.tokenizer = tokenizer
    state.max_model_len = info.max_model_len
    state.block_size = info.block_size
    state.root_hash = info.root_hash
    state.engine = async_llm


async def _respond(raw: Request, work: Awaitable[Any]) -> Response:
    """Run a handler until it answers or the client disconnects (then it is cancelled, which
    aborts its engine requests and frees their blocks)."""
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if handler not in done:
        handler.cancel()
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    watcher.cancel()
    result = handler.result()
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return JSONResponse(result.model_dump())


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


RequestBody = TypeVar(
    "RequestBody", CompletionRequest, ChatCompletionRequest, ResponsesRequest, MessagesRequest
)


PRIORITY_HEADER = "X-Vllm-Priority"
"""vLLM's header for a request's ``priority``; it wins over the body's field."""


def _from_headers(body: RequestBody, raw: Request) -> RequestBody:
    """The request with its ``request_id`` taken from the ``X-Request-Id`` header and its
    ``priority`` from ``X-Vllm-Priority`` when there are such headers (vLLM's order: the
    header, then the body's field).

    Raises:
        OpenAIError: 400 naming the header when ``X-Vllm-Priority`` is not a 64-bit integer
            (vLLM ignores such a header; here it is refused rather than silently unused).
    """
    update: dict[str, Any] = {}
    if header := raw.headers.get("x-request-id"):
        update["request_id"] = header
    if (priority := raw.headers.get(PRIORITY_HEADER)) is not None:
        try:
            update["priority"] = int(priority)
        except ValueError:
            update["priority"] = 2**63  # out of range: refused below
        if not -(2**63) <= update["priority"] < 2**63:
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST,
                f"{PRIORITY_HEADER}: must be an integer between -2**63 and 2**63-1, "
                f"got {priority!r}",
                PRIORITY_HEADER,
            )
    return body.model_copy(update=update) if update else body
