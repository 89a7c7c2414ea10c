"""What the router believes one replica holds in its prefix cache: the block hashes it sent there.

An LRU set bounded by the replica's KV capacity in blocks, as the engine's own cache evicts its
least recently used free blocks first. It is the router's estimate, not the engine's truth: the
engine publishing its real KV events (blocks stored and evicted) is a later step.

Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY_BLOCKS = 4096
"""Until a replica's ``kvpilot:kv_cache_capacity_tokens`` is known."""


class PrefixIndex:
    """An LRU set of block hashes, at most ``capacity_blocks`` of them.

    Args:
        capacity_blocks: how many blocks the replica's KV cache holds (> 0).

    Raises:
        ValueError: ``capacity_blocks`` < 1.
    """

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.capacity_blocks = 0
        self.resize(capacity_blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def resize(self, capacity_blocks: int) -> None:
        """Change the bound, evicting the least recently used hashes beyond it.

        Raises:
            ValueError: ``capacity_blocks`` < 1.
        """
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._evict()

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt's hash chain are held (blocks, not tokens): a
        chain stops at its first missing block, as the engine's cache lookup does."""
        matched = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            matched += 1
        return matched

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Record a prompt's blocks as just used, evicting beyond the bound.

        The chain is recorded tail first, so that its first blocks are the most recent and the
        last to go: the engine frees a request's blocks tail first for the same reason.
        """
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        self._evict()

    def _evict(self) -> None:
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
