"""The official ``openai`` client against a live ``kvpilot serve`` on the default model."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

import kvpilot
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import CPU_BLOCK_SIZE
from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL

MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


SECOND_KEY = "second-key"
ORIGIN = "https://ui.example"


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory, api_key):
    # Flags as a vLLM manifest may give them: a --config YAML file (underscores or dashes),
    # an underscore-spelled flag, several API keys.
    config = tmp_path_factory.mktemp("serve") / "config.yaml"
    config.write_text(
        f"max_model_len: {MAX_MODEL_LEN}\nmax-num-seqs: 8\nallowed-origins: '[\"{ORIGIN}\"]'\n"
        "trust-remote-code: true\nenable-prefix-caching: true\nmax-logprobs: 30\n"
    )
    return start_server("--config", str(config), "--api_key", api_key, SECOND_KEY)


@pytest.fixture(scope="module")
def client(server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def offline(server) -> Iterator[LLM]:
    """The offline API on the same model: the server must give the same greedy tokens.

    One torch thread while it shares the cores with the server process: two processes with
    two spinning OpenMP threads each on two cores run several times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(max_model_len=MAX_MODEL_LEN)
    torch.set_num_threads(threads)


def offline_text(offline: LLM, prompt: str, **params) -> str:
    [output] = offline.generate([prompt], SamplingParams(**params), use_tqdm=False)
    return output.outputs[0].text


def chat_prompt(offline: LLM, messages) -> str:
    tokenizer = offline.get_tokenizer()
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def stream_completion(client, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    """Concatenated text and finish reason per choice index, plus every chunk."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert len({(chunk.id, chunk.created) for chunk in chunks}) == 1  # one stamp a stream
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def stream_chat(client, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert len({(chunk.id, chunk.created) for chunk in chunks}) == 1  # one stamp a stream
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_models_and_version(client, server):
    [card] = client.models.list().data
    assert card.id == MODEL
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_vllm_routes_and_names_a_client_may_rely_on(http, server, offline):
    # /ping as vLLM (SageMaker) has it; an empty model name is the base model, as vLLM reads it.
    assert [http.get("/ping").status_code, http.post("/ping").status_code] == [200, 200]
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    empty = http.post("/v1/completions", json={**body, "model": ""}).json()
    assert empty["model"] == MODEL
    assert empty["choices"][0]["text"] == offline_text(offline, PROMPT, temperature=0, max_tokens=3)
    # prometheus_client's process metrics beside the engine's, as on vLLM's /metrics.
    metrics = server.metrics()
    rss = metrics[("process_resident_memory_bytes", ())]
    assert 50e6 < rss < 64e9


def test_invocations_serves_a_chat_or_a_completion_by_its_body_as_vllm_routes_it(
    http, server, offline
):
    # SageMaker's one route: a body with a prompt is a completion, one with messages a chat.
    completion = http.post(
        "/invocations", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    ).json()
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == offline_text(
        offline, PROMPT, temperature=0, max_tokens=5
    )
    chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0}
    answer = http.post("/invocations", json=chat).json()
    assert answer["object"] == "chat.completion"
    direct = http.post("/v1/chat/completions", json=chat).json()
    assert answer["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert answer["usage"] == direct["usage"]
    # Streamed when the body asks, as the chat route streams.
    with http.stream("POST", "/invocations", json={**chat, "stream": True}) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and '"chat.completion.chunk"' in lines[0]
    # A chat body with a bad field gets the chat route's own 400; a body that is neither, one
    # that says what /invocations takes; no key, 401 (vLLM leaves the route open).
    bad = http.post("/invocations", json={**chat, "temperature": "hot"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    neither = http.post("/invocations", json={"input": "hello"})
    assert neither.status_code == 400
    assert "'messages'" in neither.json()["error"]["message"]
    # A null messages is no chat (vLLM's order: a chat if it validates, else a completion).
    completed = http.post(
        "/invocations", json={"messages": None, "prompt": PROMPT, "max_tokens": 2}
    )
    assert completed.json()["object"] == "text_completion"
    # JSON under another content type: the 400 says so, as /v1/completions does.
    form = http.post(
        "/invocations", content=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"}
    )
    assert form.status_code == 400 and "Content-Type" in form.json()["error"]["message"]
    unauthorized = httpx.post(f"{server.url}/invocations", json=chat)
    assert unauthorized.status_code == 401


def test_several_api_keys_and_cors_as_vllm_serves_them(server, api_key):
    url = f"{server.url}/v1/models"
    for key in (api_key, SECOND_KEY):
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    # A browser's preflight is answered before the key check, for the allowed origin only.
    preflight = {"Access-Control-Request-Method": "POST"}
    allowed = httpx.options(url, headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(url, headers={"Origin": "https://elsewhere.example", **preflight})
    assert "access-control-allow-origin" not in other.headers


def test_greedy_completion_equals_offline_llm(client, offline):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    [choice] = response.choices
    assert choice.text == offline_text(offline, PROMPT, temperature=0, max_tokens=16)
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 16
    assert response.usage.prompt_tokens == len(offline.get_tokenizer().encode(PROMPT))
    assert response.usage.total_tokens == response.usage.prompt_tokens + 16


def test_greedy_chat_equals_offline_llm_on_the_chat_template(client, offline):
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0
    )
    [choice] = response.choices
    prompt = chat_prompt(offline, CHAT)
    assert choice.message.role == "assistant"
    assert choice.message.content == offline_text(offline, prompt, temperature=0, max_tokens=12)
    assert response.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))


def test_streamed_completion_equals_non_streamed(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs)
    texts, reasons, chunks = stream_completion(
        client, stream_options={"include_usage": True}, **kwargs
    )
    assert texts == {0: full.choices[0].text}
    assert reasons == {0: full.choices[0].finish_reason}
    # The chunk count depends on how far the reader lags (steps not yet read are merged, as in
    # vLLM); that chunks come before the end is shown by the mid-stream disconnect tests.
    assert len(chunks) >= 2
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_streamed_chat_equals_non_streamed(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    texts, reasons, chunks = stream_chat(client, stream_options={"include_usage": True}, **kwargs)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts == {0: full.choices[0].message.content}
    assert reasons == {0: full.choices[0].finish_reason}
    assert chunks[-1].usage == full.usage


def test_system_fingerprint_on_every_completion_and_chunk(client):
    # OpenAI's field (vLLM's reads "vllm-<version>-<hash>"): the backend that answered.
    fingerprint = f"kvpilot-{kvpilot.__version__}"
    completion = dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    chat = dict(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert client.completions.create(**completion).system_fingerprint == fingerprint
    assert client.chat.completions.create(**chat).system_fingerprint == fingerprint
    options = {"include_usage": True}
    _, _, chunks = stream_completion(client, stream_options=options, **completion)
    _, _, chat_chunks = stream_chat(client, stream_options=options, **chat)
    assert {chunk.system_fingerprint for chunk in chunks + chat_chunks} == {fingerprint}


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    _, _, chunks = stream_completion(client, prompt=PROMPT, stream_options=options, **kwargs)
    _, _, chat_chunks = stream_chat(client, messages=CHAT, stream_options=options, **kwargs)
    for stream in (chunks, chat_chunks):
        final = stream[-1].usage
        assert stream[-1].choices == [] and final.completion_tokens == 8
        counts = [c.usage.completion_tokens for c in stream]
        assert counts == sorted(counts) and counts[-2] == 8  # the last token's chunk: all 8
        assert {c.usage.prompt_tokens for c in stream} == {final.prompt_tokens}
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
                   for c in stream)  # fmt: skip
    assert chat_chunks[0].usage.completion_tokens == 0  # the role chunk
    # Without the flag, only the last chunk has it.
    _, _, plain = stream_completion(
        client, prompt=PROMPT, stream_options={"include_usage": True}, **kwargs
    )
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_n_choices_streamed_and_not(client):
    kwargs = dict(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    full = client.completions.create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 3 * 6
    assert len({c.text for c in full.choices}) > 1  # seeds seed, seed+1, seed+2 differ
    texts, reasons, _ = stream_completion(client, **kwargs)
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {0: "length", 1: "length", 2: "length"}


def test_null_parameters_mean_their_defaults(client):
    # The openai client sends null for a parameter given as None; OpenAI and vLLM read it as
    # the default (n 1, no stream, no logprobs, no echo), never as a 400.
    chat_kwargs = dict(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    chat = client.chat.completions.create(
        **chat_kwargs, n=None, stream=None, logprobs=None, parallel_tool_calls=None
    )
    plain = client.chat.completions.create(**chat_kwargs)
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    assert chat.choices[0].message.content == plain.choices[0].message.content
    completion_kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    completion = client.completions.create(**completion_kwargs, n=None, echo=None, stream=None)
    assert len(completion.choices) == 1
    assert (
        completion.choices[0].text == client.completions.create(**completion_kwargs).choices[0].text
    )
    assert not completion.choices[0].text.startswith(PROMPT)  # echo off


def test_seed_reproduces_sampled_output(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0.9)
    first = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    again = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    other = client.chat.completions.create(seed=4321, **kwargs).choices[0].message.content
    assert first == again
    assert first != other


def test_stop_string_split_across_tokens_is_not_emitted(client, offline):
    full = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0
    ).choices[0]
    tokens = full.logprobs.tokens
    # A stop string made of the end of token 2 and the start of token 3.
    stop = tokens[2][-2:] + tokens[3][:2]
    assert stop not in tokens[2] and stop not in tokens[3]
    expected = full.text[: full.text.index(stop)]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    stopped = client.completions.create(**kwargs).choices[0]
    assert (stopped.text, stopped.finish_reason) == (expected, "stop")
    assert stopped.model_extra["stop_reason"] == stop
    texts, reasons, chunks = stream_completion(client, **kwargs)
    assert texts == {0: expected} and reasons == {0: "stop"}
    assert all(stop not in c.text for chunk in chunks for c in chunk.choices)
    included = client.completions.create(
        extra_body={"include_stop_str_in_output": True}, **kwargs
    ).choices[0]
    assert included.text == expected + stop


def test_stop_string_counts_only_after_min_tokens_as_in_vllm(client):
    # Greedy " 6, 7, 8, 9, ..." is " ", "6", ",", " ", "7", ... (one token each). The "," of
    # output token 6 is within min_tokens=6 and ignored; the next one, token 9, stops: vLLM
    # 0.32 answers " 6, 7, 8" with 9 completion tokens on this request.
    kwargs = dict(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=10, temperature=0, stop=[","])
    response = client.completions.create(extra_body={"min_tokens": 6}, **kwargs)
    [choice] = response.choices
    assert (choice.text, choice.finish_reason) == (" 6, 7, 8", "stop")
    assert choice.model_extra["stop_reason"] == ","
    assert response.usage.completion_tokens == 9
    texts, reasons, _ = stream_completion(client, extra_body={"min_tokens": 6}, **kwargs)
    assert texts == {0: " 6, 7, 8"} and reasons == {0: "stop"}
    # Without min_tokens the first "," stops.
    assert client.completions.create(**kwargs).choices[0].text == " 6"
    # Greedy " Paris", ".", "\n", "\n", "The": the "." is within min_tokens=3 and stays
    # ignored beside a longer stop string; vLLM 0.32 answers " Paris." stopped by "\n\nThe".
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[".", "\n\nThe"])
    [choice] = client.completions.create(extra_body={"min_tokens": 3}, **kwargs).choices
    assert (choice.text, choice.model_extra["stop_reason"]) == (" Paris.", "\n\nThe")
    texts, reasons, _ = stream_completion(client, extra_body={"min_tokens": 3}, **kwargs)
    assert texts == {0: " Paris."} and reasons == {0: "stop"}


def test_completion_logprobs_match_offline_llm(client, offline):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    [reference] = offline.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False
    )
    expected = reference.outputs[0]
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert len(logprobs.token_logprobs) == 8
    for i, (token_id, candidates) in enumerate(
        zip(expected.token_ids, expected.logprobs, strict=True)
    ):
        assert logprobs.token_logprobs[i] == pytest.approx(candidates[token_id].logprob, abs=1e-4)
        # Greedy: the chosen token is the most likely one.
        assert logprobs.token_logprobs[i] == pytest.approx(max(logprobs.top_logprobs[i].values()))
        assert len(logprobs.top_logprobs[i]) >= 3
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[1] == len(logprobs.tokens[0])


def offline_prompt_logprobs(offline: LLM, prompt, k: int):
    """The engine's prompt token ids and prompt logprobs (top ``k``) for one prompt."""
    [output] = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k), use_tqdm=False
    )
    return output.prompt_token_ids, output.prompt_logprobs


def assert_echoed_prompt(logprobs, prompt_ids: list[int], expected, k: int) -> None:
    """OpenAI's echoed logprobs of a prompt: its tokens, null for the first, then each
    token's logprob and top ``k`` (plus itself) equal to the engine's prompt logprobs."""
    n = len(prompt_ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[1:n] == [expected[i][prompt_ids[i]].decoded_token for i in range(1, n)]
    for i in range(1, n):
        own = expected[i][prompt_ids[i]]
        assert logprobs.token_logprobs[i] == pytest.approx(own.logprob, abs=1e-5)
        top = {lp.decoded_token: lp.logprob for lp in expected[i].values() if lp.rank <= k}
        top[own.decoded_token] = own.logprob
        assert logprobs.top_logprobs[i] == pytest.approx(top, abs=1e-5)
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_does(client, offline):
    prompt_ids, expected = offline_prompt_logprobs(offline, PROMPT, 2)
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    choice = response.choices[0]
    [generated] = offline.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False
    )
    assert choice.text == PROMPT + generated.outputs[0].text
    assert len(choice.logprobs.tokens) == len(prompt_ids) + 1
    assert "".join(choice.logprobs.tokens) == choice.text
    assert_echoed_prompt(choice.logprobs, prompt_ids, expected, 2)
    [sampled] = generated.outputs[0].logprobs
    token_id = generated.outputs[0].token_ids[0]
    assert choice.logprobs.token_logprobs[-1] == pytest.approx(sampled[token_id].logprob, abs=1e-4)
    assert response.usage.completion_tokens == 1
    # The same, streamed: the prompt and its logprobs come in the first chunk.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2,
            stream=True,
        )
    )  # fmt: skip
    parts = [c.choices[0] for c in chunks if c.choices]
    assert parts[0].text.startswith(PROMPT)
    assert parts[0].logprobs.tokens[: len(prompt_ids)] == choice.logprobs.tokens[: len(prompt_ids)]
    merged = [lp for part in parts if part.logprobs for lp in part.logprobs.token_logprobs]
    assert merged[0] is None
    assert merged[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)
    assert "".join(part.text for part in parts) == choice.text


def test_echo_without_generation_returns_the_prompt_alone(client, offline):
    tokenizer = offline.get_tokenizer()
    batch = [tokenizer.encode(PROMPT), tokenizer.encode("Once upon a time")]
    response = client.completions.create(
        model=MODEL, prompt=batch, max_tokens=0, temperature=0, echo=True, logprobs=1, n=2
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 0
    for choice, prompt_ids in zip(response.choices, [batch[0]] * 2 + [batch[1]] * 2, strict=True):
        assert choice.text == tokenizer.decode(prompt_ids)
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(prompt_ids)
        _, expected = offline_prompt_logprobs(offline, {"prompt_token_ids": prompt_ids}, 1)
        assert_echoed_prompt(choice.logprobs, prompt_ids, expected, 1)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0, stream=True
        )
    )
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == PROMPT
    assert parts[-1].finish_reason == "length"
    assert sum(len(p.logprobs.tokens) for p in parts if p.logprobs) == len(batch[0])


def test_prompt_logprobs_field_in_vllms_format(client, offline):
    prompt_ids, expected = offline_prompt_logprobs(offline, PROMPT, 3)
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    choice = response.choices[0]
    assert choice.logprobs is None
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for entry, token_id, candidates in zip(
        prompt_logprobs[1:], prompt_ids[1:], expected[1:], strict=True
    ):
        assert str(token_id) in entry and len(entry) == len(candidates) <= 4
        for key, value in entry.items():
            reference = candidates[int(key)]
            assert value["logprob"] == pytest.approx(reference.logprob, abs=1e-5)
            assert value["rank"] == reference.rank
            assert value["decoded_token"] == reference.decoded_token


def test_chat_prompt_logprobs_equal_the_completions_on_the_rendered_prompt(client, offline):
    prompt_ids = offline.get_tokenizer().encode(
        chat_prompt(offline, CHAT), add_special_tokens=False
    )
    kwargs = dict(model=MODEL, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2})
    chat = client.chat.completions.create(messages=CHAT, **kwargs)
    completion = client.completions.create(prompt=prompt_ids, **kwargs)
    expected = completion.choices[0].model_extra["prompt_logprobs"]
    # At the top of the response, as vLLM's ChatCompletionResponse has it; not in a choice.
    prompt_logprobs = chat.model_extra["prompt_logprobs"]
    assert "prompt_logprobs" not in chat.choices[0].model_extra
    assert chat.usage.prompt_tokens == len(prompt_logprobs) == len(prompt_ids) == len(expected)
    assert prompt_logprobs[0] is None and expected[0] is None
    for entry, reference, token_id in zip(
        prompt_logprobs[1:], expected[1:], prompt_ids[1:], strict=True
    ):
        assert str(token_id) in entry and entry.keys() == reference.keys()
        assert 2 <= len(entry) <= 3  # the top 2 and the prompt token
        for key, value in entry.items():
            assert value["logprob"] == pytest.approx(reference[key]["logprob"], abs=1e-5)
            assert (value["rank"], value["decoded_token"]) == (
                reference[key]["rank"],
                reference[key]["decoded_token"],
            )


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)
        assert bytes(token.bytes).decode() == token.token


@pytest.mark.parametrize(
    ("prompt", "pattern"),
    [
        ("English: hello\nChinese: 你好\nEnglish: world\nChinese: 世界\nEnglish: thank you\nChinese:", "CJK"),
        ("Rocket: 🚀\nParty: 🎉\nHeart: ❤️\nFire: 🔥\nSmile:", "emoji"),
    ],
)  # fmt: skip
def test_non_ascii_text_streams_byte_safe(client, prompt, pattern):
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=["\n"])
    full = client.completions.create(logprobs=0, **kwargs).choices[0]
    # Some character of the answer is split over several tokens (each alone is not valid
    # UTF-8): as in vLLM, the tokens before the last part show "" and the last the character,
    # so that the tokens join into the text (the stop string "\n" may follow it).
    assert "" in full.logprobs.tokens
    assert not any("\ufffd" in token for token in full.logprobs.tokens)
    assert "".join(full.logprobs.tokens).startswith(full.text)
    assert "\ufffd" not in full.text and any(ord(c) > 0x2E80 for c in full.text), pattern
    texts, _, chunks = stream_completion(client, **kwargs)
    assert texts == {0: full.text}
    assert all("\ufffd" not in c.text for chunk in chunks for c in chunk.choices)


def test_sampling_parameters_reach_the_engine(client, offline):
    params = dict(
        max_tokens=12, temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
        repetition_penalty=1.3, min_tokens=4,
    )  # fmt: skip
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.3, "min_tokens": 4, "top_k": 20, "min_p": 0.05},
    )
    assert response.choices[0].text == offline_text(offline, PROMPT, **params)
    assert response.choices[0].text != offline_text(offline, PROMPT, max_tokens=12, temperature=0)


def test_logit_bias_forces_a_token(client, offline):
    token_id = offline.get_tokenizer().encode(" banana")[0]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(token_id): 100}
    )
    assert response.choices[0].text == offline.get_tokenizer().decode([token_id] * 4)


def test_stop_token_ids_and_echo(client, offline):
    tokenizer = offline.get_tokenizer()
    full = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True
    ).choices[0]
    assert full.text.startswith(PROMPT)
    generated_ids = tokenizer.encode(full.text[len(PROMPT) :])
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [generated_ids[2]]},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == generated_ids[2]
    assert response.usage.completion_tokens == 3
    assert choice.text == tokenizer.decode(generated_ids[:2])


def test_a_stop_token_on_the_last_allowed_token_finishes_with_stop(client, offline):
    # vLLM checks EOS and stop_token_ids before the length limit: the token that ends the
    # output on max_tokens still reports "stop", and its text is left out.
    [greedy] = offline.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )
    first, second = greedy.outputs[0].token_ids
    choice = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=2,
        extra_body={"stop_token_ids": [second]},
    ).choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", second)
    assert choice.text == offline.get_tokenizer().decode([first])
    # EOS as the last allowed token: a chat that ends by itself, cut to exactly its length.
    ended = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=64)
    assert ended.choices[0].finish_reason == "stop"
    exact = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=ended.usage.completion_tokens
    )
    assert exact.choices[0].finish_reason == "stop"
    assert exact.choices[0].message.content == ended.choices[0].message.content


def test_max_tokens_is_cut_to_the_context_left_as_vllm_cuts_it(client, offline):
    tokenizer = offline.get_tokenizer()
    # Left out, completions' default of 16; an explicit null, as vLLM reads it (CompletionRequest
    # max_tokens: int | None = 16), the rest of the context.
    long_prompt = tokenizer.encode(" hello" * (MAX_MODEL_LEN - 1))[: MAX_MODEL_LEN - 1]
    kwargs = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})
    unset = client.completions.create(prompt=long_prompt[:-40], **kwargs)
    assert (unset.usage.completion_tokens, unset.choices[0].finish_reason) == (16, "length")
    null = client.completions.create(prompt=long_prompt[:-40], max_tokens=None, **kwargs)
    assert (null.usage.completion_tokens, null.choices[0].finish_reason) == (41, "length")
    # A prompt one token short of the context with the default 16: one token, "length".
    full = client.completions.create(model=MODEL, prompt=long_prompt, temperature=0)
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (MAX_MODEL_LEN - 1, 1)
    assert full.choices[0].finish_reason == "length"
    # max_tokens up to max_model_len is taken and cut to the room the prompt leaves.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        temperature=0,
        max_tokens=MAX_MODEL_LEN,
        extra_body={"ignore_eos": True},
    )
    usage = chat.usage
    assert usage.prompt_tokens + usage.completion_tokens == MAX_MODEL_LEN
    assert chat.choices[0].finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, offline, http):
    tokenizer = offline.get_tokenizer()
    ids = tokenizer.encode(PROMPT)
    kwargs = dict(model=MODEL, temperature=0, max_tokens=4)
    cut = client.completions.create(
        prompt=PROMPT, echo=True, extra_body={"truncate_prompt_tokens": 2}, **kwargs
    )
    kept = client.completions.create(prompt=ids[-2:], echo=True, **kwargs)
    assert cut.usage.prompt_tokens == 2
    # The echo is the kept prompt's text, and the answer that of the kept tokens alone.
    assert cut.choices[0].text == kept.choices[0].text
    assert cut.choices[0].text.startswith(tokenizer.decode(ids[-2:]))
    assert not cut.choices[0].text.startswith(PROMPT)
    chat = client.chat.completions.create(
        messages=CHAT, extra_body={"truncate_prompt_tokens": 3}, **kwargs
    )
    assert chat.usage.prompt_tokens == 3
    for bad in (0, MAX_MODEL_LEN + 1):
        response = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "truncate_prompt_tokens": bad},
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_allowed_token_ids_and_bad_words_as_vllm_takes_them(client, offline):
    tokenizer = offline.get_tokenizer()
    kwargs = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12, logprobs=0)
    free = client.completions.create(**kwargs).choices[0]
    assert "Paris" in free.text
    # bad_words: the word never comes out, wherever it would start.
    banned = client.completions.create(**kwargs, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].text
    # allowed_token_ids: every sampled token is one of them.
    allowed = [tokenizer.encode(t, add_special_tokens=False)[0] for t in (" yes", " no", ".")]
    only = client.completions.create(
        **kwargs, extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True}
    ).choices[0]
    assert {int(t.removeprefix("token_id:")) for t in only.logprobs.tokens} <= set(allowed)
    [expected] = offline.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed),
        use_tqdm=False,
    )
    assert only.logprobs.tokens == [f"token_id:{t}" for t in expected.outputs[0].token_ids]


def test_max_logprobs_is_the_servers_limit(client, http):
    # --max-logprobs 30 (from the config file): 25 top logprobs beyond vLLM's default 20.
    wide = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=25
    )
    assert [len(top) for top in wide.choices[0].logprobs.top_logprobs] == [25, 25]
    for field, body in (
        ("logprobs", {"prompt": PROMPT, "logprobs": 31}),
        ("prompt_logprobs", {"prompt": PROMPT, "prompt_logprobs": 31}),
    ):
        response = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 1, **body})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == field and "--max-logprobs" in error["message"]


def test_return_token_ids_gives_prompt_and_output_ids_streamed_or_not(client, offline):
    [greedy] = offline.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    kwargs = dict(model=MODEL, temperature=0, max_tokens=6, extra_body={"return_token_ids": True})
    whole = client.completions.create(prompt=PROMPT, **kwargs).choices[0].model_extra
    assert whole["prompt_token_ids"] == greedy.prompt_token_ids
    assert whole["token_ids"] == greedy.outputs[0].token_ids
    chunks = [c.choices[0].model_extra for c in client.completions.create(
        prompt=PROMPT, stream=True, **kwargs
    ) if c.choices]  # fmt: skip
    assert chunks[0]["prompt_token_ids"] == greedy.prompt_token_ids
    assert all(c.get("prompt_token_ids") is None for c in chunks[1:])
    assert sum((c["token_ids"] for c in chunks), []) == greedy.outputs[0].token_ids
    # Chat: the prompt's ids at the top (as vLLM), the output's in the choice.
    chat = client.chat.completions.create(messages=CHAT, **kwargs)
    expected_prompt = offline.get_tokenizer().encode(
        chat_prompt(offline, CHAT), add_special_tokens=False
    )
    assert chat.model_extra["prompt_token_ids"] == expected_prompt
    output_ids = chat.choices[0].model_extra["token_ids"]
    assert len(output_ids) == chat.usage.completion_tokens
    streamed = list(client.chat.completions.create(messages=CHAT, stream=True, **kwargs))
    assert streamed[0].model_extra["prompt_token_ids"] == expected_prompt
    ids = [
        tok for c in streamed if c.choices for tok in c.choices[0].model_extra["token_ids"] or []
    ]
    assert ids == output_ids
    # Not asked: no ids.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].model_extra.get("token_ids") is None


def test_return_tokens_as_token_ids(client, offline):
    [greedy] = offline.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    expected = [f"token_id:{t}" for t in greedy.outputs[0].token_ids]
    completion = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=3,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == expected
    assert [list(top) for top in logprobs.top_logprobs] == [[t] for t in expected]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        temperature=0,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:") and bytes(entry.bytes).decode() == entry.token
        assert all(top.token.startswith("token_id:") for top in entry.top_logprobs)


def test_response_id_from_the_request_id_or_the_x_request_id_header(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    named = http.post("/v1/completions", json={**body, "request_id": "mine"}).json()
    assert named["id"] == "cmpl-mine"
    # The header wins; two requests of the same name both run (the engine's ids stay unique).
    headers = {"X-Request-Id": "same"}
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    ids = [http.post("/v1/chat/completions", json=chat, headers=headers) for _ in range(2)]
    assert [r.status_code for r in ids] == [200, 200]
    assert {r.json()["id"] for r in ids} == {"chatcmpl-same"}
    plain = http.post("/v1/completions", json=body).json()["id"]
    assert plain.startswith("cmpl-") and len(plain) == len("cmpl-") + 32


def test_batch_of_token_id_prompts(client, offline):
    tokenizer = offline.get_tokenizer()
    batch = [tokenizer.encode(PROMPT), tokenizer.encode("Once upon a time")]
    response = client.completions.create(model=MODEL, prompt=batch, max_tokens=5, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].text == offline_text(offline, PROMPT, temperature=0, max_tokens=5)
    assert response.usage.prompt_tokens == len(batch[0]) + len(batch[1])


def test_metrics_move_as_requests_run(client, server):
    before = server.metrics()

    def value(metrics, name, **labels):
        labels.setdefault("model_name", MODEL)
        return metrics[(name, tuple(sorted(labels.items())))]

    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = server.metrics()

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:prompt_tokens_total") == response.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 7
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:request_generation_tokens_sum") == 7
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0
    total = value(after, "kvpilot:kv_cache_total_blocks")
    assert value(after, "kvpilot:kv_cache_free_blocks") == total
    # The engine was given no block size: the CPU default.
    assert value(after, "kvpilot:kv_cache_capacity_tokens") == total * CPU_BLOCK_SIZE
    assert value(after, "kvpilot:max_concurrency") == pytest.approx(
        total * CPU_BLOCK_SIZE / MAX_MODEL_LEN
    )
    [info] = [labels for name, labels in after if name == "vllm:cache_config_info"]
    assert dict(info)["block_size"] == str(CPU_BLOCK_SIZE)
    assert dict(info)["num_gpu_blocks"] == str(int(total))
    assert dict(info)["cache_dtype"] == "float32"  # the KV cache's (--kv-cache-dtype auto)


def test_prefix_cache_counters_move_on_a_repeated_prompt(client, server):
    prompt = "Kubernetes schedules pods onto nodes; each pod runs one or more containers. " * 3
    before = server.metric("vllm:prefix_cache_hits_total")
    queries = server.metric("vllm:prefix_cache_queries_total")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    hits = server.metric("vllm:prefix_cache_hits_total") - before
    # The second request reuses every full 16-token block but the one holding the last token
    # (its logits are needed); the first found nothing (the text is unique to this test).
    prompt_tokens = first.usage.prompt_tokens
    assert hits == (prompt_tokens - 1) // 16 * 16 > 0
    assert server.metric("vllm:prefix_cache_queries_total") - queries == 2 * prompt_tokens
