"""Routing policies side by side on real engines: round-robin, consistent hashing on the prompt's
prefix (KubeAI's method), kvpilot's router, and the best possible (each user pinned to one
replica, no router), in one run, on the same engines and the same workload.

Engines: ``--replicas`` ``kvpilot serve`` processes of ``--model`` (default: the built-in
SmolLM2-135M-Instruct) on loopback, each with ``--kv-cache-memory`` of KV cache. Each policy but
the pinned one is a ``kvpilot router --routing-policy P`` process in front of them.

Workload: ``--users`` users, each with a document of ``--prefix-tokens`` tokens (uniform in the
range given: a system prompt or a pasted document, random text) and ``--turns`` questions about
it, asked one after another (chat: the document, then the conversation so far with the
engine's real answers, then the next question). Sessions start as a Poisson process of
``--session-rate`` per second; a follow-up comes an exponential think time
(``--think-seconds``) after the answer before it. The schedule and the texts are the same for
every policy (``--seed``); each policy sends its own ``cache_salt``, so no policy is served
from blocks another one cached.

Reported per policy:

- prefix-cache hit rate: the engines' own ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``
  over the policy's run, all replicas together;
- TTFT p50 / p99 (request sent -> first streamed token), from the client;
- output throughput: completion tokens / (last answer - first request);
- max/mean load: requests each replica finished (``vllm:request_success``), the busiest over
  the mean; and the same for the time-averaged requests running or waiting on each engine
  (``vllm:num_requests_running`` + ``waiting``, sampled every 0.25 s).

    python benchmarks/routing.py --users 24 --turns 4 --prefix-tokens 500 2000 \\
        --session-rate 0.5 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
from local_servers import LocalProcess, scrape
from tqdm.auto import tqdm

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME, load_tokenizer, resolve_model
from kvpilot.machine import describe_machine

POLICIES = ("round-robin", "consistent-hash", "kvpilot", "pinned")
ENGINE_COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:request_success")
ENGINE_LOAD = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass
class Turn:
    """One request of the schedule."""

    user: int
    turn: int
    question: str


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    failed: int = 0
    hit_rate: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    output_tokens_per_s: float = 0.0
    max_over_mean_requests: float = 0.0
    max_over_mean_busy: float = 0.0
    requests_per_replica: list[float] = field(default_factory=list)


def make_documents(tokenizer, args: argparse.Namespace, rng: random.Random) -> list[str]:
    """One document per user, of a length drawn from ``--prefix-tokens`` (random token ids of
    the vocabulary, decoded: text the tokenizer reads back at about that length)."""
    low, high = args.prefix_tokens
    vocab = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.all_special_ids]
    documents = []
    for user in range(args.users):
        length = rng.randint(low, high)
        text = tokenizer.decode([rng.choice(vocab) for _ in range(length)])
        documents.append(f"Document {user} for this conversation:\n{text}")
    return documents


def make_questions(args: argparse.Namespace, rng: random.Random) -> list[list[str]]:
    topics = ["the summary", "the second part", "the numbers", "the main claim", "the ending"]
    return [
        [f"Question {t + 1}: what does the document say about {rng.choice(topics)}?"
         for t in range(args.turns)]
        for _ in range(args.users)
    ]  # fmt: skip


async def run_policy(
    policy: str,
    base_urls: list[str],
    documents: list[str],
    questions: list[list[str]],
    args: argparse.Namespace,
    salt: str,
) -> tuple[list[dict], float, float]:
    """Play the schedule against one policy. ``base_urls``: one URL (a router), or one per
    replica (pinned: user ``u`` goes to replica ``u % n``). Returns per-request records and
    the first send and last answer times (``time.perf_counter``)."""
    rng = random.Random(args.seed)  # the same schedule for every policy
    starts = np.cumsum([rng.expovariate(args.session_rate) for _ in documents])
    think = [[rng.expovariate(1 / args.think_seconds) for _ in qs] for qs in questions]
    records: list[dict] = []
    progress = tqdm(total=len(documents) * args.turns, desc=policy, leave=False)
    began = time.perf_counter()

    async def session(client: httpx.AsyncClient, user: int) -> None:
        await asyncio.sleep(starts[user])
        messages = [{"role": "system", "content": documents[user]}]
        base = base_urls[user % len(base_urls)]
        for turn, question in enumerate(questions[user]):
            if turn:
                await asyncio.sleep(think[user][turn])
            messages.append({"role": "user", "content": question})
            record = await one_request(client, base, messages, args, salt)
            record.update(user=user, turn=turn)
            records.append(record)
            progress.update()
            messages.append({"role": "assistant", "content": record.get("text", "")})

    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30)) as client:
        await asyncio.gather(*(session(client, u) for u in range(len(documents))))
    progress.close()
    ended = max((r["end"] for r in records if r["ok"]), default=time.perf_counter())
    return records, began, ended


async def one_request(
    client: httpx.AsyncClient, base: str, messages: list[dict], args: argparse.Namespace, salt: str
) -> dict:
    body = {
        "model": args.served_model_name,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }
    sent = time.perf_counter()
    record = {"ok": False, "ttft": None, "end": sent, "output_tokens": 0, "text": ""}
    parts = []
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record["error"] = f"{response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        if record["ttft"] is None:
                            record["ttft"] = time.perf_counter() - sent
                        parts.append(text)
                if chunk.get("usage"):
                    record["output_tokens"] = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        record["error"] = repr(exc)
        return record
    record.update(ok=True, end=time.perf_counter(), text="".join(parts))
    return record


async def sample_load(replicas: list[str], samples: list[list[float]], stop: asyncio.Event):
    """Every 0.25 s, each engine's running + waiting requests, until ``stop``."""
    while not stop.is_set():
        loads = await asyncio.gather(*(asyncio.to_thread(scrape, u, ENGINE_LOAD) for u in replicas))
        samples.append([sum(load.values()) for load in loads])
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


def max_over_mean(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 0.0


async def measure(policy: str, replicas: list[str], router: str | None, *inputs) -> PolicyResult:
    documents, questions, args = inputs
    before = [scrape(u, ENGINE_COUNTERS) for u in replicas]
    samples: list[list[float]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_load(replicas, samples, stop))
    salt = f"{policy}-{args.seed}-{time.time_ns()}"
    urls = replicas if router is None else [router]
    records, began, ended = await run_policy(policy, urls, documents, questions, args, salt)
    stop.set()
    await sampler
    after = [scrape(u, ENGINE_COUNTERS) for u in replicas]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    hits = sum(d["vllm:prefix_cache_hits"] for d in delta)
    queries = sum(d["vllm:prefix_cache_queries"] for d in delta)
    ok = [r for r in records if r["ok"] and r["ttft"] is not None]
    ttft = np.array([r["ttft"] for r in ok]) * 1000 if ok else np.array([0.0])
    per_replica = [d["vllm:request_success"] for d in delta]
    busy = np.mean(samples, axis=0).tolist() if samples else [0.0] * len(replicas)
    for r in records:
        if not r["ok"]:
            print(f"{policy}: failed: {r.get('error')}", file=sys.stderr)
    return PolicyResult(
        policy=policy,
        requests=len(records),
        failed=len(records) - len(ok),
        hit_rate=hits / queries if queries else 0.0,
        ttft_p50_ms=float(np.percentile(ttft, 50)),
        ttft_p99_ms=float(np.percentile(ttft, 99)),
        output_tokens_per_s=sum(r["output_tokens"] for r in ok) / max(ended - began, 1e-9),
        max_over_mean_requests=max_over_mean(per_replica),
        max_over_mean_busy=max_over_mean(busy),
        requests_per_replica=per_replica,
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the built-in)")
    parser.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--users", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, nargs=2, default=[500, 2000])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--session-rate", type=float, default=0.5, help="sessions per second")
    parser.add_argument("--think-seconds", type=float, default=2.0)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="per replica")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON here")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    model = str(resolve_model(args.model))
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("machine:", describe_machine(), f"(torch threads per engine: {args.threads})")
    tokenizer = load_tokenizer(model)
    rng = random.Random(args.seed)
    documents = make_documents(tokenizer, args, rng)
    questions = make_questions(args, rng)
    lengths = [len(tokenizer.encode(d)) for d in documents]
    print(f"documents: {len(documents)}, {min(lengths)}-{max(lengths)} tokens")
    engine_flags = ["serve", "--model", model, "--served-model-name", args.served_model_name]
    engine_flags += ["--max-model-len", str(args.max_model_len)]
    engine_flags += ["--max-num-seqs", str(args.max_num_seqs)]
    engine_flags += ["--kv-cache-memory", args.kv_cache_memory]
    env = {"OMP_NUM_THREADS": str(args.threads), "KVPILOT_NUM_THREADS": str(args.threads)}
    engines = [LocalProcess(engine_flags, env) for _ in range(args.replicas)]
    results: list[PolicyResult] = []
    try:
        for engine in engines:
            engine.wait_healthy()
        urls = [e.url for e in engines]
        for policy in args.policies:
            router = None
            if policy != "pinned":
                flags = ["router", "--routing-policy", policy, "--tokenizer", model]
                flags += [arg for url in urls for arg in ("--endpoint", url)]
                router = LocalProcess(flags, {"OMP_NUM_THREADS": "1"})
                router.wait_healthy()
            try:
                inputs = (documents, questions, args)
                result = asyncio.run(measure(policy, urls, router and router.url, *inputs))
            finally:
                if router is not None:
                    router.stop()
            results.append(result)
            print(json.dumps(asdict(result)))
    finally:
        for engine in engines:
            engine.stop()
    print()
    print("| policy | requests (failed) | prefix-cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) "
          "| output tok/s | max/mean requests | max/mean busy |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r.policy} | {r.requests} ({r.failed}) | {r.hit_rate:.1%} | {r.ttft_p50_ms:.0f} "
            f"| {r.ttft_p99_ms:.0f} | {r.output_tokens_per_s:.1f} "
            f"| {r.max_over_mean_requests:.2f} | {r.max_over_mean_busy:.2f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv, "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
