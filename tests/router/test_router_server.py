"""The router in front of two real ``kvpilot serve`` replicas of the tiny model, on loopback.

The router runs in this process (uvicorn on a thread, on a loopback port); the replicas are
``tests/server``'s ``LiveServer`` processes. Tests run in file order: the last one kills a
replica.
"""

from __future__ import annotations

import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from kvpilot.engine.kv_cache_manager import extend_block_hashes
from kvpilot.engine.model_loader import load_tokenizer
from kvpilot.engine.tokenization import encode_text
from kvpilot.ports import free_port
from kvpilot.router.config import RouterConfig
from tests.router.live_router import RouterThread, live_replicas
from tests.server.conftest import API_KEY, LiveServer

MODEL = "tiny"
GREEDY = {"temperature": 0, "max_tokens": 12}
LONG_PREFIX = "Once upon a time, in a cluster far away, a router kept every prefix warm. " * 8


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    flags = (str(tiny_model_dir("llama")), "--served-model-name", MODEL)
    flags += ("--max-model-len", "512", "--max-num-seqs", "4", "--enable-responses-store")
    with live_replicas(flags, flags) as servers:
        yield servers


@pytest.fixture(scope="module")
def router(replicas, tiny_model_dir):
    config = RouterConfig(
        endpoints=[s.url for s in replicas],
        tokenizer=str(tiny_model_dir("llama")),
        down_s=30.0,
        refresh_s=60.0,  # no poll marks the killed replica down first
        api_key=API_KEY,
    )
    router = RouterThread(config)
    yield router
    router.stop()


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=API_KEY, max_retries=0)


def hits(server: LiveServer) -> float:
    return server.metric("vllm:prefix_cache_hits_total", model_name=MODEL)


def prompt_tokens(server: LiveServer) -> float:
    return server.metric("vllm:prompt_tokens_total", model_name=MODEL)


def aborts(server: LiveServer) -> float:
    return server.metrics().get(
        ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL))), 0.0
    )


def test_models_and_health(router, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{router.url}/health", timeout=10)
    assert health.status_code == 200 and all(health.json()["replicas"].values())
    refused = httpx.get(f"{router.url}/v1/models", headers={"Authorization": "Bearer no"})
    assert refused.status_code == 401  # the replicas' answer, unchanged


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_answers_equal_the_replicas_direct_answers(replicas, client, stream) -> None:
    direct = replicas[0].openai_client()
    messages = [{"role": "user", "content": "Name three colors."}]
    for make in (
        lambda c, **kw: c.completions.create(model=MODEL, prompt="The capital of", **kw),
        lambda c, **kw: c.chat.completions.create(model=MODEL, messages=messages, **kw),
    ):
        if not stream:
            ours, theirs = make(client, **GREEDY), make(direct, **GREEDY)
            assert ours.model_dump(exclude={"id", "created"}) == theirs.model_dump(
                exclude={"id", "created"}
            )
            continue
        options = {**GREEDY, "stream": True, "stream_options": {"include_usage": True}}
        ours = [c.model_dump(exclude={"id", "created"}) for c in make(client, **options)]
        theirs = [c.model_dump(exclude={"id", "created"}) for c in make(direct, **options)]
        # How many chunks depends on timing (see merged); each stream has at least one with
        # tokens and ends with the usage chunk. That the router passes chunks on as they come,
        # not at the end, is shown by the mid-stream disconnect test below.
        assert ours[-1]["usage"] and theirs[-1]["usage"] and len(ours) >= 2
        assert merged(ours) == merged(theirs)
        assert merged(ours)["choices"][0]["text"]


def merged(chunks: list[dict]) -> dict:
    """What a stream says, whatever its chunking: a server merges the tokens of the steps its
    reader has not taken yet into one chunk (as vLLM does), so where the chunks fall depends
    on timing. Per choice the concatenated text and the finish reason, then the usage."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            seen = choices.setdefault(choice["index"], {"text": "", "finish_reason": None})
            delta = choice.get("delta") or {}
            seen["text"] += choice.get("text") or delta.get("content") or ""
            seen["finish_reason"] = choice["finish_reason"] or seen["finish_reason"]
    usage = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    return {"object": chunks[0]["object"], "choices": choices, "usage": usage}


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": "Hi", "temperature": -1},
        {"model": MODEL, "messages": [{"role": "user"}], "max_tokens": -3},
        {"model": MODEL, "prompt": [10**9]},
    ],
)
def test_a_replicas_400_passes_through_unchanged(router, replicas, body) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    ours = httpx.post(f"{router.url}{path}", json=body, headers=headers, timeout=30)
    theirs = httpx.post(f"{replicas[0].url}{path}", json=body, headers=headers, timeout=30)
    assert ours.status_code == theirs.status_code == 400
    assert ours.content == theirs.content


def test_bad_bodies_and_keys_get_the_replicas_own_4xx(router) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    not_json = httpx.post(f"{router.url}/v1/completions", content=b"{oops", headers=headers)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    wrong_key = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi"},
        headers={"Authorization": "Bearer wrong"},
    )
    assert wrong_key.status_code == 401


@pytest.mark.parametrize(
    ("path", "content", "content_type", "message", "param"),
    [
        (
            "/v1/completions",
            b"{oops",
            "application/json",
            "the request body is not valid JSON: Expecting property name enclosed in double "
            "quotes at character 1",
            None,
        ),
        (
            "/v1/completions",
            b'{"model": "tiny", "prompt": "Hi',
            "application/json",
            "the request body is not valid JSON: Unterminated string starting at character 28",
            None,
        ),
        (
            "/v1/completions",
            b'["tiny", "Hi"]',
            "application/json",
            "Input should be a valid dictionary or object to extract fields from",
            None,
        ),
        (
            "/v1/chat/completions",
            b'{"model": 3, "messages": [{"role": "user", "content": "Hi"}]}',
            "application/json",
            "model: Input should be a valid string",
            "model",
        ),
        (
            "/v1/completions",
            b'{"model": "tiny", "prompt": "Hi"}',
            "text/plain",
            "the request body must be JSON sent with 'Content-Type: application/json' "
            "(got Content-Type: text/plain)",
            None,
        ),
        (
            "/v1/completions",
            b"",
            "application/json",
            "the request body is missing: send a JSON object",
            None,
        ),
    ],
    ids=[
        "not-json",
        "unterminated-string",
        "not-an-object",
        "model-not-a-string",
        "text-plain",
        "empty",
    ],
)
def test_debug_route_refuses_what_the_engine_refuses_with_its_400(
    router, replicas, path, content, content_type, message, param
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": content_type}
    debug = httpx.post(f"{router.url}/debug/route", content=content, headers=headers)
    engine = httpx.post(f"{replicas[0].url}{path}", content=content, headers=headers)
    assert debug.status_code == engine.status_code == 400
    assert debug.json() == engine.json()
    assert debug.json() == {
        "error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    }


def test_an_unknown_model_is_an_openai_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert caught.value.body == {
        "message": "The model `no-such-model` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_a_shared_prefix_lands_on_the_replica_that_holds_it(router, replicas, client) -> None:
    before = [(hits(s), prompt_tokens(s)) for s in replicas]
    decisions = router.metric("kvpilot:router_routing_decisions_total", reason="prefix")
    for question in ("What did the router keep?", "Where was the cluster?"):
        client.completions.create(model=MODEL, prompt=LONG_PREFIX + question, **GREEDY)
    after = [(hits(s), prompt_tokens(s)) for s in replicas]
    grew = [i for i in range(2) if after[i][1] > before[i][1]]
    assert len(grew) == 1, (before, after)  # both requests went to one replica
    [chosen] = grew
    assert after[chosen][0] - before[chosen][0] >= 96  # the second one hit the prefix
    assert router.metric("kvpilot:router_routing_decisions_total", reason="prefix") > decisions
    assert router.metric("kvpilot:router_prefix_matched_tokens_total", replica=replicas[chosen].url)


def test_a_response_is_rendered_as_its_chat_conversation(router) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    conversation = {"instructions": "Be brief.", "input": "Name three colors."}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name three colors."},
    ]
    routes = [
        httpx.post(f"{router.url}/debug/route", json={"model": MODEL, **body}, headers=headers)
        for body in (conversation, {"messages": messages})
    ]
    assert [r.status_code for r in routes] == [200, 200]
    response, chat = (r.json() for r in routes)
    assert response["path"] == "/v1/responses" and response["untokenized"] is None
    assert response["prompt_tokens"] == chat["prompt_tokens"] > 0


def test_responses_are_continued_on_the_replica_that_stored_them(router, replicas, client):
    ask = {"model": MODEL, "temperature": 0, "max_output_tokens": 6}
    first = client.responses.create(input="Name three colors.", **ask)
    direct = replicas[0].openai_client().responses.create(input="Name three colors.", **ask)
    assert first.output_text == direct.output_text
    assert first.usage.input_tokens == direct.usage.input_tokens

    def holder(response_id: str) -> int:
        kept = []
        for i, server in enumerate(replicas):
            try:
                server.openai_client().responses.retrieve(response_id)
                kept.append(i)
            except openai.NotFoundError:
                pass
        [index] = kept  # stored on one replica only
        return index

    pinned = router.metric("kvpilot:router_routing_decisions_total", reason="previous_response")
    chain = [first]
    for turn in ("And two more?", "Which is warmest?", "Thanks."):
        chain.append(client.responses.create(input=turn, previous_response_id=chain[-1].id, **ask))
    assert {holder(r.id) for r in chain} == {holder(first.id)}
    assert (
        router.metric("kvpilot:router_routing_decisions_total", reason="previous_response")
        == pinned + 3
    )
    assert client.responses.retrieve(chain[-1].id).output_text == chain[-1].output_text
    client.responses.delete(chain[-1].id)
    for response_id in (chain[-1].id, "resp_never_routed"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve(response_id)
        assert missing.value.body["message"] == f"Response with id '{response_id}' not found."


def test_anthropic_messages_are_routed_and_answered_as_directly(router, replicas) -> None:
    ask = {
        "model": MODEL,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "Name three colors."}],
        "extra_body": {"temperature": 0},
    }
    routed, direct = (
        anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0).messages.create(**ask)
        for url in (router.url, replicas[0].url)
    )
    assert routed.content == direct.content and routed.usage == direct.usage


def test_invocations_are_routed_by_their_prompt_and_answered_as_directly(router, replicas):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    messages = [{"role": "user", "content": "Name three colors."}]
    for body in ({"messages": messages}, {"prompt": "The capital of"}):
        body = {"model": MODEL, **GREEDY, **body}
        routed_tokens = sum(
            router.metric("kvpilot:router_prompt_tokens_total", replica=s.url) for s in replicas
        )
        routed, direct = (
            httpx.post(f"{url}/invocations", json=body, headers=headers, timeout=60)
            for url in (router.url, replicas[0].url)
        )
        assert routed.status_code == direct.status_code == 200
        ours, theirs = routed.json(), direct.json()
        assert ours["object"] == theirs["object"] != ""
        assert ours["choices"] == theirs["choices"] and ours["usage"] == theirs["usage"]
        # The router tokenized it as the engine did (the chat template, or the bare prompt).
        counted = sum(
            router.metric("kvpilot:router_prompt_tokens_total", replica=s.url) for s in replicas
        )
        assert counted - routed_tokens == theirs["usage"]["prompt_tokens"]
    neither = httpx.post(f"{router.url}/invocations", json={"model": MODEL}, headers=headers)
    assert neither.status_code == 400 and "'messages'" in neither.json()["error"]["message"]


def test_tokenize_and_detokenize_reach_a_replica_and_leave_no_prompt_behind(
    router, replicas
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Only ever tokenized, never generated from. " * 8}
    routed = httpx.post(f"{router.url}/tokenize", json=body, headers=headers)
    direct = httpx.post(f"{replicas[0].url}/tokenize", json=body, headers=headers)
    assert routed.status_code == direct.status_code == 200
    assert routed.json() == direct.json()
    tokens = routed.json()["tokens"]
    assert len(tokens) == routed.json()["count"] > 64
    # ``model`` is optional there, as in vLLM: any replica answers.
    anyone = httpx.post(f"{router.url}/tokenize", json={"prompt": body["prompt"]}, headers=headers)
    assert anyone.status_code == 200
    assert anyone.json()["tokens"] == tokens
    # An empty name is no name (the engine reads it as its base model, as vLLM does).
    empty = httpx.post(f"{router.url}/tokenize", json={**body, "model": ""}, headers=headers)
    assert empty.status_code == 200
    assert empty.json()["tokens"] == tokens
    text = httpx.post(
        f"{router.url}/detokenize", json={"model": MODEL, "tokens": tokens}, headers=headers
    )
    assert text.status_code == 200
    assert text.json()["prompt"] == body["prompt"]
    # No replica is taken to hold the prompt's blocks: a completion of it matches nothing.
    debug = httpx.post(f"{router.url}/debug/route", json=body, headers=headers).json()
    assert debug["prompt_tokens"] == len(tokens)
    assert debug["decision"]["matched_tokens"] == 0
    assert all(c["matched_tokens"] == 0 for c in debug["decision"]["candidates"])


def test_a_client_that_disconnects_mid_stream_frees_the_replicas_blocks(router, replicas) -> None:
    body = {
        "model": MODEL,
        "prompt": "Count:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    aborted = sum(aborts(s) for s in replicas)
    with httpx.stream(
        "POST", f"{router.url}/v1/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        next(response.iter_bytes())
    for server in replicas:
        server.wait_for(
            lambda s=server: (
                s.metric("vllm:num_requests_running", model_name=MODEL) == 0
                and s.metric("vllm:kv_cache_usage_perc", model_name=MODEL) == 0
            )
        )
    assert sum(aborts(s) for s in replicas) == aborted + 1  # cut short, not finished
    for server in replicas:
        assert router.metric("kvpilot:router_in_flight_requests", replica=server.url) == 0


def test_the_kvpilot_router_command_serves(replicas, tiny_model_dir) -> None:
    port = free_port()
    command = [sys.executable, "-m", "kvpilot", "router", "--port", str(port), "--api-key", API_KEY]
    command += ["--tokenizer", str(tiny_model_dir("llama")), "--log-level", "debug"]
    command += [arg for s in replicas for arg in ("--endpoint", s.url)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        answer = client.completions.create(model=MODEL, prompt=LONG_PREFIX, **GREEDY)
        assert answer.choices[0].text
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
    # The debug line that explains the decision.
    assert "chose http://127.0.0.1:" in output and "bound=1" in output, output[-2000:]


def test_the_index_of_a_replica_is_its_engines_kv_events(replicas, tiny_model_dir) -> None:
    config = RouterConfig(
        endpoints=[s.url for s in replicas],
        tokenizer=str(tiny_model_dir("llama")),
        refresh_s=0.2,
        api_key=API_KEY,
    )
    fresh = RouterThread(config)
    try:
        state = fresh.state
        client = openai.OpenAI(base_url=f"{fresh.url}/v1", api_key=API_KEY, max_retries=0)
        prompt = "A story of KV events, told to the router block by block. " * 10
        before = {s.url: prompt_tokens(s) for s in replicas}
        client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1)
        [a] = [s for s in replicas if prompt_tokens(s) > before[s.url]]
        [b] = [s for s in replicas if s is not a]
        # The engine's own account: its log from the start, replayed.
        log = httpx.get(f"{a.url}/kv_events", headers={"Authorization": f"Bearer {API_KEY}"})
        log = log.json()
        assert not log["truncated"]
        engine_held: set[bytes] = set()
        for event in log["events"]:
            if event["type"] == "BlockStored":
                engine_held.add(bytes.fromhex(event["block_hash"]))
            elif event["type"] == "BlockRemoved":
                engine_held.discard(bytes.fromhex(event["block_hash"]))
            else:
                engine_held.clear()
        tokens = encode_text(load_tokenizer(tiny_model_dir("llama")), prompt, "prompt")
        root = bytes.fromhex(log["root_hash"])
        full = extend_block_hashes([], tokens, log["block_size"], root)
        assert len(full) >= 4 and set(full) <= engine_held
        index = state.replicas.replicas[a.url]
        a.wait_for(lambda: index.events is not None and index.events.next_seq >= log["next"])
        time.sleep(3 * config.refresh_s)  # two more polls: what the router sent is forgotten
        assert index.root_hash == root
        assert set(index.events.blocks) == engine_held
        assert not set(full) & state.replicas.replicas[b.url].events.blocks
        matched = fresh.metric("kvpilot:router_prefix_matched_tokens_total", replica=a.url)
        client.completions.create(model=MODEL, prompt=prompt + " More?", **GREEDY)
        assert prompt_tokens(a) > before[a.url] + len(tokens) and prompt_tokens(b) == before[b.url]
        assert fresh.metric("kvpilot:router_prefix_matched_tokens_total", replica=a.url) == (
            matched + len(full) * log["block_size"]
        )
    finally:
        fresh.stop()


def test_a_killed_replica_is_routed_around(router, replicas, client) -> None:
    prompt = LONG_PREFIX + "Which replica?"
    before = {s.url: prompt_tokens(s) for s in replicas}
    client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    # The replica that now holds the prompt's prefix: the router would send it there again.
    [target] = [s for s in replicas if prompt_tokens(s) > before[s.url]]
    [survivor] = [s for s in replicas if s is not target]
    target.stop()
    retries = router.metric("kvpilot:router_retries_total", model=MODEL)
    answer = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert answer.choices[0].text
    assert router.metric("kvpilot:router_retries_total", model=MODEL) == retries + 1
    assert router.metric("kvpilot:router_errors_total", model=MODEL, replica=target.url,
                         kind="connect") == 1  # fmt: skip
    assert router.metric("kvpilot:router_replica_up", replica=target.url) == 0
    served = router.metric(
        "kvpilot:router_requests_total", model=MODEL, replica=survivor.url, status="200"
    )
    for question in ("One?", "Two?", "Three?"):
        client.completions.create(model=MODEL, prompt=LONG_PREFIX + question, **GREEDY)
    assert router.metric("kvpilot:router_retries_total", model=MODEL) == retries + 1
    assert (
        router.metric(
            "kvpilot:router_requests_total", model=MODEL, replica=survivor.url, status="200"
        )
        == served + 3
    )
