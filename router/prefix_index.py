"""What the router believes one replica holds in its prefix cache.

``EventIndex``: the engine's truth, for a replica that publishes its KV events (``GET
/kv_events``, ``engine/kv_events.py``): the set of hashes it stored and has not removed, plus the
chains the router sent it since its last poll or the one before (their blocks are stored once
the engine schedules them, after the router's choice).

``PrefixIndex``: the router's own estimate, for a replica that does not publish them: the block
hashes the router sent there, in an LRU set bounded by the replica's KV capacity in blocks, as the
engine's own cache evicts its least recently used free blocks first.

Pure: no I/O.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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
        return _leading(hashes, self._blocks.__contains__)

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


class EventIndex:
    """A replica's cached block hashes, rebuilt from its ``/kv_events`` answers.

    Args:
        root_hash: the replica's root hash (the parent of every first block), 32 bytes.

    Attributes:
        root_hash: as given.
        next_seq: the ``since`` of the next poll.
        blocks: the hashes the engine stored and has not removed since.
    """

    def __init__(self, root_hash: bytes) -> None:
        self.root_hash = root_hash
        self.next_seq = 0
        self.blocks: set[bytes] = set()
        # Chains sent since the last poll, and in the interval before it.
        self._sent: set[bytes] = set()
        self._sent_before: set[bytes] = set()

    def apply(self, answer: Mapping[str, Any]) -> None:
        """Apply one ``/kv_events`` answer (a ``truncated`` one replaces every block)."""
        if answer["truncated"]:
            self.blocks.clear()
        for event in answer["events"]:
            if event["type"] == "AllBlocksCleared":
                self.blocks.clear()
                self._sent.clear()
                self._sent_before.clear()
                continue
            block_hash = bytes.fromhex(event["block_hash"])
            if event["type"] == "BlockStored":
                self.blocks.add(block_hash)
            elif event["type"] == "BlockRemoved":
                self.blocks.discard(block_hash)
                self._sent.discard(block_hash)
                self._sent_before.discard(block_hash)
        self.next_seq = int(answer["next"])
        self._sent_before, self._sent = self._sent, set()

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a chain the replica holds or was just sent (blocks)."""
        return _leading(
            hashes, lambda h: h in self.blocks or h in self._sent or h in self._sent_before
        )

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Record a chain just sent to the replica, until the polls after it report it."""
        self._sent.update(hashes)


def _leading(hashes: Sequence[bytes], held: Callable[[bytes], bool]) -> int:
    """How many leading hashes are ``held``: a chain stops at its first missing block."""
    return sum(1 for _ in itertools.takewhile(held, hashes))
