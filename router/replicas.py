"""The engine replicas behind the router (local mode: a fixed list of URLs) and what it knows of
each: the models it serves, its block size and KV capacity, its in-flight requests, whether it
is up, and what its prefix cache holds.

Every poll (``refresh``, every ``--refresh-interval`` seconds) reads ``/metrics``, ``/v1/models``
and ``/kv_events?since=N``: a replica that publishes its KV events gets an ``EventIndex`` (its
engine's real cached hashes and root hash); one that does not (a 404) keeps the router's guess,
its ``PrefixIndex``. A replica that refuses connections is marked down for ``down_s`` seconds
and routed around; a poll that reaches it again brings it back, and its events are read again
from the start (a restarted engine begins a new log).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.router.prefix_index import EventIndex, PrefixIndex

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
"""The engine's default ``--block-size``, until a replica's ``vllm:cache_config_info`` says."""


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
    """

    url: str
    models: set[str] = field(default_factory=set)
    block_size: int = DEFAULT_BLOCK_SIZE
    in_flight: int = 0
    down_until: float = 0.0
    index: PrefixIndex = field(default_factory=PrefixIndex)
    adapters: set[str] = field(default_factory=set)
    events: EventIndex | None = None

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
        """Read the block size and KV capacity from its ``/metrics`` text; return the served
        model names found in its labels."""
        models = set()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if "model_name" in sample.labels:
                    models.add(sample.labels["model_name"])
                if sample.name == "vllm:cache_config_info" and "block_size" in sample.labels:
                    self.block_size = int(sample.labels["block_size"])
                if sample.name == "kvpilot:kv_cache_capacity_tokens" and sample.value > 0:
                    self.index.resize(max(1, int(sample.value) // self.block_size))
        return models


class ReplicaSet:
    """The replicas, in the order given.

    Args:
        urls: base addresses (at least one).
        down_s: how long a replica that refused a connection is routed around.
        api_key: the key the router's own polls of ``/v1/models`` send (adapter names); without
            one, or when refused, the served model comes from ``/metrics`` only.
        allow_empty: accept no URLs (discovered replicas: a deployment may be at zero).

    Raises:
        ValueError: no URLs (unless ``allow_empty``), or one given twice.
    """

    def __init__(
        self,
        urls: list[str],
        down_s: float = 10.0,
        api_key: str | None = None,
        *,
        allow_empty: bool = False,
    ) -> None:
        urls = [url.rstrip("/") for url in urls]
        if not urls and not allow_empty:
            raise ValueError("the router needs at least one --endpoint")
        if len(set(urls)) != len(urls):
            raise ValueError(f"an --endpoint is given twice: {urls}")
        self.replicas = {url: Replica(url) for url in urls}
        self.down_s = down_s
        self.api_key = api_key

    def replace(self, models_by_url: dict[str, set[str]]) -> None:
        """Make the replicas exactly these URLs (discovery: pods became Ready or went).

        A replica that stays keeps its state (in-flight count, prefix index, KV events); a new
        one starts with the given model names, known before its first poll; one that goes is
        forgotten, while requests already relayed to it keep their own reference and finish.
        """
        replicas = {}
        for url, models in models_by_url.items():
            url = url.rstrip("/")
            replica = self.replicas.get(url) or Replica(url, models=set(models))
            replicas[url] = replica
        self.replicas = replicas

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

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        """Poll every replica's ``/metrics``, ``/v1/models`` and ``/kv_events`` once,
        concurrently."""
        await asyncio.gather(*(self._poll(session, r) for r in self.replicas.values()))

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
