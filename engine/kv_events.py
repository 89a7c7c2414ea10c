"""The prefix cache's KV events: what the block pool stored and dropped, in a bounded log.

Named after vLLM's KV events: ``BlockStored`` (a full block got its hash and entered the prefix
cache), ``BlockRemoved`` (a cached hash was evicted), ``AllBlocksCleared`` (the prefix cache was
reset). Each event has the next sequence number (0, 1, 2, ...), so that a reader asks for the
events since the last one it saw; the log keeps the latest ``max_events`` only, and a reader
that fell further behind is told so (``KVEventBatch.truncated``) and must drop what it built from
the older events. The server publishes the log as ``GET /kv_events``; the router rebuilds each
replica's cached blocks from it.

The engine thread owns the log, as it owns the block pool: read it there (``AsyncLLM.kv_events``).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"
DEFAULT_MAX_KV_EVENTS = 1 << 16
"""Events the log holds (the latest ones): a few MiB at most."""


class KVEvent(NamedTuple):
    """One event.

    Attributes:
        seq: its sequence number (the log's first event is 0).
        type: ``BLOCK_STORED``, ``BLOCK_REMOVED`` or ``ALL_BLOCKS_CLEARED``.
        block_hash: the block's hash (32 bytes); None for ``ALL_BLOCKS_CLEARED``.
    """

    seq: int
    type: str
    block_hash: bytes | None


@dataclass(frozen=True)
class KVEventBatch:
    """The answer to ``KVEventLog.since``.

    Attributes:
        next: the sequence number of the next event to come (ask for it next time).
        events: the events from the one asked for (all the log holds when truncated), oldest
            first.
        truncated: the log no longer holds the event asked for (or never did: a number past
            ``next``, e.g. from before an engine restart); the reader must drop what it built
            and rebuild from ``events``.
    """

    next: int
    events: list[KVEvent]
    truncated: bool


class KVEventLog:
    """The latest ``max_events`` events; recording one is a deque append.

    Args:
        max_events: how many events it holds (> 0).

    Raises:
        ValueError: ``max_events`` < 1.
    """

    def __init__(self, max_events: int = DEFAULT_MAX_KV_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.events: deque[KVEvent] = deque(maxlen=max_events)
        self.next_seq = 0

    def record(self, event_type: str, block_hash: bytes | None = None) -> None:
        """Append one event with the next sequence number."""
        self.events.append(KVEvent(self.next_seq, event_type, block_hash))
        self.next_seq += 1

    def since(self, seq: int) -> KVEventBatch:
        """The events numbered ``seq`` and later (see ``KVEventBatch``)."""
        oldest = self.events[0].seq if self.events else self.next_seq
        if seq < oldest or seq > self.next_seq:
            return KVEventBatch(self.next_seq, list(self.events), True)
        return KVEventBatch(
            self.next_seq, list(itertools.islice(self.events, seq - oldest, None)), False
        )
