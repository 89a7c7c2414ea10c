"""vLLM's offline ``LLM.generate`` on given prompts: the vLLM column of benchmarks/throughput.py.

Runs in vLLM's own virtual environment (benchmarks/peers/install-vllm.sh), started by
throughput.py with the prompts of each round in a JSON file (a list of rounds, each a list of
token id lists):

    VENV/bin/python -I benchmarks/peers/vllm_offline.py --model DIR --prompts FILE \
        --output-len 64 --max-model-len 256

Loads the model (vLLM compiles it with torch.compile at every start: minutes), warms it up and
prints ``READY_LINE``; then, for each round, waits for a line on stdin (so that throughput.py
runs kvpilot's rounds between vLLM's on the same cores, not at the same time), times
``generate`` on that round's prompts alone and prints one line ``RESULT_PREFIX`` + JSON
``{"wall", "cpu", "tokens", "version"}`` among vLLM's own log lines (seconds, seconds, the
output token ids per prompt). CPU time is that of this process and every process it started
(vLLM's engine core and workers), read from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

RESULT_PREFIX = "vllm_offline result: "
READY_LINE = "vllm_offline ready"


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and all its descendants now alive, each with the
    children it has waited for (``cutime``, ``cstime``), so that a process's time stays counted
    after it exits (vLLM's workers start short-lived processes): a later call never returns less
    unless a child exits that nobody in the tree waits for."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        # utime, stime, cutime, cstime (fields 14-17 of proc(5)).
        times[int(entry)] = sum(int(x) for x in fields[11:15]) / tick
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(times.get(pid, 0.0) for pid in tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--prompts", required=True, help="JSON file: rounds, each a list of token id lists"
    )
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    args = parser.parse_args()

    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    with open(args.prompts) as f:
        rounds = json.load(f)
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=args.max_model_len,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=rounds[0][0][:8])], SamplingParams(max_tokens=2))
    print(READY_LINE, flush=True)
    for prompts in rounds:
        if not sys.stdin.readline():
            return
        cpu, wall = tree_cpu_seconds(os.getpid()), time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        wall, cpu = time.perf_counter() - wall, tree_cpu_seconds(os.getpid()) - cpu
        result = {
            "wall": wall,
            "cpu": cpu,
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "version": vllm.__version__,
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
