"""The router's HTTP front: OpenAI's routes, each request routed to one replica and relayed.

``POST /v1/completions`` and ``POST /v1/chat/completions``: the body's ``model`` selects the
replicas that serve it (an unknown one is a 404 in OpenAI's error body, as the engine's); the
prompt is tokenized and hashed (``prompt_hashes``), each replica scored (``scoring``), and the
request relayed (``proxy``). When the connection fails before the first byte the request goes to
the next best replica (each replica tried once); after a byte it never does. Every answer of a
replica, 4xx and 5xx included, comes back as the replica wrote it. A body the router cannot read
(not JSON, no ``model``) is still forwarded, to the least loaded replica, so that the engine
answers it with its own 400.

``GET /v1/models``: the union of the replicas' lists, asked with the client's own credentials
(a replica's refusal, e.g. a 401, comes back unchanged when none accepts). ``GET /health``: 200
while some replica is up and has reported its models. ``GET /metrics``: the router's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvpilot.engine.server.errors import error_response
from kvpilot.router import proxy
from kvpilot.router.config import RouterConfig
from kvpilot.router.consistent_hash import HashRing
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.prompt_hashes import (
    model_root_hash,
    prefix_key,
    prompt_block_hashes,
    prompt_token_ids,
)
from kvpilot.router.replicas import Replica, ReplicaSet
from kvpilot.router.scoring import Candidate, choose_replica

logger = logging.getLogger("kvpilot.router")

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
WAKE_POLL_S = 0.2
"""How often a held request looks for a replica (and renews its wake request)."""


class Router:
    """The routing state of one router process: replicas, client session, tokenizer, metrics.

    Args:
        config: the settings.
        registry: where the router's metrics live.

    Raises:
        ValueError: no endpoint, one given twice, or ``load_factor`` < 1.
    """

    def __init__(self, config: RouterConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.replicas = ReplicaSet(
            config.endpoints, config.down_s, config.api_key, allow_empty=config.kubernetes
        )
        self.ring = HashRing(config.endpoints) if config.endpoints else None
        self.metrics = RouterMetrics(registry)
        self.discovery = None  # a KubernetesDiscovery once started, with --kubernetes
        self.session: aiohttp.ClientSession | None = None
        self.tokenizer = None  # an AsyncTokenizer once started, with --tokenizer

    async def start(self) -> None:
        """Open the client session, load the tokenizer, poll the replicas once."""
        self.session = proxy.make_session(self.config.connect_timeout_s)
        if self.config.tokenizer is not None:
            from kvpilot.engine.model_loader import load_tokenizer
            from kvpilot.engine.server.async_tokenizer import AsyncTokenizer

            try:
                tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer)
                self.tokenizer = AsyncTokenizer(tokenizer)
            except (OSError, ValueError) as exc:
                if not self.config.kubernetes:
                    raise
                # The operator names the model's tokenizer; one it cannot read (a config-only
                # folder, a gated hub model without a token) must not keep the pods' router
                # down: it routes by consistent hashing instead.
                logger.warning(
                    "tokenizer %s not loaded (%s): routing by consistent hashing",
                    self.config.tokenizer,
                    exc,
                )
        if self.config.kubernetes:
            from kvpilot.router.kubernetes import KubernetesDiscovery

            self.discovery = KubernetesDiscovery(
                self.config.namespace, self.config.llmdeployments, self.set_replicas
            )
        await self.refresh()

    async def set_replicas(self, models_by_url: dict[str, set[str]]) -> None:
        """Route to exactly these replicas from now on (discovery's callback), then poll them."""
        self.replicas.replace(models_by_url)
        self.ring = HashRing(list(models_by_url)) if models_by_url else None
        logger.info("replicas: %s", sorted(models_by_url) or "none")
        await self.refresh()

    async def hold_until_served(self, model: str) -> bool:
        """Wake the deployments serving ``model`` (``--kubernetes``) and wait until a replica
        serves it, at most ``wake_timeout_s`` seconds; False when none came."""
        if self.discovery is None or model not in self.discovery.models():
            return False
        deadline = time.monotonic() + self.config.wake_timeout_s
        while model not in self.replicas.known_models():
            if time.monotonic() >= deadline:
                return False
            await self.discovery.request_wake(model)
            await asyncio.sleep(WAKE_POLL_S)
        return True

    async def stop(self) -> None:
        """Close the client session and the tokenizer thread."""
        if self.session is not None:
            await self.session.close()
        if self.tokenizer is not None:
            self.tokenizer.shutdown()

    async def refresh(self) -> None:
        """Poll every replica once and publish which are up."""
        await self.replicas.refresh(self.session)
        for replica in self.replicas.all():
            self.metrics.replica_up.labels(replica.url).set(int(replica.is_up()))

    async def refresh_forever(self) -> None:
        """``refresh`` every ``refresh_s`` seconds (until cancelled)."""
        while True:
            await asyncio.sleep(self.config.refresh_s)
            await self.refresh()

    async def route(self, raw: Request, path: str) -> Response:
        """Answer one ``POST`` of a routed path (see the module docstring)."""
        arrival = time.perf_counter()
        payload = await raw.body()
        body = _json_object(payload)
        model = body.get("model")
        model = model if isinstance(model, str) else None
        if (
            model is not None
            and model not in self.replicas.known_models()
            and not await self.hold_until_served(model)
        ):
            served = self.discovery.models() if self.discovery is not None else set()
            if model in served:
                self.metrics.errors.labels(model, "", "wake_timeout").inc()
                return self._unavailable(model, f"no replica of `{model}` became ready in time")
            kind = "unknown_model" if self.replicas.known_models() | served else "no_replica"
            self.metrics.errors.labels(model, "", kind).inc()
            if kind == "no_replica":
                return self._unavailable(model, "no replica has reported its models yet")
            self.metrics.requests.labels(model, "", "404").inc()
            return error_response(
                HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", param="model"
            )
        token_ids = None
        if self.tokenizer is not None and body:
            token_ids = await self.tokenizer.call(prompt_token_ids, path, body)
        order = self.ring.order(prefix_key(body)) if self.ring is not None else []
        hashes: dict[tuple, list[bytes]] = {}  # (block size, root, adapter) -> the chain

        def chain(replica: Replica) -> list[bytes]:
            if token_ids is None:
                return []
            # The engine's root where it publishes it (then its real hashes match), else the
            # router's own. An adapter's digest is the engine's secret: its chains are keyed on
            # its name, which matches the router's own sends only, never another model's.
            root = replica.root_hash or model_root_hash(model or "")
            lora = (model, None) if replica.root_hash and model in replica.adapters else None
            key = (replica.block_size, root, lora)
            if key not in hashes:
                hashes[key] = prompt_block_hashes(
                    token_ids, replica.block_size, root, body.get("cache_salt"), lora
                )
            return hashes[key]

        tried: set[str] = set()
        label = model or ""
        while True:
            replicas = [r for r in self.replicas.serving(model) if r.url not in tried]
            if not replicas:
                self.metrics.errors.labels(label, "", "no_replica").inc()
                return self._unavailable(label, "no replica could be reached")
            candidates = [
                Candidate(
                    r.url,
                    r.in_flight,
                    r.match(chain(r)) * r.block_size,
                    order.index(r.url),
                )
                for r in replicas
            ]
            decision = choose_replica(
                candidates,
                None if token_ids is None else len(token_ids),
                self.config.load_factor,
                self.config.prefix_weight,
                self.config.load_weight,
            )
            logger.debug("route %s model=%s: %s", path, model, decision.explanation)
            replica = self.replicas.replicas[decision.replica]
            if not tried:
                self.metrics.added_latency.observe(time.perf_counter() - arrival)
            self._count_decision(replica, decision.reason, token_ids, decision.matched_tokens)
            replica.in_flight += 1
            self.metrics.in_flight.labels(replica.url).inc()
            replica.record_sent(chain(replica))
            try:
                upstream = await self._open_or_disconnect(raw, replica, path, payload)
            except proxy.UpstreamUnreachable as exc:
                self._finish(replica, label, None, "connect")
                logger.warning("retrying elsewhere: %s", exc)
                if exc.refused:
                    replica.mark_down(self.config.down_s)
                    self.metrics.replica_up.labels(replica.url).set(0)
                tried.add(replica.url)
                self.metrics.retries.labels(label).inc()
                continue
            if upstream is None:  # the client left before the answer started
                self._finish(replica, label, 499, "disconnect")
                return Response(status_code=499)
            on_done = functools.partial(self._finish, replica, label, upstream.status)
            return proxy.UpstreamResponse(upstream, on_done)

    async def models(self, raw: Request) -> Response:
        """``GET /v1/models``: the union of the replicas' lists."""
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}

        async def ask(replica: Replica) -> tuple[int, bytes] | None:
            try:
                async with self.session.get(f"{replica.url}/v1/models", headers=headers) as r:
                    return r.status, await r.read()
            except (aiohttp.ClientError, TimeoutError):
                return None

        up = [r for r in self.replicas.all() if r.is_up()]
        answers = [a for a in await asyncio.gather(*(ask(r) for r in up)) if a is not None]
        accepted = [json.loads(body) for status, body in answers if status == 200]
        if not accepted:
            if answers:
                status, body = answers[0]
                return Response(body, status_code=status, media_type="application/json")
            return self._unavailable("", "no replica could be reached")
        seen: dict[str, dict[str, Any]] = {}
        for listing in accepted:
            for entry in listing.get("data", []):
                seen.setdefault(entry.get("id"), entry)
        return JSONResponse({"object": "list", "data": list(seen.values())})

    async def _open_or_disconnect(
        self, raw: Request, replica: Replica, path: str, payload: bytes
    ) -> aiohttp.ClientResponse | None:
        """The replica's open response, or None when the client disconnected first (the
        upstream request is then cancelled, which closes its connection)."""
        opening = asyncio.ensure_future(
            proxy.open_upstream(self.session, "POST", replica.url + path, raw.headers, payload)
        )
        watcher = asyncio.ensure_future(proxy.wait_for_disconnect(raw.receive))
        try:
            await asyncio.wait({opening, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if opening.done():
            return opening.result()
        opening.cancel()
        with contextlib.suppress(asyncio.CancelledError, proxy.UpstreamUnreachable):
            await opening
        return None

    def _count_decision(
        self, replica: Replica, reason: str, token_ids: list[int] | None, matched: int
    ) -> None:
        self.metrics.decisions.labels(reason).inc()
        if token_ids is not None:
            self.metrics.prompt_tokens.labels(replica.url).inc(len(token_ids))
            self.metrics.matched_tokens.labels(replica.url).inc(matched)

    def _finish(self, replica: Replica, model: str, status: int | None, outcome: str) -> None:
        """Account for the end of one forwarding attempt."""
        replica.in_flight -= 1
        self.metrics.in_flight.labels(replica.url).dec()
        if status is not None:
            self.metrics.requests.labels(model, replica.url, str(status)).inc()
        if outcome in ("connect", "stream"):
            self.metrics.errors.labels(model, replica.url, outcome).inc()

    def _unavailable(self, model: str, why: str) -> Response:
        self.metrics.requests.labels(model, "", "503").inc()
        return error_response(
            HTTPStatus.SERVICE_UNAVAILABLE, f"{why}; retry later", headers={"Retry-After": "1"}
        )


def _json_object(payload: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``{}`` when it is none (the engine will say why)."""
    try:
        body = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


def create_app(config: RouterConfig, registry: CollectorRegistry | None = None) -> FastAPI:
    """The router's FastAPI app; its lifespan starts and stops the ``Router``.

    Raises:
        ValueError: from ``Router``.
    """
    registry = registry if registry is not None else CollectorRegistry()
    router = Router(config, registry)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        tasks = [asyncio.create_task(router.refresh_forever())]
        if router.discovery is not None:
            tasks.append(asyncio.create_task(router.discovery.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await router.stop()

    app = FastAPI(title="kvpilot router", lifespan=lifespan)
    app.state.router = router

    def routed(path: str):
        async def handler(raw: Request) -> Response:
            return await router.route(raw, path)

        return handler

    for path in ROUTED_PATHS:
        app.add_api_route(path, routed(path), methods=["POST"])

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await router.models(raw)

    @app.get("/health")
    async def health() -> Response:
        replicas = {r.url: r.is_up() for r in router.replicas.all()}
        ready = any(replicas.values()) and bool(router.replicas.known_models())
        return JSONResponse({"replicas": replicas}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
