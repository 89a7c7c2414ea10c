"""Greedy tokens with an fp8 KV cache against a float32 one, on the default model (issue 20).

For each ``--kv-cache-dtype`` the same chat prompts are decoded greedily for ``--max-tokens``
tokens, and compared with the float32 cache's (``auto`` on CPU) tokens two ways:

- free-running: requests whose whole output is identical, and the mean share of tokens before
  the first difference (after one, the two continuations condition on different text);
- teacher-forced: the fp8 engine scores the float32 run's prompt + output as a prompt
  (``prompt_logprobs``); a token matches when it is the fp8 cache's top-1 there. This is the
  per-token match rate: each position conditions on the same text.

It also prints the KV blocks each cache dtype gets from the same ``--kv-cache-memory``.

    python benchmarks/fp8_kv_cache.py --threads 2

Takes about a minute per cache dtype on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import parse_bytes
from kvpilot.machine import describe_machine

QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Translate 'good morning' into Spanish, French and German.",
    "Explain in two sentences what a paged KV cache is and why inference engines use one.",
    "Give me three tips for writing clean Python code.",
    "Why is the sky blue?",
]


def chat_prompts(llm: LLM, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn in the model's chat template, as token ids."""
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for q in questions
    ]


def greedy_ids(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of exactly ``max_tokens`` tokens (EOS ignored), in prompt order."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def first_difference(a: list[int], b: list[int]) -> int:
    """Tokens before the first position where ``a`` and ``b`` differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def teacher_forced_matches(llm: LLM, prompts: list[list[int]], outputs: list[list[int]]) -> int:
    """How many of ``outputs``' tokens are ``llm``'s top-1 given the prompt and the output
    tokens before them."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    full = [{"prompt_token_ids": p + o} for p, o in zip(prompts, outputs, strict=True)]
    matches = 0
    for request, prompt, out in zip(
        llm.generate(full, params, use_tqdm=False), prompts, outputs, strict=True
    ):
        scored = request.prompt_logprobs[len(prompt) :]
        matches += sum(entry[t].rank == 1 for entry, t in zip(scored, out, strict=True))
    return matches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default="64MiB")
    parser.add_argument(
        "--kv-cache-dtype", nargs="+", default=["fp8", "fp8_e5m2"], help="dtypes to compare"
    )
    parser.add_argument("--calculate-kv-scales", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("command: python", " ".join(sys.argv))
    print(f"machine: {describe_machine()}; threads {args.threads}")
    common = dict(model=args.model, kv_cache_memory=args.kv_cache_memory, max_model_len=1024)
    start = time.perf_counter()
    reference = LLM(**common)
    prompts = chat_prompts(reference, QUESTIONS)
    expected = greedy_ids(reference, prompts, args.max_tokens)
    print(
        f"auto (float32): {reference.llm_engine.cache_config.num_blocks} blocks, "
        f"{time.perf_counter() - start:.0f} s"
    )
    del reference
    total = len(prompts) * args.max_tokens
    for kv_cache_dtype in args.kv_cache_dtype:
        start = time.perf_counter()
        llm = LLM(
            **common, kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales
        )
        got = greedy_ids(llm, prompts, args.max_tokens)
        identical = sum(g == e for g, e in zip(got, expected, strict=True))
        prefix = sum(first_difference(g, e) for g, e in zip(got, expected, strict=True))
        forced = teacher_forced_matches(llm, prompts, expected)
        print(
            f"{kv_cache_dtype}: {llm.llm_engine.cache_config.num_blocks} blocks; "
            f"identical outputs {identical}/{len(prompts)}; tokens before the first "
            f"difference {prefix}/{total} ({prefix / total:.1%}); teacher-forced top-1 match "
            f"{forced}/{total} ({forced / total:.1%}); {time.perf_counter() - start:.0f} s"
        )
        del llm


if __name__ == "__main__":
    main()
