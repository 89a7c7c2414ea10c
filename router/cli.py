"""``kvpilot router --endpoint URL ...``: the OpenAI-compatible router in front of engine
replicas (local mode: the replicas are the URLs given); ``kvpilot router --kubernetes
--namespace NS [--llmdeployment NAME ...]``: the replicas are the Ready engine pods of those
LLMDeployments, and a request for one at zero replicas wakes it (``router/kubernetes.py``).

Imports nothing heavy at module level: ``kvpilot --help`` must not load torch. The defaults
are ``RouterConfig``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from kvpilot.engine.server.cli import API_KEY_ENV_VARS, UVICORN_LOG_LEVELS
from kvpilot.router.config import FLAGS, ROUTING_POLICIES, RouterConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RouterConfig)}

# RouterConfig field -> (type, help); its flag is config.FLAGS[field]
_TUNING = {
    "tokenizer": (
        str,
        "the served model's tokenizer (folder, Hub id, or SmolLM2-135M-Instruct for the "
        "built-in model) for prefix-aware routing; without it, consistent hashing on the "
        "prompt's first characters",
    ),
    "routing_policy": (
        str,
        "kvpilot (prefix affinity and load), consistent-hash (KubeAI's: consistent hashing with "
        "bounded loads on the prompt's first characters) or round-robin; the last two for "
        "comparison",
    ),
    "load_factor": (
        float,
        "bounded load (>= 1): no replica gets more than this factor of the mean in-flight "
        "requests, rounded up, counting the new one",
    ),
    "prefix_weight": (float, "score per fraction of the prompt cached"),
    "load_weight": (float, "score taken off per fraction of the bound used"),
    "waiting_weight": (
        float,
        "score taken off per fraction of the bound in the engine's waiting queue",
    ),
    "kv_weight": (float, "score taken off per unit of the engine's KV usage"),
    "down_s": (
        float,
        "how long a replica that refused a connection is routed around",
    ),
    "refresh_s": (
        float,
        "seconds between polls of the replicas' /metrics, /v1/models and /kv_events",
    ),
    "wake_timeout_s": (
        float,
        "seconds a request for a model with no ready replica is held while it wakes, before "
        "a 503 with Retry-After",
    ),
    "wake_poll_s": (
        float,
        "seconds between polls of the replicas while requests are held",
    ),
    "connect_timeout_s": (float, "seconds to connect to a replica"),
    "api_key": (
        str,
        "the replicas' API key, for the router's own /v1/models polls (LoRA adapter names); "
        "default: $KVPILOT_API_KEY or $VLLM_API_KEY. Clients' keys pass through as sent",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the router's flags."""
    parser.add_argument(
        "--endpoint",
        dest="endpoints",
        action="append",
        default=[],
        metavar="URL",
        help="an engine replica's base URL, e.g. http://127.0.0.1:8001 (repeat per replica)",
    )
    parser.add_argument(
        "--kubernetes",
        action="store_true",
        help="discover the replicas from the Kubernetes API (in-cluster, else KUBECONFIG): "
        "the Ready pods of LLMDeployments, instead of --endpoint",
    )
    parser.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="with --kubernetes: the LLMDeployments' namespace (default: $POD_NAMESPACE or "
        "%(default)s)",
    )
    parser.add_argument(
        "--llmdeployment",
        dest="llmdeployments",
        action="append",
        default=[],
        metavar="NAME",
        help="with --kubernetes: an LLMDeployment to serve (repeat; default: every one in the "
        "namespace)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=8080, help="port to listen on (default: %(default)s)"
    )
    for dest, (kind, text) in _TUNING.items():
        flag = FLAGS[dest]
        default = _DEFAULTS[dest]
        suffix = "" if default is None else " (default: %(default)s)"
        options = {"metavar": flag.removeprefix("--").upper().replace("-", "_")}
        if dest == "routing_policy":
            options = {"choices": ROUTING_POLICIES}
        parser.add_argument(
            flag, dest=dest, type=kind, default=default, help=text + suffix, **options
        )
    parser.add_argument(
        "--log-level",
        choices=UVICORN_LOG_LEVELS[:-1],
        default="info",
        help="the router's and uvicorn's log level (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Serve the router until interrupted.

    Raises:
        SystemExit: invalid settings (no endpoint and no ``--kubernetes``, or both; one endpoint
            twice; ``--load-factor`` below 1; no cluster configuration with ``--kubernetes``).
    """
    if not args.endpoints and not args.kubernetes:
        raise SystemExit("kvpilot router: give --endpoint URL (once per replica) or --kubernetes")
    import prometheus_client
    import uvicorn

    from kvpilot.router.app import create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    prometheus_client.disable_created_metrics()  # no *_created series in /metrics, as vLLM
    values = {name: getattr(args, name) for name in _DEFAULTS}
    values["api_key"] = args.api_key or next(
        (os.environ[name] for name in API_KEY_ENV_VARS if os.environ.get(name)), None
    )
    try:
        app = create_app(RouterConfig(**values))
    except ValueError as exc:
        raise SystemExit(f"kvpilot router: {exc}") from None
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
