"""Periodic work per LLMDeployment (the resync reconcile, the autoscaler's tick), without kopf
timers.

kopf's timers and daemons put a finalizer on every object they run for, so that they can be
stopped before it goes: with the operator down or uninstalled, every LLMDeployment being deleted
would then stay ``Terminating`` (and its namespace with it). Here the operator keeps the
LLMDeployments it has seen in kopf's watch events instead (:meth:`Periodic.observe`), and one
background task (:meth:`Periodic.run`) runs each object's jobs when they are due: none of it
needs a finalizer, and a deleted object is simply forgotten.

Each job of an object runs at most once at a time; the next run is due ``interval`` seconds
after the previous one ended (a kopf ``TemporaryError``'s delay instead, when it asks for one).
The first resync comes one interval after the object was first seen (creation and operator
start-up reconcile it anyway); the first autoscaling tick at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import kopf

logger = logging.getLogger("kvpilot.operator.periodic")

Key = tuple[str, str]
"""(namespace, name) of an LLMDeployment."""


@dataclasses.dataclass
class Job:
    """One kind of periodic work.

    Attributes:
        name: for logs (``resync``, ``autoscale``).
        interval: seconds between the end of one run and the start of the next.
        run: the work for one object's body.
        initial_delay: seconds from first sight to the first run.
    """

    name: str
    interval: float
    run: Callable[[dict[str, Any]], Awaitable[Any]]
    initial_delay: float = 0.0


class Periodic:
    """The objects seen and their jobs' next due times (see the module docstring)."""

    def __init__(self, jobs: list[Job], clock: Callable[[], float] = time.monotonic) -> None:
        self.jobs = jobs
        self.clock = clock
        self.bodies: dict[Key, dict[str, Any]] = {}
        self.due: dict[tuple[Key, str], float] = {}
        self.running: dict[tuple[Key, str], asyncio.Task[None]] = {}
        self.forgotten: list[Callable[[Key], None]] = []
        self._wake = asyncio.Event()

    def observe(self, event_type: str | None, body: dict[str, Any]) -> None:
        """Record a watch event: the newest body of an object, or its deletion."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if event_type == "DELETED":
            self.bodies.pop(key, None)
            for job in self.jobs:
                self.due.pop((key, job.name), None)
            for callback in self.forgotten:
                callback(key)
            return
        if key not in self.bodies:
            now = self.clock()
            for job in self.jobs:
                self.due.setdefault((key, job.name), now + job.initial_delay)
            self._wake.set()
        self.bodies[key] = body

    def next_due(self) -> float | None:
        """The earliest time a job that is not running is due, or None."""
        waiting = [t for slot, t in self.due.items() if slot not in self.running]
        return min(waiting) if waiting else None

    async def run(self) -> None:
        """Start due jobs forever (cancel the task to stop)."""
        while True:
            now = self.clock()
            for (key, name), when in list(self.due.items()):
                slot = (key, name)
                if when <= now and slot not in self.running and key in self.bodies:
                    job = next(j for j in self.jobs if j.name == name)
                    self.running[slot] = asyncio.create_task(self._run(job, key))
            upcoming = self.next_due()
            timeout = 1.0 if upcoming is None else max(0.0, min(1.0, upcoming - self.clock()))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    async def _run(self, job: Job, key: Key) -> None:
        delay = job.interval
        try:
            body = self.bodies.get(key)
            if body is not None:
                await job.run(body)
        except kopf.TemporaryError as exc:
            logger.warning("%s/%s: %s: %s", *key, job.name, exc)
            delay = exc.delay if exc.delay is not None else job.interval
        except Exception:  # noqa: BLE001 - one object's failure must not stop the others
            logger.exception("%s/%s: %s failed", *key, job.name)
        finally:
            self.running.pop((key, job.name), None)
            if key in self.bodies:
                self.due[(key, job.name)] = self.clock() + delay
            self._wake.set()

    async def stop(self) -> None:
        """Cancel running jobs and wait for them."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def register(
    registry: kopf.OperatorRegistry, periodic: Periodic, group: str, version: str, plural: str
) -> None:
    """Feed ``periodic`` from kopf's watch of the LLMDeployments and run it with the operator."""

    @kopf.on.event(group, version, plural, registry=registry)
    def seen(body: kopf.Body, type: str | None, **_: Any) -> None:
        periodic.observe(type, dict(body))

    tasks: list[asyncio.Task[None]] = []

    @kopf.on.startup(registry=registry)
    async def start(**_: Any) -> None:
        tasks.append(asyncio.create_task(periodic.run()))

    @kopf.on.cleanup(registry=registry)
    async def stop(**_: Any) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await periodic.stop()
