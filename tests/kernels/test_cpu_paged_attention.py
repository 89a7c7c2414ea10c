"""The C++ CPU paged attention kernel against the torch backend's gather + SDPA path.

The kernel builds on first use (about a minute the first time on a machine, cached after);
these tests need a C++ compiler, like the engine's default CPU path.
"""

from __future__ import annotations

import itertools
import logging
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.kernels.cpu import paged_attention, prebuilt

BLOCK_SIZE = 16


@pytest.fixture(scope="module", autouse=True)
def built_kernel():
    assert paged_attention.load_extension() is not None, (
        "the CPU paged attention kernel did not build"
    )


def paged_decode_batch(
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
    seed=0,
    spare=5,
    q_lens=None,
    block_size=BLOCK_SIZE,
):
    """Caches with shuffled blocks, NaN in every slot no sequence owns up to its length, and
    the metadata of each sequence's last ``q_lens`` positions as its new tokens (default one:
    decodes). The values drawn (cached K/V by position, q, k, v) depend on ``seed`` alone, not
    on ``block_size``: only where they lie does."""
    q_lens = q_lens or [1] * len(seq_lens)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    width = max(blocks_per_seq) + 1  # one padding column of block 0 in every row
    tables, slots = [], []
    for n, new, count in zip(seq_lens, q_lens, blocks_per_seq, strict=True):
        table = [free.pop() for _ in range(count)]
        for p in range(n - new):  # cached positions; the new ones are written by the forward
            block, offset = table[p // block_size], p % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n - new, n)]
        tables.append(table + [0] * (width - count))
    num = sum(q_lens)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    q = torch.randn(num, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num, num_kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, k_cache, v_cache, metadata


def both_paths(batch, scale, sliding_window=None):
    q, k, v, k_cache, v_cache, md = batch
    outs = []
    for kernel in (False, True):
        caches = (k_cache.clone(), v_cache.clone())
        backend = TorchAttentionBackend(paged_decode_kernel=kernel)
        assert backend.uses_kernel(q, caches[0]) is kernel
        outs.append(
            backend.forward(q, k, v, caches, md, scale=scale, sliding_window=sliding_window)
        )
    return outs


# Lengths 1, multiples of the block size, one past one, and ragged ones in between.
RAGGED = [1, 16, 17, 5, 48, 33, 2, 64, 31, 100]

# Block sizes: groups of 16 positions (16), of 8 (8, 24: a multiple of 8, not of 16), and plain
# loops (12).
BLOCK_SIZES = [16, 8, 24, 12]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim",
    [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 80), (14, 2, 64), (32, 4, 128)],
    ids=["smollm2", "gqa4-d128", "mha-d32", "mqa-d80", "gqa7-d64", "gqa8-d128"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_gather_and_sdpa_path(
    num_heads, num_kv_heads, head_dim, dtype, block_size
):
    batch = paged_decode_batch(
        RAGGED, num_heads, num_kv_heads, head_dim, dtype, block_size=block_size
    )
    reference, out = both_paths(batch, scale=head_dim**-0.5)
    assert out.dtype == dtype and out.shape == batch[0].shape
    assert torch.isfinite(out).all(), "a NaN slot past some sequence's end leaked into an output"
    tolerance = 2e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out, reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_sliding_window_matches_the_gather_and_sdpa_path(window, block_size):
    batch = paged_decode_batch(RAGGED, 9, 3, 64, torch.float32, seed=1, block_size=block_size)
    reference, out = both_paths(batch, scale=0.125, sliding_window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference, atol=2e-6, rtol=2e-6)
    if window == 1:  # only its own value: the new token's v, whatever the scores
        q, k, v, *_ = batch
        torch.testing.assert_close(out, v.repeat_interleave(3, dim=1), atol=0, rtol=0)


# (context after the step, new tokens): whole prompts of 1, 2, 16, 17 and 70 tokens, chunks
# after 9 and 32 cached tokens, a decode, and two-token drafts, ragged against the blocks.
PROMPTS = [(1, 1), (2, 2), (16, 16), (17, 17), (70, 70), (25, 16), (45, 13), (30, 1), (19, 2)]


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim",
    [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 80), (32, 1, 64), (14, 2, 64)],
    ids=["smollm2", "gqa4-d128", "mha-d32", "mqa-d80", "mqa32-d64", "gqa7-d64"],
)
@pytest.mark.parametrize("window", [None, 5, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 8])
def test_prompts_chunks_and_decodes_in_one_step_match_the_gather_and_sdpa_path(
    num_heads, num_kv_heads, head_dim, window, dtype, block_size
):
    # Float32 prompts go through tiles of 16 (token, head) rows (a tile may hold several tokens,
    # or part of one token's heads when a KV head has more than 16), the rest token by token
    # (which the engine leaves to SDPA, so the kernel is called directly here).
    seq_lens, q_lens = zip(*PROMPTS, strict=True)
    q, k, v, k_cache, v_cache, md = paged_decode_batch(
        list(seq_lens),
        num_heads,
        num_kv_heads,
        head_dim,
        dtype,
        seed=4,
        q_lens=list(q_lens),
        block_size=block_size,
    )
    scale = head_dim**-0.5
    backend = TorchAttentionBackend(paged_decode_kernel=False)  # writes the new K/V too
    reference = backend.forward(q, k, v, (k_cache, v_cache), md, scale=scale, sliding_window=window)
    out = paged_attention.paged_attention(
        q,
        k_cache,
        v_cache,
        md.block_tables,
        md.seq_lens,
        scale,
        window,
        query_start_loc=md.query_start_loc,
    )
    avx512 = paged_attention.load_extension().tiles_supported()
    assert paged_attention.tiles_prompts(q, k_cache) == (
        avx512 and dtype == torch.float32 and head_dim % 16 == 0 and block_size % 8 == 0
    )
    assert torch.isfinite(out).all(), "a NaN slot past some sequence's end leaked into an output"
    tolerance = 2e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out, reference, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(
    not paged_attention.load_extension().tiles_supported(), reason="prompt tiles need AVX-512"
)
def test_a_prompts_last_token_alone_gets_its_bits_in_the_whole_prompt_when_marked_a_prompt():
    """The last token of a 37-token prompt attended alone (a one-token last chunk, or the token
    recomputed after a prefix-cache hit) against the same cache: marked in ``prompt_seqs`` it
    takes the prompt's tile and gets the bits of its row in the whole prompt's call; unmarked it
    is a decode's item, another summation order."""
    q, k, v, k_cache, v_cache, md = paged_decode_batch([37], 9, 3, 64, torch.float32, q_lens=[37])
    backend = TorchAttentionBackend(paged_decode_kernel=False)  # writes the prompt's K/V
    backend.forward(q, k, v, (k_cache, v_cache), md, scale=0.125, sliding_window=None)
    whole = paged_attention.paged_attention(
        q, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, query_start_loc=md.query_start_loc
    )
    last = q[-1:].clone()
    one = torch.tensor([0, 1], dtype=torch.int32)
    marked = paged_attention.paged_attention(
        last, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, query_start_loc=one,
        prompt_seqs=torch.tensor([True]),
    )  # fmt: skip
    unmarked = paged_attention.paged_attention(
        last, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, query_start_loc=one
    )
    assert torch.equal(marked[0], whole[-1])
    assert not torch.equal(unmarked[0], whole[-1])  # what the mark is for
    torch.testing.assert_close(unmarked[0], whole[-1], atol=2e-6, rtol=2e-6)
    with pytest.raises(RuntimeError, match="prompt_seqs must be empty or contiguous bool"):
        paged_attention.paged_attention(
            last, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, query_start_loc=one,
            prompt_seqs=torch.tensor([True, False]),
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_block_size_changes_no_bit(dtype):
    # Groups of 16 positions (block sizes 16, 32) or of 8 (8, 24), prompt tiles scoring up to 8
    # positions of a block at a time: every dot product and every row's sums run in one order,
    # so the KV cache's block size changes no bit of any output, decode or prompt. (Not so with
    # a sliding window: the positions before the first whole block after its start take the
    # plain loops, and which ones those are depends on the block size.)
    seq_lens, q_lens = zip(*PROMPTS, *[(n, 1) for n in RAGGED], strict=True)
    outs = []
    for block_size in (16, 8, 24, 32):
        q, k, v, k_cache, v_cache, md = paged_decode_batch(
            list(seq_lens), 9, 3, 64, dtype, seed=9, q_lens=list(q_lens), block_size=block_size
        )
        k_cache.view(-1, 3, 64)[md.slot_mapping] = k
        v_cache.view(-1, 3, 64)[md.slot_mapping] = v
        outs.append(
            paged_attention.paged_attention(
                q,
                k_cache,
                v_cache,
                md.block_tables,
                md.seq_lens,
                0.125,
                query_start_loc=md.query_start_loc,
            )
        )
    assert torch.isfinite(outs[0]).all()
    for block_size, out in zip((8, 24, 32), outs[1:], strict=True):
        assert torch.equal(out, outs[0]), block_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
def test_a_decodes_bits_do_not_depend_on_how_many_share_its_step(dtype, window):
    # Ten decodes on one thread are one item a token (every KV head); one decode alone is an
    # item per KV head. Same arithmetic a row: the same bits.
    q, k, v, k_cache, v_cache, md = paged_decode_batch(RAGGED, 9, 3, 64, dtype, seed=6)
    k_cache.view(-1, 3, 64)[md.slot_mapping] = k
    v_cache.view(-1, 3, 64)[md.slot_mapping] = v
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        together = paged_attention.paged_attention(
            q, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, window
        )
        for i in range(len(RAGGED)):
            alone = paged_attention.paged_attention(
                q[i : i + 1],
                k_cache,
                v_cache,
                md.block_tables[i : i + 1],
                md.seq_lens[i : i + 1],
                0.125,
                window,
            )
            assert torch.equal(alone[0], together[i]), i
    finally:
        torch.set_num_threads(threads)
    assert torch.isfinite(together).all()


def test_decodes_beside_a_prefill_and_a_length_one_sequence():
    # A prefill between decodes: the kernel gets the decode rows, SDPA the prefill.
    q, k, v, k_cache, v_cache, md = paged_decode_batch([20, 1, 37], 9, 3, 64, torch.float32)
    prompt_len = 5
    owned = {
        b
        for row, n in zip(md.block_tables.tolist(), [20, 1, 37], strict=True)
        for b in row[: -(-n // BLOCK_SIZE)]
    }
    prompt_table = [min(set(range(k_cache.shape[0])) - owned)]  # a spare block (NaN)
    md.block_tables = torch.cat(
        [
            md.block_tables[:1],
            torch.tensor([prompt_table + [0] * 3], dtype=torch.int32),
            md.block_tables[1:],
        ]
    )
    md.seq_lens = torch.tensor([20, prompt_len, 1, 37], dtype=torch.int32)
    md.query_start_loc = torch.tensor([0, 1, 1 + prompt_len, 2 + prompt_len, 3 + prompt_len])
    md.query_start_loc = md.query_start_loc.to(torch.int32)
    prompt_slots = torch.arange(prompt_len) + prompt_table[0] * BLOCK_SIZE
    md.slot_mapping = torch.cat([md.slot_mapping[:1], prompt_slots, md.slot_mapping[1:]])
    md.max_query_len, md.max_seq_len = prompt_len, 37
    gen = torch.Generator().manual_seed(3)

    def with_prompt(x):
        return torch.cat([x[:1], torch.randn(prompt_len, *x.shape[1:], generator=gen), x[1:]])

    batch = (with_prompt(q), with_prompt(k), with_prompt(v), k_cache, v_cache, md)
    reference, out = both_paths(batch, scale=0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference, atol=2e-6, rtol=2e-6)


def test_direct_call_reads_only_its_blocks_and_checks_its_inputs():
    q, k, v, k_cache, v_cache, md = paged_decode_batch([1, 16], 4, 2, 64, torch.float32)
    # Write each sequence's new token as the forward would, then call the kernel directly.
    k_cache.view(-1, 2, 64)[md.slot_mapping] = k
    v_cache.view(-1, 2, 64)[md.slot_mapping] = v
    out = paged_attention.paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125)
    # Length 1: the output is that token's own value, for every head of its group.
    torch.testing.assert_close(out[0], v[0].repeat_interleave(2, dim=0), atol=0, rtol=0)
    assert torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match="out of range"):
        bad = md.block_tables.clone()
        bad[1, 0] = k_cache.shape[0]
        paged_attention.paged_attention(q, k_cache, v_cache, bad, md.seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        too_long = torch.tensor([1, 16 * md.block_tables.shape[1] + 1], dtype=torch.int32)
        paged_attention.paged_attention(q, k_cache, v_cache, md.block_tables, too_long, 0.1)
    for short in (1, 0):  # a sequence needs at least its new tokens as context
        with pytest.raises(RuntimeError, match="is shorter than its 2 query tokens"):
            paged_attention.paged_attention(
                q,
                k_cache,
                v_cache,
                md.block_tables,
                torch.tensor([1, short], dtype=torch.int32),
                0.125,
                query_start_loc=torch.tensor([0, 0, 2], dtype=torch.int32),
            )
    with pytest.raises(RuntimeError, match="share one dtype"):
        paged_attention.paged_attention(
            q.double(), k_cache, v_cache, md.block_tables, md.seq_lens, 0.125
        )
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention.paged_attention(
            q, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, sliding_window=0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_each_token_at_its_slot(dtype):
    gen = torch.Generator().manual_seed(7)
    num_blocks, num_kv_heads, head_dim = 6, 3, 64
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
    # K and V as views of a fused QKV output (rows strided), one padding token (-1).
    qkv = torch.randn(5, (9 + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    key = qkv[:, 9 * head_dim : 12 * head_dim].view(5, num_kv_heads, head_dim)
    value = qkv[:, 12 * head_dim :].view(5, num_kv_heads, head_dim)
    slots = torch.tensor([17, 0, -1, 95, 40])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k.view(-1, num_kv_heads, head_dim)[slot] = key[t]
            want_v.view(-1, num_kv_heads, head_dim)[slot] = value[t]
    paged_attention.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # Heads not contiguous within a token: copied first, the same rows land.
    k_t = key.transpose(1, 2).contiguous().transpose(1, 2)
    paged_attention.reshape_and_cache(k_t * 2, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[17], key[0] * 2)
    # A slot past the cache: refused, and nothing written.
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="slot 96 out of range"):
        paged_attention.reshape_and_cache(key, value, k_cache, v_cache, slots.clamp(max=96) + 1)
    assert torch.equal(k_cache, before)
    with pytest.raises(RuntimeError, match="share one dtype"):
        paged_attention.reshape_and_cache(key.double(), value, k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="num_tokens, num_kv_heads, head_dim"):
        paged_attention.reshape_and_cache(key[:4], value, k_cache, v_cache, slots)


def test_fp8_caches_and_the_switch_keep_the_torch_path(monkeypatch):
    q = torch.randn(2, 4, 64)
    assert TorchAttentionBackend().uses_kernel(q, torch.zeros(3, 16, 2, 64))
    assert not TorchAttentionBackend().uses_kernel(
        q, torch.zeros(3, 16, 2, 64, dtype=torch.float8_e4m3fn)
    )
    assert not TorchAttentionBackend().uses_kernel(
        q, torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16)
    )
    monkeypatch.setenv(paged_attention.ENV_VAR, "0")
    assert not TorchAttentionBackend().uses_kernel(q, torch.zeros(3, 16, 2, 64))


def test_a_failed_build_warns_once_and_the_backend_keeps_the_torch_path(
    monkeypatch, caplog, tmp_path
):
    from torch.utils import cpp_extension

    monkeypatch.setenv(prebuilt.ENV_VAR, str(tmp_path))  # empty: the build path is taken

    calls = []

    def failing_load(**kwargs):
        calls.append(kwargs["name"])
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    paged_attention.load_extension.cache_clear()
    try:
        batch = paged_decode_batch([3, 20], 9, 3, 64, torch.float32)
        q, k, v, k_cache, v_cache, md = batch
        backend = TorchAttentionBackend()
        with caplog.at_level(logging.WARNING, logger="kvpilot.kernels"):
            assert not backend.uses_kernel(q, k_cache)
            out = backend.forward(q, k, v, (k_cache, v_cache), md, scale=0.125)
            backend.forward(q, k, v, (k_cache, v_cache), md, scale=0.125)
        assert torch.isfinite(out).all()
        assert calls == [paged_attention.EXTENSION_NAME]
        warnings = [r for r in caplog.records if "paged attention kernel unavailable" in r.message]
        assert len(warnings) == 1 and "Ninja is required" in warnings[0].message
        with pytest.raises(RuntimeError, match="could not be built"):
            paged_attention.paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, 1.0)
    finally:
        paged_attention.load_extension.cache_clear()


@pytest.mark.parametrize("new_tokens", [1, 40], ids=["decode", "prompts"])
def test_the_benchmark_runs_and_both_paths_agree(new_tokens):
    script = pathlib.Path(__file__).parents[2] / "benchmarks" / "cpu_attention.py"
    done = subprocess.run(
        [sys.executable, str(script), "--num-seqs", "3", "--layers", "2", "--min-len", "1",
         "--max-len", "40", "--repeats", "1", "--new-tokens", str(new_tokens)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    match = re.search(r"speedup: [\d.]+x; largest output difference: (\S+)", done.stdout)
    assert match, done.stdout
    assert float(match.group(1)) < 1e-5
