"""``kvpilot serve [MODEL]``: the OpenAI-compatible server (engine flags spelled as vLLM's).

Imports nothing heavy at module level: ``kvpilot --help`` must not load torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from kvpilot.argv import json_object, only_one
from kvpilot.engine.chat_content_format import CHAT_TEMPLATE_CONTENT_FORMATS
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME
from kvpilot.engine.server.protocol import MAX_LOGPROBS
from kvpilot.engine.server.reasoning_parsers import REASONING_PARSERS

if TYPE_CHECKING:
    from kvpilot.engine.server.app import ServerConfig

API_KEY_ENV_VARS = ("KVPILOT_API_KEY", "VLLM_API_KEY")
# vLLM's switch for keeping /v1/responses responses (--enable-responses-store's default).
RESPONSES_STORE_ENV_VAR = "VLLM_ENABLE_RESPONSES_API_STORE"
HOST_ENV_VAR = "KVPILOT_HOST"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the server flags and every engine flag (``EngineArgs.add_cli_args``)."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"model folder, .gguf file or Hub id (default: {DEFAULT_MODEL_NAME}, built in); "
        "same as --model",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host",
        default=os.environ.get(HOST_ENV_VAR, "127.0.0.1"),
        help=f"address to listen on (default: ${HOST_ENV_VAR}, else 127.0.0.1; the engine "
        "image sets 0.0.0.0)",
    )
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    server.add_argument(
        "--config",
        metavar="FILE",
        help="a YAML file of flags, as vLLM's: {max-model-len: 2048, enable-prefix-caching: "
        "true, ...}; the command line's own flags win (read before parsing: kvpilot.argv)",
    )
    server.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer <key>' on /v1 routes, any of these keys "
        f"(default: ${API_KEY_ENV_VARS[0]} or ${API_KEY_ENV_VARS[1]})",
    )
    server.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy serves the app under (ASGI root_path, as vLLM's)",
    )
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key file")
    server.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    for flag, what in (
        ("--allowed-origins", "origins"),
        ("--allowed-methods", "methods"),
        ("--allowed-headers", "headers"),
    ):
        server.add_argument(
            flag,
            type=_json_list,
            default=["*"],
            help=f'CORS: allowed {what}, a JSON list (default ["*"], as vLLM)',
        )
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    server.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access log line per HTTP request",
    )
    server.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request's id, prompt length and sampling parameters at INFO, and its "
        "prompt text and token ids at DEBUG (logger kvpilot.server), as vLLM does "
        "(--disable-log-requests, older vLLM's flag, is the default)",
    )
    server.add_argument(
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_false",
        help=argparse.SUPPRESS,
    )
    server.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        metavar="N",
        help="with --enable-log-requests, log at most N characters of a prompt's or an "
        "output's text and N of its token ids (default: all)",
    )
    server.add_argument(
        "--enable-log-outputs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --enable-log-requests, log each chat or completion output at INFO (its "
        "text and finish reason; its token ids at DEBUG), as vLLM does",
    )
    server.add_argument(
        "--enable-log-deltas",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --enable-log-outputs, also log each streamed delta (default on, as vLLM)",
    )
    server.add_argument(
        "--log-config-file",
        default=None,
        metavar="PATH",
        help="a JSON logging configuration (Python's logging.config.dictConfig schema) for "
        "uvicorn's and kvpilot's loggers, in place of the default one (checked at start)",
    )
    server.add_argument(
        "--disable-fastapi-docs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve no /docs, /redoc or /openapi.json",
    )
    server.add_argument(
        "--api-server-count",
        "-asc",
        type=only_one("one API server per engine, beside its engine-core process"),
        default=None,
        metavar="1",
        help="API server processes: kvpilot runs one beside its engine-core process, so only "
        "1 is accepted (serve more copies with replicas)",
    )
    server.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help=f"the most top logprobs a request may ask for (logprobs, top_logprobs, "
        f"prompt_logprobs; default {MAX_LOGPROBS}, as vLLM; -1: up to the vocabulary)",
    )
    server.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="report usage.prompt_tokens_details.cached_tokens (prompt tokens read from the "
        "prefix cache) in chat and completion responses",
    )
    server.add_argument(
        "--enable-force-include-usage",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="streams carry the usage as if every request set stream_options.include_usage "
        "and continuous_usage_stats (vLLM's meaning: the usage so far on every chunk too)",
    )
    server.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name their tokens token_id:<id> (as a request's return_tokens_as_token_ids)",
    )
    server.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="every response carries X-Request-Id: the request's own, else a fresh one",
    )
    server.add_argument(
        "--response-role",
        default="assistant",
        help="the role of chat replies (default assistant)",
    )
    server.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted as vLLM takes it; changes nothing: kvpilot logs no periodic stats (its "
        "numbers are on /metrics)",
    )
    server.add_argument(
        "--enable-server-load-tracking",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="count the requests in flight on the routes that run the model (completions, "
        'chat, responses, messages), read back as GET /load: {"server_load": N} (0 '
        "without this flag, as vLLM)",
    )
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 with Retry-After once this many requests wait beyond the free "
        "--max-num-seqs slots (default: no limit)",
    )
    server.add_argument(
        "--engine-core-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core (scheduling and the model) in a process of its own, beside "
        "the API's (HTTP, tokenization, streaming), as vLLM V1 does; --no-engine-core-process "
        "runs it on a thread of the server's process",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, wait at most this long for the requests in flight, then "
        "abort them (0: at once, as vLLM's default); default: wait for every one to finish (an "
        "engine pod's preStop drain and terminationGracePeriodSeconds bound the wait there); a "
        "second Ctrl-C aborts them at once",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=UVICORN_LOG_LEVELS,
        help="uvicorn's log level",
    )
    templates = parser.add_argument_group("chat template")
    templates.add_argument(
        "--chat-template",
        default=None,
        help="chat template for every chat request, in place of the model's (or for a model "
        "without one): a Jinja file's path, or the template itself (checked at start)",
    )
    templates.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a request's own chat_template (refused with a 400 otherwise); the server "
        "renders it in a Jinja sandbox",
    )
    templates.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=CHAT_TEMPLATE_CONTENT_FORMATS,
        help="how a message's content reaches the chat template: 'string' (text parts joined "
        "one a line), 'openai' (a list of {'type': 'text', 'text': ...} parts) or 'auto' "
        "(default: 'openai' for a template that loops over a message's content, else 'string')",
    )
    templates.add_argument(
        "--default-chat-template-kwargs",
        type=json_object,
        default=None,
        metavar="JSON",
        help="template variables for every chat request, e.g. '{\"enable_thinking\": false}'; "
        "a request's own chat_template_kwargs win, key by key",
    )
    tools = parser.add_argument_group("tool calling")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="allow tool_choice 'auto': the model decides whether to call a tool and "
        "--tool-call-parser finds the calls in its text ('required' and named tools need no flag)",
    )
    tools.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a request with tool_choice 'none' renders its chat template without its tools",
    )
    server.add_argument(
        "--enable-responses-store",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get(RESPONSES_STORE_ENV_VAR, "0") not in ("", "0"),
        help="keep the newest 1024 responses of /v1/responses in memory, for "
        "previous_response_id and GET /v1/responses/{id} (default: off, or on with vLLM's "
        "VLLM_ENABLE_RESPONSES_API_STORE=1); without it a request's store is ignored",
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: 'hermes' (<tool_call>{...}</tool_call>, Hermes "
        "and Qwen models), 'llama3_json' (Llama 3.1-3.3's JSON calls, after <|python_tag|> "
        "or alone), 'mistral' ([TOOL_CALLS] followed by a JSON array or name[ARGS]{...}) or "
        "'pythonic' ([get_weather(city='Paris')], Llama 3.2 and 4)",
    )
    reasoning = parser.add_argument_group("reasoning")
    reasoning.add_argument(
        "--reasoning-parser",
        default=None,
        choices=list(REASONING_PARSERS),
        help="split chat replies into reasoning (message.reasoning, delta.reasoning) and "
        "content: 'deepseek_r1' or 'qwen3' (<think>...</think>, the reply starting inside the "
        "block); tool calls are read from the content; its tags are the markers of requests' "
        "thinking_token_budget unless --reasoning-config gives others",
    )
    EngineArgs.add_cli_args(parser)


def _json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's CORS flags take it (an argparse type)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings, e.g. ["*"]: {text!r}')
    return value


def load_log_config(path: str | None) -> dict[str, Any] | None:
    """Read ``--log-config-file``: a JSON object in ``logging.config.dictConfig``'s schema.

    Args:
        path: the file's path; None: no file (the default logging).

    Returns:
        The configuration, or None when ``path`` is None.

    Raises:
        ValueError: ``"--log-config-file: ..."`` when the file cannot be read, is not JSON, or
            is not a JSON object.
    """
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except OSError as exc:
        raise ValueError(f"--log-config-file: cannot read {path!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"--log-config-file: {path!r} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"--log-config-file: {path!r} must hold a JSON object (a logging.config.dictConfig "
            f"configuration), got {type(config).__name__}"
        )
    return config


def configure_logging(log_config: dict[str, Any] | None) -> None:
    """Set up this process's logging: ``log_config`` (``--log-config-file``) through
    ``logging.config.dictConfig``, else INFO and above to stderr.

    Raises:
        ValueError: ``"--log-config-file: ..."`` when ``dictConfig`` refuses the configuration
            (an unknown handler class, a missing key, ...).
    """
    import logging
    import logging.config

    if log_config is None:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        return
    try:
        logging.config.dictConfig(log_config)
    except (ValueError, TypeError, AttributeError, ImportError) as exc:
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
        raise ValueError(
            f"--log-config-file: the configuration was refused: {exc}{cause}"
        ) from None


def _configure(args: argparse.Namespace) -> tuple[EngineArgs, ServerConfig]:
    """The engine's and the server's configuration from the flags, checked before anything
    loads.

    Raises:
        ValueError: a bad or conflicting flag, the message naming it.
    """
    from kvpilot.engine.server.app import ServerConfig
    from kvpilot.engine.tokenization import load_chat_template

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"got model {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError("--max-waiting-requests must be at least 1")
    if args.max_logprobs < -1:
        raise ValueError("--max-logprobs must be -1 (the vocabulary) or 0 or more")
    if args.shutdown_timeout is not None and not args.shutdown_timeout >= 0:
        raise ValueError("--shutdown-timeout must be 0 or more seconds")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError("--max-log-len must be 0 or more")
    args.served_model_name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    served_model_names = getattr(args, "served_model_names", None) or [args.served_model_name]
    engine_args = EngineArgs.from_cli_args(args)
    try:
        chat_template = (
            None if args.chat_template is None else load_chat_template(args.chat_template)
        )
    except ValueError as exc:
        raise ValueError(f"--chat-template: {exc}") from None
    env_key = next((os.environ[name] for name in API_KEY_ENV_VARS if os.environ.get(name)), None)
    config = ServerConfig(
        served_model_names=served_model_names,
        api_keys=args.api_key or ([env_key] if env_key else []),
        max_waiting_requests=args.max_waiting_requests,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        cors={
            "allow_origins": args.allowed_origins,
            "allow_methods": args.allowed_methods,
            "allow_headers": args.allowed_headers,
            "allow_credentials": args.allow_credentials,
        },
        log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        log_outputs=args.enable_log_outputs,
        log_deltas=args.enable_log_deltas,
        disable_fastapi_docs=args.disable_fastapi_docs,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        chat_template_content_format=args.chat_template_content_format,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        enable_responses_store=args.enable_responses_store,
        max_logprobs=None if args.max_logprobs == -1 else args.max_logprobs,
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        request_id_headers=args.enable_request_id_headers,
        enable_server_load_tracking=args.enable_server_load_tracking,
    )
    return engine_args, config


def run(args: argparse.Namespace) -> int:
    """Start the server; returns the process exit code: 2 for a bad flag (its one-line message
    on stderr, before anything loads, as argparse and ``kvpilot generate`` do), 1 when the model
    failed to load, 130 after Ctrl-C (as a shell reports an interrupted command)."""
    import prometheus_client
    import uvicorn

    from kvpilot.engine.server.app import create_app
    from kvpilot.engine.server.shutdown import DrainingServer

    try:
        engine_args, config = _configure(args)
        log_config = load_log_config(args.log_config_file)
        configure_logging(log_config)
    except ValueError as exc:
        print(f"kvpilot serve: error: {exc}", file=sys.stderr)
        return 2
    prometheus_client.disable_created_metrics()  # no *_created series in /metrics, as vLLM

    def load_engine():
        if args.engine_core_process:
            from kvpilot.engine.core_client import MPClient

            return MPClient(engine_args, log_config)
        from kvpilot.engine.llm_engine import LLMEngine

        return LLMEngine.from_engine_args(engine_args)

    failed: list[BaseException] = []

    def on_load_error(exc: BaseException) -> None:
        failed.append(exc)
        server.should_exit = True

    app = create_app(load_engine, config, on_load_error=on_load_error)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            # vLLM's way: the file's configuration is uvicorn's too (uvicorn applies it again).
            **({} if log_config is None else {"log_config": log_config}),
            access_log=not args.disable_uvicorn_access_log,
            root_path=args.root_path,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
        ),
        args.shutdown_timeout,
        app.state.abort_all,
    )
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn raises the Ctrl-C it deferred once the server has stopped (engine included);
        # not where SIGINT was ignored at launch (a background job), hence server.interrupted.
        pass
    if failed:
        raise SystemExit(f"kvpilot serve: loading the model failed: {failed[0]}")
    return 130 if server.interrupted else 0
