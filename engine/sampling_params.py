"""Per-request sampling parameters, named as in vLLM (and the OpenAI API where it has a name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """The constraint a request's output must satisfy (vLLM's ``StructuredOutputsParams``);
    set exactly one of the constraint fields.

    Attributes:
        json: a JSON Schema (a dict or its JSON text): the output is one JSON value valid
            against it (OpenAI's ``response_format`` ``json_schema``).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in EBNF (GBNF), whose ``root`` rule the output matches.
        json_object: the output is a JSON object (OpenAI's ``response_format`` ``json_object``).
        disable_any_whitespace: JSON without optional whitespace (no newlines or indentation
            between tokens); some models otherwise emit whitespace without end.

    Raises:
        ValueError: ``structured_outputs: ...`` when none or several constraints are set, or a
            field has the wrong type. Whether a schema, regex or grammar is valid is checked
            when it is compiled (``LLMEngine.add_request``).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of json, regex, choice, grammar, "
                f"json_object; got {kinds or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("structured_outputs: json must be a JSON Schema (dict or string)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs: {name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs: choice must be a list of non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint is set: ``json``, ``regex``, ``choice``, ``grammar`` or
        ``json_object``."""
        if self.json_object:
            return "json_object"
        return next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None
        )


@dataclass
class SamplingParams:
    """How to sample one request's output tokens.

    Field names follow vLLM's ``SamplingParams``. ``temperature=0`` means greedy decoding.
    Token limits are counted in tokens; probabilities are in [0, 1].

    Raises:
        ValueError: from ``__post_init__`` when a value is out of range; the message names the
            parameter (the server turns it into an OpenAI-style 400 with ``param`` set).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token (plus the sampled one)
    # Number of top logprobs per prompt token (plus the prompt token itself); the first prompt
    # token gets None. Such a request computes its whole prompt (no prefix-cache read).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # None: unconstrained. With speculative decoding, constrained requests are not speculated.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: sample only among these token ids; never produce these words (each banned as
    # its token sequence, at the start of a word and inside one).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # The bad words' token sequences, filled from the tokenizer when the request is added
    # (vLLM's ``_bad_words_token_ids``).
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's: arguments for custom logits processors, carried with the request (kvpilot's own
    # processors read none of them).
    extra_args: dict[str, Any] | None = None
    # vLLM's: the most tokens of a think block (tokens after the think start, the prompt's
    # included); once spent, the engine forces the end-of-thinking tokens. None or -1: no limit.
    # Needs the engine's reasoning config (``reasoning_parser`` / ``reasoning_config``).
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        self.thinking_token_budget = check_thinking_token_budget(self.thinking_token_budget)
        self._check()

    def _check(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise ValueError(f"{param} {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - self.n:
            bad("seed", f"must be a 64-bit signed integer (seed + n - 1 too), got {self.seed}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"must be >= 0, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            bad("stop", "must not contain empty strings")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty (no token could be sampled)")
            if not all(is_int(t) for t in self.allowed_token_ids):
                bad(
                    "allowed_token_ids",
                    f"must be token ids (integers), got {self.allowed_token_ids!r}",
                )
        if self.bad_words is not None:
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                bad("bad_words", "must be non-blank strings")
            if not all(is_unicode(w) for w in self.bad_words):
                bad("bad_words", "the text is not valid Unicode (it holds a lone surrogate)")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int):
                    bad(
                        "logit_bias",
                        f"keys must be token ids (int), got {tok!r} ({type(tok).__name__})",
                    )
                if not -100.0 <= float(bias) <= 100.0:
                    bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tok}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature < _GREEDY_EPS


def check_thinking_token_budget(value: Any) -> int | None:
    """vLLM's ``thinking_token_budget`` rule: a non-negative integer (tokens), or -1 or None for
    no limit (returned as None).

    Raises:
        ValueError: ``thinking_token_budget: must be an integer >= 0, or -1 for no limit, got
            ...`` for anything else (a number below -1, a float, a bool, a string).
    """
    if value is None or (is_int(value) and value == -1):
        return None
    if not is_int(value) or value < 0:
        raise ValueError(
            f"thinking_token_budget: must be an integer >= 0, or -1 for no limit, got {value!r}"
        )
    return value


def is_int(value: Any) -> bool:
    """An integer and not a bool (``True`` would index a tensor as a mask, or count as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_unicode(text: str) -> bool:
    """Whether UTF-8 can encode ``text`` (JSON may carry lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
