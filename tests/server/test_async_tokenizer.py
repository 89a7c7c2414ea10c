"""``AsyncTokenizer``: every tokenizer call runs on one worker thread, never the event loop's,
and gives what the tokenizer gives when called directly."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvpilot.engine.model_loader import load_tokenizer
from kvpilot.engine.server.async_tokenizer import AsyncTokenizer
from kvpilot.engine.tokenization import longest_token_bytes

CONVERSATION = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


async def test_calls_run_on_one_thread_off_the_loop(tokenizer, default_model_dir):
    reference = load_tokenizer(default_model_dir)
    worker = AsyncTokenizer(tokenizer)
    try:
        threads = await asyncio.gather(
            *(worker.call(lambda _: threading.get_ident()) for _ in range(8))
        )
        assert len(set(threads)) == 1 and threads[0] != threading.get_ident()
        ids = await worker.encode("Hello, world", "prompt")
        assert ids == reference.encode("Hello, world")
        assert await worker.decode(ids) == reference.decode(ids)
        chat_ids = await worker.apply_chat_template(CONVERSATION, add_generation_prompt=True)
        expected = reference.apply_chat_template(CONVERSATION, add_generation_prompt=True)
        assert chat_ids == list(expected["input_ids"])
        with pytest.raises(ValueError, match="^prompt: the text is not valid Unicode"):
            await worker.encode("\ud800", "prompt")
    finally:
        worker.shutdown()


async def test_a_text_far_over_the_context_is_refused_without_waiting_for_the_tokenizer(
    tokenizer,
):
    """The bound is by length: no text of more than 2 * longest_token_bytes characters per
    context token can fit, so a prompt is refused at once, even while the tokenizer thread is
    busy."""
    longest = longest_token_bytes(tokenizer)
    assert longest == 81  # SmolLM2's vocabulary
    worker = AsyncTokenizer(tokenizer, max_prompt_tokens=100)
    release = threading.Event()
    try:
        busy = asyncio.ensure_future(worker.call(lambda _: release.wait(30)))
        with pytest.raises(ValueError, match="^prompt: the text is 16201 characters"):
            await worker.encode("x" * (2 * longest * 100 + 1), "prompt")
        release.set()
        await busy
        # A rendered chat prompt is measured once rendered, on the tokenizer thread.
        with pytest.raises(ValueError, match="^messages: the text is"):
            await worker.apply_chat_template([{"role": "user", "content": "x" * 20_000}])
        # At the bound, texts are tokenized as ever (the server then counts their tokens).
        assert len(await worker.encode("x" * (2 * longest * 100), "prompt")) > 100
    finally:
        release.set()
        worker.shutdown()


def test_the_length_bound_never_refuses_a_text_that_fits(tokenizer):
    """The densest text there is, the longest token repeated, still has at least
    len(text) / longest tokens: the bound holds with room to spare."""
    vocab = tokenizer.get_vocab()
    longest = longest_token_bytes(tokenizer)
    token = max(vocab, key=lambda t: len(tokenizer.convert_tokens_to_string([t]).encode()))
    text = tokenizer.convert_tokens_to_string([token]) * 50
    assert len(tokenizer.encode(text, add_special_tokens=False)) * longest >= len(text)
