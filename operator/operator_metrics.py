"""The operator's own Prometheus metrics: how often it reconciles, how often that fails, how long.

Kept in a registry of their own (not prometheus_client's global one), so the operator's
``/metrics`` shows exactly these series plus the process collectors, and tests can build a
fresh registry per operator instance.

Series (names follow Prometheus conventions: ``_total`` counters, ``_seconds`` histograms):

- ``kvpilot_operator_reconciles_total{trigger, result}``: finished reconciles. ``trigger`` is
  what started it (``create``, ``update``, ``resume``, ``timer``, ``child``); ``result`` is
  ``changed`` (something was written), ``unchanged`` (nothing to do), or ``error``.
- ``kvpilot_operator_reconcile_errors_total{trigger, reason}``: failed reconciles by cause
  (``InvalidSpec``, ``PlanFailed``, ``ApiError``, ``Transient``, ``OwnershipConflict``, ...).
- ``kvpilot_operator_reconcile_duration_seconds{trigger}``: wall time of each reconcile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

# From 5 ms (nothing to patch) to 30 s (a slow API server, a hub config fetch).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass
class ReconcileOutcome:
    """What a reconcile reports back to :meth:`OperatorMetrics.track` before it ends."""

    changed: bool = False
    error_reason: str | None = None


class OperatorMetrics:
    """The operator's counters and histogram in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "kvpilot_operator_reconciles",
            "Reconciles of LLMDeployments that finished, by trigger and result.",
            ["trigger", "result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvpilot_operator_reconcile_errors",
            "Reconciles that failed, by trigger and reason.",
            ["trigger", "reason"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvpilot_operator_reconcile_duration_seconds",
            "Wall time of one reconcile, seconds.",
            ["trigger"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )

    @contextlib.contextmanager
    def track(self, trigger: str) -> Iterator[ReconcileOutcome]:
        """Time one reconcile and count its result.

        The block sets ``outcome.changed`` or ``outcome.error_reason``; an exception escaping
        the block counts as an error with the exception's class name as reason (and is
        re-raised).
        """
        outcome = ReconcileOutcome()
        start = time.perf_counter()
        try:
            yield outcome
        except Exception as exc:
            outcome.error_reason = outcome.error_reason or type(exc).__name__
            raise
        finally:
            self.duration.labels(trigger).observe(time.perf_counter() - start)
            if outcome.error_reason is not None:
                self.errors.labels(trigger, outcome.error_reason).inc()
                result = "error"
            else:
                result = "changed" if outcome.changed else "unchanged"
            self.reconciles.labels(trigger, result).inc()

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread."""
        prometheus_client.start_http_server(port, addr=host, registry=self.registry)
