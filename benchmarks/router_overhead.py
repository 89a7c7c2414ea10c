"""What one ``kvpilot router`` process adds to a request, and the highest rate it sustains.

Backends: ``--replicas`` trivial backends (``trivial_backend.py``: a fixed answer at once), so
that a request's time is the router's work plus the loopback hops. The router runs the default
policy with ``--tokenizer`` (every prompt tokenized and hashed, as in production); the prompt is
``--prompt-tokens`` tokens of text.

1. Added latency: ``--requests`` requests at ``--rate`` per second (fixed gaps, open loop),
   first straight to a backend, then through the router; reported: latency p50/p99 of each and
   their difference (the added latency), and the router's own
   ``kvpilot:router_added_latency_seconds`` (arrival to forwarding) p50/p99 from its buckets,
   and the router process's CPU time per request (user + system, from ``/proc``: what a
   loaded machine does not distort).
2. Highest sustained rate: ``--step-seconds`` at each rate of ``--rates`` (open loop) through
   the router; a rate is sustained when at least 95% of the offered requests completed within
   the step and their p99 latency stayed under ``--max-p99-ms``.

    python benchmarks/router_overhead.py --rate 100 --requests 2000 \\
        --rates 100 200 400 800 1600 --step-seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time

import aiohttp
import numpy as np
from local_servers import LocalProcess
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm

from kvpilot.engine.model_loader import load_tokenizer, resolve_model
from kvpilot.machine import describe_machine

MODEL_NAME = "trivial"


async def open_loop(
    url: str, body: dict, rate: float, count: int, deadline_s: float | None = None, desc: str = ""
) -> tuple[list[float], int]:
    """Send ``count`` requests at ``rate`` per second (fixed gaps); return the latencies
    (seconds) of those answered 200 (within ``deadline_s`` of the first send, when given) and
    the number of failures."""
    latencies: list[float] = []
    failed = 0
    progress = tqdm(total=count, desc=desc, leave=False)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def one() -> None:
            nonlocal failed
            sent = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    await response.read()
                    ok = response.status == 200
            except aiohttp.ClientError:
                ok = False
            done = time.perf_counter()
            if ok and (deadline_s is None or done - start <= deadline_s):
                latencies.append(done - sent)
            else:
                failed += 1
            progress.update()

        tasks = []
        for i in range(count):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    progress.close()
    return latencies, failed


def histogram_buckets(text: str, name: str) -> list[tuple[float, float]]:
    """One histogram's cumulative buckets ``[(le, count)]`` from a ``/metrics`` text."""
    return sorted(
        (float(s.labels["le"]), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == f"{name}_bucket"
    )


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' ``histogram_quantile`` over cumulative buckets (linear within a bucket)."""
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            width = count - lower_count
            return lower_bound + (bound - lower_bound) * (
                (rank - lower_count) / width if width else 1
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles_ms(latencies: list[float]) -> tuple[float, float]:
    values = np.array(latencies or [0.0]) * 1000
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=None, help="default: the built-in model's")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s for part 1")
    parser.add_argument("--requests", type=int, default=2000, help="requests for part 1")
    parser.add_argument("--rates", type=float, nargs="+", default=[100, 200, 400, 800, 1600])
    parser.add_argument("--step-seconds", type=float, default=10.0)
    parser.add_argument("--max-p99-ms", type=float, default=100.0)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    tokenizer_path = str(resolve_model(args.tokenizer))
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("machine:", describe_machine())
    tokenizer = load_tokenizer(tokenizer_path)
    words = "the router adds a few milliseconds at most to each request it forwards ".split()
    text = " ".join(words[i % len(words)] for i in range(args.prompt_tokens))
    print(f"prompt: {len(tokenizer.encode(text))} tokens")
    body = {"model": MODEL_NAME, "prompt": text, "max_tokens": 1}
    backend = [sys.executable, "trivial_backend.py", "--port", "{port}"]
    backends = [LocalProcess(backend, command=True) for _ in range(args.replicas)]
    router = None
    try:
        for b in backends:
            b.wait_healthy()
        flags = ["router", "--tokenizer", tokenizer_path, "--log-level", "warning"]
        flags += [arg for b in backends for arg in ("--endpoint", b.url)]
        router = LocalProcess(flags, {"OMP_NUM_THREADS": "1"})
        router.wait_healthy()
        asyncio.run(open_loop(router.url, body, 50, 100, desc="warm-up"))
        before = aiohttp_get_text(f"{router.url}/metrics")
        direct, direct_failed = asyncio.run(
            open_loop(backends[0].url, body, args.rate, args.requests, desc="direct")
        )
        cpu_before = cpu_seconds(router.process.pid)
        routed, routed_failed = asyncio.run(
            open_loop(router.url, body, args.rate, args.requests, desc="router")
        )
        cpu_per_request_ms = 1000 * (cpu_seconds(router.process.pid) - cpu_before) / args.requests
        after = aiohttp_get_text(f"{router.url}/metrics")
        d50, d99 = percentiles_ms(direct)
        r50, r99 = percentiles_ms(routed)
        name = "kvpilot:router_added_latency_seconds"
        pairs = zip(histogram_buckets(after, name), histogram_buckets(before, name), strict=True)
        routed_buckets = [(le, a - b) for (le, a), (_, b) in pairs]
        own = [1000 * histogram_quantile(routed_buckets, q) for q in (0.5, 0.99)]
        print(f"\nadded latency at {args.rate:g} requests/s, {args.requests} requests:")
        print("| path | p50 (ms) | p99 (ms) | failed |")
        print("| --- | --- | --- | --- |")
        print(f"| straight to a backend | {d50:.2f} | {d99:.2f} | {direct_failed} |")
        print(f"| through the router | {r50:.2f} | {r99:.2f} | {routed_failed} |")
        print(f"| difference (added) | {r50 - d50:.2f} | {r99 - d99:.2f} | |")
        print(
            f"| router's own histogram (arrival to forwarding; bucket-interpolated) "
            f"| {own[0]:.2f} | {own[1]:.2f} | |"
        )
        print(f"\nrouter CPU per request: {cpu_per_request_ms:.2f} ms (user + system)")
        print(f"\nsustained rate, {args.step_seconds:g} s per step:")
        print("| offered (requests/s) | completed in the step | p50 (ms) | p99 (ms) | sustained |")
        print("| --- | --- | --- | --- | --- |")
        best = 0.0
        for rate in args.rates:
            count = int(rate * args.step_seconds)
            latencies, _ = asyncio.run(
                open_loop(router.url, body, rate, count, args.step_seconds * 1.05, f"{rate:g}/s")
            )
            p50, p99 = percentiles_ms(latencies)
            sustained = len(latencies) >= 0.95 * count and p99 <= args.max_p99_ms
            print(f"| {rate:g} | {len(latencies)}/{count} | {p50:.1f} | {p99:.1f} | {sustained} |")
            if not sustained:
                break
            best = rate
        print(f"\nhighest sustained rate: {best:g} requests/s")
    finally:
        if router is not None:
            router.stop()
        for b in backends:
            b.stop()
    return 0


def aiohttp_get_text(url: str) -> str:
    async def get() -> str:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return await response.text()

    return asyncio.run(get())


if __name__ == "__main__":
    sys.exit(main())
