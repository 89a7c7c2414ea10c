"""The router's pure parts: the scoring rule (bounded load, prefix affinity, tie-breaks), the
consistent-hash ring and the per-replica prefix index."""

from __future__ import annotations

import pytest

from kvpilot.router.consistent_hash import HashRing
from kvpilot.router.prefix_index import EventIndex, PrefixIndex
from kvpilot.router.scoring import Candidate, Weights, choose_replica, load_bound


def test_load_bound_is_the_rounded_up_factor_of_the_mean_with_the_new_request() -> None:
    assert load_bound([0, 0], 1.25) == 1  # ceil(1.25 * 1 / 2)
    assert load_bound([1, 0], 1.25) == 2  # ceil(1.25 * 2 / 2)
    assert load_bound([4, 4, 3], 1.25) == 5  # ceil(1.25 * 12 / 3)
    with pytest.raises(ValueError, match="load_factor"):
        load_bound([0], 0.9)
    with pytest.raises(ValueError, match="at least one"):
        load_bound([], 1.25)


def test_the_longest_cached_prefix_wins() -> None:
    decision = choose_replica(
        [Candidate("a", 0, 16), Candidate("b", 0, 96), Candidate("c", 0, 0)], prompt_tokens=100
    )
    assert (decision.replica, decision.reason, decision.matched_tokens) == ("b", "prefix", 96)
    assert "chose b (prefix)" in decision.explanation


def test_a_full_match_keeps_its_replica_up_to_the_bound_and_never_beyond() -> None:
    # 3 in flight on a, 0 on b: bound = ceil(1.25 * 4 / 2) = 3, so a is full.
    over = choose_replica([Candidate("a", 3, 100), Candidate("b", 0, 0)], prompt_tokens=100)
    assert (over.replica, over.reason, over.bound) == ("b", "load", 3)
    assert (
        "a in_flight=3 running=0 waiting=0 kv=0.00 matched=100 ring=0 over bound"
        in over.explanation
    )
    # 2 on a, 0 on b: bound 2 -> a at 1.0 - 2/2 = 0 would tie b's 0; it is full anyway.
    assert choose_replica([Candidate("a", 2, 100), Candidate("b", 0, 0)], 100).replica == "b"
    # 2 on a, 1 on b: bound ceil(1.25 * 4 / 2) = 3: a scores 1 - 2/3 > b's -1/3.
    assert choose_replica([Candidate("a", 2, 100), Candidate("b", 1, 0)], 100).replica == "a"


def test_a_small_match_does_not_outweigh_a_queue() -> None:
    # bound = ceil(1.25 * 5 / 2) = 4: a scores 0.1 - 3/4, b scores -1/4.
    decision = choose_replica([Candidate("a", 3, 10), Candidate("b", 1, 0)], 100)
    assert (decision.replica, decision.reason) == ("b", "load")


def test_no_replica_is_ever_picked_above_the_bound() -> None:
    for loads in ([5, 0, 0], [3, 3, 0], [7, 2, 1], [0, 0, 0], [9, 9, 9]):
        candidates = [Candidate(str(i), n, 100, ring_rank=i) for i, n in enumerate(loads)]
        for tokens in (None, 100):
            decision = choose_replica(candidates, tokens, load_factor=1.25)
            picked = loads[int(decision.replica)]
            assert picked + 1 <= decision.bound
            assert picked + 1 <= 1.25 * (sum(loads) + 1) / len(loads) + 1


def test_ties_go_to_fewer_in_flight_then_the_ring_then_the_name() -> None:
    # Equal scores (no match, equal load): the ring's order decides.
    tied = [Candidate("a", 0, 0, ring_rank=1), Candidate("b", 0, 0, ring_rank=0)]
    assert choose_replica(tied, 50).replica == "b"
    # Equal scores with zero load weight: fewer in flight first.
    busy = [Candidate("a", 1, 0, ring_rank=0), Candidate("b", 0, 0, ring_rank=1)]
    assert choose_replica(busy, 50, weights=Weights(load=0)).replica == "b"
    same = [Candidate("b", 0, 0), Candidate("a", 0, 0)]
    assert choose_replica(same, 50).replica == "a"


def test_without_tokens_it_is_consistent_hashing_with_bounded_loads() -> None:
    ring = [Candidate("a", 0, ring_rank=2), Candidate("b", 0, ring_rank=0), Candidate("c", 0, 1)]
    assert (choose_replica(ring, None).replica, choose_replica(ring, None).reason) == ("b", "hash")
    # The owner is full (bound ceil(1.25 * 4 / 3) = 2): the next on the ring takes it.
    full = [Candidate("a", 0, ring_rank=2), Candidate("b", 2, ring_rank=0), Candidate("c", 1, 1)]
    assert choose_replica(full, None).replica == "c"


def test_one_candidate_and_bad_input() -> None:
    assert choose_replica([Candidate("a", 7, 0)], 10).reason == "only"
    with pytest.raises(ValueError, match="at least one candidate"):
        choose_replica([], 10)


def test_the_ring_is_stable_and_moves_only_the_removed_replicas_keys() -> None:
    three = HashRing(["http://a", "http://b", "http://c"])
    two = HashRing(["http://c", "http://a"])
    keys = [f"prompt {i}".encode() for i in range(300)]
    owners = [three.order(k)[0] for k in keys]
    assert sorted(three.order(keys[0])) == ["http://a", "http://b", "http://c"]
    assert owners == [HashRing(["http://c", "http://b", "http://a"]).order(k)[0] for k in keys]
    for key, owner in zip(keys, owners, strict=True):
        if owner != "http://b":
            assert two.order(key)[0] == owner
    shares = [owners.count(name) / len(keys) for name in three.names]
    assert min(shares) > 0.2


def test_the_prefix_index_matches_leading_blocks_and_evicts_tails_first() -> None:
    index = PrefixIndex(capacity_blocks=4)
    index.insert([b"1", b"2", b"3"])
    assert index.match([b"1", b"2", b"3", b"4"]) == 3
    assert index.match([b"9", b"2"]) == 0  # a chain stops at its first missing block
    index.insert([b"1", b"5", b"6"])  # 5 blocks > 4: the least recent, 3 (a tail), goes
    assert len(index) == 4
    assert index.match([b"1", b"2", b"3"]) == 2
    index.resize(1)
    assert index.match([b"1"]) == 1 and len(index) == 1
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(0)


def answer(next_seq: int, *events: tuple[str, bytes | None], truncated: bool = False) -> dict:
    """A ``/kv_events`` answer whose events end at ``next_seq``."""
    first = next_seq - len(events)
    return {
        "next": next_seq,
        "truncated": truncated,
        "events": [
            {"seq": first + i, "type": kind, "block_hash": None if h is None else h.hex()}
            for i, (kind, h) in enumerate(events)
        ],
    }


def test_the_event_index_replays_stored_removed_and_cleared() -> None:
    index = EventIndex(b"root")
    index.apply(answer(3, ("BlockStored", b"1"), ("BlockStored", b"2"), ("BlockStored", b"3")))
    assert index.blocks == {b"1", b"2", b"3"} and index.next_seq == 3
    assert index.match([b"1", b"2", b"9", b"3"]) == 2
    index.apply(answer(4, ("BlockRemoved", b"2")))
    assert index.match([b"1", b"2"]) == 1
    index.apply(answer(5, ("AllBlocksCleared", None)))
    assert index.blocks == set()
    index.apply(answer(9, ("BlockStored", b"7"), truncated=True))  # fell behind: start over
    assert index.blocks == {b"7"} and index.next_seq == 9


def test_the_event_index_holds_a_sent_chain_for_two_polls() -> None:
    index = EventIndex(b"root")
    index.insert([b"1", b"2"])  # routed there; the engine has not scheduled it yet
    assert index.match([b"1", b"2"]) == 2
    index.apply(answer(0))
    assert index.match([b"1", b"2"]) == 2  # a poll may come before the engine stores them
    index.apply(answer(0))
    assert index.match([b"1", b"2"]) == 0  # never stored (evicted, or failed): forgotten


def test_the_engines_own_load_counts_toward_the_bound_and_the_score() -> None:
    # a holds the whole prompt but its engine runs 3 requests (other clients'): load 3, b's 0,
    # bound ceil(1.25 * 4 / 2) = 3: a is full although this router sent it nothing.
    hot = Candidate("a", 0, 100, num_requests_running=3)
    decision = choose_replica([hot, Candidate("b", 0, 0)], 100)
    assert (decision.replica, decision.reason, decision.bound) == ("b", "load", 3)
    # The router's own count wins when the engine's is older than its sends.
    assert Candidate("a", 4, num_requests_running=1).load == 4
    # Equal load and match: waiting requests and a full KV cache push a replica down.
    waiting = Candidate("a", 1, 50, num_requests_waiting=1)  # load max(1, 1) = 1
    kv_full = Candidate("b", 1, 50, ring_rank=1, kv_cache_usage_perc=1.0)
    calm = Candidate("c", 1, 50, ring_rank=2)
    decision = choose_replica([waiting, kv_full, calm], 100, load_factor=2)
    assert decision.replica == "c"
    terms = {t.candidate.name: t for t in decision.terms}
    assert terms["a"].waiting == pytest.approx(1 / decision.bound)
    assert terms["b"].kv == pytest.approx(0.25) and terms["c"].kv == 0
    assert terms["c"].score == pytest.approx(0.5 - 1 / decision.bound)


def test_weights_must_not_be_negative() -> None:
    assert Weights().kv == 0.25
    with pytest.raises(ValueError, match="the waiting weight must be >= 0"):
        Weights(waiting=-1)
