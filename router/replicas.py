"""The engine replicas behind the router and what it knows of each: the models it serves, its
context length, block size and KV capacity, its engine's own load, its in-flight requests,
whether it is up, and what its prefix cache holds.

The set of replicas is a list of URLs: fixed in local mode (``--endpoint``), replaced by
discovery (``ReplicaSet.set_urls``: e.g. the Ready pods of an ``LLMDeployment``). A replica
that leaves the set gets no new request; those already sent to it finish on it.

Every poll (``refresh``, every ``--refresh-interval`` seconds) reads ``/metrics`` (block size,
KV capacity, ``vllm:num_requests_running``/``waiting``, ``vllm:kv_cache_usage_perc``),
``/v1/models`` (served names, adapters, ``max_model_len``) and ``/kv_events?since=N``: a replica
that publishes its KV events gets an ``EventIndex`` (its engine's real cached hashes and root
hash); one that does not (a 404) keeps the router's guess, its ``PrefixIndex``. A replica that refuses connections is marked down for ``down_s`` seconds
and routed around; a poll that reaches it again brings it back, and its events are read again
from the start (a restarted engine begins a new log).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.router.consistent_hash import HashRing
from kvpilot.router.prefix_index import EventIndex, PrefixIndex

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
"""The engine's default ``--block-size``, until a replica's ``vllm:cache_config_info`` says."""

ENGINE_LOAD_GAUGES = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
}
"""The engine's gauges the score reads (summed over its served models) -> ``Replica`` field."""


@dataclass
class Replica:
    """One engine replica.

    Attributes:
        url: its base address (``http://host:port``, no trailing slash).
        models: model names it serves (base model and LoRA adapters); empty until polled.
        block_size: its KV block size in tokens.
        in_flight: requests the router has sent and not finished.
        down_until: ``time.monotonic()`` before which it is routed around.
        adapters: the served names that are LoRA adapters (a ``parent`` in ``/v1/models``).
        index: the block hashes the router has sent there (its guess).
        events: the engine's cached hashes from its KV events; None until it publishes them.
        max_model_len: its context (tokens) from ``/v1/models``; None until polled.
        num_requests_running, num_requests_waiting, kv_cache_usage_perc: its engine's gauges
            at the last poll (``ENGINE_LOAD_GAUGES``).
        polled: a poll has read its models at least once.
    """

    url: str
    models: set[str] = field(default_factory=set)
    block_size: int = DEFAULT_BLOCK_SIZE
    in_flight: int = 0
    down_until: float = 0.0
    index: PrefixIndex = field(default_factory=PrefixIndex)
    adapters: set[str] = field(default_factory=set)
    events: EventIndex | None = None
    max_model_len: int | None = None
    num_requests_running: float = 0.0
    num_requests_waiting: float = 0.0
    kv_cache_usage_perc: float = 0.0
    polled: bool = False

    def is_ready(self, model: str | None = None) -> bool:
        """Up, polled, and serving ``model`` (any model for None)."""
        return self.is_up() and self.polled and (model is None or model in self.models)

    @property
    def root_hash(self) -> bytes | None:
        """The engine's root hash, once it publishes its KV events."""
        return None if self.events is None else self.events.root_hash

    def match(self, hashes: list[bytes]) -> int:
        """Leading blocks of a chain it holds: its engine's events where it publishes them,
        else the router's guess (blocks, not tokens)."""
        return (self.index if self.events is None else self.events).match(hashes)

    def record_sent(self, hashes: list[bytes]) -> None:
        """Note a chain just sent there (both indexes: the guess is the fallback)."""
        self.index.insert(hashes)
        if self.events is not None:
            self.events.insert(hashes)

    def apply_kv_events(self, answer: dict) -> None:
        """Apply one ``/kv_events`` answer; a new root hash (another model or a restarted
        engine) starts a new index."""
        root_hash = bytes.fromhex(answer["root_hash"])
        if self.events is None or self.events.root_hash != root_hash:
            self.events = EventIndex(root_hash)
        self.block_size = int(answer["block_size"])
        self.events.apply(answer)

    def is_up(self, now: float | None = None) -> bool:
        """False while it is marked down."""
        return (time.monotonic() if now is None else now) >= self.down_until

    def mark_down(self, down_s: float) -> None:
        """Route around it for ``down_s`` seconds."""
        if self.is_up():
            logger.warning("replica %s is down; routing around it for %.0f s", self.url, down_s)
        self.down_until = time.monotonic() + down_s

    def apply_metrics(self, text: str) -> set[str]:
        """Read the block size, KV capacity and engine load from its ``/metrics`` text; return
        the served model names found in its labels."""
        models = set()
        load = dict.fromkeys(ENGINE_LOAD_GAUGES.values(), 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ENGINE_LOAD_GAUGES:
                    load[ENGINE_LOAD_GAUGES[sample.name]] += sample.value
                if "model_name" in sample.labels:
                    models.add(sample.labels["model_name"])
                if sample.name == "vllm:cache_config_info" and "block_size" in sample.labels:
                    self.block_size = int(sample.labels["block_size"])
                if sample.name == "kvpilot:kv_cache_capacity_tokens" and sample.value > 0:
                    self.index.resize(max(1, int(sample.value) // self.block_size))
        for name, value in load.items():
            setattr(self, name, value)
        return models


class ReplicaSet:
    """The replicas, in the order given.

    Args:
        urls: base addresses (none is allowed: discovery adds them with ``set_urls``).
        down_s: how long a replica that refused a connection is routed around.
        api_key: the key the router's own polls of ``/v1/models`` send (adapter names); without
            one, or when refused, the served model comes from ``/metrics`` only.

    Attributes:
        replicas: ``{url: Replica}``, in the order given.
        ring: the consistent-hash ring over the URLs (None while there are none).

    Raises:
        ValueError: a URL given twice.
    """

    def __init__(
        self, urls: list[str] | None = None, down_s: float = 10.0, api_key: str | None = None
    ) -> None:
        self.replicas: dict[str, Replica] = {}
        self.ring: HashRing | None = None
        self.down_s = down_s
        self.api_key = api_key
        self._changed = asyncio.Event()
        self.set_urls(urls or [])

    def set_urls(self, urls: list[str]) -> None:
        """Make the set exactly ``urls`` (discovery calls this with the Ready replicas).

        Replicas that stay keep what the router knows of them; new ones are polled at the next
        refresh (``refresh`` at once to route to them sooner); removed ones get no new request,
        and the requests already relayed from them finish. Call from the router's event loop.

        Raises:
            ValueError: a URL given twice.
        """
        urls = [url.rstrip("/") for url in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica URL is given twice: {urls}")
        self.replicas = {url: self.replicas.get(url) or Replica(url) for url in urls}
        self.ring = HashRing(urls) if urls else None
        self._notify()

    def replace(self, models_by_url: dict[str, set[str]]) -> None:
        """:meth:`set_urls` for discovered replicas whose model names are known before their
        first poll (Kubernetes discovery reads them from the LLMDeployment); a replica that
        stays keeps what its polls found."""
        new = {url.rstrip("/"): models for url, models in models_by_url.items()}
        fresh = new.keys() - self.replicas.keys()
        self.set_urls(list(new))
        for url in fresh:
            self.replicas[url].models = set(new[url])

    def all(self) -> list[Replica]:
        """Every replica, up or down."""
        return list(self.replicas.values())

    def known_models(self) -> set[str]:
        """The union of the models the replicas have reported."""
        return {model for replica in self.replicas.values() for model in replica.models}

    def serving(self, model: str | None) -> list[Replica]:
        """The replicas to route a request for ``model`` to: those that serve it (every
        replica for None) and are up; when all of those are down, all of them (a down mark
        is a guess, and trying beats refusing)."""
        serving = [r for r in self.replicas.values() if model is None or model in r.models]
        up = [r for r in serving if r.is_up()]
        return up or serving

    def ready(self, model: str | None) -> list[Replica]:
        """The replicas up, polled and serving ``model`` (see ``Replica.is_ready``)."""
        return [r for r in self.replicas.values() if r.is_ready(model)]

    def max_model_len(self, model: str | None) -> int | None:
        """The shortest context among the replicas serving ``model`` (a prompt longer than it
        is refused by one of them at least); None while none has said."""
        lengths = [r.max_model_len for r in self.serving(model) if r.max_model_len]
        return min(lengths) if lengths else None

    async def wait_changed(self, timeout_s: float) -> None:
        """Return after the next ``set_urls`` or ``refresh``, or after ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        """Poll every replica's ``/metrics``, ``/v1/models`` and ``/kv_events`` once,
        concurrently."""
        await asyncio.gather(*(self._poll(session, r) for r in self.replicas.values()))
        self._notify()

    async def _poll(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        models: set[str] = set()
        adapters: set[str] = set()
        try:
            async with session.get(f"{replica.url}/metrics") as response:
                if response.status == 200:
                    models |= replica.apply_metrics(await response.text())
            async with session.get(f"{replica.url}/v1/models", headers=headers) as response:
                if response.status == 200:
                    body = await response.json()
                    data = [m for m in body.get("data", []) if "id" in m]
                    models |= {m["id"] for m in data}
                    adapters = {m["id"] for m in data if m.get("parent")}
                    lengths = [m["max_model_len"] for m in data if m.get("max_model_len")]
                    replica.max_model_len = min(lengths) if lengths else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if isinstance(exc, aiohttp.ClientConnectionError | TimeoutError):
                replica.mark_down(self.down_s)
            logger.debug("poll of %s failed: %s", replica.url, exc)
            return
        if not replica.is_up():
            logger.info("replica %s is back", replica.url)
            replica.events = None
        replica.down_until = 0.0
        replica.models = models
        replica.adapters = adapters
        replica.polled = True
        await self._poll_kv_events(session, replica, headers)

    async def _poll_kv_events(
        self, session: aiohttp.ClientSession, replica: Replica, headers: dict[str, str]
    ) -> None:
        since = 0 if replica.events is None else replica.events.next_seq
        url = f"{replica.url}/kv_events"
        try:
            async with session.get(url, params={"since": since}, headers=headers) as response:
                if response.status == 404:  # an engine without KV events: keep the guess
                    replica.events = None
                elif response.status == 200:
                    replica.apply_kv_events(await response.json())
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            logger.debug("KV events of %s not read: %s", replica.url, exc)
