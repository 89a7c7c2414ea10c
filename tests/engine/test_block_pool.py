"""Block pool and KV cache manager with plain values: ref counts, LRU eviction, prefix hits."""

from __future__ import annotations

import pytest

from kvpilot.engine.block_pool import BlockPool, hash_block_tokens
from kvpilot.engine.kv_cache_manager import KVCacheManager, extend_block_hashes
from kvpilot.engine.kv_events import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    KVEvent,
    KVEventBatch,
    KVEventLog,
)
from kvpilot.engine.request import Request
from kvpilot.engine.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(temperature=0),
        eos_token_ids=frozenset(),
        max_tokens=16,
        cache_salt=cache_salt,
    )


def admit(manager: KVCacheManager, request: Request) -> int:
    """Allocate the whole prompt as the scheduler would; returns the cache-hit token count."""
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit) is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit


def test_hash_is_stable_and_chained():
    a = hash_block_tokens(b"", [1, 2, 3, 4])
    assert a == hash_block_tokens(b"", [1, 2, 3, 4])
    assert len(a) == 32
    assert a != hash_block_tokens(b"", [1, 2, 3, 5])
    assert a != hash_block_tokens(b"x", [1, 2, 3, 4])
    assert a != hash_block_tokens(b"", [1, 2, 3, 4], ("salt",))


def test_pool_takes_from_head_and_frees_to_tail():
    pool = BlockPool(4, enable_caching=True)
    first = pool.get_new_blocks(2)
    assert [b.block_id for b in first] == [0, 1]
    assert [b.ref_cnt for b in first] == [1, 1]
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks_of(reversed(first))
    # Freed blocks queue behind the never-used ones, tail block first.
    assert list(pool.free_blocks) == [2, 3, 1, 0]
    with pytest.raises(ValueError, match="only 4 are free"):
        pool.get_new_blocks(5)


def test_cached_block_stays_until_a_fresh_block_is_needed():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(b"", [1, 2, 3, 4])
    pool.cache_full_blocks([block], [h], 0, 1)
    pool.free_blocks_of([block])
    assert pool.get_cached_block(h) is block and block.ref_cnt == 0
    pool.get_new_blocks(1)  # takes the never-used block 1 first
    assert pool.get_cached_block(h) is block
    pool.get_new_blocks(1)  # now block 0 must be evicted
    assert pool.get_cached_block(h) is None and block.block_hash is None


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute():
    manager = KVCacheManager(16, BS, enable_caching=True)
    prompt = list(range(10, 22))  # 12 tokens = 3 full blocks
    a = make_request("a", prompt)
    assert admit(manager, a) == 0
    # Same prompt: the third block holds the last token, which must be computed again.
    b = make_request("b", prompt)
    assert admit(manager, b) == 8
    assert manager.get_block_ids("b")[:2] == manager.get_block_ids("a")[:2]
    assert manager.get_block_ids("b")[2] != manager.get_block_ids("a")[2]
    shared = manager.req_to_blocks["a"][0]
    assert shared.ref_cnt == 2
    # A longer prompt with the same 12-token prefix reuses all three blocks.
    c = make_request("c", prompt + [99, 98])
    assert admit(manager, c) == 12
    assert shared.ref_cnt == 3


def test_partial_block_prefix_is_not_shared():
    manager = KVCacheManager(16, BS, enable_caching=True)
    admit(manager, make_request("a", [1, 2, 3, 4, 5, 6]))
    assert admit(manager, make_request("b", [1, 2, 3, 4, 5, 7, 8])) == 4
    assert admit(manager, make_request("c", [1, 2, 3, 9, 9])) == 0


def test_cache_salt_isolates_and_prefix_caching_off_never_hits():
    manager = KVCacheManager(16, BS, enable_caching=True)
    prompt = list(range(9))
    admit(manager, make_request("a", prompt, cache_salt="tenant-1"))
    assert admit(manager, make_request("b", prompt, cache_salt="tenant-2")) == 0
    assert admit(manager, make_request("c", prompt)) == 0
    assert admit(manager, make_request("d", prompt, cache_salt="tenant-1")) == 8
    off = KVCacheManager(16, BS, enable_caching=False)
    admit(off, make_request("a", prompt))
    assert admit(off, make_request("b", prompt)) == 0


def test_allocation_failure_changes_nothing_and_free_returns_everything():
    manager = KVCacheManager(4, BS, enable_caching=True)
    a = make_request("a", list(range(12)))
    admit(manager, a)
    b = make_request("b", list(range(100, 108)))
    assert manager.allocate_slots(b, 8) is None
    assert "b" not in manager.req_to_blocks
    assert manager.block_pool.get_num_free_blocks() == 1
    manager.free(a)
    assert manager.block_pool.get_num_free_blocks() == 4
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert manager.usage == 0.0


def test_evictable_hits_are_not_counted_as_free_twice():
    # 3 blocks; "a" caches 2 full blocks and finishes (both at ref count 0, still cached).
    manager = KVCacheManager(3, BS, enable_caching=True)
    a = make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    # "b" hits both cached blocks and needs 2 fresh ones: only 1 remains once the hits are
    # taken off the free list, so the allocation must fail cleanly.
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert manager.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit) is None
    assert manager.block_pool.get_num_free_blocks() == 3
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


def test_decode_fills_block_and_caches_it():
    manager = KVCacheManager(8, BS, enable_caching=True)
    a = make_request("a", [1, 2, 3])
    admit(manager, a)
    a.append_output_token(4)
    assert manager.allocate_slots(a, 1) == []  # the 4th slot is in the same block
    a.num_computed_tokens += 1
    assert manager.num_cached_blocks["a"] == 1
    b = make_request("b", [1, 2, 3, 4, 5])
    assert admit(manager, b) == 4


def test_kv_events_record_stored_removed_and_cleared_hashes():
    manager = KVCacheManager(4, BS, enable_caching=True, root_hash=b"root")
    pool = manager.block_pool
    a = make_request("a", list(range(12)))  # 3 full blocks
    admit(manager, a)
    stored = extend_block_hashes([], list(range(12)), BS, b"root")
    batch = pool.kv_events.since(0)
    assert batch == KVEventBatch(3, [KVEvent(i, BLOCK_STORED, h) for i, h in enumerate(stored)],
                                 False)  # fmt: skip
    manager.free(a)
    # Filling the cache: 4 fresh blocks take the never-used one, then evict a's three, tail
    # first (the free list's order).
    b = make_request("b", list(range(100, 116)))
    admit(manager, b)
    events = pool.kv_events.since(3).events
    removed = [e for e in events if e.type == BLOCK_REMOVED]
    assert [e.block_hash for e in removed] == stored[::-1]
    assert [e.seq for e in events] == list(range(3, 3 + len(events)))
    assert [e.block_hash for e in events if e.type == BLOCK_STORED] == extend_block_hashes(
        [], list(range(100, 116)), BS, b"root"
    )
    manager.free(b)
    assert pool.reset_prefix_cache()
    last = pool.kv_events.since(pool.kv_events.next_seq - 1)
    assert last.events == [KVEvent(last.next - 1, ALL_BLOCKS_CLEARED, None)]


def test_kv_event_log_is_bounded_and_says_truncated():
    log = KVEventLog(max_events=2)
    for i in range(5):
        log.record(BLOCK_STORED, bytes([i]))
    assert log.since(3) == KVEventBatch(5, [KVEvent(3, BLOCK_STORED, b"\x03"),
                                            KVEvent(4, BLOCK_STORED, b"\x04")], False)  # fmt: skip
    assert log.since(5) == KVEventBatch(5, [], False)
    behind = log.since(1)
    assert behind.truncated and [e.seq for e in behind.events] == [3, 4]
    assert log.since(9).truncated  # a cursor from before a restart
    with pytest.raises(ValueError, match="max_events"):
        KVEventLog(0)


def test_no_kv_events_without_prefix_caching():
    manager = KVCacheManager(4, BS, enable_caching=False)
    admit(manager, make_request("a", list(range(12))))
    assert manager.block_pool.kv_events is None
