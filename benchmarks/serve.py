"""Serving load generator with vLLM ``bench serve`` definitions, for any OpenAI-compatible server.

Workload: ``--num-prompts`` synthetic prompts of ``--random-input-len`` tokens (random token ids
from the model's vocabulary, decoded to text), each asking for ``--random-output-len`` tokens
(lengths drawn uniformly within +-``--random-range-ratio``), streamed from
``/v1/completions``. Arrivals follow a Poisson process at ``--request-rate`` requests/s
(gamma-distributed gaps with ``--burstiness``; 1 = Poisson, ``inf`` = all at once), optionally
capped at ``--max-concurrency`` requests in flight.

Metrics, as vLLM defines them:

- TTFT: request sent -> first streamed token; E2EL: request sent -> last byte.
- ITL: gaps between successive streamed chunks; TPOT: (E2EL - TTFT) / (output tokens - 1).
- request throughput = completed / wall time; output token throughput = output tokens / wall
  time; total token throughput adds the prompt tokens.
- goodput: completed requests per second that meet every SLO of ``--goodput`` (e.g.
  ``ttft:2000 tpot:200``, milliseconds).

Output tokens are counted from the final ``usage`` chunk when the server sends one (``stream_options
.include_usage``), else by tokenizing the generated text.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 32 \\
        --random-input-len 128 --random-output-len 32 --request-rate 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from kvpilot.machine import describe_machine


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    error: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument(
        "--model", default=None, help="model name sent (default: the server's first)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the built-in model's)"
    )
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=32)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send vLLM's ignore_eos so every request produces its full length")  # fmt: skip
    parser.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                        help="SLOs, e.g. ttft:2000 tpot:200 e2el:10000 (milliseconds)")  # fmt: skip
    parser.add_argument("--percentiles", default="50,90,99")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="name of the server in the report")
    parser.add_argument("--result-json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def parse_slos(items: list[str]) -> dict[str, float]:
    """``["ttft:2000", "tpot:200"]`` -> ``{"ttft": 2.0, "tpot": 0.2}`` (seconds).

    Raises:
        ValueError: an unknown metric or a value that is not a positive number.
    """
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput: expected ttft|tpot|e2el:<ms>, got {item!r}")
        if float(value) <= 0:
            raise ValueError(f"--goodput: {name} must be positive, got {value}")
        slos[name] = float(value) / 1000.0
    return slos


def random_requests(
    tokenizer, num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """vLLM's random dataset: random token ids decoded to text; lengths within +-range_ratio."""
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    vocab = np.array([t for t in range(len(tokenizer)) if t not in special])
    requests = []
    for _ in range(num):
        n_in = int(
            rng.integers(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)) + 1)
        )
        n_out = int(
            rng.integers(
                int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio)) + 1
            )
        )
        prompt = tokenizer.decode(rng.choice(vocab, size=max(n_in, 1)).tolist())
        requests.append(BenchRequest(prompt, len(tokenizer.encode(prompt)), max(n_out, 1)))
    return requests


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma gaps with mean 1/rate (0 for an infinite rate)."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]


async def send(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    model: str,
    request: BenchRequest,
    tokenizer,
) -> RequestResult:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    result = RequestResult(prompt_len=request.prompt_len)
    text = ""
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", args.endpoint, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
                choices = chunk.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if not text:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                text += choices[0]["text"]
        result.latency = time.perf_counter() - start
        if not result.output_tokens:
            result.output_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        result.success = bool(text)
        if not result.success:
            result.error = "no text streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(
    args: argparse.Namespace, requests: list[BenchRequest], tokenizer
) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=None, limits=limits
    ) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        semaphore = asyncio.Semaphore(args.max_concurrency or len(requests))

        async def limited(request: BenchRequest) -> RequestResult:
            async with semaphore:
                return await send(client, args, model, request, tokenizer)

        tasks = []
        start = time.perf_counter()
        for gap, request in zip(
            arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed),
            requests,
            strict=True,
        ):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(
    results: list[RequestResult], duration: float, slos: dict[str, float], percentiles: list[float]
) -> dict[str, float]:
    """vLLM ``bench serve`` metrics from per-request results (times in milliseconds)."""
    ok = [r for r in results if r.success]
    out: dict[str, float] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "total_token_throughput": sum(r.prompt_len + r.output_tokens for r in ok) / duration,
    }
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, values in series.items():
        values_ms = np.array(values or [0.0]) * 1000.0
        out[f"mean_{name}_ms"] = float(values_ms.mean())
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(values_ms, p))
    if slos:
        good = 0
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            measured = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
            good += all(measured[name] <= limit for name, limit in slos.items())
        out["goodput"] = good / duration
    return out


def report(args: argparse.Namespace, summary: dict[str, float], errors: list[str]) -> str:
    lines = [
        f"command: {shlex.join([sys.executable, *sys.argv])}",
        f"machine: {describe_machine()}",
        f"server: {args.label or args.base_url}",
        f"load: {args.num_prompts} prompts, input {args.random_input_len}, output "
        f"{args.random_output_len} tokens, rate {args.request_rate}/s, max concurrency "
        f"{args.max_concurrency or 'unbounded'}",
    ]
    lines += [
        f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}"
        for key, value in summary.items()
    ]
    lines += [f"error: {e}" for e in errors[:5]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    slos = parse_slos(args.goodput)
    percentiles = [float(p) for p in args.percentiles.split(",")]
    from transformers import AutoTokenizer

    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from kvpilot.engine.model_loader import resolve_model

        tokenizer_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    requests = random_requests(
        tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
        args.random_range_ratio, args.seed,
    )  # fmt: skip
    results, duration = asyncio.run(run_load(args, requests, tokenizer))
    summary = summarize(results, duration, slos, percentiles)
    print(report(args, summary, [r.error for r in results if r.error]))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(
                {"args": vars(args), "summary": summary, "results": [asdict(r) for r in results]},
                f,
                indent=1,
            )
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
