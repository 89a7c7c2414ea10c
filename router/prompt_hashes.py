"""A request's prompt as the engine will see it: token ids, then the engine's own block hashes.

The router tokenizes with the engine's code (``kvpilot.engine.tokenization``: ``encode_text`` for
completions, ``apply_chat_template`` for chat, as ``engine/server`` does) and hashes the tokens
with the engine's hash chain (``kvpilot.engine.kv_cache_manager.extend_block_hashes`` and
``block_extra_keys``, over ``block_pool.hash_block_tokens``), so a router index keyed by these
hashes speaks the engine's language: given the engine's root hash, block size, salt and adapter
digest, they are the engine's hashes (``tests/router/test_prompt_hashes.py`` holds them equal).

Where a replica publishes its KV events (``GET /kv_events``), the router roots the chain at the
``root_hash`` it reports, so that the chain is the engine's own and matches its cached hashes.
Elsewhere (an engine without KV events, or not polled yet) it roots each chain at
``model_root_hash(model)``: the index is then the router's own guess, which only needs to agree
with itself, and the model name keeps models and adapters apart. Adapter digests are left out
either way (the router cannot read them).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvpilot.engine.block_pool import BlockHash
from kvpilot.engine.chat_content_format import resolve_content_format
from kvpilot.engine.kv_cache_manager import block_extra_keys, extend_block_hashes
from kvpilot.engine.server.anthropic_protocol import CountTokensRequest
from kvpilot.engine.server.responses_items import input_messages
from kvpilot.engine.server.responses_protocol import ResponsesRequest
from kvpilot.engine.tokenization import (
    apply_chat_template,
    encode_text,
    parse_chat_messages,
    with_reasoning_effort,
)

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
PREFIX_KEY_CHARS = 256
"""Characters of the prompt that the consistent-hash fallback keys on."""


def model_root_hash(model: str) -> BlockHash:
    """The router's root of every chain for ``model`` (32 bytes)."""
    return hashlib.sha256(f"kvpilot-router\0{model}".encode()).digest()


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root_hash: BlockHash,
    cache_salt: str | None = None,
    lora: tuple[str, str | None] | None = None,
) -> list[BlockHash]:
    """The engine's hashes of every full block of a prompt.

    Args:
        token_ids: the prompt's token ids.
        block_size: the engine's ``--block-size`` (tokens per block, > 0).
        root_hash: the parent of the first block (the engine's model identity, or
            ``model_root_hash``).
        cache_salt: the request's ``cache_salt``.
        lora: ``(adapter name, weight digest)`` of the request's adapter, or None.

    Returns:
        ``len(token_ids) // block_size`` hashes of 32 bytes.
    """
    return extend_block_hashes(
        [], token_ids, block_size, root_hash, block_extra_keys(cache_salt, lora)
    )


def responses_chat_body(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """A Responses API body as the chat completions body the engine renders for it (the
    engine's own conversion: ``responses_items.input_messages`` and
    ``ResponsesRequest.to_chat_request``); None when it continues a stored response (its
    conversation is on the replica that stored it) or cannot be read (the engine answers it)."""
    if body.get("previous_response_id") is not None:
        return None
    try:
        request = ResponsesRequest.model_validate(body)
        chat = request.to_chat_request(input_messages(request.instructions, request.input))
    except ValueError:
        return None
    return chat.model_dump(exclude_none=True)


def messages_chat_body(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """An Anthropic Messages API body as the chat completions body the engine renders for it
    (the engine's own conversion, ``MessagesRequest.to_chat_request``; read as a
    ``count_tokens`` body, since ``max_tokens`` changes no prompt); None when it cannot be
    read (the engine answers it)."""
    try:
        return (
            CountTokensRequest.model_validate(body).to_chat_request().model_dump(exclude_none=True)
        )
    except ValueError:
        return None


def prompt_chars(path: str, body: Mapping[str, Any]) -> int:
    """A lower bound on the characters the engine will tokenize for a request body, in time
    linear in the number of messages (never in their length): the completions prompt's (its
    first, for a batch), or the sum of the chat messages' text contents. A token-id prompt
    counts its ids. 0 when there is no prompt the router can read."""
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(_content_chars(m.get("content")) for m in messages if isinstance(m, Mapping))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    return len(prompt) if isinstance(prompt, str | list) else 0


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        texts = (p.get("text") for p in content if isinstance(p, Mapping))
        return sum(len(t) for t in texts if isinstance(t, str))
    return 0


def prompt_token_ids(
    tokenizer: Any, path: str, body: Mapping[str, Any], max_chars: int | None = None
) -> list[int] | None:
    """The prompt token ids the engine's server computes for a request body, or None when the
    body has no prompt the router can tokenize (the engine answers those with a 400 itself) or
    one longer than ``max_chars`` (``tokenization.max_prompt_chars`` of the replicas' context:
    the engine refuses it; the router does not pay for tokenizing it).

    A completions request's first prompt only (a batch goes to one replica). Chat requests are
    rendered with the tokenizer's chat template, or the request's ``chat_template``, their
    content in the format that template expects (the engine's default
    ``--chat-template-content-format auto``); a server
    started with ``--chat-template`` renders otherwise, and the router's affinity then only
    matches its own earlier routing, which it still does. Runs the tokenizer: call it from the
    one thread that owns it.
    """
    try:
        if path == CHAT_PATH:
            tools = body.get("tools") or None
            template = body.get("chat_template") or tokenizer.chat_template
            # The engine's default --chat-template-content-format auto, for the same template.
            content_format = resolve_content_format("auto", template, has_tools=bool(tools))
            return apply_chat_template(
                tokenizer,
                parse_chat_messages(body["messages"], content_format),
                tools=tools,
                chat_template=body.get("chat_template"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                chat_template_kwargs=with_reasoning_effort(
                    body.get("reasoning_effort"), body.get("chat_template_kwargs")
                ),
                max_chars=max_chars,
            )
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return encode_text(tokenizer, prompt, "prompt", max_chars=max_chars)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
    except Exception as exc:  # noqa: BLE001 - any bad input: no affinity, the engine answers it
        logger.debug("not tokenized (%s): %s", type(exc).__name__, exc)
    return None


def prefix_key(body: Mapping[str, Any]) -> bytes:
    """The consistent-hash key of a request: its model, salt and the first
    ``PREFIX_KEY_CHARS`` characters of its prompt, or of its messages' roles and text
    (bounded work, however long the prompt)."""
    prompt = body.get("messages", body.get("prompt", ""))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], Mapping):
        parts = []
        for message in prompt:
            if sum(map(len, parts)) >= PREFIX_KEY_CHARS or not isinstance(message, Mapping):
                break
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(
                    p["text"][:PREFIX_KEY_CHARS]
                    for p in content[:8]
                    if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                )
            parts.append(f"{message.get('role')}:{str(content)[:PREFIX_KEY_CHARS]}\n")
        text = "".join(parts)
    elif isinstance(prompt, list):
        text = json.dumps(prompt[:PREFIX_KEY_CHARS], default=str)
    else:
        text = str(prompt)[:PREFIX_KEY_CHARS]
    head = f"{body.get('model')}\0{body.get('cache_salt')}\0{text[:PREFIX_KEY_CHARS]}"
    return head.encode("utf-8", "surrogatepass")
