"""``POST /tokenize`` and ``POST /detokenize``: vLLM's tokenizer endpoints, on the server's own
tokenizer and chat template, so a client counts a prompt's tokens exactly as the engine will
(before it sends it, against ``max_model_len``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvpilot.engine.server.async_tokenizer import AsyncTokenizer
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from kvpilot.engine.server.serving_chat import OpenAIServingChat
from kvpilot.engine.server.serving_models import OpenAIServingModels


def tokenize_request_type(body: Any) -> type[BaseModel]:
    """The ``/tokenize`` body's model: a conversation when it has ``messages``, else a text."""
    return (
        TokenizeChatRequest
        if isinstance(body, dict) and "messages" in body
        else (TokenizeCompletionRequest)
    )


class OpenAIServingTokenization:
    """The two endpoints.

    Args:
        tokenizer: the server's tokenizer thread.
        models: resolves ``model`` (a 404 for an unknown name, as the other endpoints).
        chat: renders a conversation as ``/v1/chat/completions`` does.
        max_model_len: the context (tokens), reported with every answer.
        vocab_size: token ids ``/detokenize`` accepts are ``0..vocab_size - 1``.
    """

    def __init__(
        self,
        tokenizer: AsyncTokenizer,
        models: OpenAIServingModels,
        chat: OpenAIServingChat,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.models = models
        self.chat = chat
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    async def tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        """The prompt token ids of a text or a conversation.

        Raises:
            OpenAIError: 404 for an unknown ``model``; 400 for a text that is not valid
                Unicode or far longer than any prompt, or a conversation the template refuses.
        """
        self.models.resolve(request.model)
        if isinstance(request, TokenizeChatRequest):
            tokens = await self.chat.render(request)
        else:
            try:
                tokens = await self.tokenizer.encode(
                    request.prompt, "prompt", request.add_special_tokens
                )
            except ValueError as exc:
                raise bad_request(exc, "prompt") from None
        strings = None
        if request.return_token_strs:
            strings = await self.tokenizer.call(lambda t: t.convert_ids_to_tokens(tokens))
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.max_model_len, tokens=tokens, token_strs=strings
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids (special tokens included, as the tokenizer writes them).

        Raises:
            OpenAIError: 404 for an unknown ``model``; 400 for an id outside the vocabulary.
        """
        self.models.resolve(request.model)
        bad = next((t for t in request.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"tokens: {bad} is not a token id of this model (0..{self.vocab_size - 1})",
                "tokens",
            )
        return DetokenizeResponse(prompt=await self.tokenizer.decode(request.tokens))
