"""Which replica gets a request: prefix affinity plus load, under a bound on load (pure).

For every replica that serves the request's model and is not marked down::

    score = PREFIX_WEIGHT * matched_tokens / prompt_tokens - LOAD_WEIGHT * in_flight / bound

- ``matched_tokens``: the prompt's tokens in the leading blocks the replica is believed to hold
  (``prefix_index.PrefixIndex.match`` times the block size); 0..``prompt_tokens``.
- ``in_flight``: requests the router has sent there and not yet finished.
- ``bound``: bounded load (consistent hashing with bounded loads, Mirrokni et al. 2018): with
  ``n`` replicas and ``total`` requests in flight, none may hold more than
  ``ceil(load_factor * (total + 1) / n)`` once this request is added; replicas at that bound are
  not candidates. Some replica is always under it (``load_factor`` >= 1).

With the default weights (1.0 and 1.0), a replica holding a fraction ``f`` of the prompt wins
over one holding none while it runs fewer than ``f * bound`` requests more: a whole-prompt match
keeps its replica until the bound, a small match does not outweigh a queue. Ties go to
fewer in-flight requests, then to the replica first on the consistent-hash ring walk from the
prompt's key (so equal replicas still split traffic by prefix), then to the name.

Without prompt tokens (no tokenizer, or a prompt the router could not tokenize), the choice is
consistent hashing with bounded loads: the first replica on the ring walk under the bound.

Reasons (the ``reason`` label of ``kvpilot:router_routing_decisions_total``): ``prefix`` (the
chosen replica holds part of the prompt), ``load`` (no usable match: the least loaded), ``hash``
(no tokens: the ring), ``only`` (one candidate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX_WEIGHT = 1.0
"""Score per fraction of the prompt already cached on the replica."""
LOAD_WEIGHT = 1.0
"""Score taken off per fraction of the bound the replica's in-flight requests fill."""
DEFAULT_LOAD_FACTOR = 1.25


@dataclass(frozen=True)
class Candidate:
    """One replica as the scorer sees it.

    Attributes:
        name: the replica (its URL).
        in_flight: requests routed there and not finished.
        matched_tokens: prompt tokens in its prefix index (0 without a tokenizer).
        ring_rank: its position on the consistent-hash ring walk from the prompt's key (0: the
            key's owner).
    """

    name: str
    in_flight: int
    matched_tokens: int = 0
    ring_rank: int = 0


@dataclass(frozen=True)
class Decision:
    """The chosen replica and why.

    Attributes:
        replica: the chosen candidate's name.
        reason: ``prefix``, ``load``, ``hash`` or ``only`` (see the module docstring).
        matched_tokens: prompt tokens the chosen replica is believed to hold.
        bound: the most in-flight requests a replica may hold once this one is added.
        explanation: one line with every candidate's figures, for the debug log.
    """

    replica: str
    reason: str
    matched_tokens: int
    bound: int
    explanation: str


def load_bound(in_flight: Sequence[int], load_factor: float) -> int:
    """``ceil(load_factor * (sum(in_flight) + 1) / len(in_flight))``: the most requests a
    replica may hold once the request being routed is added.

    Raises:
        ValueError: no replicas, or ``load_factor`` < 1.
    """
    if not in_flight:
        raise ValueError("load_bound needs at least one replica")
    if load_factor < 1:
        raise ValueError(f"load_factor must be >= 1, got {load_factor}")
    return math.ceil(load_factor * (sum(in_flight) + 1) / len(in_flight))


def choose_replica(
    candidates: Sequence[Candidate],
    prompt_tokens: int | None,
    load_factor: float = DEFAULT_LOAD_FACTOR,
    prefix_weight: float = PREFIX_WEIGHT,
    load_weight: float = LOAD_WEIGHT,
) -> Decision:
    """Pick a replica for one request (see the module docstring for the rule).

    Args:
        candidates: the replicas that serve the request's model and are up (distinct names).
        prompt_tokens: the prompt's length in tokens, or None when it was not tokenized
            (consistent hashing then).
        load_factor: the bounded-load factor (>= 1).
        prefix_weight: ``PREFIX_WEIGHT`` unless tuned.
        load_weight: ``LOAD_WEIGHT`` unless tuned.

    Returns:
        The decision.

    Raises:
        ValueError: no candidates, or ``load_factor`` < 1.
    """
    if not candidates:
        raise ValueError("choose_replica needs at least one candidate")
    bound = load_bound([c.in_flight for c in candidates], load_factor)
    allowed = [c for c in candidates if c.in_flight + 1 <= bound]

    def score(c: Candidate) -> float:
        if not prompt_tokens:
            return 0.0
        return prefix_weight * c.matched_tokens / prompt_tokens - load_weight * c.in_flight / bound

    if prompt_tokens is None:
        best = min(allowed, key=lambda c: (c.ring_rank, c.name))
        reason = "hash"
    else:
        best = min(allowed, key=lambda c: (-score(c), c.in_flight, c.ring_rank, c.name))
        reason = "prefix" if best.matched_tokens > 0 else "load"
    if len(candidates) == 1:
        reason = "only"
    figures = "; ".join(
        f"{c.name} in_flight={c.in_flight} matched={c.matched_tokens} ring={c.ring_rank} "
        + (f"score={score(c):.3f}" if c in allowed else "over bound")
        for c in candidates
    )
    explanation = (
        f"chose {best.name} ({reason}): prompt_tokens={prompt_tokens} bound={bound}: {figures}"
    )
    return Decision(best.name, reason, best.matched_tokens, bound, explanation)
