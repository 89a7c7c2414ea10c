"""``speculative_config``: which proposer drafts tokens, and how many (vLLM's JSON shape).

This module imports no torch: the CLI parses ``--speculative-config`` with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
METHODS = (NGRAM, DRAFT_MODEL)

# vLLM's defaults when neither prompt-lookup bound is given.
DEFAULT_PROMPT_LOOKUP_MIN = 5
DEFAULT_PROMPT_LOOKUP_MAX = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, one per engine.

    Field names and the JSON shape are vLLM's (``--speculative-config``)::

        {"method": "ngram", "num_speculative_tokens": 4,
         "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        {"method": "draft_model", "model": "path/or/hub-id", "num_speculative_tokens": 4}

    As in vLLM, ``method`` may be left out when ``model`` is given (a draft model), and when
    only one of the prompt-lookup bounds is given the other takes its value (both default to 5).

    Attributes:
        method: ``"ngram"`` (prompt lookup) or ``"draft_model"``.
        num_speculative_tokens: the most draft tokens proposed per request and step (k >= 1).
        model: the draft model (local folder, ``.gguf`` or hub id); ``draft_model`` only.
        revision: the draft model's hub revision.
        prompt_lookup_min: shortest suffix (tokens) the n-gram proposer matches.
        prompt_lookup_max: longest suffix (tokens) the n-gram proposer matches.

    Raises:
        ValueError: from ``__post_init__`` for a bad value; the message names the field.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    revision: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config: unknown method {self.method!r}; supported: "
                f"{', '.join(METHODS)}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        if self.method == DRAFT_MODEL:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative_config: method 'draft_model' needs 'model' (the draft model's "
                    "folder or hub id)"
                )
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config: {name} applies to method 'ngram' only")
            return
        if self.model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no 'model'")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low, high = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        low = high if low is None else low
        high = low if high is None else high
        _check_int("prompt_lookup_min", low, minimum=1)
        _check_int("prompt_lookup_max", high, minimum=1)
        if low > high:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({low}) must be <= "
                f"prompt_lookup_max ({high})"
            )
        # Frozen: the resolved bounds are stored through object.__setattr__.
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def from_json(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Build from the JSON text of ``--speculative-config`` or from its dict.

        Raises:
            ValueError: text that is not a JSON object, an unknown key, a missing
                ``num_speculative_tokens``, or any value ``__post_init__`` refuses.
        """
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a JSON object, got {type(value).__name__}"
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; accepted: "
                f"{', '.join(known)}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: 'num_speculative_tokens' is required")
        args = dict(value)
        if args.get("method") is None:
            if args.get("model") is None:
                raise ValueError(
                    f"speculative_config: 'method' is required ({', '.join(METHODS)}) unless "
                    "'model' names a draft model"
                )
            args["method"] = DRAFT_MODEL
        return cls(**args)

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape, without unset fields."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"speculative_config: {name} must be an integer >= {minimum}, got {value!r}"
        )
