"""Soak test: one ``kvpilot serve`` under sustained mixed load; memory, KV blocks and 5xx checked.

Issue 17's check that a server process survives real traffic for a long time (default 30
minutes) without a leak. ``--concurrency`` clients on loopback send, back to back, requests of
these kinds (drawn with ``--seed``):

- ``stream``: a streamed chat completion, read to ``[DONE]``;
- ``abort``: a streamed completion the client stops reading after a few chunks and closes
  (the server must abort it and free its KV blocks);
- ``disconnect``: a non-streamed completion whose client gives up (a read timeout well under
  its generation time) and closes the connection;
- ``n``: a non-streamed completion with ``n`` 2-3 (parallel sampling);
- ``json``: a chat completion with ``response_format`` ``json_schema`` (structured output);
- ``shared_prefix``: a long prompt opening with one of a few shared prefixes (prefix caching,
  chunked prefill);
- ``bad``: an invalid request (``max_tokens`` -1, an unknown model, a prompt over the context),
  which must get a 4xx.

Every ``--sample-seconds`` the server's resident memory (``VmRSS`` of its process and of its
engine-core process, from ``/proc``) and its ``/metrics`` are read. When the load stops and the
server is idle, the checks are:

- resident memory flat: the median of the last three samples at most ``--max-rss-growth``
  (5%) above the median of the first three after ``--warmup-minutes``;
- no KV block leaked: ``kvpilot:kv_cache_free_blocks`` equals ``kvpilot:kv_cache_total_blocks``
  (cached blocks at reference count 0 count as free);
- no answer with a 5xx status, and no transport error other than the disconnects the
  client made on purpose; every ``bad`` request answered with a 4xx.

The summary (counts per kind, the memory samples, the verdicts) is printed as JSON and written
to ``--out``; the exit status is 1 when a check fails. A benchmark, not a test: run it on a
quiet machine (``make bench-soak``), never in the suite.

    python benchmarks/soak.py --duration-minutes 30 --concurrency 8 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_servers import LocalProcess, scrape  # noqa: E402

from kvpilot.machine import describe_machine  # noqa: E402

KINDS = {
    "stream": 4,
    "abort": 2,
    "disconnect": 1,
    "n": 2,
    "json": 2,
    "shared_prefix": 2,
    "bad": 1,
}
"""Request kinds and their weights in the mix."""

PREFIXES = [
    "You are a careful assistant for a library. " * 40,
    "The following is a transcript of a long meeting about budgets. " * 30,
    "Chapter one. It was a cold morning in the harbour town. " * 35,
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass
class Tally:
    """What the clients saw, per request kind."""

    sent: Counter = field(default_factory=Counter)
    status: Counter = field(default_factory=Counter)  # "kind status" -> count
    intended_disconnects: Counter = field(default_factory=Counter)
    transport_errors: list[str] = field(default_factory=list)
    bad_not_4xx: list[str] = field(default_factory=list)

    def server_errors(self) -> int:
        """Answers with a 5xx status."""
        return sum(n for key, n in self.status.items() if key.split()[1].startswith("5"))


def request_for(kind: str, rng: random.Random, model: str, max_model_len: int) -> dict:
    """The JSON body (and endpoint, under ``"_path"``) of one request of ``kind``."""
    topic = rng.choice(["the sea", "a GPU", "bread", "Kubernetes", "a cat", "winter"])
    chat = {"model": model, "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
    if kind == "stream":
        return {**chat, "_path": "/v1/chat/completions", "stream": True,
                "max_tokens": rng.randint(16, 64), "temperature": 0.8}  # fmt: skip
    if kind == "abort":
        return {"_path": "/v1/completions", "model": model, "prompt": f"A story about {topic}:",
                "max_tokens": 200, "stream": True, "ignore_eos": True}  # fmt: skip
    if kind == "disconnect":
        return {"_path": "/v1/completions", "model": model, "prompt": f"An essay on {topic}:",
                "max_tokens": 200, "ignore_eos": True}  # fmt: skip
    if kind == "n":
        return {"_path": "/v1/completions", "model": model, "prompt": f"Facts about {topic}:",
                "max_tokens": 24, "n": rng.randint(2, 3), "temperature": 1.0, "seed": rng.randint(0, 9999)}  # fmt: skip
    if kind == "json":
        return {**chat, "_path": "/v1/chat/completions", "max_tokens": 48,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": SCHEMA}}}  # fmt: skip
    if kind == "shared_prefix":
        prompt = rng.choice(PREFIXES) + f" Now, about {topic}:"
        return {"_path": "/v1/completions", "model": model, "prompt": prompt,
                "max_tokens": rng.randint(4, 16)}  # fmt: skip
    if kind == "bad":
        broken = rng.choice(["max_tokens", "model", "length"])
        body = {"_path": "/v1/completions", "model": model, "prompt": "Hi", "max_tokens": 8}
        if broken == "max_tokens":
            body["max_tokens"] = -1
        elif broken == "model":
            body["model"] = "no-such-model"
        else:
            body["prompt"] = "word " * (2 * max_model_len)
        return body
    raise ValueError(f"unknown request kind {kind!r}")


async def one_request(
    client: httpx.AsyncClient, kind: str, body: dict, rng: random.Random, tally: Tally
) -> None:
    """Send one request of ``kind`` and record what came back."""
    path = body.pop("_path")
    tally.sent[kind] += 1
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as answer:
                tally.status[f"{kind} {answer.status_code}"] += 1
                stop_after = rng.randint(1, 5) if kind == "abort" else None
                chunks = 0
                async for line in answer.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        if stop_after is not None and chunks >= stop_after:
                            tally.intended_disconnects[kind] += 1
                            return  # leaving the block closes the connection mid-stream
            return
        timeout = rng.uniform(0.3, 1.0) if kind == "disconnect" else 300.0
        answer = await client.post(path, json=body, timeout=timeout)
        tally.status[f"{kind} {answer.status_code}"] += 1
        if kind == "bad" and not 400 <= answer.status_code < 500:
            tally.bad_not_4xx.append(f"{answer.status_code}: {answer.text[:200]}")
    except httpx.TimeoutException:
        if kind == "disconnect":
            tally.intended_disconnects[kind] += 1
        else:
            tally.transport_errors.append(f"{kind}: timeout")
    except httpx.TransportError as error:
        tally.transport_errors.append(f"{kind}: {error!r}")


async def client_loop(
    url: str, model: str, max_model_len: int, seed: int, deadline: float, tally: Tally
) -> None:
    """One client: requests back to back until ``deadline`` (monotonic seconds)."""
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as client:
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            await one_request(
                client, kind, request_for(kind, rng, model, max_model_len), rng, tally
            )


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` and its descendants (the engine-core process),
    the sum of their ``VmRSS``, bytes."""
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total = int(line.split()[1]) * 1024
            break
    else:
        raise RuntimeError(f"no VmRSS for process {pid}")
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            try:
                total += rss_bytes(int(child))
            except (OSError, RuntimeError):
                pass  # it exited meanwhile
    return total


KV_METRICS = (
    "kvpilot:kv_cache_free_blocks",
    "kvpilot:kv_cache_total_blocks",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


async def sampler(
    url: str, pid: int, every: float, deadline: float, samples: list[dict], bar: tqdm
) -> None:
    """Every ``every`` seconds until ``deadline``: the server's RSS and KV metrics."""
    start = time.monotonic()
    while (now := time.monotonic()) < deadline:
        metrics = await asyncio.to_thread(scrape, url, KV_METRICS)
        samples.append({"t": round(now - start, 1), "rss_bytes": rss_bytes(pid), **metrics})
        bar.n = min(int(now - start), bar.total)
        bar.set_postfix(rss_mib=f"{samples[-1]['rss_bytes'] / 2**20:.0f}")
        bar.refresh()
        await asyncio.sleep(every)


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    """The KV metrics once no request runs or waits (after at most ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(url, KV_METRICS)
        busy = metrics["vllm:num_requests_running"] + metrics["vllm:num_requests_waiting"]
        if busy == 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(1.0)


def verdicts(
    samples: list[dict], warmup: float, idle: dict[str, float], tally: Tally, max_growth: float
) -> dict[str, dict]:
    """Each check's numbers and whether it passed (pure)."""
    after = [s["rss_bytes"] for s in samples if s["t"] >= warmup]
    if len(after) < 6:
        rss = {"passed": False, "why": f"{len(after)} samples after warm-up; need 6"}
    else:
        first, last = statistics.median(after[:3]), statistics.median(after[-3:])
        growth = last / first - 1.0
        rss = {"passed": growth <= max_growth, "after_warmup_mib": round(first / 2**20, 1),
               "at_end_mib": round(last / 2**20, 1), "growth": round(growth, 4)}  # fmt: skip
    free, total = idle["kvpilot:kv_cache_free_blocks"], idle["kvpilot:kv_cache_total_blocks"]
    busy = idle["vllm:num_requests_running"] + idle["vllm:num_requests_waiting"]
    blocks = {"passed": busy == 0 and free == total, "free": free, "total": total,
              "requests_left": busy}  # fmt: skip
    errors = {
        "passed": tally.server_errors() == 0 and not tally.transport_errors
        and not tally.bad_not_4xx,
        "5xx": tally.server_errors(),
        "transport_errors": tally.transport_errors[:20],
        "bad_not_4xx": tally.bad_not_4xx[:20],
    }  # fmt: skip
    return {"rss_flat": rss, "no_kv_block_leaked": blocks, "no_5xx": errors}


async def soak(args: argparse.Namespace, url: str, pid: int, model: str) -> dict:
    duration = args.duration_minutes * 60.0
    deadline = time.monotonic() + duration
    tally, samples = Tally(), []
    with tqdm(total=int(duration), desc="soak", unit="s") as bar:
        clients = [
            client_loop(url, model, args.max_model_len, args.seed + i, deadline, tally)
            for i in range(args.concurrency)
        ]
        await asyncio.gather(
            sampler(url, pid, args.sample_seconds, deadline, samples, bar), *clients
        )
    idle = await asyncio.to_thread(wait_idle, url)
    checks = verdicts(samples, args.warmup_minutes * 60.0, idle, tally, args.max_rss_growth)
    return {
        "machine": describe_machine(),
        "command": " ".join(sys.argv),
        "requests": dict(tally.sent),
        "answers": dict(tally.status),
        "intended_disconnects": dict(tally.intended_disconnects),
        "idle_metrics": idle,
        "samples": samples,
        "checks": checks,
        "passed": all(c["passed"] for c in checks.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration-minutes", type=float, default=30.0, help="load time")
    parser.add_argument(
        "--warmup-minutes", type=float, default=3.0, help="not counted for memory growth"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once")
    parser.add_argument("--sample-seconds", type=float, default=10.0, help="RSS/metrics period")
    parser.add_argument("--max-rss-growth", type=float, default=0.05, help="0.05 = 5%%")
    parser.add_argument("--max-model-len", type=int, default=2048, help="the server's context")
    parser.add_argument("--threads", type=int, default=2, help="the server's OMP threads")
    parser.add_argument("--seed", type=int, default=0, help="of the request mix")
    parser.add_argument("--model", default=None, help="model to serve (default: kvpilot's)")
    parser.add_argument("--out", default="soak.json", help="the whole report (JSON)")
    args = parser.parse_args()
    if args.warmup_minutes >= args.duration_minutes:
        parser.error("--warmup-minutes must be shorter than --duration-minutes")

    serve = ["serve", "--host", "127.0.0.1", "--max-model-len", str(args.max_model_len),
             "--served-model-name", "soak"] + (["--model", args.model] if args.model else [])  # fmt: skip
    server = LocalProcess(serve, env={"OMP_NUM_THREADS": str(args.threads)})
    try:
        print(f"starting kvpilot serve on {server.url} ...", file=sys.stderr)
        server.wait_healthy()
        report = asyncio.run(soak(args, server.url, server.process.pid, "soak"))
    finally:
        server.stop()
    Path(args.out).write_text(json.dumps(report, indent=1))
    summary = {k: report[k] for k in ("requests", "answers", "intended_disconnects", "checks")}
    print(json.dumps({**summary, "passed": report["passed"]}, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
