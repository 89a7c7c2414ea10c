"""Multi-LoRA throughput: a batch mixing 8 adapters vs the base model alone, same engine.

Builds ``--num-adapters`` random PEFT adapters (rank ``--rank`` on every q/k/v/o/gate/up/down
projection, written by peft's ``save_pretrained``) for the model, then runs the same workload
three times, each in a fresh engine with one ``torch.set_num_threads`` value:

1. ``base``: LoRA off (the engine exactly as without this feature);
2. ``lora, base requests``: LoRA on (projections wrapped) but no request uses an adapter;
3. ``lora, N adapters``: request ``i`` uses adapter ``i % N``; ``--max-loras`` slots
   (default: all adapters resident).

Workload: ``--num-prompts`` random prompts of ``--prompt-len`` tokens, ``--output-len`` new
tokens each, greedy, EOS ignored, all submitted at once. Target (issue 11): mixed-adapter
throughput >= 0.7x the base model's.

    python benchmarks/lora.py --threads 2

Prints the command, the machine, the thread count, each run's wall and CPU seconds and output
tokens/s, and its throughput relative to the base run, by wall time and by CPU time (on a
shared machine the CPU time counts only this process's work). Numbers go to docs/benchmarks.md ("Multi-LoRA").
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import torch

from kvpilot.machine import describe_machine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="model folder or hub id (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=None, help="default: --num-adapters")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--output-len", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_adapters(model_dir: pathlib.Path, root: pathlib.Path, count: int, rank: int) -> list:
    """``count`` PEFT adapters with random A and B (PEFT's own init zeroes B)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
    )
    generator = torch.Generator().manual_seed(0)
    folders = []
    for i in range(count):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
        folders.append(root / f"adapter-{i}")
        model.save_pretrained(folders[-1])
    return folders


def run(args, model_dir, prompts, lora_kwargs: dict, loras: list) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and output tokens of the workload in a fresh engine."""
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        max_model_len=args.prompt_len + args.output_len,
        seed=args.seed,
        **lora_kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warmup = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], warmup, use_tqdm=False)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=loras or None)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from kvpilot.engine.lora import LoRARequest
    from kvpilot.engine.model_loader import resolve_model

    print("command:", " ".join([sys.executable, *sys.argv]))
    print("machine:", describe_machine())
    print(f"threads: {torch.get_num_threads()}")
    model_dir = resolve_model(args.model)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(100, 10000, (args.prompt_len,), generator=generator).tolist()
        for _ in range(args.num_prompts)
    ]
    max_loras = args.max_loras or args.num_adapters
    print(
        f"workload: {args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} "
        f"new tokens each; {args.num_adapters} adapters of rank {args.rank}, max_loras "
        f"{max_loras}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folders = build_adapters(model_dir, pathlib.Path(tmp), args.num_adapters, args.rank)
        requests = [LoRARequest(f"adapter-{i}", i + 1, str(f)) for i, f in enumerate(folders)]
        lora = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": args.rank}
        runs = {
            "base": run(args, model_dir, prompts, {}, []),
            "lora, base requests": run(args, model_dir, prompts, lora, []),
            f"lora, {args.num_adapters} adapters": run(
                args,
                model_dir,
                prompts,
                lora,
                [requests[i % len(requests)] for i in range(len(prompts))],
            ),
        }
    base_wall, base_cpu, _ = runs["base"]
    print(f"{'run':<24} {'wall s':>8} {'cpu s':>8} {'tok/s':>8} {'vs base':>8} {'(cpu)':>7}")
    for name, (wall, cpu, tokens) in runs.items():
        ratio, cpu_ratio = base_wall / wall, base_cpu / cpu
        print(
            f"{name:<24} {wall:8.2f} {cpu:8.2f} {tokens / wall:8.1f} {ratio:7.2f}x "
            f"{cpu_ratio:6.2f}x"
        )


if __name__ == "__main__":
    main()
