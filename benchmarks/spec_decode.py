"""Single-stream decode speed with and without speculative decoding (issue 10).

Runs, in one process and with one ``torch.set_num_threads`` value, each prompt alone (one
request at a time, greedy, EOS honoured) through:

1. the plain engine;
2. the engine with the n-gram (prompt lookup) proposer;
3. with ``--draft-model DIR``, the engine with that draft model.

Two prompt sets: *repetitive* (answers that copy the prompt: editing code, quoting a text)
and *open* (answers that do not). For each set and system it prints the output tokens per
second of the decode phase (first token excluded), the speedup over plain decoding by wall
time and by this process's CPU time (the fairer figure on a shared machine), the
acceptance rate (accepted / drafted tokens) and the mean tokens emitted per verification step.
It also checks that every speculative output equals the plain one token for token.

    python benchmarks/spec_decode.py --threads 2

Numbers go to docs/benchmarks.md ("Speculative decoding").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

REPETITIVE = [
    (
        "Add type hints to this Python code. Reply with the code only.\n\n"
        "def mean(values):\n"
        "    total = 0\n"
        "    for value in values:\n"
        "        total += value\n"
        "    return total / len(values)\n\n"
        "def variance(values):\n"
        "    m = mean(values)\n"
        "    total = 0\n"
        "    for value in values:\n"
        "        total += (value - m) ** 2\n"
        "    return total / len(values)\n"
    ),
    (
        "Rename the variable `count` to `num_items` in this function and return the whole "
        "function.\n\n"
        "def summarize(items):\n"
        "    count = 0\n"
        "    names = []\n"
        "    for item in items:\n"
        "        count += 1\n"
        "        names.append(item.name)\n"
        "    print(count, names)\n"
        "    return count\n"
    ),
    (
        "Quote the first two sentences of this text exactly, then summarise it.\n\n"
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
        "It is named after the engineer Gustave Eiffel, whose company designed and built the "
        "tower from 1887 to 1889. Locally nicknamed La dame de fer, it was constructed as the "
        "centrepiece of the 1889 World's Fair.\n"
    ),
    (
        "Repeat this list exactly, then add one more item in the same style.\n\n"
        "- apples: 3 kg, bought on Monday\n"
        "- pears: 2 kg, bought on Tuesday\n"
        "- plums: 1 kg, bought on Wednesday\n"
        "- grapes: 4 kg, bought on Thursday\n"
    ),
]

OPEN = [
    "Write a short poem about the sea at night.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Tell me a short story about a robot who learns to paint.",
    "Why is the sky blue? Answer in a few sentences.",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="target model (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--draft-model", default=None, help="draft model folder sharing the tokenizer"
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128, help="most new tokens per prompt")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--smoke", action="store_true", help="one prompt per set, 8 tokens")
    return parser.parse_args()


def chat(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(prompt, add_special_tokens=False)


def run(
    llm, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], float, float, int]:
    """Each prompt alone; returns the outputs, the decode wall and CPU seconds (this process)
    and the decode tokens."""
    from kvpilot.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    engine = llm.llm_engine
    outputs, seconds, cpu_seconds, tokens = [], 0.0, 0.0, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params)
        first = None
        final = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first is None and output.outputs[0].token_ids:
                    first = (
                        time.perf_counter(),
                        time.process_time(),
                        len(output.outputs[0].token_ids),
                    )
                final = output
        end, cpu_end = time.perf_counter(), time.process_time()
        ids = final.outputs[0].token_ids
        outputs.append(ids)
        seconds += end - first[0]
        cpu_seconds += cpu_end - first[1]
        tokens += len(ids) - first[2]
    return outputs, seconds, cpu_seconds, tokens


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from kvpilot.engine import LLM

    print("command:", " ".join([sys.executable, *sys.argv]))
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, torch threads {args.threads}"
    )
    max_tokens = 8 if args.smoke else args.output_len
    sets = {
        "repetitive": REPETITIVE[:1] if args.smoke else REPETITIVE,
        "open": OPEN[:1] if args.smoke else OPEN,
    }
    k = args.num_speculative_tokens
    systems = {
        "plain": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
        },
    }
    if args.draft_model:
        systems["draft_model"] = {
            "method": "draft_model",
            "model": args.draft_model,
            "num_speculative_tokens": k,
        }
    results = {}
    plain_outputs = {}
    for system, config in systems.items():
        llm = LLM(args.model, speculative_config=config, enable_prefix_caching=False)
        tokenizer = llm.get_tokenizer()
        for set_name, texts in sets.items():
            prompts = [chat(tokenizer, t) for t in texts]
            run(llm, prompts[:1], 4)  # warm-up
            before = llm.llm_engine.get_stats().spec_decode
            outputs, seconds, cpu_seconds, tokens = run(llm, prompts, max_tokens)
            after = llm.llm_engine.get_stats().spec_decode
            row = {
                "tokens_per_s": tokens / seconds,
                "tokens_per_cpu_s": tokens / cpu_seconds,
                "decode_tokens": tokens,
            }
            if after is not None:
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                steps = after.num_drafts - before.num_drafts
                row["acceptance_rate"] = accepted / drafted if drafted else 0.0
                row["tokens_per_step"] = (accepted + steps) / steps if steps else 1.0
            if system == "plain":
                plain_outputs[set_name] = outputs
            else:
                row["identical_to_plain"] = outputs == plain_outputs[set_name]
                plain = results[("plain", set_name)]
                row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"]
                row["cpu_speedup"] = row["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"]
            results[(system, set_name)] = row
        del llm
    print()
    print(
        "| system | prompts | decode tok/s (wall) | speedup (wall) | speedup (CPU) | "
        "acceptance | tokens/step | identical to plain |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (system, set_name), row in results.items():
        if system == "plain":
            print(
                f"| plain | {set_name} | {row['tokens_per_s']:.1f} | 1.00x | 1.00x | - | 1.00 | - |"
            )
            continue
        print(
            f"| {system} | {set_name} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
            f"{row['cpu_speedup']:.2f}x | {row['acceptance_rate']:.0%} | "
            f"{row['tokens_per_step']:.2f} | {row['identical_to_plain']} |"
        )
    print()
    print(json.dumps({f"{s}/{p}": r for (s, p), r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
