"""``kvpilot serve [MODEL]``: the OpenAI-compatible server (engine flags spelled as vLLM's).

Imports nothing heavy at module level: ``kvpilot --help`` must not load torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME
from kvpilot.engine.server.protocol import MAX_LOGPROBS
from kvpilot.engine.server.reasoning_parsers import REASONING_PARSERS

if TYPE_CHECKING:
    from kvpilot.engine.server.app import ServerConfig

API_KEY_ENV_VARS = ("KVPILOT_API_KEY", "VLLM_API_KEY")
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
        help="log each request's id, prompt length and sampling parameters at INFO "
        "(--disable-log-requests, older vLLM's flag, is the default)",
    )
    server.add_argument(
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_false",
        help=argparse.SUPPRESS,
    )
    server.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help=f"the most top logprobs a request may ask for (logprobs, top_logprobs, "
        f"prompt_logprobs; default {MAX_LOGPROBS}, as vLLM; -1: up to the vocabulary)",
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
    tools = parser.add_argument_group("tool calling")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="allow tool_choice 'auto': the model decides whether to call a tool and "
        "--tool-call-parser finds the calls in its text ('required' and named tools need no flag)",
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
        "block); tool calls are read from the content",
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
        max_logprobs=None if args.max_logprobs == -1 else args.max_logprobs,
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        request_id_headers=args.enable_request_id_headers,
    )
    return engine_args, config


def run(args: argparse.Namespace) -> int:
    """Start the server; returns the process exit code: 2 for a bad flag (its one-line message
    on stderr, before anything loads, as argparse and ``kvpilot generate`` do), 1 when the model
    failed to load, 130 after Ctrl-C (as a shell reports an interrupted command)."""
    import logging

    import prometheus_client
    import uvicorn

    from kvpilot.engine.server.app import create_app
    from kvpilot.engine.server.shutdown import DrainingServer

    try:
        engine_args, config = _configure(args)
    except ValueError as exc:
        print(f"kvpilot serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    prometheus_client.disable_created_metrics()  # no *_created series in /metrics, as vLLM

    def load_engine():
        if args.engine_core_process:
            from kvpilot.engine.core_client import MPClient

            return MPClient(engine_args)
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
