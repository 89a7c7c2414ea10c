"""The greedy token of the LM head on the CPU: every float32 logit then their argmax (kvpilot's
GEMM kernel and argmax) against the greedy head (``kvpilot.kernels.cpu.greedy_head``: a
bfloat16 screen, its bound, the float32 logits of the candidates), on the default model's real
head and real final hidden states (transformers' forward pass of random token prompts).

For each batch size ``M`` of ``--rows``: best wall time of ``--repeats`` calls after one
warm-up, at ``--threads`` torch threads pinned to the first cores; checks that the tokens are
the same and counts the rows the head left undecided (-1).

    python benchmarks/greedy_head.py --threads 1
    python benchmarks/greedy_head.py --threads 2

Takes about half a minute.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from cpu_gemm import best_time  # noqa: E402  (benchmarks/ is not a package)

from kvpilot.engine.model_loader.resolve import resolve_model
from kvpilot.kernels.cpu import gemm, greedy_head
from kvpilot.machine import describe_machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,128", help="batch sizes M")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    os.sched_setaffinity(0, set(range(args.threads)))
    torch.set_num_threads(args.threads)
    if not greedy_head.available():
        raise SystemExit("the greedy head is not available here (AVX-512 BF16, the GEMM kernel)")
    model_dir = resolve_model(None)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [int(r) for r in args.rows.split(",")]
    ids = torch.randint(3, model.config.vocab_size, (4, -(-max(rows) // 4)))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]
    hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    head = gemm.pack_weight(model.lm_head.weight.detach())
    screen = greedy_head.build_screen(head)
    print(f"machine: {describe_machine()}; threads: {args.threads}")
    print(f"head: {tuple(head.shape)} of {model_dir.name}")
    print(
        f"{'M':>5} {'float32 + argmax ms':>20} {'greedy head ms':>15} {'ratio':>6}  same  undecided"
    )
    for m in rows:
        x = hidden[:m].contiguous()
        full = best_time(lambda x=x: gemm.packed_linear(x, head).argmax(dim=-1), args.repeats)
        fast = best_time(lambda x=x: greedy_head.greedy_tokens(x, head, screen), args.repeats)
        tokens = greedy_head.greedy_tokens(x, head, screen)
        reference = gemm.packed_linear(x, head).argmax(dim=-1)
        decided = tokens >= 0
        same = bool((tokens[decided] == reference[decided]).all())
        print(
            f"{m:>5} {full * 1e3:>20.2f} {fast * 1e3:>15.2f} {fast / full:>5.2f}x  {same!s:>4}"
            f"  {int((~decided).sum())}"
        )


if __name__ == "__main__":
    main()
