"""Wake from zero, the router's side: the hook it calls when a request names a model that no
ready replica serves.

The router (``app.py``) asks the hook whether it can wake the model (``can_wake``): a model of
a deployment scaled to zero can be, an unknown name cannot (that is a 404). If it can, the
router calls ``request_wake`` once per episode (when the first request for that model is held;
again only after every held request for it was answered), holds the requests until a replica
serving the model is ready (``ReplicaSet.ready``), bounded by ``--wake-timeout``, then forwards
them; past the timeout they get a 503 with ``Retry-After``. While requests are held the router
also reports how many (``report_held``, every ``--wake-poll-interval`` seconds and once with 0 when the
last one is answered): that is demand the autoscaler counts, so a wake starts enough replicas
for the requests waiting, and a deployment is not scaled back to zero while any waits. The
held requests are also the gauge ``kvpilot:router_held_requests{model}``.

In Kubernetes the hook records the wake request and the held count on the ``LLMDeployment``
(the autoscaler's ``kvpilot.dev/wake`` and ``kvpilot.dev/held-requests`` annotations), and
discovery adds the new pod once it is Ready. Here:
``NoWake`` (the default: nothing can be woken) and ``LocalWakeStandIn``, a stand-in for tests
and local use that records each wake request and runs a callback (e.g. one that starts an
engine process and adds its URL).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)


@runtime_checkable
class WakeHook(Protocol):
    """What the router needs from a wake mechanism."""

    def can_wake(self, model: str) -> bool:
        """Whether ``model`` (a served model or adapter name) belongs to a deployment this
        hook can scale up from zero."""
        ...

    async def request_wake(self, model: str) -> None:
        """Ask for a replica serving ``model``; return once the request is recorded (not when
        the replica is ready). Errors propagate: the router logs and counts them and keeps
        holding until its timeout (another router, or a retry, may still wake it)."""
        ...

    async def report_held(self, model: str, held: int) -> None:
        """Report the number of requests (``held`` >= 0) held for ``model`` now: demand for
        the autoscaler. Called every ``wake_poll_s`` seconds while any is held, and once with
        0 after the last one was answered (or let go). Errors propagate, as for
        ``request_wake``; the router logs them and reports again at its next poll."""
        ...


class NoWake:
    """The default hook: no model can be woken (a model no replica serves is a 404, or a 503
    while no replica has reported its models)."""

    def can_wake(self, model: str) -> bool:
        return False

    async def request_wake(self, model: str) -> None:
        raise RuntimeError(f"no wake hook is configured; cannot wake {model!r}")

    async def report_held(self, model: str, held: int) -> None:
        return None


class LocalWakeStandIn:
    """A stand-in for the Kubernetes wake hook (tests and local use): it can wake the models
    given, records every wake request in ``requested``, and runs ``on_wake(model)`` (a plain or
    async function) for each, e.g. to start an engine and ``ReplicaSet.set_urls`` it. Held
    counts are recorded as reported, ``(model, held)``, in ``held_reports``.

    Args:
        models: the names it can wake.
        on_wake: what a wake request does; None: only record it.
    """

    def __init__(
        self,
        models: Iterable[str],
        on_wake: Callable[[str], Awaitable[None] | None] | None = None,
    ) -> None:
        self.models = set(models)
        self.on_wake = on_wake
        self.requested: list[str] = []
        self.held_reports: list[tuple[str, int]] = []

    def can_wake(self, model: str) -> bool:
        return model in self.models

    async def request_wake(self, model: str) -> None:
        self.requested.append(model)
        logger.info("wake requested for %s (local stand-in)", model)
        if self.on_wake is not None:
            result = self.on_wake(model)
            if inspect.isawaitable(result):
                await result

    async def report_held(self, model: str, held: int) -> None:
        self.held_reports.append((model, held))
