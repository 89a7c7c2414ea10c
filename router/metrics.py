"""The router's Prometheus metrics, in a registry of its own (``/metrics`` of the router).

- ``kvpilot:router_requests_total{model, replica, status}``: answers forwarded (the replica's
  HTTP status), and the router's own answers (``replica=""``: 404 unknown model, 503 none
  reachable);
- ``kvpilot:router_errors_total{model, replica, kind}``: ``connect`` (refused or failed before
  the first byte; retried elsewhere), ``stream`` (the replica broke off after bytes were sent;
  never retried), ``unknown_model``, ``no_replica``, ``wake_timeout`` (held past
  ``--wake-timeout``), ``wake`` (the wake hook failed);
- ``kvpilot:router_routing_decisions_total{reason}``: ``prefix``, ``load``, ``hash``, ``only``
  (see ``scoring.py``), ``round_robin``;
- ``kvpilot:router_prompt_tokens_total{replica}`` and
  ``kvpilot:router_prefix_matched_tokens_total{replica}``: tokens of routed prompts, and those
  the router expected the replica to hold (their ratio is the expected hit rate);
- ``kvpilot:router_retries_total{model}``: requests sent again to another replica;
- ``kvpilot:router_added_latency_seconds``: time from the request's arrival to its forwarding
  (reading the body, tokenizing, scoring; time held for a wake left out): what the router adds
  before the replica starts;
- ``kvpilot:router_held_requests{model}``: requests held for a model without a ready replica
  while it wakes (``wake.py``): demand that no engine sees yet, for the autoscaler;
- ``kvpilot:router_wake_requests_total{model, outcome}``: calls of the wake hook (``ok``,
  ``error``);
- ``kvpilot:router_in_flight_requests{replica}`` and ``kvpilot:router_replica_up{replica}``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)


# attribute -> (metric name, help, labels); "kvpilot:router_" is prefixed, Counters get "_total".
_COUNTERS = {
    "requests": ("requests", "Requests answered, by model, replica and HTTP status.",
                 ("model", "replica", "status")),
    "errors": ("errors", "Routing and forwarding failures, by model, replica and kind.",
               ("model", "replica", "kind")),
    "decisions": ("routing_decisions", "Routing decisions, by reason.", ("reason",)),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens routed, by replica.", ("replica",)),
    "matched_tokens": ("prefix_matched_tokens",
                       "Prompt tokens the chosen replica was expected to hold in its prefix cache.",
                       ("replica",)),
    "retries": ("retries", "Requests sent again to another replica after a failed connection.",
                ("model",)),
    "wake_requests": ("wake_requests", "Calls of the wake hook, by model and outcome.",
                      ("model", "outcome")),
}  # fmt: skip
_GAUGES = {
    "in_flight": ("in_flight_requests", "Requests forwarded and not finished, by replica.",
                  ("replica",)),
    "replica_up": ("replica_up", "1 while the replica is routed to, 0 while it is marked down.",
                   ("replica",)),
    "held": ("held_requests", "Requests held until a replica of their model is ready, by model.",
             ("model",)),
}  # fmt: skip


class RouterMetrics:
    """The router's metric objects, registered in ``registry``: one attribute per key of
    ``_COUNTERS`` and ``_GAUGES``, and ``added_latency``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        for attribute, (name, text, labels) in _COUNTERS.items():
            counter = Counter(f"kvpilot:router_{name}", text, labels, registry=registry)
            setattr(self, attribute, counter)
        for attribute, (name, text, labels) in _GAUGES.items():
            gauge = Gauge(f"kvpilot:router_{name}", text, labels, registry=registry)
            setattr(self, attribute, gauge)
        self.added_latency = Histogram(
            "kvpilot:router_added_latency_seconds",
            "Seconds from a request's arrival (or the end of its hold) to its forwarding.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
