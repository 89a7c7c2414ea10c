"""The router's HTTP front: OpenAI's routes, each request routed to one replica and relayed.

``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``, Anthropic's
``POST /v1/messages`` (these two rendered as the chat conversation the engine makes of them) and
vLLM's ``POST /invocations`` (read as a chat when its body has ``messages``, else as a
completion, as the engine reads it): the body's ``model`` selects the replicas that serve it
(served model names and LoRA adapter names, as each replica lists them in ``/v1/models``). A model
no replica serves is held while the wake hook (``wake.py``) wakes it, or a 404 in OpenAI's error
body when the hook cannot. The prompt is tokenized on the tokenizer's
thread and hashed (``prompt_hashes``), unless it is longer than the replicas' context allows
(``tokenization.max_prompt_chars`` of their ``max_model_len``: the engine will refuse it; the
router refuses nothing and pays nothing for it, and routes it by consistent hashing); each
replica is scored (``scoring``) and the request relayed (``proxy``). When the connection fails
before the first byte the request goes to the next best replica (each replica tried once); after
a byte it never does. Every answer of a replica, 4xx and 5xx included, comes back as the replica
wrote it. A body the router cannot read (not JSON, no ``model``) is still forwarded, to the
least loaded replica, so that the engine answers it with its own 400.

A response is stored on the replica that answered it (``--enable-responses-store``), so the
router remembers each response's replica (the newest ``RESPONSE_AFFINITY_SIZE``; the id is the
client's ``X-Request-Id`` or ``request_id``, else one the router sends as ``X-Request-Id``): a
request with ``previous_response_id`` goes to that replica while it is up, and
``GET``/``DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` are relayed to it
(404 for an id the router does not know).

``POST /tokenize`` and ``POST /detokenize`` (vLLM's): routed as above by their ``model``, but
never tokenized or recorded as a prompt a replica has cached (nothing is generated from them),
so the choice is by load and the body's consistent hash alone.

``POST /debug/route``: the same body as a completions or chat request (chat when it has
``messages``); answers the decision the router would take now, with every replica's score terms,
and forwards nothing; a body the engine refuses (not JSON, not an object, a parameter of the
wrong type or out of range) gets the 400 the engine answers for it, as the routed paths do.
``GET /v1/models``: the union of the replicas' lists, asked with the client's own credentials
(a replica's refusal, e.g. a 401, comes back unchanged when none accepts). ``GET /health``: 200
while some replica is up and has reported its models. ``GET /metrics``: the router's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvpilot.engine.server import invocations
from kvpilot.engine.server.errors import OpenAIError, error_response, read_body
from kvpilot.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.engine.server.responses_protocol import ResponsesRequest
from kvpilot.engine.tokenization import max_prompt_chars
from kvpilot.router import proxy
from kvpilot.router.config import RouterConfig
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.prompt_hashes import (
    CHAT_PATH,
    MESSAGES_PATH,
    RESPONSES_PATH,
    messages_chat_body,
    model_root_hash,
    prefix_key,
    prompt_block_hashes,
    prompt_chars,
    prompt_token_ids,
    responses_chat_body,
)
from kvpilot.router.replicas import Replica, ReplicaSet
from kvpilot.router.scoring import Candidate, Decision, choose_replica
from kvpilot.router.wake import NoWake, WakeHook

logger = logging.getLogger("kvpilot.router")

ROUTED_PATHS = ("/v1/completions", CHAT_PATH, RESPONSES_PATH, MESSAGES_PATH, invocations.PATH)
CHAT_VIEWS = {RESPONSES_PATH: responses_chat_body, MESSAGES_PATH: messages_chat_body}
"""Paths whose bodies are planned as the chat body the engine renders from them."""
TOKENIZER_PATHS = ("/tokenize", "/detokenize")
"""Routed by model and load; their bodies are not prompts (nothing is cached from them)."""
FALLBACK_MAX_MODEL_LEN = 32768
"""The context (tokens) that bounds what the router tokenizes while no replica serving the
model has reported its ``max_model_len`` (e.g. its ``/v1/models`` refused the router's key)."""
RESPONSE_AFFINITY_SIZE = 65536
"""Response ids the router remembers the replica of (the newest), for ``previous_response_id``
and ``/v1/responses/{id}``."""
WAKE_RETRY_AFTER_S = 10
"""``Retry-After`` (seconds) of the 503 for a request held past ``--wake-timeout``."""


@dataclass
class Plan:
    """What the router knows of one request before choosing a replica.

    Attributes:
        path: the routed path (``ROUTED_PATHS``, ``TOKENIZER_PATHS``).
        body: the body as a JSON object (``{}`` when it is none).
        model: the body's ``model`` when it is a string.
        token_ids: the prompt's token ids, or None (see ``untokenized``).
        untokenized: why there are no token ids: ``no tokenizer``, ``policy``, ``too long``,
            ``not a prompt``; None when there are.
        key: the consistent-hash key (``prompt_hashes.prefix_key``).
        chains: the prompt's block hashes by (block size, root hash, adapter), as computed.
        pinned: the replica that must answer it (it holds the response a
            ``previous_response_id`` continues), or None.
    """

    path: str
    body: dict[str, Any]
    model: str | None
    token_ids: list[int] | None
    untokenized: str | None
    key: bytes
    chains: dict[tuple, list[bytes]] | None = None
    pinned: str | None = None


class Router:
    """The routing state of one router process: replicas, client session, tokenizer, metrics.

    Args:
        config: the settings.
        registry: where the router's metrics live.
        wake: what wakes a model no ready replica serves (``wake.py``); default ``NoWake``.

    Raises:
        ValueError: a replica URL given twice.
    """

    def __init__(
        self, config: RouterConfig, registry: CollectorRegistry, wake: WakeHook | None = None
    ) -> None:
        self.config = config
        self.replicas = ReplicaSet(config.endpoints, config.down_s, config.api_key)
        self.metrics = RouterMetrics(registry)
        self.wake: WakeHook = NoWake() if wake is None else wake
        self.discovery = None  # a KubernetesDiscovery once started, with --kubernetes
        self.session: aiohttp.ClientSession | None = None
        self.tokenizer = None  # an AsyncTokenizer once started, with --tokenizer
        self._max_chars: dict[int, int] = {}  # max_model_len -> tokenization.max_prompt_chars
        self._next_round_robin = 0
        self._held: dict[str, int] = {}  # model -> requests held for it
        self._held_to_report: dict[str, int] = {}  # model -> count to report next
        self._reporters: dict[str, asyncio.Future] = {}  # model -> the task reporting it
        self._poll_soon = asyncio.Event()
        self._published: set[str] = set()  # replicas with a replica_up series
        self._responses: OrderedDict[str, str] = OrderedDict()  # response id -> replica URL

    async def start(self) -> None:
        """Open the client session, load the tokenizer, poll the replicas once."""
        self.session = proxy.make_session(self.config.connect_timeout_s)
        if self.config.tokenizer is not None and self.config.routing_policy == "kvpilot":
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
            if isinstance(self.wake, NoWake):
                self.wake = self.discovery  # it wakes LLMDeployments at zero replicas
        await self.refresh()

    async def set_replicas(self, models_by_url: dict[str, set[str]]) -> None:
        """Route to exactly these replicas from now on (discovery's callback), then poll them."""
        self.replicas.replace(models_by_url)
        logger.info("replicas: %s", sorted(models_by_url) or "none")
        await self.refresh()

    async def stop(self) -> None:
        """Close the client session and the tokenizer thread."""
        if self.session is not None:
            await self.session.close()
        if self.tokenizer is not None:
            self.tokenizer.shutdown()

    async def refresh(self) -> None:
        """Poll every replica once and publish which are up (replicas that left the set lose
        their ``replica_up`` series)."""
        await self.replicas.refresh(self.session)
        for url in self._published - self.replicas.replicas.keys():
            self.metrics.replica_up.remove(url)
        self._published = set(self.replicas.replicas)
        for replica in self.replicas.all():
            self.metrics.replica_up.labels(replica.url).set(int(replica.is_up()))

    async def refresh_forever(self) -> None:
        """``refresh`` every ``refresh_s`` seconds, every ``wake_poll_s`` while requests are
        held (until cancelled)."""
        while True:
            interval = self.config.wake_poll_s if self._held else self.config.refresh_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poll_soon.wait(), interval)
            self._poll_soon.clear()
            for model, held in self._held.items():
                self._report_held(model, held)
            try:
                await self.refresh()
            except Exception:  # a failed poll must not end polling for good
                logger.exception("polling the replicas failed")

    async def plan(self, path: str, body: dict[str, Any]) -> Plan:
        """Read the model and the prompt's token ids (on the tokenizer's thread, and only when
        the prompt can fit the replicas' context: ``tokenization.max_prompt_chars``)."""
        model = _requested_model(body)
        # A Responses API body is rendered as the chat body the engine makes of it.
        prompt_path, view, previous, pinned = path, body, None, None
        if path == invocations.PATH:  # a chat or a completion, as the engine reads it
            prompt_path = CHAT_PATH if invocations.is_chat(body) else ROUTED_PATHS[0]
        if path in CHAT_VIEWS:
            prompt_path, view = CHAT_PATH, CHAT_VIEWS[path](body) or {}
        if path == RESPONSES_PATH:
            previous = body.get("previous_response_id")
            if isinstance(previous, str):
                pinned = self._responses.get(previous)
        plan = Plan(path, body, model, None, None, prefix_key(view or body), {}, pinned)
        if self.config.routing_policy != "kvpilot":
            plan.untokenized = "policy"
        elif self.tokenizer is None:
            plan.untokenized = "no tokenizer"
        elif not view or path in TOKENIZER_PATHS:
            plan.untokenized = "not a prompt"
        else:
            max_chars = await self._max_prompt_chars(model)
            if prompt_chars(prompt_path, view) > max_chars:
                plan.untokenized = "too long"
            else:
                plan.token_ids = await self.tokenizer.call(
                    prompt_token_ids, prompt_path, view, max_chars
                )
                plan.untokenized = None if plan.token_ids is not None else "not a prompt"
        return plan

    def decide(self, plan: Plan, tried: set[str], advance: bool = True) -> Decision | None:
        """The replica for ``plan`` among those that serve its model, are up and were not
        tried (``scoring.choose_replica``; the next in turn for ``round-robin``); None when
        there is none. ``advance``: move the round-robin turn on."""
        replicas = [r for r in self.replicas.serving(plan.model) if r.url not in tried]
        if not replicas:
            return None
        pinned = next((r for r in replicas if r.url == plan.pinned), None)
        if pinned is not None:  # the replica that stored the previous response
            return Decision(pinned.url, "previous_response", 0, pinned.in_flight + 1, ())
        order = self.replicas.ring.order(plan.key)
        candidates = [
            Candidate(
                r.url,
                r.in_flight,
                r.match(self._chain(plan, r)) * r.block_size,
                order.index(r.url),
                r.num_requests_running,
                r.num_requests_waiting,
                r.kv_cache_usage_perc,
            )
            for r in replicas
        ]
        decision = choose_replica(
            candidates,
            None if plan.token_ids is None else len(plan.token_ids),
            self.config.load_factor,
            self.config.weights,
        )
        if self.config.routing_policy == "round-robin":
            turn = self._next_round_robin % len(candidates)
            self._next_round_robin += int(advance)
            pick = candidates[turn]
            decision = dataclasses.replace(
                decision, replica=pick.name, reason="round_robin", matched_tokens=0
            )
        return decision

    async def route(self, raw: Request, path: str) -> Response:
        """Answer one ``POST`` of a routed path (see the module docstring)."""
        arrival = time.perf_counter()
        payload = await raw.body()
        body = _json_object(payload)
        model = _requested_model(body)
        label = model or ""
        if model is not None and not self.replicas.ready(model):
            if self.wake.can_wake(model):
                held_since = time.perf_counter()
                refusal = await self._hold(raw, model)
                if refusal is not None:
                    return refusal
                arrival += time.perf_counter() - held_since
            elif model not in self.replicas.known_models():
                return self._no_such_model(model)
        plan = await self.plan(path, body)
        headers: Any = raw.headers
        response_id = None
        if path == RESPONSES_PATH:
            response_id, headers = _response_id(raw, body)
        tried: set[str] = set()
        while True:
            decision = self.decide(plan, tried)
            if decision is None:
                self.metrics.errors.labels(label, "", "no_replica").inc()
                return self._unavailable(label, "no replica could be reached")
            if logger.isEnabledFor(logging.DEBUG):  # the explanation is built only if logged
                logger.debug("route %s model=%s: %s", path, model, decision.explanation)
            replica = self.replicas.replicas[decision.replica]
            if not tried:
                self.metrics.added_latency.observe(time.perf_counter() - arrival)
            self._count_decision(replica, decision.reason, plan.token_ids, decision.matched_tokens)
            self._start(replica)
            replica.record_sent(self._chain(plan, replica))
            try:
                upstream = await self._open_or_disconnect(
                    raw, replica, path, payload, headers=headers
                )
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
            if response_id is not None and upstream.status == HTTPStatus.OK:
                self._responses[response_id] = replica.url
                self._responses.move_to_end(response_id)
                while len(self._responses) > RESPONSE_AFFINITY_SIZE:
                    self._responses.popitem(last=False)
            on_done = functools.partial(self._finish, replica, label, upstream.status)
            return proxy.UpstreamResponse(upstream, on_done)

    async def stored_response(self, raw: Request, response_id: str, suffix: str = "") -> Response:
        """``GET``/``DELETE /v1/responses/{id}`` and ``POST .../cancel``: relayed to the replica
        that answered the response (the one that stored it); 404 as the engine's for an id the
        router did not route (or no longer remembers), 503 when that replica is unreachable."""
        url = self._responses.get(response_id)
        replica = self.replicas.replicas.get(url) if url is not None else None
        if replica is None:
            return error_response(
                HTTPStatus.NOT_FOUND, f"Response with id '{response_id}' not found.", "response_id"
            )
        path = f"{RESPONSES_PATH}/{response_id}{suffix}"
        self._start(replica)
        try:
            upstream = await self._open_or_disconnect(
                raw, replica, path, await raw.body(), method=raw.method
            )
        except proxy.UpstreamUnreachable as exc:
            self._finish(replica, "", None, "connect")
            return self._unavailable(
                "", f"the replica that holds the response is unreachable: {exc}"
            )
        if upstream is None:
            self._finish(replica, "", 499, "disconnect")
            return Response(status_code=499)
        on_done = functools.partial(self._finish, replica, "", upstream.status)
        return proxy.UpstreamResponse(upstream, on_done)

    async def debug_route(self, raw: Request) -> Response:
        """``POST /debug/route``: the decision for a request body, forwarding nothing; a body
        the engine would refuse gets the engine's own 400 (``errors.read_body``)."""
        payload = await raw.body()
        try:
            request = read_body(payload, raw.headers.get("content-type"), _request_type)
        except OpenAIError as exc:
            return exc.response()
        body = _json_object(payload)
        path = (
            CHAT_PATH
            if isinstance(request, ChatCompletionRequest)
            else RESPONSES_PATH
            if isinstance(request, ResponsesRequest)
            else ROUTED_PATHS[0]
        )
        plan = await self.plan(path, body)
        model = plan.model
        decision = self.decide(plan, set(), advance=False)
        if model is not None and not self.replicas.ready(model) and self.wake.can_wake(model):
            outcome = "hold"
        elif model is not None and model not in self.replicas.known_models():
            outcome = "unknown_model"
        else:
            outcome = "forward" if decision is not None else "no_replica"
        return JSONResponse(
            {
                "path": path,
                "model": model,
                "policy": self.config.routing_policy,
                "outcome": outcome,
                "prompt_tokens": None if plan.token_ids is None else len(plan.token_ids),
                "untokenized": plan.untokenized,
                "load_factor": self.config.load_factor,
                "weights": dataclasses.asdict(self.config.weights),
                "decision": None if decision is None else _decision_json(decision),
            }
        )

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

    def _chain(self, plan: Plan, replica: Replica) -> list[bytes]:
        """The prompt's block hashes as ``replica`` would compute them ([] untokenized)."""
        if plan.token_ids is None:
            return []
        # The engine's root where it publishes it (then its real hashes match), else the
        # router's own. An adapter's digest is the engine's secret: its chains are keyed on
        # its name, which matches the router's own sends only, never another model's.
        model = plan.model
        root = replica.root_hash or model_root_hash(model or "")
        lora = (model, None) if replica.root_hash and model in replica.adapters else None
        key = (replica.block_size, root, lora)
        if key not in plan.chains:
            plan.chains[key] = prompt_block_hashes(
                plan.token_ids, replica.block_size, root, plan.body.get("cache_salt"), lora
            )
        return plan.chains[key]

    async def _max_prompt_chars(self, model: str | None) -> int:
        """``tokenization.max_prompt_chars`` of the shortest context among the replicas
        serving ``model`` (computed once per context length, on the tokenizer's thread)."""
        max_model_len = self.replicas.max_model_len(model) or FALLBACK_MAX_MODEL_LEN
        if max_model_len not in self._max_chars:
            self._max_chars[max_model_len] = await self.tokenizer.call(
                max_prompt_chars, max_model_len
            )
        return self._max_chars[max_model_len]

    async def _hold(self, raw: Request, model: str) -> Response | None:
        """Hold a request for ``model`` until a replica serving it is ready (None: forward
        it now), asking the wake hook first when no other request for it is held; past
        ``wake_timeout_s`` a 503 with ``Retry-After``; a client that leaves meanwhile, 499."""
        first = not self._held.get(model)
        self._held[model] = self._held.get(model, 0) + 1
        self.metrics.held.labels(model).inc()
        self._poll_soon.set()
        watcher = asyncio.ensure_future(proxy.wait_for_disconnect(raw.receive))
        deadline = time.monotonic() + self.config.wake_timeout_s
        left = False
        try:
            if first:
                await self._request_wake(model)
            while not self.replicas.ready(model):
                remaining = deadline - time.monotonic()
                left = watcher.done()
                if remaining <= 0 or left:
                    break
                changed = asyncio.ensure_future(self.replicas.wait_changed(remaining))
                await asyncio.wait({watcher, changed}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
            else:
                return None
        finally:
            watcher.cancel()
            self._held[model] -= 1
            if not self._held[model]:
                del self._held[model]
                self._report_held(model, 0)
            self.metrics.held.labels(model).dec()
        if left:
            self.metrics.requests.labels(model, "", "499").inc()
            return Response(status_code=499)
        self.metrics.errors.labels(model, "", "wake_timeout").inc()
        self.metrics.requests.labels(model, "", "503").inc()
        return error_response(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"The model `{model}` has no ready replica: it was asked to wake and none became "
            f"ready within {self.config.wake_timeout_s:g} s; retry later",
            headers={"Retry-After": str(WAKE_RETRY_AFTER_S)},
        )

    def _report_held(self, model: str, held: int) -> None:
        """Tell the wake hook how many requests are held for ``model``, in the background: one
        report per model at a time, and the latest count is the one sent next (a final 0 is
        never lost behind an earlier report). A failure is logged and counted; the next poll
        reports again while requests are held."""
        self._held_to_report[model] = held
        if model in self._reporters:
            return

        async def report() -> None:
            try:
                while model in self._held_to_report:
                    count = self._held_to_report.pop(model)
                    try:
                        await asyncio.wait_for(
                            self.wake.report_held(model, count), self.config.wake_timeout_s
                        )
                    except Exception as exc:  # the hook's API is away: the next poll retries
                        logger.warning("reporting %d held for %s failed: %r", count, model, exc)
                        self.metrics.errors.labels(model, "", "wake").inc()
            finally:
                del self._reporters[model]

        self._reporters[model] = asyncio.ensure_future(report())

    async def _request_wake(self, model: str) -> None:
        """Call the wake hook (bounded by ``wake_timeout_s``); count and log its failures."""
        try:
            await asyncio.wait_for(self.wake.request_wake(model), self.config.wake_timeout_s)
        except Exception as exc:  # any hook failure: hold on; another router may wake it
            logger.warning("the wake hook failed for %s: %r", model, exc)
            self.metrics.wake_requests.labels(model, "error").inc()
            self.metrics.errors.labels(model, "", "wake").inc()
        else:
            self.metrics.wake_requests.labels(model, "ok").inc()

    def _no_such_model(self, model: str) -> Response:
        """404 for a model no replica lists (503 while none has reported its models)."""
        if not self.replicas.known_models():
            self.metrics.errors.labels(model, "", "no_replica").inc()
            return self._unavailable(model, "no replica has reported its models yet")
        self.metrics.errors.labels(model, "", "unknown_model").inc()
        self.metrics.requests.labels(model, "", "404").inc()
        return error_response(
            HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", param="model"
        )

    async def _open_or_disconnect(
        self,
        raw: Request,
        replica: Replica,
        path: str,
        payload: bytes,
        headers: Any = None,
        method: str = "POST",
    ) -> aiohttp.ClientResponse | None:
        """The replica's open response, or None when the client disconnected first (the
        upstream request is then cancelled, which closes its connection). ``headers``: the
        client's (default) or those to send instead."""
        headers = raw.headers if headers is None else headers
        opening = asyncio.ensure_future(
            proxy.open_upstream(self.session, method, replica.url + path, headers, payload)
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

    def _start(self, replica: Replica) -> None:
        """Account for the start of one forwarding attempt (``_finish`` ends it)."""
        replica.in_flight += 1
        self.metrics.in_flight.labels(replica.url).inc()

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


def _requested_model(body: dict[str, Any]) -> str | None:
    """The body's ``model``; None when it names none (absent, not a string, or ``""``, which
    the engine reads as its base model, as vLLM does)."""
    model = body.get("model")
    return model if isinstance(model, str) and model else None


def _request_type(body: Any) -> type[CompletionRequest | ChatCompletionRequest | ResponsesRequest]:
    """The request a body is: chat when it has ``messages``, a response when it has
    ``input``."""
    if isinstance(body, dict) and "messages" in body:
        return ChatCompletionRequest
    if isinstance(body, dict) and "input" in body:
        return ResponsesRequest
    return CompletionRequest


def _response_id(raw: Request, body: dict[str, Any]) -> tuple[str, Any]:
    """The id a Responses API request's response will have, and the headers to forward: the
    client's ``X-Request-Id``, else the body's ``request_id``, which the engine makes the
    response's id; else one the router makes and sends as ``X-Request-Id``."""
    header = raw.headers.get("x-request-id")
    if header:
        return header, raw.headers
    requested = body.get("request_id")
    if isinstance(requested, str) and requested:
        return requested, raw.headers
    response_id = f"resp_{uuid.uuid4().hex}"
    return response_id, {**raw.headers, "x-request-id": response_id}


def _decision_json(decision: Decision) -> dict[str, Any]:
    """A decision as ``/debug/route`` answers it."""
    return {
        "replica": decision.replica,
        "reason": decision.reason,
        "matched_tokens": decision.matched_tokens,
        "bound": decision.bound,
        "explanation": decision.explanation,
        "candidates": [
            {
                **dataclasses.asdict(t.candidate),
                "load": t.candidate.load,
                "allowed": t.allowed,
                "terms": {"prefix": t.prefix, "load": t.load, "waiting": t.waiting, "kv": t.kv},
                "score": t.score,
            }
            for t in decision.terms
        ],
    }


def create_app(
    config: RouterConfig, registry: CollectorRegistry | None = None, wake: WakeHook | None = None
) -> FastAPI:
    """The router's FastAPI app; its lifespan starts and stops the ``Router``.

    Args:
        config: the settings.
        registry: where its metrics live (a new one by default).
        wake: the wake hook (``wake.py``; default ``NoWake``).

    Raises:
        ValueError: from ``Router``.
    """
    registry = registry if registry is not None else CollectorRegistry()
    router = Router(config, registry, wake)

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

    for path in ROUTED_PATHS + TOKENIZER_PATHS:
        app.add_api_route(path, routed(path), methods=["POST"])

    @app.api_route(RESPONSES_PATH + "/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, raw: Request) -> Response:
        return await router.stored_response(raw, response_id)

    @app.post(RESPONSES_PATH + "/{response_id}/cancel")
    async def cancel_response(response_id: str, raw: Request) -> Response:
        return await router.stored_response(raw, response_id, "/cancel")

    @app.post("/debug/route")
    async def debug_route(raw: Request) -> Response:
        return await router.debug_route(raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await router.models(raw)

    @app.get("/health")
    async def health() -> Response:
        replicas = {r.url: r.is_up() for r in router.replicas.all()}
        # With a wake hook the router serves even at zero replicas: it holds requests.
        ready = bool(router.replicas.ready(None)) or not isinstance(router.wake, NoWake)
        return JSONResponse({"replicas": replicas}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
