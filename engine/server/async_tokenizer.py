"""The server's tokenizer, used from the event loop through one dedicated worker thread.

Tokenizing a prompt costs about 0.7 s per MB of text on one core, and rendering a chat
template is not free either: done on the event loop, one large prompt would stall ``/health``
and every other stream for seconds. So the server never calls the tokenizer itself: it awaits
these methods, which run on a thread of their own (the Rust tokenizer releases the GIL while it
encodes). One thread, because a fast tokenizer must not be used by two threads at once (it fails
with "Already borrowed"); the object given here must be used by no other thread either (the
engine detokenizes on its own thread with its own tokenizer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from kvpilot.engine.tokenization import (
    apply_chat_template,
    check_prompt_chars,
    encode_text,
    max_prompt_chars,
)

T = TypeVar("T")


class AsyncTokenizer:
    """Runs tokenizer work off the event loop, one call at a time, in arrival order.

    Args:
        tokenizer: a Hugging Face tokenizer owned by this object from now on.
        max_prompt_tokens: the model's context (tokens): prompts far longer, by their length
            in characters, are refused before they reach the tokenizer; None: no limit.

    Call ``shutdown()`` when the server stops.
    """

    def __init__(self, tokenizer: Any, max_prompt_tokens: int | None = None) -> None:
        self._tokenizer = tokenizer
        self.max_chars = (
            None if max_prompt_tokens is None else max_prompt_chars(tokenizer, max_prompt_tokens)
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(tokenizer, *args, **kwargs)`` on the tokenizer thread; its exceptions propagate.

        A caller cancelled while waiting stops waiting; work already running finishes.
        """
        work = functools.partial(fn, self._tokenizer, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """``[num_tokens]`` token ids of ``text`` (see ``tokenization.encode_text``).

        Raises:
            ValueError: ``"{param}: the text is not valid Unicode (...)"``, or the text is far
                longer than any prompt that fits (refused at once, off no thread).
        """
        check_prompt_chars(text, self.max_chars, param)
        return await self.call(encode_text, text, param, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included."""
        return await self.call(lambda tokenizer: tokenizer.decode(token_ids))

    async def apply_chat_template(
        self, conversation: list[dict[str, Any]], **kwargs: Any
    ) -> list[int]:
        """Prompt token ids of a conversation (see ``tokenization.apply_chat_template``).

        Raises:
            ValueError: naming ``messages`` or ``continue_final_message``.
        """
        return await self.call(
            apply_chat_template, conversation, max_chars=self.max_chars, **kwargs
        )

    def shutdown(self) -> None:
        """Drop queued work and let the thread end once its current call returns."""
        self._executor.shutdown(wait=False, cancel_futures=True)
