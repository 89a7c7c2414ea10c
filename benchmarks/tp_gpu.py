"""Tensor parallelism on GPUs: greedy identity and throughput of N=1 against N=2 (or --tp N).

For each tensor-parallel size the script starts a fresh process (so no GPU memory or CUDA
context carries over) that builds ``LLM(model, tensor_parallel_size=tp)`` and runs:

1. identity: ``--identity-prompts`` real-text prompts, greedy, ``--identity-len`` new tokens,
   in float32 (bitwise-stable matmuls; what is compared is the sharding, not bf16 rounding);
2. throughput: ``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len`` new
   tokens each, greedy, EOS ignored, all submitted at once, in ``--dtype``, after a warm-up.

It then prints the command, the machine (GPUs, torch, CUDA, NCCL), a Markdown table to paste
into docs/benchmarks.md ("Tensor parallelism"), and exits with status 1 when the greedy tokens
of N ranks differ from one rank's.

The GPU machine has no Hub access, so the default model is a random Llama built locally
(``--preset llama-1b``: Llama-3.2-1B's shapes, 32 query / 8 KV heads; tokenizer from the
default model package). ``--model`` takes a local folder instead (its head counts must divide
by ``--tp``).

    python benchmarks/tp_gpu.py --tp 2 --out tp_gpu.json        # two CUDA devices, minutes
    python benchmarks/tp_gpu.py --device cpu --preset tiny --tp 2 --num-prompts 8 \
        --input-len 32 --output-len 16                           # the same path on CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

# Llama-family shapes of the locally built random models.
PRESETS = {
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}
IDENTITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three laws of thermodynamics state that",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "Translate to German: The weather is nice today.",
    "A list of prime numbers: 2, 3, 5,",
    "import numpy as np\n\nx = np.",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local model folder (default: --preset)")
    parser.add_argument("--preset", default="llama-1b", choices=sorted(PRESETS))
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size compared to 1")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the throughput run")
    parser.add_argument("--identity-prompts", type=int, default=len(IDENTITY_PROMPTS))
    parser.add_argument("--identity-len", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--run-one", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def build_random_model(preset: str, out_dir: pathlib.Path) -> pathlib.Path:
    """Save a randomly initialised Llama (``preset`` shapes, SmolLM2's 49152-token tokenizer)."""
    import torch
    import transformers

    from kvpilot.engine.model_loader import resolve_model

    tokenizer_dir = resolve_model(None)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        **PRESETS[preset],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def run_one(args: argparse.Namespace) -> dict:
    """Identity and throughput runs for ``args.run_one`` ranks (in this process and its workers)."""
    import torch

    from kvpilot.engine import LLM, SamplingParams

    tp = args.run_one
    result: dict = {"tensor_parallel_size": tp}
    common = dict(tensor_parallel_size=tp, device=args.device, enable_prefix_caching=False)
    if args.device == "cpu":
        common["max_model_len"] = args.input_len + args.output_len + 64

    start = time.perf_counter()
    llm = LLM(args.model_dir, dtype="float32", **common)
    result["load_s"] = time.perf_counter() - start
    greedy = SamplingParams(temperature=0, max_tokens=args.identity_len, ignore_eos=True)
    prompts = IDENTITY_PROMPTS[: args.identity_prompts]
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    result["identity_tokens"] = [o.outputs[0].token_ids for o in outputs]
    result["identity_text"] = [o.outputs[0].text for o in outputs]
    llm.llm_engine.shutdown()
    del llm

    llm = LLM(args.model_dir, dtype=args.dtype, **common)
    generator = torch.Generator().manual_seed(0)
    random_prompts = [
        {
            "prompt_token_ids": torch.randint(
                3, 49000, (args.input_len,), generator=generator
            ).tolist()
        }
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(random_prompts[:2], params, use_tqdm=False)  # warm-up (Triton compiles)
    start = time.perf_counter()
    outputs = llm.generate(random_prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.llm_engine.get_stats()
    result.update(
        throughput_s=elapsed,
        output_tokens_per_s=generated / elapsed,
        total_tokens_per_s=(generated + args.num_prompts * args.input_len) / elapsed,
        kv_capacity_tokens=stats.kv_capacity_tokens,
        num_preemptions=stats.num_preemptions_total,
    )
    llm.llm_engine.shutdown()
    return result


def machine(device: str) -> str:
    import torch

    lines = [f"{platform.node()}: {platform.platform()}, Python {platform.python_version()}"]
    lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    if device == "cuda" and torch.cuda.is_available():
        lines.append(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        for i in range(torch.cuda.device_count()):
            lines.append(f"cuda:{i} {torch.cuda.get_device_name(i)}")
    else:
        lines.append(f"CPU, {os.cpu_count()} cores, gloo")
    return "\n".join(lines)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def main() -> int:
    args = parse_args()
    if args.run_one is not None:
        print(json.dumps(run_one(args)))
        return 0
    print("command:", " ".join([sys.executable, *sys.argv]))
    print(machine(args.device))
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.tp:
            print(f"needs {args.tp} CUDA devices, found {torch.cuda.device_count()}: not run")
            return 2
    with tempfile.TemporaryDirectory(prefix="kvpilot-tp-") as tmp:
        if args.model is None:
            model_dir = build_random_model(args.preset, pathlib.Path(tmp) / args.preset)
        else:
            model_dir = pathlib.Path(args.model)
        print(f"model: {model_dir} ({args.model or 'random ' + args.preset})")
        results = {}
        for tp in (1, args.tp):
            command = [sys.executable, __file__, *sys.argv[1:], "--run-one", str(tp)]
            command += ["--model-dir", str(model_dir)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
                print(f"tensor_parallel_size {tp} failed (exit code {done.returncode})")
                return 1
            results[tp] = json.loads(done.stdout.strip().splitlines()[-1])
    one, many = results[1], results[args.tp]
    identical = [
        a == b for a, b in zip(one["identity_tokens"], many["identity_tokens"], strict=True)
    ]
    prefixes = [
        common_prefix(a, b)
        for a, b in zip(one["identity_tokens"], many["identity_tokens"], strict=True)
    ]
    print(
        "\n| tensor_parallel_size | load (s) | output tok/s | total tok/s | KV capacity (tokens) "
        "| preemptions |\n| --- | --- | --- | --- | --- | --- |"
    )
    for tp, r in results.items():
        print(
            f"| {tp} | {r['load_s']:.1f} | {r['output_tokens_per_s']:.0f} | "
            f"{r['total_tokens_per_s']:.0f} | {r['kv_capacity_tokens']} | {r['num_preemptions']} |"
        )
    print(
        f"\nthroughput ratio N={args.tp} / N=1: "
        f"{many['output_tokens_per_s'] / one['output_tokens_per_s']:.2f}x "
        f"({args.num_prompts} prompts x {args.input_len} + {args.output_len} tokens, {args.dtype})"
    )
    print(
        f"greedy identity (float32, {len(identical)} prompts x {args.identity_len} tokens): "
        f"{sum(identical)}/{len(identical)} identical; common prefix lengths {prefixes}"
    )
    if args.out:
        pathlib.Path(args.out).write_text(
            json.dumps({"args": vars(args), "results": results}, indent=2)
        )
    return 0 if all(identical) else 1


if __name__ == "__main__":
    sys.exit(main())
