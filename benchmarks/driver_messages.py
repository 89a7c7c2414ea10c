"""Bytes the driver sends each worker per decode step, and decode steps per second, with
tensor parallelism (``--tp``, default 2) on the ``mp`` and ``ray`` executors.

What is counted is the payload the executor hands its transport for one step, pickled as the
executor sends it: ``(method, args, reply_rank)`` for ``mp`` (the bytes written to each
worker's pipe); the ``args`` for ``ray`` (what Ray serializes for each actor). The same run
also pickles the step's whole ``SchedulerOutput``, which is what the driver sent before the
diff protocol (``engine/executor/worker_input.py``); running the script on the commit before
it (``--before``: no Ray executor, ``mp`` only) measures the old steps per second.

Workload: a random tiny Llama (``tp_gpu.py``'s ``tiny`` preset; or ``--model DIR``), ``--num-seqs`` requests of
``--prompt-len`` random tokens and ``--output-len`` greedy tokens (EOS ignored), all admitted at
once; only steps in which every scheduled request decodes one token are counted. Each backend
runs the workload twice on one engine: timed first, then with the message sizes measured
(pickling costs time).

    python benchmarks/driver_messages.py --backend mp ray           # ~3 minutes on 2 cores
    python benchmarks/driver_messages.py --backend mp --before      # on the commit before
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time

# Keep a local Ray cluster on 127.0.0.1 (Ray binds to the outward address otherwise).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pathlib  # noqa: E402

import torch  # noqa: E402
from tp_gpu import build_random_model  # noqa: E402  (benchmarks/ is the script's folder)


def run(engine, prompts, output_len: int, measure_bytes: bool, tag: str) -> dict:
    """One pass of the workload; decode-step times, and message sizes when asked."""
    from kvpilot.engine import SamplingParams

    executor = engine.executor
    sent: list[int] = []
    whole: list[int] = []
    is_decode = [False]
    execute_model, collective_rpc = executor.execute_model, executor.collective_rpc

    def counted_execute(scheduler_output):
        is_decode[0] = bool(scheduler_output.scheduled) and all(
            s.num_new_tokens == 1 and s.request.output_token_ids for s in scheduler_output.scheduled
        )
        if measure_bytes and is_decode[0]:
            whole.append(len(pickle.dumps(("execute_model", (scheduler_output,), 0), protocol=5)))
        return execute_model(scheduler_output)

    def counted_rpc(method, *args, reply_rank=None):
        if measure_bytes and is_decode[0] and method.startswith("execute"):
            payload = (method, args, reply_rank) if BACKEND == "mp" else args
            sent.append(len(pickle.dumps(payload, protocol=5)))
        return collective_rpc(method, *args, reply_rank=reply_rank)

    executor.execute_model, executor.collective_rpc = counted_execute, counted_rpc
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    decode_times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        if is_decode[0]:
            decode_times.append(time.perf_counter() - start)
        is_decode[0] = False
    executor.execute_model, executor.collective_rpc = execute_model, collective_rpc
    return {"decode_times": decode_times, "sent": sent, "whole": whole}


BACKEND = "mp"


def main() -> None:
    global BACKEND
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", nargs="+", default=["mp", "ray"], choices=["mp", "ray"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", default=None, help="a local model folder (default: tiny)")
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--before", action="store_true", help="the code before the diff protocol (mp only)"
    )
    args = parser.parse_args()
    print("command: python", " ".join(sys.argv))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{max(1, torch.get_num_threads() // args.tp)} torch thread(s) per rank"
    )
    from kvpilot.engine import LLM

    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 49000, (args.prompt_len,), generator=generator).tolist()
        for _ in range(args.num_seqs)
    ]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or str(build_random_model("tiny", pathlib.Path(folder)))
        for backend in args.backend:
            BACKEND = backend
            kwargs = {} if args.before else {"distributed_executor_backend": backend}
            llm = LLM(
                model,
                tensor_parallel_size=args.tp,
                dtype="float32",
                seed=0,
                max_model_len=args.prompt_len + args.output_len,
                max_num_seqs=args.num_seqs,
                enable_prefix_caching=False,
                **kwargs,
            )
            engine = llm.llm_engine
            engine.executor.collective_rpc("weight_bytes")
            try:
                timed = run(engine, prompts, args.output_len, False, "timed")
                sized = run(engine, prompts, args.output_len, True, "sized")
            finally:
                engine.shutdown()
            steps_per_s = 1 / statistics.median(timed["decode_times"])
            rows.append(
                (
                    backend + (" (before)" if args.before else ""),
                    statistics.mean(sized["whole"]),
                    statistics.mean(sized["sent"]),
                    steps_per_s,
                    len(timed["decode_times"]),
                )
            )
    print()
    print(
        "| executor | SchedulerOutput bytes / decode step | bytes sent per worker / decode step "
        "| decode steps/s (median) | decode steps |"
    )
    print("| --- | --- | --- | --- | --- |")
    for backend, whole, sent, rate, steps in rows:
        print(f"| {backend} | {whole:,.0f} | {sent:,.0f} | {rate:.1f} | {steps} |")


if __name__ == "__main__":
    main()
