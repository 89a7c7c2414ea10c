"""The engine at two commits, side by side in one run: same workload, same machine, same threads.

Checks a refactoring: the greedy outputs must be identical token for token, and the time not
higher. The workload is ``benchmarks/throughput.py``'s (``make_prompts``: random prompts of
``--min-len``..``--max-len`` tokens, ``--output-len`` new tokens each, greedy, EOS ignored),
run through ``LLM.generate`` on the default model. Each side runs in its own process with the
``kvpilot`` package mapped onto that commit's tree (a git worktree); the sides alternate
``--repeats`` times so that a change in the machine's load hits both.

    python benchmarks/ab_engine.py --base 4513625 --repeats 3 --threads 2

Prints the command, the machine, per run the CPU and wall seconds of each side, the best of
each, and whether the outputs match. Numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]

# One side: run in a child whose sys.path maps ``kvpilot`` onto one tree.
CHILD = """
import json, sys, time
import torch
torch.set_num_threads({threads})
sys.path.insert(0, {bench!r})
from throughput import make_prompts
from kvpilot.engine import LLM, SamplingParams
import transformers
from kvpilot.engine.model_loader import resolve_model
args = type("Args", (), {args!r})()
vocab_size = transformers.AutoConfig.from_pretrained(resolve_model(None)).vocab_size
prompts = make_prompts(args, vocab_size)
llm = LLM(max_model_len=args.max_len + args.output_len, seed=0)
params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
llm.generate([{{"prompt_token_ids": prompts[0][:8]}}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
wall, cpu = time.perf_counter(), time.process_time()
outputs = llm.generate([{{"prompt_token_ids": p}} for p in prompts], params, use_tqdm=False)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
import os, kvpilot.engine
source = os.path.dirname(os.path.realpath(kvpilot.engine.__file__))
print(json.dumps({{"wall": wall, "cpu": cpu, "source": source, "tokens": [o.outputs[0].token_ids for o in outputs]}}))
"""


def overlay(tree: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A folder whose ``kvpilot`` package is ``tree``'s (``kvpilot/`` with ``engine/``,
    ``kernels/``, ``operator/`` linked in, as setup.py's ``package-dir`` maps them)."""
    package = into / "kvpilot"
    package.mkdir(parents=True)
    for item in (tree / "kvpilot").iterdir():
        (package / item.name).symlink_to(item)
    for sub in ("engine", "kernels", "operator"):
        (package / sub).symlink_to(tree / sub)
    return into


def run_side(path: pathlib.Path, args: argparse.Namespace) -> dict:
    workload = {k: getattr(args, k) for k in ("num_prompts", "min_len", "max_len", "output_len")}
    code = CHILD.format(
        threads=args.threads, bench=str(REPO / "benchmarks"), args={**workload, "seed": 0}
    )
    env = {**os.environ, "PYTHONPATH": str(path)}
    # Run from the overlay's folder: a child started in the repository would import its
    # ``kvpilot`` from the current directory, whatever PYTHONPATH says.
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=path, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare the tree with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from kvpilot.machine import describe_machine

    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"machine: {describe_machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = pathlib.Path(tmp) / "base"
        subprocess.run(
            [
                "git",
                "-C",
                str(REPO),
                "worktree",
                "add",
                "-q",
                "--detach",
                str(base_tree),
                args.base,
            ],
            check=True,
        )
        try:
            sides = {
                args.base: overlay(base_tree, pathlib.Path(tmp) / "base-path"),
                "tree": overlay(REPO, pathlib.Path(tmp) / "tree-path"),
            }
            results: dict[str, list[dict]] = {name: [] for name in sides}
            for repeat in range(args.repeats):
                for name, path in sides.items():
                    result = run_side(path, args)
                    results[name].append(result)
                    print(
                        f"run {repeat + 1} {name} (engine from {result['source']}): "
                        f"{result['cpu']:.2f} CPU s, {result['wall']:.2f} wall s",
                        flush=True,
                    )
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)],
                check=False,
            )
    tokens = args.num_prompts * args.output_len
    for name, runs in results.items():
        best = min(r["cpu"] for r in runs)
        print(
            f"{name}: best {best:.2f} CPU s ({tokens / best:.1f} output tokens per CPU s), "
            f"best wall {min(r['wall'] for r in runs):.2f} s"
        )
    outputs = [r["tokens"] for runs in results.values() for r in runs]
    identical = all(o == outputs[0] for o in outputs)
    print(f"greedy outputs identical across every run of both: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
