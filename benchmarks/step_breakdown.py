"""Where a decode step's time goes: the throughput workload in process, its parts timed.

Runs ``benchmarks/throughput.py``'s workload (same prompts, same flags for it) through one
``LLMEngine`` and times, by wrappers around them, each step, the model's forward pass, the LM
head, the CPU kernels (GEMM, attention, the fused elementwise ops), the attention layer (cache
writes included), the sampler and the input preparation. Prints the milliseconds per step of
each, averaged over the decode steps ``--first-step`` to ``--last-step`` (the prefill steps
come first), and the whole run's wall and CPU seconds. ``--shuffle-free-blocks`` hands the
KV blocks out in random order, as in a server that has run a while (a fresh engine's come in
order, so a sequence's blocks are mostly adjacent).

    taskset -c 1 python benchmarks/step_breakdown.py --threads 1
    taskset -c 0-1 python benchmarks/step_breakdown.py --threads 2

The GEMM figure includes the LM head where its logits are computed (which goes through the same
kernel; greedy rows take the greedy head, a line of its own) but not the gate/up projections
with their SwiGLU epilogue (a line of their own); what the forward
pass spends outside the timed kernels is Python and torch's own small ops. Numbers go to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from throughput import Timer, make_prompts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or hub id (default model)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=16, help="shortest prompt (tokens)")
    parser.add_argument("--max-len", type=int, default=192, help="longest prompt (tokens)")
    parser.add_argument("--output-len", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--first-step", type=int, default=10, help="first decode step averaged")
    parser.add_argument("--last-step", type=int, default=60, help="step the average stops at")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="step budget (the engine's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shuffle-free-blocks",
        action="store_true",
        help="hand out KV blocks in random order, as a server does after a while (default: "
        "in order, as a fresh engine does)",
    )
    return parser.parse_args()


class Clock:
    """Seconds spent inside wrapped callables, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, attribute: str, name: str) -> None:
        """Replace ``owner.attribute`` (a function, method or class attribute) by a timed one."""
        inner: Callable = getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        setattr(owner, attribute, timed)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
    from kvpilot.kernels.cpu import elementwise, gemm, paged_attention

    llm = LLM(
        args.model,
        max_model_len=args.max_len + args.output_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    engine = llm.llm_engine
    runner = engine.model_runner
    prompts = make_prompts(args, engine.model_shape.vocab_size)
    clock = Clock()
    clock.wrap(runner, "execute_model", "model runner")
    clock.wrap(runner.model, "forward", "forward")
    clock.wrap(runner.model, "compute_logits", "LM head")
    clock.wrap(runner.model, "greedy_tokens", "LM head, greedy")
    clock.wrap(gemm, "packed_linear", "GEMM kernel")
    clock.wrap(gemm, "packed_silu_and_mul", "GEMM kernel, gate/up and SwiGLU")
    clock.wrap(paged_attention, "paged_attention", "attention kernel")
    clock.wrap(TorchAttentionBackend, "forward", "attention layer")
    for op in ("rms_norm", "silu_and_mul", "rotary_neox"):
        clock.wrap(elementwise, op, op)
    clock.wrap(type(runner.sampler), "__call__", "sampler")
    clock.wrap(runner, "prepare_inputs", "prepare inputs")

    llm.generate(
        [{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2), use_tqdm=False
    )
    if args.shuffle_free_blocks:
        free = engine.kv_cache_manager.block_pool.free_blocks
        order = list(free.items())
        random.Random(args.seed).shuffle(order)
        free.clear()
        free.update(order)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params)
    step_seconds, steps = 0.0, 0
    before: dict[str, float] = {}
    with Timer() as timer:
        while engine.has_unfinished_requests():
            if steps == args.first_step:
                before = dict(clock.seconds)
            start = time.perf_counter()
            engine.step()
            if args.first_step <= steps < args.last_step:
                step_seconds += time.perf_counter() - start
            steps += 1
            if steps == args.last_step:
                after = dict(clock.seconds)
    if steps < args.last_step:
        sys.exit(f"only {steps} steps: lower --last-step")
    count = args.last_step - args.first_step
    print(f"threads: {args.threads}; {steps} steps, wall {timer.wall:.3f} s, CPU {timer.cpu:.3f} s")
    print(f"ms per step, steps {args.first_step}..{args.last_step - 1}:")
    print(f"  step: {1000 * step_seconds / count:.2f}")
    for name in after:
        print(f"  {name}: {1000 * (after[name] - before.get(name, 0.0)) / count:.2f}")


if __name__ == "__main__":
    main()
