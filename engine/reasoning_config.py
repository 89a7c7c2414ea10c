"""``reasoning_config``: where a model's think block starts and ends, as text and as token ids
(vLLM's ``ReasoningConfig``, ``--reasoning-config``); what a request's ``thinking_token_budget``
needs to count thinking tokens and to end the block.

The JSON shape is vLLM's::

    {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
    {"reasoning_parser": "deepseek_r1", "reasoning_end_str": "Time to answer.</think>"}

As in vLLM, a reasoning parser (``--reasoning-parser``, or ``reasoning_parser`` here) supplies
the strings that are left empty: its start tag, and its end tag, which is also the end the
budget watches for when ``reasoning_end_str`` forces a longer text ending with it.

This module imports no torch: the command line parses ``--reasoning-config`` with it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThinkingTokenIds:
    """A think block's markers as token ids, each non-empty.

    Attributes:
        start: the tokens of ``reasoning_start_str``; thinking tokens are counted after them.
        end: the tokens of ``reasoning_end_str``, forced one a step once a budget is spent.
        natural_end: the tokens of the block's end as the parser knows it (``end`` without a
            parser): the budget stops counting, and forcing, once the sequence holds them.
    """

    start: tuple[int, ...]
    end: tuple[int, ...]
    natural_end: tuple[int, ...]


@dataclass(frozen=True)
class ReasoningConfig:
    """The think block's markers of one engine (vLLM's ``ReasoningConfig``).

    Attributes:
        reasoning_parser: a ``--reasoning-parser`` name (``deepseek_r1``, ``qwen3``) whose tags
            fill the strings left empty; "" for none.
        reasoning_start_str: the text that opens a think block.
        reasoning_end_str: the text forced once a request's thinking budget is spent (it may
            put a phrase before the parser's end tag).

    Raises:
        ValueError: from ``__post_init__``: ``reasoning_config: ...`` naming a field that is
            not a string, or an unknown parser.
    """

    reasoning_parser: str = ""
    reasoning_start_str: str = ""
    reasoning_end_str: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, str):
                raise ValueError(
                    f'reasoning_config: "{field.name}" must be a string, got {value!r}'
                )
        if self.reasoning_parser and self.reasoning_parser not in _parsers():
            raise ValueError(
                f'reasoning_config: unknown "reasoning_parser" {self.reasoning_parser!r}; '
                f"supported: {', '.join(_parsers())}"
            )

    @classmethod
    def from_json(
        cls, value: str | dict[str, Any] | ReasoningConfig | None, reasoning_parser: str | None
    ) -> ReasoningConfig | None:
        """The engine's config from ``--reasoning-config`` (JSON text, its dict, or a config)
        and ``--reasoning-parser``, which names the parser whatever the JSON says (vLLM's rule);
        None when neither is given.

        Raises:
            ValueError: text that is not a JSON object, an unknown key, or what
                ``__post_init__`` refuses.
        """
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"reasoning_config is not valid JSON: {exc}") from None
        if isinstance(value, dict):
            known = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(known))
            if unknown:
                raise ValueError(
                    f"reasoning_config: unknown key(s) {', '.join(map(json.dumps, unknown))}; "
                    f"accepted: {', '.join(map(json.dumps, known))}"
                )
            value = cls(**value)
        if value is not None and not isinstance(value, ReasoningConfig):
            raise ValueError(f"reasoning_config must be a JSON object, got {type(value).__name__}")
        if reasoning_parser:
            value = dataclasses.replace(value or cls(), reasoning_parser=reasoning_parser)
        return value

    def thinking_token_ids(self, tokenizer: Any) -> ThinkingTokenIds | None:
        """The markers as ``tokenizer``'s token ids (no special tokens added), the parser's
        tags filling the empty strings; None, with a warning, when a start or an end string
        is still missing (a request with a thinking budget is then refused).

        Raises:
            ValueError: a string that encodes to no token.
        """
        start, end = self.reasoning_start_str, self.reasoning_end_str
        natural_end = ""
        if self.reasoning_parser:
            parser = _parsers()[self.reasoning_parser]
            start = start or parser.start_tag or ""
            end = end or parser.end_tag or ""
            natural_end = parser.end_tag or ""
        natural_end = natural_end or end
        if not start or not end:
            logger.warning(
                "reasoning_config %s gives no think start or end string: requests with a "
                "thinking_token_budget will be refused",
                self,
            )
            return None
        ids = {
            name: tuple(tokenizer.encode(text, add_special_tokens=False))
            for name, text in (("start", start), ("end", end), ("natural_end", natural_end))
        }
        empty = [name for name, token_ids in ids.items() if not token_ids]
        if empty:
            raise ValueError(
                f"reasoning_config: the think {' and '.join(empty)} string(s) of {self} encode "
                "to no token of the model's vocabulary"
            )
        return ThinkingTokenIds(**ids)


def _parsers() -> dict[str, Any]:
    """``--reasoning-parser`` names -> parser classes (imported when first needed: the
    parsers live with the server)."""
    from kvpilot.engine.server.reasoning_parsers import REASONING_PARSERS

    return REASONING_PARSERS
