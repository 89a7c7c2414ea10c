"""The router's block hashes are the engine's: same tokens, same chain, same salt and adapter keys.

The engine's side is a real ``LLMEngine`` (its own tokenization, its own ``KVCacheManager``) and,
for an adapter, a real ``KVCacheManager`` on a ``Request`` carrying one; the router's side is
``prompt_token_ids`` on a request body and ``prompt_block_hashes`` given the engine's root hash.
Any drift (tokenization, chat rendering, hash payload, extra keys) breaks these.
"""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.model_loader import load_tokenizer
from kvpilot.engine.request import Request
from kvpilot.router.prompt_hashes import (
    CHAT_PATH,
    messages_chat_body,
    prefix_key,
    prompt_block_hashes,
    prompt_chars,
    prompt_token_ids,
    responses_chat_body,
)

BS = 16
PROMPT = "The router must hash prompts exactly as the engine does. " * 12
CHAT = [
    {"role": "system", "content": "You are a careful assistant. " * 10},
    {"role": "user", "content": "Name three colors."},
    {"role": "assistant", "content": "Red, green and blue."},
    {"role": "user", "content": [{"type": "text", "text": "And three "}, {"type": "text", "text": "more?"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLM(str(model_dir), block_size=BS, max_model_len=512).llm_engine


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def engine_hashes(engine, request_id: str, prompt, cache_salt: str | None = None) -> list[bytes]:
    """The hashes the engine gives the request's blocks (added, hashed, then aborted)."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1), cache_salt=cache_salt)
    request = engine.scheduler.requests[request_id]
    hashes = list(engine.kv_cache_manager.update_block_hashes(request))
    engine.abort_request(request_id)
    return hashes


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_completion_prompt_hashes_equal_the_engines(engine, tokenizer, salt) -> None:
    body = {"model": "m", "prompt": PROMPT}
    token_ids = prompt_token_ids(tokenizer, "/v1/completions", body)
    root = engine.kv_cache_manager.root_hash
    ours = prompt_block_hashes(token_ids, BS, root, cache_salt=salt)
    assert len(ours) == len(token_ids) // BS >= 5
    assert ours == engine_hashes(engine, f"completion-{salt}", PROMPT, cache_salt=salt)
    # Salts part the chains from the first block on.
    other = prompt_block_hashes(token_ids, BS, root, cache_salt="tenant-b")
    assert not set(other) & set(ours)


def test_token_id_prompts_and_batches_hash_their_first_prompt(engine, tokenizer) -> None:
    ids = list(range(100, 180))
    root = engine.kv_cache_manager.root_hash
    expected = engine_hashes(engine, "ids", {"prompt_token_ids": ids})
    for prompt in (ids, [ids, [5, 6, 7]]):
        token_ids = prompt_token_ids(tokenizer, "/v1/completions", {"prompt": prompt})
        assert prompt_block_hashes(token_ids, BS, root) == expected


def test_chat_hashes_equal_the_engines_on_transformers_rendering(engine, tokenizer) -> None:
    body = {"model": "m", "messages": CHAT, "cache_salt": "s"}
    token_ids = prompt_token_ids(tokenizer, "/v1/chat/completions", body)
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else "And three \nmore?"}
            for m in CHAT]  # fmt: skip
    reference = tokenizer.apply_chat_template(flat, tokenize=True, add_generation_prompt=True)
    reference = reference if isinstance(reference, list) else reference["input_ids"]
    assert token_ids == reference
    ours = prompt_block_hashes(token_ids, BS, engine.kv_cache_manager.root_hash, cache_salt="s")
    assert ours == engine_hashes(engine, "chat", {"prompt_token_ids": reference}, cache_salt="s")


def test_responses_and_messages_bodies_render_as_their_chat_conversation(tokenizer) -> None:
    """A Responses API body and an Anthropic Messages body are tokenized as the chat body the
    engine renders from them (the same conversation as ``CHAT``)."""
    system, (user, assistant, more) = CHAT[0]["content"], CHAT[1:]
    chat = prompt_token_ids(tokenizer, CHAT_PATH, {"messages": CHAT})
    parts = [{"type": "input_text", "text": p["text"]} for p in more["content"]]
    response = {
        "instructions": system,
        "input": [user, assistant, {"role": "user", "content": parts}],
    }
    assert prompt_token_ids(tokenizer, CHAT_PATH, responses_chat_body(response)) == chat
    blocks = [{"type": "text", "text": p["text"]} for p in more["content"]]
    message = {"system": system, "messages": [user, assistant, {"role": "user", "content": blocks}]}
    assert prompt_token_ids(tokenizer, CHAT_PATH, messages_chat_body(message)) == chat
    # A partial last assistant message (an Anthropic prefill) is continued, not answered.
    continued = prompt_token_ids(
        tokenizer,
        CHAT_PATH,
        {"messages": CHAT[:3], "add_generation_prompt": False, "continue_final_message": True},
    )
    partial = {**assistant, "status": "incomplete"}
    view = responses_chat_body({"instructions": system, "input": [user, partial]})
    assert prompt_token_ids(tokenizer, CHAT_PATH, view) == continued
    view = messages_chat_body({"system": system, "messages": [user, assistant]})
    assert prompt_token_ids(tokenizer, CHAT_PATH, view) == continued
    # Bodies the engine will refuse, or whose conversation a replica holds, give no view.
    assert responses_chat_body({"input": 5}) is None
    assert responses_chat_body({"input": "Hi", "previous_response_id": "resp_1"}) is None
    assert messages_chat_body({"messages": [{"role": "tool", "content": "x"}]}) is None


def test_chat_parts_reach_a_template_that_loops_over_them_as_the_engine_sends_them(
    tokenizer,
) -> None:
    """A chat template that iterates over a message's content gets OpenAI's list of parts, as
    the engine's default ``--chat-template-content-format auto`` gives it, so the router
    tokenizes the prompt the engine renders."""
    template = (
        "{% for m in messages %}<{{ m.role }}>{% for part in m.content %}[{{ part.text }}]"
        "{% endfor %}{% endfor %}"
    )
    body = {"model": "m", "messages": CHAT, "chat_template": template}
    token_ids = prompt_token_ids(tokenizer, "/v1/chat/completions", body)
    rendered = "".join(
        f"<{m['role']}>"
        + "".join(
            f"[{part['text']}]"
            for part in (
                m["content"]
                if isinstance(m["content"], list)
                else [{"type": "text", "text": m["content"]}]
            )
        )
        for m in CHAT
    )
    assert token_ids == tokenizer.encode(rendered, add_special_tokens=False)


def test_adapter_hashes_equal_a_kv_cache_managers() -> None:
    token_ids = list(range(1000, 1070))
    lora = LoRARequest("sql", 1, "/adapters/sql")
    manager = KVCacheManager(num_blocks=32, block_size=BS, enable_caching=True, root_hash=b"r")
    request = Request(
        request_id="a",
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(),
        eos_token_ids=frozenset(),
        max_tokens=1,
        cache_salt="t",
        lora_request=lora,
        lora_digest="ab12",
    )
    expected = manager.update_block_hashes(request)
    assert prompt_block_hashes(token_ids, BS, b"r", "t", ("sql", "ab12")) == expected
    assert prompt_block_hashes(token_ids, BS, b"r", "t", ("sql", "cd34")) != expected
    assert prompt_block_hashes(token_ids, BS, b"r", "t") != expected


def test_bodies_without_a_usable_prompt_give_no_tokens(tokenizer) -> None:
    for path, body in [
        ("/v1/completions", {}),
        ("/v1/completions", {"prompt": 3}),
        ("/v1/chat/completions", {"messages": "hi"}),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ]:
        assert prompt_token_ids(tokenizer, path, body) is None
    assert prefix_key({"model": "m", "prompt": "x" * 1000}) == prefix_key(
        {"model": "m", "prompt": "x" * 300}
    )


def test_a_prompt_past_max_chars_is_measured_not_tokenized(tokenizer) -> None:
    chat = [{"role": "system", "content": "s" * 300}, {"role": "user", "content": [
        {"type": "text", "text": "ab"}, {"type": "image_url"}]}]  # fmt: skip
    assert prompt_chars("/v1/chat/completions", {"messages": chat}) == 302
    assert prompt_chars("/v1/completions", {"prompt": ["abc", "de"]}) == 3
    assert prompt_chars("/v1/completions", {"prompt": [1, 2, 3, 4]}) == 4
    assert prompt_chars("/v1/completions", {"prompt": None}) == 0
    body = {"prompt": "word " * 100}
    assert prompt_token_ids(tokenizer, "/v1/completions", body, max_chars=499) is None
    assert prompt_token_ids(tokenizer, "/v1/completions", body, max_chars=500)
    assert prompt_token_ids(tokenizer, "/v1/chat/completions", {"messages": chat}, 200) is None
    # The hash key of a long conversation reads its first characters only.
    longer = [*chat, {"role": "user", "content": "z" * 10**6}]
    assert prefix_key({"messages": chat}) == prefix_key({"messages": longer})
    assert prefix_key({"messages": chat}) != prefix_key({"messages": chat[1:]})


async def test_the_built_in_model_name_names_its_tokenizer(default_model_dir):
    """``--tokenizer SmolLM2-135M-Instruct`` loads the built-in model's tokenizer, as
    ``kvpilot serve`` without ``--model`` serves it."""
    import prometheus_client

    from kvpilot.engine.model_loader import load_tokenizer
    from kvpilot.router.app import Router
    from kvpilot.router.config import RouterConfig

    router = Router(
        # No replica listens there: only the tokenizer matters here.
        RouterConfig(endpoints=["http://127.0.0.1:9"], tokenizer="SmolLM2-135M-Instruct"),
        prometheus_client.CollectorRegistry(),
    )
    await router.start()
    try:
        ids = await router.tokenizer.encode("Hello, world", "prompt")
        assert ids == load_tokenizer(default_model_dir).encode("Hello, world")
    finally:
        await router.stop()
