"""Offline throughput: kvpilot vs transformers, same model, same prompts, same thread count.

Runs, in one process and with one ``torch.set_num_threads`` value:

1. a large float32 matmul by torch's BLAS and by oneDNN, the machine's practical peak
   (FLOP/s) for the MFU figure;
2. kvpilot (``LLMEngine`` stepped to completion, all prompts submitted at once), recording the
   KV cache waste at peak allocation (allocated but unused token slots / allocated slots);
3. transformers' continuous batching (``generate_batch``) on the same prompts;
4. transformers' ``generate()`` one prompt at a time (``--skip-sequential`` to leave it out);
5. with ``--vllm-python``, vLLM's CPU build (the peer users would pick; its own virtual
   environment from ``benchmarks/peers/install-vllm.sh``) on the same prompts, in its own
   processes (``benchmarks/peers/vllm_offline.py``), timed on ``generate`` alone, CPU time of
   all its processes; at its own block size (its CPU attention takes multiples of 32 only).

With ``--rounds N`` kvpilot and vLLM each run the workload N times, alternating (kvpilot then
vLLM, then vLLM then kvpilot, ...), both loaded once: a shared machine's slow spells then fall on
both, and the medians (and the median of the rounds' ratios) say more than one run each. Round
r's prompts have the same lengths and are drawn with seed ``--seed + r``, so that no prefix
cache serves a round from an earlier one; the token hash and the transformers columns are
round 0's.

``--cores 0`` (or ``0-1``) pins every system to those cores (this process with
``sched_setaffinity``, vLLM's processes too, and its OpenMP threads with
``VLLM_CPU_OMP_THREADS_BIND``), so that a system with more processes cannot use more cores.

Workload (issue 2): ``--num-prompts`` random prompts with lengths spread evenly over
``--min-len``..``--max-len`` tokens, ``--output-len`` new tokens each, greedy, EOS ignored.

    python benchmarks/throughput.py --threads 2
    python benchmarks/throughput.py --threads 1 --cores 0 --skip-sequential \
        --vllm-python "$(benchmarks/peers/install-vllm.sh | tail -1)"

Prints the command, the machine, the thread count, each system's time and tokens/s, the ratios,
the model FLOP utilisation, the KV waste and a hash of kvpilot's greedy tokens (equal across
runs exactly when every token is). Numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from tqdm.auto import tqdm

from kvpilot.engine.config import CPU_BLOCK_SIZE, CPU_MAX_NUM_BATCHED_TOKENS
from kvpilot.machine import describe_machine


class Timer:
    """Wall-clock and CPU time (all threads of this process) of a block, in seconds.

    On a shared machine the CPU time is the fairer figure: with the same thread count it counts
    only the work done, not the time other processes held the cores.
    """

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="model folder or hub id (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=16, help="shortest prompt (tokens)")
    parser.add_argument("--max-len", type=int, default=192, help="longest prompt (tokens)")
    parser.add_argument("--output-len", type=int, default=64, help="new tokens per prompt")
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads for every system",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=CPU_BLOCK_SIZE,
        help=f"KV block size (tokens) of kvpilot and transformers (default: the engine's CPU "
        f"default, {CPU_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="kvpilot's step budget (default: the engine's)",
    )
    parser.add_argument(
        "--skip-transformers",
        action="store_true",
        help="leave out both transformers columns (kvpilot against vLLM only)",
    )
    parser.add_argument(
        "--skip-sequential",
        action="store_true",
        help="leave out transformers generate() one prompt at a time",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="how many times kvpilot and vLLM each run the workload, alternating, both loaded "
        "once; round r draws its prompts with seed --seed + r (default: 1)",
    )
    parser.add_argument(
        "--cores", default=None, help="pin every system to these cores, e.g. 0 or 0-1"
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of vLLM's virtual environment (benchmarks/peers/install-vllm.sh): adds vLLM",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        parser.error(f"--vllm-python: {args.vllm_python} is not an executable file")
    try:
        args.core_set = parse_cores(args.cores) if args.cores else None
    except ValueError as e:
        parser.error(f"--cores: {e}")
    return args


def parse_cores(text: str) -> set[int]:
    """``0``, ``0-1`` or ``0,2`` -> the set of core numbers.

    Raises:
        ValueError: not of that form, or a core this process may not run on (the message lists
            those it may).
    """
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"{text!r} is not a core list like 0, 0-1 or 0,2") from None
    allowed = os.sched_getaffinity(0)
    if not cores or not cores <= allowed:
        raise ValueError(f"{text!r}: this process may run on cores {sorted(allowed)} only")
    return cores


def matmul_peak_flops(n: int = 2048, reps: int = 5) -> dict[str, float]:
    """Best FLOP/s (per CPU second) of an ``n x n`` float32 matmul (2 n^3 FLOPs each), by
    torch's default BLAS (``a @ b``), by oneDNN with a packed weight, and by kvpilot's CPU GEMM
    kernel (where the CPU has AVX-512); the fastest is the peak the model FLOP utilisation is
    taken against."""
    from kvpilot.kernels.cpu import gemm

    a, b = torch.randn(n, n), torch.randn(n, n)
    onednn = torch.ops.mkldnn._reorder_linear_weight(b, None)
    matmuls = {
        "torch a @ b": lambda: a @ b,
        "oneDNN packed": lambda: torch.ops.mkldnn._linear_pointwise(
            a, onednn, None, "none", [], ""
        ),
    }
    if gemm.available():
        packed = gemm.pack_weight(b)
        matmuls["kvpilot CPU GEMM"] = lambda: gemm.packed_linear(a, packed)
    peaks = {}
    for name, matmul in matmuls.items():
        matmul()
        best = float("inf")
        for _ in range(reps):
            with Timer() as timer:
                matmul()
            best = min(best, timer.cpu)
        peaks[name] = 2 * n**3 / best
    return peaks


def make_prompts(
    args: argparse.Namespace, vocab_size: int, seed: int | None = None
) -> list[list[int]]:
    """The workload's prompt token ids, drawn with ``seed`` (default ``args.seed``)."""
    generator = torch.Generator().manual_seed(args.seed if seed is None else seed)
    n = args.num_prompts
    lengths = [
        args.min_len + round(i * (args.max_len - args.min_len) / max(n - 1, 1)) for i in range(n)
    ]
    # Skip the first ids: special tokens in most vocabularies.
    return [
        torch.randint(100, vocab_size, (length,), generator=generator).tolist()
        for length in lengths
    ]


def model_flops(spec, prompts: list[list[int]], output_len: int) -> float:
    """FLOPs of the whole workload: 2 per weight per processed token (every prompt token and
    every generated token but the last), the LM head once per generated token, and attention
    (QK^T and PV: 4 * heads * head_dim per layer per context position)."""
    q_dim = spec.num_attention_heads * spec.head_dim
    kv_dim = spec.num_key_value_heads * spec.head_dim
    per_layer = spec.hidden_size * (q_dim + 2 * kv_dim) + q_dim * spec.hidden_size
    per_layer += 3 * spec.hidden_size * spec.intermediate_size
    total = 0.0
    for prompt in prompts:
        processed = len(prompt) + output_len - 1
        total += 2 * per_layer * spec.num_layers * processed
        total += 2 * spec.hidden_size * spec.vocab_size * output_len
        # Token at position p attends to p + 1 positions.
        total += 4 * spec.num_layers * q_dim * processed * (processed + 1) / 2
    return total


def kvpilot_llm(args, prompts):
    """kvpilot's ``LLM`` for the workload, warmed up on a few tokens of ``prompts[0]``."""
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        block_size=args.block_size,
        max_model_len=args.max_len + args.output_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    warmup = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], warmup, use_tqdm=False)
    return llm


def run_kvpilot(args, llm, prompts) -> tuple[Timer, list[list[int]], tuple[float, float]]:
    """kvpilot, all prompts submitted at once; also the KV waste at peak allocation and the
    part of it in the running sequences' last blocks (fractions of the allocated slots)."""
    from kvpilot.engine import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    pool = engine.kv_cache_manager.block_pool
    outputs: dict[str, list[int]] = {}
    # Waste at the peak, and the part of it that is each running sequence's last, partly
    # filled block: the floor for any allocator of whole blocks.
    peak_allocated, waste_at_peak, tail_at_peak = 0, 0.0, 0.0
    with Timer() as timer, tqdm(total=len(prompts), desc="kvpilot", unit="req") as bar:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
                    bar.update()
            allocated = (pool.num_blocks - pool.get_num_free_blocks()) * args.block_size
            if allocated > peak_allocated:
                computed = [r.num_computed_tokens for r in engine.scheduler.running]
                tail = sum(-c % args.block_size for c in computed)
                peak_allocated = allocated
                waste_at_peak = (allocated - sum(computed)) / allocated
                tail_at_peak = tail / allocated
    tokens = [outputs[f"bench-{i}"] for i in range(len(prompts))]
    return timer, tokens, (waste_at_peak, tail_at_peak)


def run_hf_batch(args, prompts, model) -> tuple[Timer, list[list[int]]]:
    """transformers' continuous batching, sized like kvpilot (page size, step budget)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(
        max_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    blocks = len(prompts) * -(-(args.max_len + args.output_len) // args.block_size) + 16
    cb_config = ContinuousBatchingConfig(
        num_blocks=blocks,
        page_size=args.block_size,
        max_batch_tokens=args.max_num_batched_tokens or CPU_MAX_NUM_BATCHED_TOKENS,
    )
    with Timer() as timer:
        results = model.generate_batch(
            inputs=prompts,
            generation_config=config,
            continuous_batching_config=cb_config,
            progress_bar=True,
        )
    return timer, [list(r.generated_tokens) for r in results.values()]


def run_hf_sequential(args, prompts, model) -> tuple[Timer, list[list[int]]]:
    """transformers' ``generate()``, one prompt at a time."""
    outputs = []
    with Timer() as timer:
        for prompt in tqdm(prompts, desc="transformers generate()", unit="req"):
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.output_len,
                do_sample=False,
                eos_token_id=None,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return timer, outputs


PEER_SCRIPT = pathlib.Path(__file__).with_name("peers") / "vllm_offline.py"


def _peer_script():
    """:data:`PEER_SCRIPT` as a module, for its protocol's lines and ``tree_cpu_seconds`` (it
    runs in vLLM's environment, so it is not a package of this one)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_offline", PEER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class VllmPeer:
    """vLLM's CPU build in its own processes (``benchmarks/peers/vllm_offline.py``), loaded once
    and given the rounds' prompts, one round each time :meth:`run` is called (see the module
    docstring). Raises SystemExit with vLLM's last log lines if it fails."""

    def __init__(self, args, rounds: list[list[list[int]]], model_dir) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads),
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": args.cores or "all",
        }
        env.pop("PYTHONPATH", None)
        self.script = _peer_script()
        cores = args.core_set
        self.prompts_file = tempfile.NamedTemporaryFile("w", suffix=".json")
        json.dump(rounds, self.prompts_file)
        self.prompts_file.flush()
        self.log = tempfile.TemporaryFile("w+")
        print("vLLM: starting (it compiles the model first; minutes)", flush=True)
        self.process = subprocess.Popen(
            [
                args.vllm_python, "-I", str(PEER_SCRIPT), "--model", str(model_dir),
                "--prompts", self.prompts_file.name, "--output-len", str(args.output_len),
                "--max-model-len", str(args.max_len + args.output_len),
            ],
            env=env, cwd=tempfile.gettempdir(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )  # fmt: skip
        self._read_until(self.script.READY_LINE)
        self.settle()

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by vLLM's processes now alive."""
        return self.script.tree_cpu_seconds(self.process.pid)

    def settle(self, quiet: float = 0.01, every: float = 0.5, limit: float = 60.0) -> None:
        """Wait (up to ``limit`` s) until vLLM's processes use under ``quiet`` CPU s in
        ``every`` s: after ``generate`` its threads may spin a while, which would take cores
        from kvpilot's next round."""
        deadline, last = time.monotonic() + limit, self.cpu_seconds()
        while time.monotonic() < deadline:
            time.sleep(every)
            now = self.cpu_seconds()
            if now - last < quiet:
                return
            last = now

    def _read_until(self, prefix: str) -> str:
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line.removeprefix(prefix)
        self.process.wait()
        self.log.seek(0)
        raise SystemExit(
            f"vLLM ({self.process.args[0]} {PEER_SCRIPT.name}) exited with status "
            f"{self.process.returncode}; the end of its log:\n{self.log.read()[-3000:] or '(empty)'}"
        )

    def run(self) -> tuple[Timer, list[list[int]]]:
        """The next round: its timer (``generate`` alone, all vLLM's processes) and tokens."""
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        result = json.loads(self._read_until(self.script.RESULT_PREFIX))
        print(f"vLLM {result['version']}: generate took {result['wall']:.1f} s", flush=True)
        timer = Timer()
        timer.wall, timer.cpu = result["wall"], result["cpu"]
        self.settle()
        return timer, result["tokens"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()
        self.prompts_file.close()
        self.log.close()


def median_timer(timers: list[Timer]) -> Timer:
    """The median wall and the median CPU seconds of ``timers`` (each its own median)."""
    timer = Timer()
    timer.wall = statistics.median(t.wall for t in timers)
    timer.cpu = statistics.median(t.cpu for t in timers)
    return timer


def same_outputs(outputs: list[list[int]], reference: list[list[int]]) -> int:
    """How many prompts' output token ids equal the reference's."""
    return sum(a == b for a, b in zip(outputs, reference, strict=False))


def print_rounds(rounds, kv_runs, vllm_runs) -> None:
    """One line a round: each system's wall and CPU seconds, the ratio, identical outputs."""
    print()
    print(f"{'round':>5} {'kvpilot wall / CPU s':>21} {'vLLM wall / CPU s':>18} "
          f"{'kvpilot is (wall)':>18} {'same tokens':>12}")  # fmt: skip
    ratios = []
    for r, (kv_timer, kv_tokens) in enumerate(kv_runs):
        line = f"{r:>5} {kv_timer.wall:12.1f} / {kv_timer.cpu:5.1f}"
        if vllm_runs:
            timer, tokens = vllm_runs[r]
            ratios.append(timer.wall / kv_timer.wall)
            same = same_outputs(tokens, kv_tokens)
            line += (
                f" {timer.wall:9.1f} / {timer.cpu:5.1f} {ratios[-1]:17.2f}x "
                f"{same:>7}/{len(rounds[r])}"
            )
        print(line)
    if ratios:
        # Each ratio pairs two runs next to each other in time: the figure to quote.
        print(f"median of the rounds' ratios (wall): {statistics.median(ratios):.2f}x")


def main() -> None:
    args = parse_args()
    if args.core_set:
        os.sched_setaffinity(0, args.core_set)
    torch.set_num_threads(args.threads)
    import transformers

    from kvpilot.engine.model_loader import resolve_model

    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"machine: {describe_machine()}")
    print(f"threads: {torch.get_num_threads()} (torch.set_num_threads, every system)")
    print(f"cores: {args.cores or 'all'} (every system pinned to them)")
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    peaks = matmul_peak_flops()
    for name, flops in peaks.items():
        print(f"fp32 matmul 2048^3, {name}: {flops / 1e9:.1f} GFLOP per CPU second")
    peak = max(peaks.values())

    model_dir = resolve_model(args.model)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    rounds = [make_prompts(args, config.vocab_size, args.seed + r) for r in range(args.rounds)]
    prompts = rounds[0]
    num_prompt_tokens = sum(len(p) for p in prompts)
    num_output_tokens = args.output_len * len(prompts)
    print(
        f"workload: {len(prompts)} prompts of {args.min_len}-{args.max_len} tokens "
        f"({num_prompt_tokens} in all), {args.output_len} new tokens each, greedy, EOS ignored"
    )

    vllm = VllmPeer(args, rounds, model_dir) if args.vllm_python else None
    llm = kvpilot_llm(args, prompts)
    spec = llm.llm_engine.model_shape
    kv_runs, vllm_runs, wastes = [], [], []

    def kvpilot_round(round_prompts: list[list[int]]) -> None:
        peer_cpu = vllm.cpu_seconds() if vllm is not None else 0.0
        timer, tokens, waste = run_kvpilot(args, llm, round_prompts)
        kv_runs.append((timer, tokens))
        wastes.append(waste)
        if vllm is not None:
            print(
                f"kvpilot: {timer.wall:.1f} s (vLLM's processes used "
                f"{vllm.cpu_seconds() - peer_cpu:.2f} CPU s meanwhile)",
                flush=True,
            )

    systems = [kvpilot_round] + ([lambda _: vllm_runs.append(vllm.run())] if vllm else [])
    for r, round_prompts in enumerate(rounds):
        # Alternate who goes first, so that a slow spell is as likely to fall on either.
        for run_round in systems if r % 2 == 0 else systems[::-1]:
            run_round(round_prompts)
    if vllm is not None:
        vllm.close()
    waste = wastes[0]
    kv_timer, kv_tokens = median_timer([t for t, _ in kv_runs]), kv_runs[0][1]
    results: dict[str, tuple[Timer, list[list[int]]]] = {"kvpilot": (kv_timer, kv_tokens)}
    if args.rounds > 1:
        print_rounds(rounds, kv_runs, vllm_runs)
    if not args.skip_transformers:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        results["transformers generate_batch"] = run_hf_batch(args, prompts, hf_model)
        if not args.skip_sequential:
            results["transformers generate() 1 by 1"] = run_hf_sequential(args, prompts, hf_model)
        del hf_model
    if vllm_runs:
        results["vLLM"] = (median_timer([t for t, _ in vllm_runs]), vllm_runs[0][1])

    print()
    if args.rounds > 1:
        print(
            f"medians of {args.rounds} rounds (each column its own median; same tokens: round "
            "0's, against kvpilot's):"
        )
    print(
        f"{'system':32} {'wall s':>8} {'CPU s':>8} {'out tok/CPU s':>14} "
        f"{'kvpilot is (CPU)':>17} {'kvpilot is (wall)':>18} {'same tokens':>12}"
    )
    for name, (timer, outputs) in results.items():
        same = same_outputs(outputs, kv_tokens)
        print(
            f"{name:32} {timer.wall:8.1f} {timer.cpu:8.1f} {num_output_tokens / timer.cpu:14.1f} "
            f"{timer.cpu / kv_timer.cpu:16.2f}x {timer.wall / kv_timer.wall:17.2f}x "
            f"{same:>7}/{len(prompts)}"
        )
    achieved = model_flops(spec, prompts, args.output_len) / kv_timer.cpu
    print()
    print(
        f"kvpilot model FLOPs per CPU second: {achieved / 1e9:.1f} GFLOP = "
        f"{100 * achieved / peak:.1f}% of the fastest measured matmul"
    )
    print(
        f"kvpilot KV waste at peak allocation: {100 * waste[0]:.2f}% (block size "
        f"{args.block_size}), of which {100 * waste[1]:.2f} points are the running sequences' "
        "last, partly filled blocks (the floor for whole-block allocation)"
    )
    # Equal across runs (and engine changes) exactly when every greedy token is.
    digest = hashlib.sha256(json.dumps(kv_tokens).encode()).hexdigest()[:16]
    print(f"kvpilot greedy tokens sha256: {digest}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
