"""Which replica gets a request: prefix affinity plus load, under a bound on load (pure).

For every replica that serves the request's model and is not marked down::

    load  = max(in_flight, num_requests_running + num_requests_waiting)
    score = PREFIX_WEIGHT  * matched_tokens / prompt_tokens
          - LOAD_WEIGHT    * load / bound
          - WAITING_WEIGHT * num_requests_waiting / bound
          - KV_WEIGHT      * kv_cache_usage_perc

- ``matched_tokens``: the prompt's tokens in the leading blocks the replica is believed to hold
  (``prefix_index`` ``match`` times the block size); 0..``prompt_tokens``.
- ``in_flight``: requests this router has sent there and not yet finished (exact, immediate).
- ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``: the engine's own
  gauges (``vllm:`` names), scraped from its ``/metrics`` every ``--refresh-interval``: they see
  what the router cannot (other routers' and direct clients' requests, long prompts still in
  prefill, a KV cache near preemption), but lag by up to one poll, so the load is the larger of
  the router's count and the engine's.
- ``bound``: bounded load (consistent hashing with bounded loads, Mirrokni et al. 2018): with
  ``n`` replicas and a total load ``total``, none may hold more than
  ``ceil(load_factor * (total + 1) / n)`` once this request is added; replicas at that bound are
  not candidates. Some replica is always under it (``load_factor`` >= 1): no replica goes above
  the factor of the mean, however hot its prefix.

The weights (defaults 1.0, 1.0, 1.0, 0.25): a replica holding a fraction ``f`` of the prompt wins
over an idle one holding none while its load is under ``f * bound``, so a whole-prompt match
keeps its replica until the bound and a small match does not outweigh a queue. A waiting
request costs twice a running one (the engine has no room for it: it will wait for a batch slot
or KV blocks, and its prefill competes with the hit the cache would give). A full KV cache costs
a quarter of a whole-prompt match: such an engine evicts cached prefixes and may preempt. Ties
go to the lower load, then to the replica first on the consistent-hash ring walk from the
prompt's key (so equal replicas still split traffic by prefix), then to the name.

Without prompt tokens (no tokenizer, a prompt the router could not tokenize, or one longer than
the replicas' context), the choice is consistent hashing with bounded loads: the first replica
on the ring walk under the bound (KubeAI's method).

Reasons (the ``reason`` label of ``kvpilot:router_routing_decisions_total``): ``prefix`` (the
chosen replica holds part of the prompt), ``load`` (no usable match: the least loaded), ``hash``
(no tokens: the ring), ``only`` (one candidate), and, chosen in ``app.py``, ``round_robin``
(by policy) and ``previous_response`` (the replica that stored the response a request
continues).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

PREFIX_WEIGHT = 1.0
"""Score per fraction of the prompt already cached on the replica."""
LOAD_WEIGHT = 1.0
"""Score taken off per fraction of the bound the replica's load fills."""
WAITING_WEIGHT = 1.0
"""Score taken off per fraction of the bound in the engine's waiting queue (on top of load)."""
KV_WEIGHT = 0.25
"""Score taken off per unit of the engine's KV cache usage (0..1)."""
DEFAULT_LOAD_FACTOR = 1.25


@dataclass(frozen=True)
class Weights:
    """The score's weights (see the module docstring); ``>= 0`` each."""

    prefix: float = PREFIX_WEIGHT
    load: float = LOAD_WEIGHT
    waiting: float = WAITING_WEIGHT
    kv: float = KV_WEIGHT

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 0:
                raise ValueError(f"the {name} weight must be >= 0, got {value}")


@dataclass(frozen=True)
class Candidate:
    """One replica as the scorer sees it.

    Attributes:
        name: the replica (its URL).
        in_flight: requests this router routed there and that have not finished.
        matched_tokens: prompt tokens in its prefix index (0 without a tokenizer).
        ring_rank: its position on the consistent-hash ring walk from the prompt's key (0: the
            key's owner).
        num_requests_running: the engine's ``vllm:num_requests_running`` (last poll).
        num_requests_waiting: the engine's ``vllm:num_requests_waiting`` (last poll).
        kv_cache_usage_perc: the engine's ``vllm:kv_cache_usage_perc``, 0..1 (last poll).
    """

    name: str
    in_flight: int
    matched_tokens: int = 0
    ring_rank: int = 0
    num_requests_running: float = 0.0
    num_requests_waiting: float = 0.0
    kv_cache_usage_perc: float = 0.0

    @property
    def load(self) -> float:
        """``max(in_flight, running + waiting)``: requests on the replica, as best known."""
        return max(self.in_flight, self.num_requests_running + self.num_requests_waiting)


@dataclass(frozen=True)
class Terms:
    """One candidate's figures in a decision (what ``/debug/route`` shows).

    Attributes:
        candidate: the candidate.
        allowed: under the bound once this request is added.
        prefix, load, waiting, kv: the score's terms, weights applied (the last three are
            subtracted); 0 without prompt tokens.
        score: ``prefix - load - waiting - kv``.
    """

    candidate: Candidate
    allowed: bool
    prefix: float
    load: float
    waiting: float
    kv: float

    @property
    def score(self) -> float:
        return self.prefix - self.load - self.waiting - self.kv

    def describe(self) -> str:
        c = self.candidate
        figures = (
            f"{c.name} in_flight={c.in_flight} running={c.num_requests_running:g} "
            f"waiting={c.num_requests_waiting:g} kv={c.kv_cache_usage_perc:.2f} "
            f"matched={c.matched_tokens} ring={c.ring_rank} "
        )
        if not self.allowed:
            return figures + "over bound"
        return figures + (
            f"score={self.score:.3f} (prefix {self.prefix:.3f} - load {self.load:.3f} "
            f"- waiting {self.waiting:.3f} - kv {self.kv:.3f})"
        )


@dataclass(frozen=True)
class Decision:
    """The chosen replica and why.

    Attributes:
        replica: the chosen candidate's name.
        reason: ``prefix``, ``load``, ``hash``, ``only``, ``round_robin`` or
            ``previous_response`` (see the module docstring).
        matched_tokens: prompt tokens the chosen replica is believed to hold.
        bound: the most load a replica may hold once this request is added.
        terms: every candidate's figures, in the order given.
        prompt_tokens: the prompt's length in tokens, or None (not tokenized).
    """

    replica: str
    reason: str
    matched_tokens: int
    bound: int
    terms: tuple[Terms, ...]
    prompt_tokens: int | None = None

    @property
    def explanation(self) -> str:
        """One line with every candidate's figures, for the debug log."""
        figures = "; ".join(t.describe() for t in self.terms)
        return (
            f"chose {self.replica} ({self.reason}): prompt_tokens={self.prompt_tokens} "
            f"bound={self.bound}: {figures}"
        )


def load_bound(loads: Sequence[float], load_factor: float) -> int:
    """``ceil(load_factor * (sum(loads) + 1) / len(loads))``: the most load a replica may hold
    once the request being routed is added.

    Raises:
        ValueError: no replicas, or ``load_factor`` < 1.
    """
    if not loads:
        raise ValueError("load_bound needs at least one replica")
    if load_factor < 1:
        raise ValueError(f"load_factor must be >= 1, got {load_factor}")
    return math.ceil(load_factor * (sum(loads) + 1) / len(loads))


def choose_replica(
    candidates: Sequence[Candidate],
    prompt_tokens: int | None,
    load_factor: float = DEFAULT_LOAD_FACTOR,
    weights: Weights | None = None,
) -> Decision:
    """Pick a replica for one request (see the module docstring for the rule).

    Args:
        candidates: the replicas that serve the request's model and are up (distinct names).
        prompt_tokens: the prompt's length in tokens, or None when it was not tokenized
            (consistent hashing with bounded loads then).
        load_factor: the bounded-load factor (>= 1).
        weights: the score's weights (default ``Weights()``).

    Returns:
        The decision.

    Raises:
        ValueError: no candidates, or ``load_factor`` < 1.
    """
    if not candidates:
        raise ValueError("choose_replica needs at least one candidate")
    weights = Weights() if weights is None else weights
    bound = load_bound([c.load for c in candidates], load_factor)

    def terms(c: Candidate) -> Terms:
        allowed = c.load + 1 <= bound
        if not prompt_tokens:
            return Terms(c, allowed, 0.0, 0.0, 0.0, 0.0)
        return Terms(
            c,
            allowed,
            weights.prefix * c.matched_tokens / prompt_tokens,
            weights.load * c.load / bound,
            weights.waiting * c.num_requests_waiting / bound,
            weights.kv * c.kv_cache_usage_perc,
        )

    figures = tuple(terms(c) for c in candidates)
    allowed = [t for t in figures if t.allowed]
    if prompt_tokens is None:
        best = min(allowed, key=lambda t: (t.candidate.ring_rank, t.candidate.name)).candidate
        reason = "hash"
    else:
        best = min(
            allowed,
            key=lambda t: (-t.score, t.candidate.load, t.candidate.ring_rank, t.candidate.name),
        ).candidate
        reason = "prefix" if best.matched_tokens > 0 else "load"
    if len(candidates) == 1:
        reason = "only"
    return Decision(best.name, reason, best.matched_tokens, bound, figures, prompt_tokens)
