"""A trivial OpenAI-shaped backend for ``router_overhead.py``: answers every completion or chat
request at once with a fixed body, lists one model, and has the ``/health`` and ``/metrics``
a router polls, so that what a request costs through the router is the router's own work.

    python benchmarks/trivial_backend.py --port 8001 [--model-name trivial]
"""

from __future__ import annotations

import argparse
import json

import uvicorn

ANSWER = {
    "id": "cmpl-trivial",
    "object": "text_completion",
    "created": 0,
    "model": "",
    "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def make_app(model_name: str, max_model_len: int):
    """A bare ASGI app (no framework: its own cost stays near zero)."""
    answer = json.dumps({**ANSWER, "model": model_name}).encode()
    models = json.dumps(
        {"object": "list", "data": [{"id": model_name, "object": "model", "max_model_len": max_model_len}]}
    ).encode()  # fmt: skip
    metrics = f'vllm:num_requests_running{{model_name="{model_name}"}} 0.0\n'.encode()
    routes = {
        ("POST", "/v1/completions"): (200, answer),
        ("POST", "/v1/chat/completions"): (200, answer),
        ("GET", "/v1/models"): (200, models),
        ("GET", "/health"): (200, b"{}"),
        ("GET", "/metrics"): (200, metrics),
    }

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        status, body = routes.get(
            (scope["method"], scope["path"]), (404, b'{"detail":"Not Found"}')
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-name", default="trivial")
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    uvicorn.run(
        make_app(args.model_name, args.max_model_len),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
