"""``unified_attention`` (Triton, interpreter on CPU) against its PyTorch reference.

Batches are described as ``(q_len, seq_len)`` per sequence: ``seq_len - q_len`` cached tokens
followed by ``q_len`` new ones. Physical blocks are handed out in a shuffled order, so block
tables are never sorted; caches hold random values everywhere, so reading a wrong slot shows.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels._utils import check_dot_dims
from kvpilot.kernels.testing import PagedBatch, paged_batch
from kvpilot.kernels.unified_attention import (
    choose_kv_splits,
    launch_config,
    unified_attention,
)

pytestmark = pytest.mark.kernel

FP16_TOL = {"atol": 2e-3, "rtol": 2e-3}
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


def make_batch(
    specs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Seeded, with two blocks no sequence owns and one spare block-table column."""
    return paged_batch(
        specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, generator=torch.Generator().manual_seed(seed),
        spare_blocks=2, spare_columns=1,
    )  # fmt: skip


# name -> (specs, num_heads, num_kv_heads, head_dim, block_size)
CASES = {
    # The first token of a sequence: context length 1.
    "decode-context-1": ([(1, 1)], 2, 1, 16, 16),
    # Decode exactly on and one past block boundaries, GQA 4 (Llama-3's ratio).
    "decode-block-boundaries": ([(1, 16), (1, 17), (1, 32), (1, 33)], 8, 2, 32, 16),
    # Whole prompts on and one past a boundary, no GQA, head_dim padded (24 -> 32).
    "prefill-block-boundaries": ([(16, 16), (17, 17)], 2, 2, 24, 16),
    # Mixed batch: decode, chunked prefill over cached context, a whole prompt, a first token,
    # and a sequence with no new token this step; GQA 3 (SmolLM2's ratio); blocks of 8, so
    # one key tile spans several blocks.
    "mixed-chunked": ([(1, 40), (5, 21), (17, 17), (1, 1), (0, 9)], 6, 2, 16, 8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case: str, dtype: torch.dtype) -> None:
    specs, num_heads, num_kv_heads, head_dim, block_size = CASES[case]
    batch = make_batch(
        specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    got = unified_attention(batch.q, batch.k_cache, batch.v_cache, **batch.attention_kwargs())
    want = reference.unified_attention(
        batch.q, batch.k_cache, batch.v_cache, **batch.attention_kwargs()
    )
    assert got.dtype == dtype and got.shape == batch.q.shape
    torch.testing.assert_close(got, want, **(FP32_TOL if dtype == torch.float32 else FP16_TOL))


# name -> (specs, num_heads, num_kv_heads, head_dim, block_size), with contexts of several key
# tiles; a context of 1 leaves two of three splits empty, which the merge must ignore.
SPLIT_CASES = {
    "decode": ([(1, 1), (1, 100), (1, 129), (1, 300)], 8, 2, 32, 16),
    "mixed": ([(1, 200), (30, 130), (17, 17), (0, 9)], 6, 2, 16, 8),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_kv_matches_reference(case: str) -> None:
    specs, num_heads, num_kv_heads, head_dim, block_size = SPLIT_CASES[case]
    batch = make_batch(
        specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=torch.float16, seed=1,
    )  # fmt: skip
    got = unified_attention(
        batch.q, batch.k_cache, batch.v_cache, num_kv_splits=3, **batch.attention_kwargs()
    )
    want = reference.unified_attention(
        batch.q, batch.k_cache, batch.v_cache, **batch.attention_kwargs()
    )
    torch.testing.assert_close(got, want, **FP16_TOL)


def test_not_causal() -> None:
    batch = make_batch([(3, 10), (1, 5)], num_heads=4, num_kv_heads=2, head_dim=16)
    got = unified_attention(
        batch.q, batch.k_cache, batch.v_cache, causal=False, **batch.attention_kwargs()
    )
    want = reference.unified_attention(
        batch.q, batch.k_cache, batch.v_cache, causal=False, **batch.attention_kwargs()
    )
    torch.testing.assert_close(got, want, **FP32_TOL)
    causal = reference.unified_attention(
        batch.q, batch.k_cache, batch.v_cache, **batch.attention_kwargs()
    )
    assert not torch.allclose(got[:3], causal[:3])  # the mask really is off


def _sliding_reference(batch: PagedBatch, window: int) -> torch.Tensor:
    """Per-sequence SDPA over the gathered cache with a causal sliding-window mask."""
    out = torch.zeros_like(batch.q)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        k = reference.gather_kv(batch.k_cache, batch.block_tables[i], seq_len)
        v = reference.gather_kv(batch.v_cache, batch.block_tables[i], seq_len)
        q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            batch.q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=batch.q.shape[-1] ** -0.5, enable_gqa=True,
        ).transpose(0, 1)  # fmt: skip
    return out


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_sliding_window(num_kv_splits: int) -> None:
    # Windows shorter than the context: whole key tiles before the window are skipped.
    batch = make_batch([(1, 150), (20, 90), (1, 3)], num_heads=4, num_kv_heads=2, head_dim=16)
    got = unified_attention(
        batch.q, batch.k_cache, batch.v_cache, sliding_window=70,
        num_kv_splits=num_kv_splits, **batch.attention_kwargs(),
    )  # fmt: skip
    torch.testing.assert_close(got, _sliding_reference(batch, 70), **FP32_TOL)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_out_buffer_strided_q_and_padding_rows(num_kv_splits: int) -> None:
    # q is a view of a fused QKV buffer; two padding tokens follow the last sequence (CUDA
    # graph padding) and their rows of `out` must be left as they were.
    batch = make_batch([(2, 7), (1, 4)], num_heads=4, num_kv_heads=2, head_dim=16)
    qkv = torch.randn(5, 8, 16)
    qkv[:3, :4] = batch.q
    q = qkv[:, :4]
    out = torch.full((5, 4, 16), 7.0)
    result = unified_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        out=out,
        num_kv_splits=num_kv_splits,
        **batch.attention_kwargs(),
    )
    assert result is out
    want = reference.unified_attention(
        batch.q, batch.k_cache, batch.v_cache, **batch.attention_kwargs()
    )
    torch.testing.assert_close(out[:3], want, **FP32_TOL)
    assert torch.equal(out[3:], torch.full((2, 4, 16), 7.0))


def test_launch_config_dot_dims() -> None:
    # Every supported shape gives tl.dot operands of at least 16 and a whole GQA group a tile.
    for group in range(1, 17):
        for head_pad in (16, 32, 64, 128, 256):
            for dtype in (torch.float16, torch.float32):
                for decode_only in (True, False):
                    config = launch_config(decode_only, group, head_pad, dtype)
                    assert config.block_m >= 16 and config.tile_n >= 16
                    assert config.block_m // group >= 1
    with pytest.raises(ValueError, match=r"tl.dot dimensions must be >= 16, got \{'TILE_N': 8\}"):
        check_dot_dims("f", {"BLOCK_M": 16, "TILE_N": 8})


def test_kv_splits_only_for_decode_batches_that_leave_the_gpu_idle() -> None:
    # Llama-3-8B decode (8 KV heads, 4 tokens per query block) on a 132-SM H100: a batch of B
    # sequences launches (B // 4 + B) x 8 programs. Batch 1 splits 16 ways (the cap), batch 16
    # in 2, batch 256 not at all.
    assert choose_kv_splits((1 // 4 + 1) * 8, 132, decode_only=True) == 16
    assert choose_kv_splits((16 // 4 + 16) * 8, 132, decode_only=True) == 2
    assert choose_kv_splits((256 // 4 + 256) * 8, 132, decode_only=True) == 1
    assert choose_kv_splits(2 * 8, 132, decode_only=False) == 1
    assert choose_kv_splits(2 * 8, None, decode_only=True) == 1


def _good_args() -> dict:
    batch = make_batch([(2, 5), (1, 20)], num_heads=4, num_kv_heads=2, head_dim=16)
    return {
        "q": batch.q,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        **batch.attention_kwargs(),
    }


BAD_INPUTS = {
    "heads-not-multiple": ({"q": torch.zeros(3, 3, 16)}, "multiple of the caches' num_kv_heads"),
    "head-dim-mismatch": ({"q": torch.zeros(3, 4, 32)}, "k_cache must have shape"),
    "dtype-mismatch": ({"q": torch.zeros(3, 4, 16, dtype=torch.float16)}, "k_cache must have dtype"),
    "qsl-decreasing": ({"query_start_loc": torch.tensor([0, 3, 2], dtype=torch.int32)}, "never decrease"),
    "qsl-past-tokens": ({"query_start_loc": torch.tensor([0, 2, 4], dtype=torch.int32)}, "at most at num_tokens=3"),
    "seq-len-below-q-len": ({"seq_lens": torch.tensor([1, 20], dtype=torch.int32)}, "seq_lens must be >="),
    "table-too-narrow": ({"seq_lens": torch.tensor([5, 60], dtype=torch.int32)}, "fewer than the 4 blocks"),
    "block-id-out-of-range": ({"block_tables": torch.tensor([[0, 0], [1, 99]], dtype=torch.int32)}, r"must lie in \[0, "),
    "float-metadata": ({"seq_lens": torch.tensor([5.0, 20.0])}, "seq_lens must have dtype"),
    "scale": ({"scale": 0.0}, "scale must be a finite positive"),
    "sliding-window": ({"sliding_window": 0}, "sliding_window must be None or an int >= 1"),
    "num-kv-splits": ({"num_kv_splits": 0}, "num_kv_splits must be None or an int >= 1"),
    "out-shape": ({"out": torch.zeros(3, 4, 8)}, "out must have shape"),
    "head-dim-too-big": (
        {"q": torch.zeros(3, 4, 512), "k_cache": torch.zeros(2, 16, 2, 512), "v_cache": torch.zeros(2, 16, 2, 512)},
        "head_dim must be <= 256",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_argument(case: str) -> None:
    changes, message = BAD_INPUTS[case]
    args = _good_args()
    args.update(changes)
    with pytest.raises(ValueError, match=message) as info:
        unified_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)
    assert str(info.value).startswith("unified_attention: ")
