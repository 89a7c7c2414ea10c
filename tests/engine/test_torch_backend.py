"""The torch attention backend against the kernels' PyTorch reference and a dense recompute."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvpilot.engine.attention import AttentionMetadata, get_attention_backend, torch_backend
from kvpilot.engine.attention.torch_backend import group_by_length
from kvpilot.kernels.cpu import paged_attention
from kvpilot.kernels.reference import reshape_and_cache, unified_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 32
# (cached tokens, new tokens) per sequence: decode, fresh prefill, prefill chunk, first decode.
BATCH = [(9, 1), (0, 6), (5, 4), (1, 1), (14, 1)]


def make_batch(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    # Blocks no sequence owns, and the slots of owned blocks past a sequence's end (stale K/V of
    # an earlier request), hold NaN: reading them must not leak into any output.
    owned = set()
    tables, slots, starts, seq_lens = [], [], [0], []
    for cached, new in BATCH:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        owned.update(table)
        slots += [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, total)
        ]
        tables.append(table)
        k_cache[table[-1], total % BLOCK_SIZE or BLOCK_SIZE :] = float("nan")
        v_cache[table[-1], total % BLOCK_SIZE or BLOCK_SIZE :] = float("nan")
        starts.append(starts[-1] + new)
        seq_lens.append(total)
    for block in set(range(NUM_BLOCKS)) - owned:
        k_cache[block] = float("nan")
        v_cache[block] = float("nan")
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(n for _, n in BATCH),
        max_seq_len=max(seq_lens),
    )
    num_tokens = starts[-1]
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v, k_cache, v_cache, metadata


@pytest.mark.parametrize("group_overhead", [torch_backend.GROUP_OVERHEAD_TOKENS, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_kernel_reference(dtype, group_overhead, monkeypatch):
    # Overhead 0 puts decodes of different lengths in separate groups.
    monkeypatch.setattr(torch_backend, "GROUP_OVERHEAD_TOKENS", group_overhead)
    q, k, v, k_cache, v_cache, md = make_batch(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache(k, v, ref_k, ref_v, md.slot_mapping)
    expected = unified_attention(
        q,
        ref_k,
        ref_v,
        query_start_loc=md.query_start_loc,
        seq_lens=md.seq_lens,
        block_tables=md.block_tables,
        scale=HEAD_DIM**-0.5,
    )
    out = get_attention_backend("torch").forward(
        q, k, v, (k_cache, v_cache), md, scale=HEAD_DIM**-0.5
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(k_cache.nan_to_num(), ref_k.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), ref_v.nan_to_num())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


def test_sliding_window_matches_dense_attention():
    window = 3
    q, k, v, k_cache, v_cache, md = make_batch(torch.float32, seed=1)
    out = get_attention_backend("torch").forward(
        q, k, v, (k_cache, v_cache), md, scale=0.25, sliding_window=window
    )
    starts, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        blocks = md.block_tables[i].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, head_dim]
        values = v_cache[blocks].flatten(0, 1)[:seq_len]
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            pos = seq_len - q_len + j
            lo = max(0, pos - window + 1)
            for h in range(NUM_HEADS):
                kv = h // (NUM_HEADS // NUM_KV_HEADS)
                scores = keys[lo : pos + 1, kv] @ q[starts[i] + j, h] * 0.25
                expected = scores.softmax(0) @ values[lo : pos + 1, kv]
                torch.testing.assert_close(out[starts[i] + j, h], expected, atol=1e-5, rtol=0)


def test_decode_groups_are_padded_per_group_and_shortest_first():
    plan = torch_backend.plan_step(make_batch(torch.float32)[-1], BLOCK_SIZE)
    # Decodes of 10, 2 and 15 tokens: one group at the default overhead, padded to 15.
    assert [d.max_len for d in plan.decodes] == [15]
    assert plan.decodes[0].seq_lens.tolist() == [2, 10, 15]
    assert plan.decodes[0].rows.tolist() == [11, 0, 12]
    assert [(p.start, p.q_len, p.seq_len) for p in plan.prefills] == [(1, 6, 6), (7, 4, 9)]


def test_in_place_plan_with_prompts_is_the_batch_layout_in_int32_without_slots():
    md = make_batch(torch.float32)[-1]
    plan = torch_backend.plan_step(md, BLOCK_SIZE, in_place=True, prompts_in_place=True)
    assert plan.decodes == [] and plan.prefills == []
    paged = plan.in_place
    assert paged.rows is None
    for name in ("seq_lens", "query_start_loc", "block_tables"):
        tensor = getattr(paged, name)
        assert tensor.dtype == torch.int32 and tensor.is_contiguous()
        assert torch.equal(tensor, getattr(md, name).int())


def test_in_place_plan_without_prompts_keeps_every_decode_in_one_call_and_prompts_on_sdpa():
    md = make_batch(torch.float32)[-1]
    plan = torch_backend.plan_step(md, BLOCK_SIZE, in_place=True)
    assert plan.decodes == []
    paged = plan.in_place
    assert paged.rows.tolist() == [0, 11, 12]  # sequences 0, 3 and 4, in batch order
    assert paged.query_start_loc.tolist() == [0, 1, 2, 3]  # one row each in query[rows]
    assert paged.seq_lens.dtype == torch.int32 and paged.seq_lens.tolist() == [10, 2, 15]
    assert paged.block_tables.dtype == torch.int32 and paged.block_tables.is_contiguous()
    assert torch.equal(paged.block_tables, md.block_tables[[0, 3, 4]])
    assert [(p.start, p.q_len, p.seq_len) for p in plan.prefills] == [(1, 6, 6), (7, 4, 9)]


@pytest.mark.skipif(
    not paged_attention.tiles_prompts(torch.zeros(1, 9, 64), torch.zeros(1, 16, 3, 64)),
    reason="prompts go to the kernel where it tiles them: float32 on an AVX-512 CPU",
)
def test_a_prompt_attends_the_same_prefilled_whole_or_in_chunks():
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(3)
    seq_len = 45
    num_blocks = -(-seq_len // block_size) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(seq_len, num_heads, head_dim, generator=gen)
    blocks = torch.randperm(num_blocks, generator=gen)[: -(-seq_len // block_size)]
    table = blocks.int()[None]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]

    def run(chunks: list[int]) -> torch.Tensor:
        caches = (torch.zeros(shape), torch.zeros(shape))
        backend, outs, done = get_attention_backend("torch"), [], 0
        for n in chunks:
            md = AttentionMetadata(
                slot_mapping=slots[done : done + n],
                query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                seq_lens=torch.tensor([done + n], dtype=torch.int32),
                block_tables=table,
                max_query_len=n,
                max_seq_len=done + n,
            )
            rows = slice(done, done + n)
            outs.append(backend.forward(q[rows], k[rows], v[rows], caches, md, scale=0.125))
            done += n
        return torch.cat(outs)

    whole = run([seq_len])
    # Each (token, head) row is computed on its own: the same bits for any chunking.
    assert torch.equal(run([5, 4, 2, 34]), whole)
    assert torch.equal(run([16, 16, 13]), whole)
    # One token at a time is the decode path: the same attention, another summation order.
    torch.testing.assert_close(run([1] * seq_len), whole, atol=2e-6, rtol=2e-6)


def brute_force_grouping_cost(lengths: list[int], overhead: int) -> int:
    ordered = sorted(lengths)
    best = None
    for cuts in itertools.product([False, True], repeat=len(ordered) - 1):
        cost, size = 0, 1
        for i, cut in enumerate([*cuts, True]):
            if cut:
                cost += size * ordered[i] + overhead
                size = 0
            size += 1
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("overhead", [0, 5, 50])
def test_group_by_length_finds_the_cheapest_grouping(overhead):
    gen = torch.Generator().manual_seed(overhead)
    for n in range(1, 8):
        lengths = torch.randint(1, 60, (n,), generator=gen).tolist()
        groups = group_by_length(lengths, overhead)
        assert sorted(i for g in groups for i in g) == list(range(n))
        cost = sum(len(g) * max(lengths[i] for i in g) + overhead for g in groups)
        assert cost == brute_force_grouping_cost(lengths, overhead)
        longest = [max(lengths[i] for i in g) for g in groups]
        assert longest == sorted(longest)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch"):
        get_attention_backend("flash")
