"""``AsyncTokenizer``: every tokenizer call runs on one worker thread, never the event loop's,
and gives what the tokenizer gives when called directly."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvpilot.engine.model_loader import load_tokenizer
from kvpilot.engine.server.async_tokenizer import AsyncTokenizer

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
