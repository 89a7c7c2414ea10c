"""Latency effects of prefix caching and chunked prefill (issue 7), on the default model.

1. Time to first token of requests sharing a ``--system-len`` (1,000) token system prompt, one
   request at a time, with and without prefix caching: the first request fills the cache, the
   others reuse it (target: >= 5x lower mean TTFT with caching).
2. Inter-token latency of ``--streams`` running streams while a ``--long-len`` (2,000) token
   prompt arrives: with chunked prefill (``--max-num-batched-tokens`` per step) the p99 stays
   near the steady inter-token latency (target: <= 2x); without it one step computes the whole
   prompt and every stream stalls for that long. The steady inter-token latency is that of a
   control: a second engine with the same streams and no long prompt, stepped in turn with the
   first (one step each), so that both see the same stream contexts and the same machine noise.
   The streams' contexts grow during a long chunked prefill (hundreds of steps on a CPU), and
   with them their own step time, so the first steps alone would understate it; that ratio is
   printed too.

    python benchmarks/prefix_and_chunked_prefill.py --threads 1 --max-num-batched-tokens 16 32

Latencies are wall-clock seconds (``time.perf_counter``); the load average is printed because
other processes on a shared machine inflate them. Step times are also given in CPU seconds
(``time.process_time``), which count only this process's work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm

# Enough for every request here; smaller than the CPU default, so engines start quickly.
KV_CACHE_MEMORY = 1024**3
# Steps of the streams alone before the long prompt arrives.
STEADY_STEPS = 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--system-len", type=int, default=1000, help="shared system prompt (tokens)"
    )
    parser.add_argument("--num-requests", type=int, default=6, help="requests sharing it")
    parser.add_argument("--streams", type=int, default=8, help="decoding streams in part 2")
    parser.add_argument(
        "--long-len", type=int, default=2000, help="the prompt that arrives (tokens)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        nargs="+",
        default=[32],
        help="step budget(s) with chunked prefill; several values run one after another",
    )
    parser.add_argument(
        "--skip-prefix-caching", action="store_true", help="run only the inter-token latency part"
    )
    parser.add_argument(
        "--skip-unchunked", action="store_true", help="leave out the run without chunked prefill"
    )
    return parser.parse_args()


def tokens(n: int, seed: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (n,), generator=generator).tolist()


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def time_to_first_token(args, enable_prefix_caching: bool) -> list[float]:
    """TTFT (s) of each request, sent one after another, all sharing the system prompt."""
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        max_model_len=4096,
        kv_cache_memory=KV_CACHE_MEMORY,
        enable_prefix_caching=enable_prefix_caching,
    )
    engine = llm.llm_engine
    vocab_size = engine.model_shape.vocab_size
    system = tokens(args.system_len, 0, vocab_size)
    params = SamplingParams(temperature=0, max_tokens=1)
    ttfts = []
    label = f"TTFT, prefix caching {'on' if enable_prefix_caching else 'off'}"
    for i in tqdm(range(args.num_requests), desc=label, unit="req"):
        start = time.perf_counter()
        engine.add_request(
            str(i), {"prompt_token_ids": system + tokens(32, i + 1, vocab_size)}, params
        )
        while engine.has_unfinished_requests():
            engine.step()
        ttfts.append(time.perf_counter() - start)
    return ttfts


class StepTimes:
    """Per-step wall-clock and CPU seconds (``time.process_time``: all threads of this process,
    so with one torch thread the work of the step without the time other processes held the
    core)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []


def streaming_engine(args, budget: int | None):
    """An engine with ``--streams`` running streams (prefilled), and the vocabulary size.

    ``budget`` None: no chunking (a step must then hold a whole prompt)."""
    from kvpilot.engine import LLM, SamplingParams

    max_model_len = max(4096, args.long_len + 16)
    llm = LLM(
        args.model,
        max_model_len=max_model_len,
        enable_chunked_prefill=budget is not None,
        max_num_batched_tokens=budget or max_model_len,
        enable_prefix_caching=False,
        kv_cache_memory=KV_CACHE_MEMORY,
    )
    engine = llm.llm_engine
    vocab_size = engine.model_shape.vocab_size
    stream = SamplingParams(temperature=0, max_tokens=max_model_len - 64, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"s{i}", {"prompt_token_ids": tokens(16, 100 + i, vocab_size)}, stream)
    engine.step()  # prefill the streams
    return engine, vocab_size


def timed_step(engine, times: StepTimes) -> list:
    """One engine step, its wall and CPU seconds appended to ``times``; returns its outputs."""
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = engine.step()
    times.wall.append(time.perf_counter() - wall)
    times.cpu.append(time.process_time() - cpu)
    return outputs


def inter_token_latencies(
    args, budget: int | None
) -> tuple[StepTimes, StepTimes, StepTimes, float]:
    """Step times of two identical engines stepped alternately, one step each in turn: the
    streams with the long prompt arriving after ``STEADY_STEPS`` steps, and the control (the
    same streams, no prompt). Interleaving gives both the same machine noise and the same
    stream contexts at every step.

    Returns:
        (the first engine's steps before the arrival, its steps from the arrival until the
        prompt's first token, the control's steps over the same step indices, the prompt's
        time to first token in seconds: the sum of the first engine's step times since the
        arrival, so the control's steps are not counted).
    """
    from kvpilot.engine import SamplingParams

    engine, vocab_size = streaming_engine(args, budget)
    control, _ = streaming_engine(args, budget)
    before, during, control_times, ignored = StepTimes(), StepTimes(), StepTimes(), StepTimes()
    label = f"{budget} tokens/step" if budget else "no chunked prefill"
    with tqdm(desc=f"ITL, {label}, with its control", unit="step") as bar:
        for _ in range(STEADY_STEPS):
            timed_step(engine, before)
            timed_step(control, ignored)
            bar.update()
        prompt = {"prompt_token_ids": tokens(args.long_len, 7, vocab_size)}
        engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=1))
        while True:
            outputs = timed_step(engine, during)
            timed_step(control, control_times)
            bar.update()
            if any(o.request_id == "long" and o.finished for o in outputs):
                break
    for e in (engine, control):
        e.abort_request([f"s{i}" for i in range(args.streams)])
    return before, during, control_times, sum(during.wall)


def report_inter_token_latencies(args, budget: int | None) -> None:
    """Print the streams' step times with the long prompt arriving against the control."""
    steady, during, control, ttft = inter_token_latencies(args, budget)
    label = f"chunked prefill, {budget} tokens/step" if budget else "no chunked prefill"
    print(f"  {label} ({len(during.wall)} steps; long prompt's TTFT {ttft:.1f} s):")
    for clock in ("wall", "cpu"):
        values, same = getattr(during, clock), getattr(control, clock)
        early = statistics.median(getattr(steady, clock))
        per_step = [v / c for v, c in zip(values, same, strict=True)]
        print(
            f"    {clock:4} while prefilling: median {statistics.median(values) * 1000:5.0f} ms, "
            f"p99 {p99(values) * 1000:5.0f} ms; control, same steps: median "
            f"{statistics.median(same) * 1000:5.0f} ms, p99 {p99(same) * 1000:5.0f} ms"
        )
        print(
            f"         p99 of the per-step ratio = {p99(per_step):.2f}x; p99 / control median "
            f"= {p99(values) / statistics.median(same):.2f}x; p99 / control p99 = "
            f"{p99(values) / p99(same):.2f}x; p99 / median of the first {STEADY_STEPS} steps "
            f"({early * 1000:.0f} ms) = {p99(values) / early:.2f}x"
        )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"threads: {torch.get_num_threads()}, load average at start: {os.getloadavg()[0]:.2f}")

    if not args.skip_prefix_caching:
        cold = time_to_first_token(args, enable_prefix_caching=False)
        warm = time_to_first_token(args, enable_prefix_caching=True)
        # The first cached request fills the cache; the rest are the hits.
        off, on = statistics.mean(cold[1:]), statistics.mean(warm[1:])
        print()
        print(
            f"TTFT, {args.system_len}-token shared system prompt + 32 tokens, "
            "one request at a time:"
        )
        print(f"  without prefix caching: mean {off * 1000:.0f} ms")
        print(
            f"  with prefix caching:    mean {on * 1000:.0f} ms "
            f"(first, cache filling: {warm[0] * 1000:.0f} ms)"
        )
        print(f"  {off / on:.1f}x lower with caching")

    print()
    print(
        f"Step time (= inter-token latency) of {args.streams} streams while a "
        f"{args.long_len}-token prompt arrives, against a control run of the same streams "
        "and steps without it:"
    )
    budgets = [*args.max_num_batched_tokens, *([] if args.skip_unchunked else [None])]
    for budget in budgets:
        report_inter_token_latencies(args, budget)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
