"""Random attention inputs in the engine's paged layout, for kernel tests and benchmarks.

Physical blocks are handed out in a shuffled order, so block tables are never sorted; caches
hold random values everywhere, so reading a wrong slot shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """Queries and a paged K/V cache with shuffled block tables (the engine's layout)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor

    def attention_kwargs(self) -> dict:
        """The metadata arguments of ``unified_attention`` (and its reference)."""
        return {
            "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens,
            "block_tables": self.block_tables,
            "scale": self.q.shape[-1] ** -0.5,
        }


def paged_batch(
    specs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    spare_blocks: int = 0,
    spare_columns: int = 0,
) -> PagedBatch:
    """A batch of ``(q_len, seq_len)`` per sequence: ``seq_len - q_len`` cached tokens followed
    by ``q_len`` new ones.

    With a ``generator`` values are drawn in float32 and rounded to ``dtype`` (every dtype sees
    the same numbers); without one they are drawn in ``dtype`` on ``device`` (no float32 copy
    of a large cache). ``spare_blocks`` physical blocks belong to no sequence; ``spare_columns``
    extra block-table columns are padded with 0, as the model runner does.
    """

    def randn(*shape: int) -> torch.Tensor:
        if generator is None:
            return torch.randn(shape, device=device, dtype=dtype)
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    needed = [-(-seq_len // block_size) for _, seq_len in specs]
    num_blocks = sum(needed) + spare_blocks
    physical = torch.randperm(num_blocks, generator=generator, device=device).int()
    tables = torch.zeros(len(specs), max(needed) + spare_columns, dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = physical[used : used + n]
        used += n
    q_lens = torch.tensor([q_len for q_len, _ in specs], device=device)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedBatch(
        q=randn(int(q_lens.sum()), num_heads, head_dim),
        k_cache=randn(*cache_shape),
        v_cache=randn(*cache_shape),
        query_start_loc=torch.cat((q_lens.new_zeros(1), q_lens.cumsum(0))).int(),
        seq_lens=torch.tensor([s for _, s in specs], dtype=torch.int32, device=device),
        block_tables=tables,
    )
