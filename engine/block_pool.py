"""The pool of KV cache blocks: reference counts, an LRU free list, and the prefix-cache index.

Follows vLLM V1's ``BlockPool`` (PagedAttention, Kwon et al. 2023; automatic prefix caching):
a block whose reference count drops to 0 keeps its contents and its hash and goes to the tail of
the free list; fresh blocks are taken from the head, so the least recently used cached block is
evicted first, and only when a fresh block is needed.

With caching on, the pool records its KV events (``kv_events.py``): ``BlockStored`` when a full
block enters the prefix cache, ``BlockRemoved`` when a cached hash is evicted,
``AllBlocksCleared`` when the cache is reset.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.kv_events import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    DEFAULT_MAX_KV_EVENTS,
    KVEventLog,
)

BlockHash = bytes


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple[Any, ...] = ()
) -> BlockHash:
    """Hash one full block from its parent's hash, its tokens and extra keys.

    sha256 over a pickle of plain values: stable across processes and runs (Python's ``hash``
    of strings is salted per process), and collisions are out of reach.

    Args:
        parent_hash: hash of the previous block (or the root hash for the first block).
        token_ids: the block's ``block_size`` token ids.
        extra_keys: anything else that changes the block's K/V for the same tokens
            (``cache_salt``, LoRA identity).

    Returns:
        32 bytes.
    """
    payload = pickle.dumps((parent_hash, tuple(token_ids), extra_keys), protocol=5)
    return hashlib.sha256(payload).digest()


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's K and V caches.

    Attributes:
        block_id: index into the cache tensors' first dimension.
        ref_cnt: running requests whose block table holds this block.
        block_hash: set once the block is full and indexed in the prefix cache.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns ``num_blocks`` blocks; hands out fresh ones, shares cached ones, frees them.

    Args:
        num_blocks: blocks in the cache (> 0).
        enable_caching: index full blocks by hash so that later requests reuse them.
        max_kv_events: how many of the latest KV events ``kv_events`` holds.

    Attributes:
        kv_events: the log of KV events; None when caching is off (nothing is recorded).

    Raises:
        ValueError: when ``num_blocks`` or ``max_kv_events`` < 1.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool, max_kv_events: int = DEFAULT_MAX_KV_EVENTS
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in LRU order: evict from the front, free to the back.
        self.free_blocks: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.kv_events = KVEventLog(max_kv_events) if enable_caching else None

    def get_num_free_blocks(self) -> int:
        """Blocks with reference count 0 (fresh, or cached and evictable)."""
        return len(self.free_blocks)

    def get_usage(self) -> float:
        """Fraction of blocks held by running requests, 0..1 (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding ``block_hash``'s contents, if still cached."""
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free list (ref count becomes 1).

        A cached block taken here is evicted from the prefix cache first.

        Raises:
            ValueError: when fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > len(self.free_blocks):
            raise ValueError(
                f"cannot take {num_blocks} blocks: only {len(self.free_blocks)} are free"
            )
        taken = []
        for _ in range(num_blocks):
            _, block = self.free_blocks.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a prefix-cache hit), taking it off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_blocks[block.block_id]
            block.ref_cnt += 1

    def free_blocks_of(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free list's tail.

        Pass a request's blocks tail first so that its last blocks, the least likely to be
        shared, are evicted before its prefix.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_blocks[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        When another block already holds the same hash (two requests computed the same prefix
        at once), the index keeps the first one; the duplicate stays private to its request.
        """
        for block, block_hash in zip(
            blocks[num_cached_blocks:num_full_blocks],
            block_hashes[num_cached_blocks:num_full_blocks],
            strict=True,
        ):
            if block.block_hash is not None:
                continue
            if block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block
                if self.kv_events is not None:
                    self.kv_events.record(BLOCK_STORED, block_hash)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.record(BLOCK_REMOVED, block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (one ``AllBlocksCleared`` event); refused (False) while any
        block is in use."""
        if len(self.free_blocks) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        if self.kv_events is not None:
            self.kv_events.record(ALL_BLOCKS_CLEARED)
        return True
