"""The router across several deployments of real ``kvpilot serve`` processes on loopback:
routing by ``model`` (served names and LoRA adapters), wake from zero with an engine that
starts late (the wake hook is ``LocalWakeStandIn``, the stand-in for the Kubernetes hook), the
engines' own load in the score, ``/debug/route``, and a prompt too long for any replica.

Replicas: ``a`` serves ``tiny`` and its LoRA adapter ``sql``; ``b`` serves ``tiny``; ``late``
(the deployment at zero) is started by the wake hook. Tests run in file order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pathlib
import socket

import httpx
import openai
import peft
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.router.config import RouterConfig
from kvpilot.router.replicas import Replica
from kvpilot.router.scoring import Candidate, choose_replica
from kvpilot.router.wake import LocalWakeStandIn
from tests.router.live_router import RouterThread, live_replicas
from tests.server.conftest import API_KEY, LiveServer

GREEDY = {"temperature": 0, "max_tokens": 6}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
FLAGS = ("--max-model-len", "512", "--max-num-seqs", "4")


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory) -> pathlib.Path:
    """A PEFT adapter with random weights on the tiny Llama."""
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    folder = tmp_path_factory.mktemp("adapter") / "sql"
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, adapter_dir):
    model = str(tiny_model_dir("llama"))
    lora = ("--enable-lora", "--lora-modules", f"sql={adapter_dir}")
    tiny = (model, "--served-model-name", "tiny", *FLAGS)
    with live_replicas((*tiny, *lora), tiny) as servers:
        yield servers


@pytest.fixture(scope="module")
def late(tiny_model_dir):
    """The replicas the wake hook starts (none until it is called)."""
    started: list[LiveServer] = []
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def router(replicas, late, tiny_model_dir):
    holder: list[RouterThread] = []

    async def start_late_replica(model: str) -> None:
        router = holder[0]
        # Deterministic: both test requests are held before the replica exists, and the held
        # gauge says so on the router's own /metrics (what an autoscaler reads).
        registry = router.state.metrics.registry
        while registry.get_sample_value("kvpilot:router_held_requests", {"model": model}) < 2:
            await asyncio.sleep(0.05)
        # ... and the hook was told so: demand for the autoscaler (it hangs here if not).
        while (model, 2) not in hook.held_reports:
            await asyncio.sleep(0.05)
        async with router.state.session.get(f"{router.url}/metrics") as response:
            hook.metrics_at_wake = await response.text()
        server = await asyncio.to_thread(
            LiveServer, str(tiny_model_dir("llama")), "--served-model-name", model, *FLAGS
        )
        late.append(server)
        router.state.replicas.set_urls([s.url for s in (*replicas, server)])

    hook = LocalWakeStandIn(["late"], start_late_replica)
    config = RouterConfig(
        endpoints=[s.url for s in replicas],
        tokenizer=str(tiny_model_dir("llama")),
        refresh_s=0.3,
        wake_poll_s=0.2,
        wake_timeout_s=300,
        api_key=API_KEY,
    )
    holder.append(RouterThread(config, wake=hook))
    holder[0].hook = hook
    yield holder[0]
    holder[0].stop()


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=API_KEY, max_retries=0)


def served(router: RouterThread, model: str, replica: LiveServer) -> float:
    return router.metric(
        "kvpilot:router_requests_total", model=model, replica=replica.url, status="200"
    )


def debug_route(router: RouterThread, body: dict) -> dict:
    answer = httpx.post(f"{router.url}/debug/route", json=body, timeout=60)
    assert answer.status_code == 200
    return answer.json()


def test_an_adapter_goes_only_to_the_replica_that_lists_it(router, replicas, client) -> None:
    a, b = replicas
    assert {m.id for m in client.models.list().data} == {"tiny", "sql"}
    for i in range(3):
        answer = client.completions.create(model="sql", prompt=f"Query {i}:", **GREEDY)
        assert answer.model == "sql"
    assert (served(router, "sql", a), served(router, "sql", b)) == (3, 0)
    direct = a.openai_client().completions.create(model="sql", prompt="Query 0:", **GREEDY)
    again = client.completions.create(model="sql", prompt="Query 0:", **GREEDY)
    assert again.choices[0].text == direct.choices[0].text
    explained = debug_route(router, {"model": "sql", "prompt": "Query 9:"})
    assert explained["outcome"] == "forward"
    assert [c["name"] for c in explained["decision"]["candidates"]] == [a.url]
    base = debug_route(router, {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
    assert base["path"] == "/v1/chat/completions" and base["prompt_tokens"] > 0
    assert {c["name"] for c in base["decision"]["candidates"]} == {a.url, b.url}
    for c in base["decision"]["candidates"]:
        assert set(c["terms"]) == {"prefix", "load", "waiting", "kv"}
        assert c["score"] == pytest.approx(
            c["terms"]["prefix"] - c["terms"]["load"] - c["terms"]["waiting"] - c["terms"]["kv"]
        )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=1)
    assert debug_route(router, {"model": "nope", "prompt": "Hi"})["outcome"] == "unknown_model"


def test_the_engines_own_load_enters_the_score(replicas) -> None:
    a, b = replicas
    body = {"model": "tiny", "prompt": "Go", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{b.url}/v1/completions", json=body, headers=HEADERS, timeout=60
    ) as stream:
        chunks = stream.iter_bytes()  # kept: a dropped iterator closes the stream
        next(chunks)  # running on b, unknown to any router
        captured: list[str] = []

        def running() -> bool:
            captured.append(httpx.get(f"{b.url}/metrics", timeout=10).text)
            return any(
                s.name == "vllm:num_requests_running" and s.value >= 1
                for f in text_string_to_metric_families(captured[-1])
                for s in f.samples
            )

        b.wait_for(running)
    seen = Replica(b.url)
    assert seen.apply_metrics(captured[-1]) == {"tiny"}
    assert seen.num_requests_running >= 1 and seen.kv_cache_usage_perc > 0
    idle = Replica(a.url)
    idle.apply_metrics(httpx.get(f"{a.url}/metrics", timeout=10).text)
    candidates = [
        Candidate(r.url, 0, 0, i, r.num_requests_running, r.num_requests_waiting,
                  r.kv_cache_usage_perc)
        for i, r in enumerate((seen, idle))
    ]  # fmt: skip
    decision = choose_replica(candidates, prompt_tokens=40)
    assert (decision.replica, decision.reason) == (a.url, "load")
    busy = next(t for t in decision.terms if t.candidate.name == b.url)
    assert busy.load > 0 and busy.kv > 0


def test_a_prompt_too_long_for_the_replicas_is_not_tokenized_and_gets_their_400(
    router, replicas, client
) -> None:
    huge = {"model": "tiny", "prompt": "All work and no play. " * 400_000, "max_tokens": 1}
    explained = debug_route(router, huge)
    assert (explained["untokenized"], explained["prompt_tokens"]) == ("too long", None)
    assert explained["decision"]["reason"] == "hash"
    hashed = router.metric("kvpilot:router_routing_decisions_total", reason="hash")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(
            httpx.post, f"{router.url}/v1/completions", json=huge, headers=HEADERS, timeout=120
        )
        # Meanwhile the router answers others (its event loop and tokenizer are not held).
        assert httpx.get(f"{router.url}/health", timeout=30).status_code == 200
        assert client.completions.create(model="tiny", prompt="Hello", **GREEDY).choices
        ours = sent.result()
    theirs = httpx.post(f"{replicas[0].url}/v1/completions", json=huge, headers=HEADERS)
    assert ours.status_code == theirs.status_code == 400
    assert ours.content == theirs.content
    assert router.metric("kvpilot:router_routing_decisions_total", reason="hash") == hashed + 1


def test_a_model_at_zero_is_woken_and_its_requests_held_until_ready(
    router, replicas, late, client
) -> None:
    assert debug_route(router, {"model": "late", "prompt": "Hi"})["outcome"] == "hold"
    prompts = ["The capital of", "Once upon"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = [
            pool.submit(client.completions.create, model="late", prompt=p, **GREEDY)
            for p in prompts
        ]
        answers = [h.result(timeout=300) for h in held]
    assert router.hook.requested == ["late"]  # one wake for both held requests
    assert 'kvpilot:router_held_requests{model="late"} 2.0' in router.hook.metrics_at_wake
    assert router.metric("kvpilot:router_held_requests", model="late") == 0
    # Once both are answered the hook hears that none is held any more.
    replicas[0].wait_for(lambda: router.hook.held_reports[-1] == ("late", 0))
    assert {count for _, count in router.hook.held_reports} <= {1, 2, 0}
    [replica] = late
    direct = replica.openai_client()
    for prompt, answer in zip(prompts, answers, strict=True):
        expected = direct.completions.create(model="late", prompt=prompt, **GREEDY)
        assert answer.choices[0].text == expected.choices[0].text
    assert served(router, "late", replica) == 2
    # The deployments stay apart: "tiny" never goes to the late replica.
    for i in range(3):
        client.completions.create(model="tiny", prompt=f"Tiny {i}", **GREEDY)
    assert served(router, "tiny", replica) == 0
    assert router.metric("kvpilot:router_wake_requests_total", model="late", outcome="ok") == 1


def test_a_model_that_does_not_wake_in_time_is_a_503_with_retry_after(replicas) -> None:
    def on_wake(model: str) -> None:  # records the wake, starts nothing; "broken" fails
        if model == "broken":
            raise RuntimeError("the API server refused the patch")

    hook = LocalWakeStandIn(["asleep", "broken"], on_wake)
    config = RouterConfig(endpoints=[replicas[1].url], wake_timeout_s=0.5, api_key=API_KEY)
    router = RouterThread(config, wake=hook)
    try:
        url = f"{router.url}/v1/chat/completions"
        body = {"model": "asleep", "messages": [{"role": "user", "content": "Hi"}]}
        answer = httpx.post(url, json=body, headers=HEADERS, timeout=30)
        assert answer.status_code == 503 and answer.headers["retry-after"] == "10"
        error = answer.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and "asleep" in error["message"]
        assert hook.requested == ["asleep"]
        assert router.metric("kvpilot:router_errors_total", model="asleep", replica="",
                             kind="wake_timeout") == 1  # fmt: skip
        assert router.metric("kvpilot:router_held_requests", model="asleep") == 0
        unknown = httpx.post(url, json={**body, "model": "other"}, headers=HEADERS, timeout=30)
        assert unknown.status_code == 404  # not the hook's: no hold
        assert hook.requested == ["asleep"]
        # A failing hook is counted, and the request is held to the timeout all the same.
        broken = httpx.post(url, json={**body, "model": "broken"}, headers=HEADERS, timeout=30)
        assert broken.status_code == 503 and hook.requested == ["asleep", "broken"]
        outcome = {"model": "broken", "outcome": "error"}
        assert router.metric("kvpilot:router_wake_requests_total", **outcome) == 1
    finally:
        router.stop()


def test_a_client_that_leaves_while_held_is_let_go(replicas) -> None:
    config = RouterConfig(endpoints=[replicas[1].url], wake_timeout_s=300, api_key=API_KEY)
    router = RouterThread(config, wake=LocalWakeStandIn(["asleep"]))
    try:

        def held() -> float:
            return router.metric("kvpilot:router_held_requests", model="asleep")

        body = b'{"model": "asleep", "prompt": "Hi"}'
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n\r\n"
        port = int(router.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as client:
            client.sendall(head.encode() + body)
            replicas[1].wait_for(lambda: held() == 1)
        # The client closed its connection: the router stops holding it.
        replicas[1].wait_for(lambda: held() == 0)
        replicas[1].wait_for(
            lambda: (
                router.metric(
                    "kvpilot:router_requests_total", model="asleep", replica="", status="499"
                )
                == 1
            )
        )
    finally:
        router.stop()
