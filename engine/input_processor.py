"""Requests in: validation, tokenization and ``n`` fan-out (vLLM V1's input processor).

Everything a request can get wrong is found here, before the scheduler sees it, so that a bad
request raises in ``add_request`` and never fails a step that other requests share. The
OpenAI server calls the same checks (:func:`check_token_ids`, :func:`check_sampling_params`)
and turns their ``ValueError`` into a 400 naming the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypedDict

from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.tokenization import encode_text


class TextPrompt(TypedDict, total=False):
    """A prompt as text (vLLM's ``vllm.inputs.TextPrompt``); ``prompt`` is required."""

    prompt: str
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """A prompt as token ids (vLLM's ``vllm.inputs.TokensPrompt``); ``prompt_token_ids`` is
    required."""

    prompt_token_ids: list[int]
    cache_salt: str


PromptType = str | dict
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
"""vLLM's prompt dict: one of the first two keys, optionally a salt for the prefix cache."""


def check_cache_salt(cache_salt: object) -> None:
    """Refuse a prefix-cache salt vLLM refuses: anything but a non-empty string (None: no salt).

    Raises:
        ValueError: ``cache_salt: must be a non-empty string if provided, ...``.
    """
    if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
        raise ValueError(f"cache_salt: must be a non-empty string if provided, got {cache_salt!r}")


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Refuse token ids outside the vocabulary ``[0, vocab_size)``: the one range check for
    prompts, ``logit_bias`` keys and ``stop_token_ids``.

    Raises:
        ValueError: ``{param}: token ids [...] are outside the vocabulary [0, vocab_size)``
            (the first five offenders).
    """
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )


def check_sampling_params(params: SamplingParams, vocab_size: int) -> None:
    """Refuse sampling parameters this model cannot honour (``SamplingParams`` checks the rest
    on construction): ``logprobs`` / ``prompt_logprobs`` above the vocabulary size, and
    ``logit_bias`` or ``stop_token_ids`` ids outside it.

    Raises:
        ValueError: the message starts with the parameter's name.
    """
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(params, name) or 0) > vocab_size:
            raise ValueError(
                f"{name} must be at most the vocabulary size ({vocab_size}), got "
                f"{getattr(params, name)}"
            )
    check_token_ids(params.logit_bias or (), vocab_size, "logit_bias")
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(params.allowed_token_ids or (), vocab_size, "allowed_token_ids")


def bad_words_token_ids(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """The token sequences that spell each bad word, as vLLM finds them: the word alone (as at
    the start of a text) and with a leading space (as after another word) where that is a
    different first token and as many tokens.

    Returns:
        ``[num_sequences][num_tokens]`` token ids, one or two sequences per word.
    """
    sequences: list[list[int]] = []
    for word in bad_words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return sequences


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's ``n`` sequences: the request's own for one, ``id:i`` for more."""
    return [request_id] if n == 1 else [f"{request_id}:{i}" for i in range(n)]


@dataclass(frozen=True)
class ProcessedPrompt:
    """A checked prompt.

    Attributes:
        text: the prompt text, or None when it came as token ids.
        token_ids: its token ids, ``[num_prompt_tokens]``, each in the vocabulary.
        max_tokens: output tokens allowed (tokens): the request's ``max_tokens`` clamped so that
            prompt and output fit ``max_model_len`` and the KV cache.
        cache_salt: the prefix-cache salt, or None.
    """

    text: str | None
    token_ids: list[int]
    max_tokens: int
    cache_salt: str | None


class InputProcessor:
    """Checks and tokenizes prompts for one engine.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary size (tokens).
        max_model_len: prompt plus output limit (tokens).
        capacity_tokens: the whole KV cache (tokens); a longer prompt could never run.
        thinking_budget: whether the engine knows its think markers (its reasoning config),
            without which a ``thinking_token_budget`` is refused, as vLLM refuses it.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        capacity_tokens: int,
        thinking_budget: bool = False,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens
        self.thinking_budget = thinking_budget

    def process(
        self, prompt: PromptType, params: SamplingParams, cache_salt: str | None = None
    ) -> ProcessedPrompt:
        """Check ``params`` and the prompt (text, ``{"prompt": text}`` or
        ``{"prompt_token_ids": [...]}``, optionally with ``"cache_salt"``); tokenize it.

        Raises:
            ValueError: naming the problem: ``params`` not a ``SamplingParams`` or out of the
                vocabulary (:func:`check_sampling_params`), an empty prompt, an unknown prompt
                dict key, an empty ``cache_salt`` or one given twice, a prompt longer than
                ``max_model_len`` or than the whole KV cache, token ids outside the vocabulary,
                a ``thinking_token_budget`` on an engine without a reasoning config.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_sampling_params(params, self.vocab_size)
        if params.thinking_token_budget is not None and not self.thinking_budget:
            raise ValueError(
                "thinking_token_budget needs the engine to know where a think block starts and "
                "ends: start it with --reasoning-parser and/or --reasoning-config"
            )
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if isinstance(prompt, dict) and "cache_salt" in prompt:
            if cache_salt is not None:
                raise ValueError(
                    "cache_salt: given both in the prompt dict and as an argument; give one"
                )
            cache_salt = prompt["cache_salt"]
        check_cache_salt(cache_salt)
        text, token_ids = self._tokenize(prompt)
        return ProcessedPrompt(
            text, token_ids, self._max_tokens(len(token_ids), params), cache_salt
        )

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - set(PROMPT_DICT_KEYS), key=str)
            if unknown:
                raise ValueError(
                    f"prompt dict has unknown keys {unknown}: it takes 'prompt' or "
                    "'prompt_token_ids', and optionally 'cache_salt'"
                )
            if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError(
                    "prompt dict must have exactly one of the keys 'prompt' or "
                    f"'prompt_token_ids', got {sorted(prompt)}"
                )
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, list | tuple) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in token_ids
                ):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return None, self._check_prompt(list(token_ids))
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or a dict, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt, self._check_prompt(encode_text(self.tokenizer, prompt, "prompt"))

    def _check_prompt(self, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise ValueError("prompt is empty (0 tokens)")
        check_token_ids(token_ids, self.vocab_size, "prompt")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, longer than max_model_len "
                f"({self.max_model_len})"
            )
        if len(token_ids) > self.capacity_tokens:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens and can never fit the KV cache "
                f"({self.capacity_tokens} tokens)"
            )
        return token_ids

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """Clamp the output length so that prompt + output fits ``max_model_len`` (as vLLM) and
        the KV cache (the last sampled token needs no slot)."""
        limits = [self.max_model_len - prompt_len, self.capacity_tokens + 1 - prompt_len]
        if params.max_tokens is not None:
            limits.append(params.max_tokens)
        return max(1, min(limits))
