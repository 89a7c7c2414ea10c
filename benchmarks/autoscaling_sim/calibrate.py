"""Measure the kvpilot engine's step time and fit the simulator's affine step model.

    .venv/bin/python benchmarks/autoscaling_sim/calibrate.py [--model PATH] [--threads 1]

Times single ``LLMEngine.step()`` calls of known shapes: prefill-only steps of one prompt
(``tokens`` scheduled, nothing cached) and decode-only steps of ``n`` sequences (``n`` tokens
scheduled, their cached tokens attended to), with random token ids and prefix caching off so
nothing is reused (CPU time of the process on a CPU, wall time around synchronized steps on a
GPU). A least-squares fit of ``time = step_base + per_batch_token * tokens +
per_context_token * cached`` gives the coefficients ``run.py`` takes with ``--step-base``,
``--per-batch-token`` and ``--per-context-token``. Run it on the device the simulated replicas
stand for: numbers from a CPU describe a CPU replica.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the built-in one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per shape")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(args.model, enable_prefix_caching=False, max_model_len=2048, seed=args.seed)
    engine = llm.llm_engine
    vocab = engine.tokenizer.vocab_size
    rng = np.random.default_rng(args.seed)
    counter = iter(range(10**9))

    def add(prompt_len: int, max_tokens: int) -> None:
        ids = rng.integers(100, vocab - 1, prompt_len).tolist()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"cal-{next(counter)}", {"prompt_token_ids": ids}, params)

    # On a CPU the process's CPU time is the fairer clock: on a shared machine it counts the
    # work done, not the time other processes held the cores (one thread: CPU time = busy time).
    on_cpu = engine.device.type == "cpu"
    clock = time.process_time if on_cpu else time.perf_counter

    def timed_step() -> float:
        if not on_cpu:
            torch.cuda.synchronize()
        started = clock()
        engine.step()
        if not on_cpu:
            torch.cuda.synchronize()
        return clock() - started

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    rows: list[tuple[int, int, float]] = []  # (scheduled tokens, cached tokens, seconds)
    add(16, 2)
    drain()  # warm-up: first-call allocations and kernel selection
    for prompt_len in (32, 128, 512):
        for _ in range(args.repeats):
            add(prompt_len, 1)
            rows.append((prompt_len, 0, timed_step()))
            drain()
    for batch in (1, 4, 16):
        for context in (64, 512):
            prefilled = engine.get_stats().prompt_tokens_total + batch * context
            for _ in range(batch):
                add(context, args.repeats + 8)
            while engine.get_stats().prompt_tokens_total < prefilled:
                engine.step()  # every prompt prefilled: what follows are decode-only steps
            for _ in range(args.repeats):
                cached = sum(r.num_computed_tokens for r in engine.scheduler.running)
                rows.append((batch, cached, timed_step()))
            drain()

    design = np.array([[1.0, tokens, cached] for tokens, cached, _ in rows])
    seconds = np.array([t for _, _, t in rows])
    (base, per_token, per_cached), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    fitted = design @ np.array([base, per_token, per_cached])
    r2 = 1 - np.sum((seconds - fitted) ** 2) / np.sum((seconds - seconds.mean()) ** 2)
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"machine: {platform.platform()}, {platform.processor() or 'cpu'}, "
          f"torch threads {torch.get_num_threads()}, device {engine.device}")  # fmt: skip
    for tokens, cached, t in rows:
        print(f"  step: {tokens:5d} scheduled, {cached:6d} cached: {t * 1e3:9.1f} ms")
    print(f"{len(rows)} steps timed ({'CPU' if on_cpu else 'wall'} time); fit R^2 {r2:.3f}")
    print(f"--step-base {base:.6g} --per-batch-token {per_token:.6g} "
          f"--per-context-token {per_cached:.6g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
