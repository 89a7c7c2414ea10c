"""Attention on the CPU: the gather + SDPA path against the in-place paged kernel.

One step of ``--num-seqs`` sequences (context lengths drawn uniformly from
``--min-len``..``--max-len``, the last ``--new-tokens`` positions of each new: 1 for a decode
step, the whole length for prompts) through ``--layers`` layers, each with a paged
cache of its own (blocks handed out in shuffled order, as after a while of serving), on
SmolLM2-135M's attention shape by default (9 query heads, 3 KV heads, head_dim 64, block size
16, float32). Timed: ``TorchAttentionBackend.forward`` of every layer (cache write + attention;
the step plan is built on the first layer, as in the engine), once with
``paged_decode_kernel=False`` (``index_select`` of the flat slots, then SDPA over each length
group, and one SDPA call per prompt) and once with the kernel
(``kvpilot.kernels.cpu.paged_attention``). CPU time
(``time.process_time``) at ``--threads`` torch threads; the median of ``--repeats`` steps after
one warm-up step. Also prints the largest difference between the two outputs.

    python benchmarks/cpu_attention.py --threads 1
    python benchmarks/cpu_attention.py --threads 1 --num-seqs 16 --min-len 128 --max-len 128 \
        --new-tokens 128       # 16 prompts of 128 tokens, one prefill step

Takes under a minute (plus the kernel's one-time build, about a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.config import CPU_BLOCK_SIZE
from kvpilot.kernels.cpu import paged_attention
from kvpilot.machine import describe_machine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--min-len", type=int, default=128, help="shortest context (tokens)")
    parser.add_argument("--max-len", type=int, default=512, help="longest context (tokens)")
    parser.add_argument(
        "--new-tokens", type=int, default=1, help="new tokens per sequence (1: decode)"
    )
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--block-size", type=int, default=CPU_BLOCK_SIZE, help="tokens per KV block"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def make_step(args: argparse.Namespace, dtype: torch.dtype):
    """Metadata of one step and each layer's (q, k, v, (k_cache, v_cache))."""
    gen = torch.Generator().manual_seed(args.seed)
    bs = args.block_size
    seq_lens = torch.randint(args.min_len, args.max_len + 1, (args.num_seqs,), generator=gen)
    blocks_per_seq = [-(-int(n) // bs) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 64
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    tables = []
    for n in blocks_per_seq:
        tables.append([free.pop() for _ in range(n)] + [0] * (width - n))
    block_tables = torch.tensor(tables, dtype=torch.int32)
    q_lens = seq_lens.clamp(max=args.new_tokens)
    slots = torch.cat(
        [
            table.long()[positions // bs] * bs + positions % bs
            for table, n, new in zip(block_tables, seq_lens, q_lens, strict=True)
            for positions in [torch.arange(n - new, n)]
        ]
    )
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=block_tables,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    num_tokens = int(q_lens.sum())
    cache_shape = (num_blocks, bs, args.num_kv_heads, args.head_dim)
    layers = []
    for _ in range(args.layers):
        q = torch.randn(num_tokens, args.num_heads, args.head_dim, generator=gen).to(dtype)
        k = torch.randn(num_tokens, args.num_kv_heads, args.head_dim, generator=gen).to(dtype)
        v = torch.randn(num_tokens, args.num_kv_heads, args.head_dim, generator=gen).to(dtype)
        caches = (
            torch.randn(cache_shape, generator=gen).to(dtype),
            torch.randn(cache_shape, generator=gen).to(dtype),
        )
        layers.append((q, k, v, caches))
    return metadata, layers


def time_steps(backend, metadata, layers, scale: float, repeats: int):
    """Median CPU seconds of one step (every layer) over ``repeats``, and the last outputs."""
    times, outs = [], []
    for i in range(repeats + 1):
        # A new metadata object per step: the backend plans once per step, as in the engine.
        step = AttentionMetadata(**vars(metadata))
        start = time.process_time()
        outs = [backend.forward(q, k, v, caches, step, scale=scale) for q, k, v, caches in layers]
        if i:  # the first step warms up
            times.append(time.process_time() - start)
    return statistics.median(times), times, outs


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"machine: {describe_machine()}")
    print(f"threads: {args.threads}; load average at start: {os.getloadavg()[0]:.2f}")
    print(
        f"step: {args.num_seqs} sequences ({args.new_tokens} new tokens at most each) x "
        f"{args.layers} layers, contexts "
        f"{args.min_len}-{args.max_len}, {args.num_heads} heads / {args.num_kv_heads} KV heads, "
        f"head_dim {args.head_dim}, block size {args.block_size}, {args.dtype}"
    )
    if not paged_attention.available():
        raise SystemExit("the paged attention kernel did not build (see the warning above)")
    metadata, layers = make_step(args, dtype)
    scale = args.head_dim**-0.5
    results = {}
    for name, kernel in [("gather + SDPA", False), ("paged kernel", True)]:
        backend = TorchAttentionBackend(paged_decode_kernel=kernel)
        median, times, outs = time_steps(backend, metadata, layers, scale, args.repeats)
        results[name] = (median, outs)
        print(
            f"{name:14} median {median * 1e3:7.1f} ms CPU per step "
            f"({median / args.layers * 1e3:.2f} ms per layer); "
            f"all: {', '.join(f'{t * 1e3:.1f}' for t in times)}"
        )
    (old, old_outs), (new, new_outs) = results.values()
    diff = max(
        (a.float() - b.float()).abs().max().item() for a, b in zip(old_outs, new_outs, strict=True)
    )
    print(f"speedup: {old / new:.2f}x; largest output difference: {diff:.2e}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
