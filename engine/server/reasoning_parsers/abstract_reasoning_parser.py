"""The reasoning parser interface (vLLM's ``ReasoningParser``): a choice's generated text split
into the model's reasoning (``message.reasoning`` / ``delta.reasoning``) and its answer
(``content``), streamed or whole."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.protocol import DeltaMessage


class ReasoningParser:
    """Splits one choice's output into reasoning and content.

    One instance per choice: ``extract_reasoning_streaming`` keeps state between deltas, and
    ``extract_reasoning`` feeds it the whole output at once, so a streamed and a whole response
    always agree: the reasoning pieces of any split of the output, joined, are the whole
    output's reasoning, and so are the content pieces its content.

    Args:
        chat_template_kwargs: the request's template variables after merging
            (``chat_template_kwargs`` over its own fields), which some parsers read, as vLLM's do
            (Qwen3's ``enable_thinking``).
        constrained: the output is constrained by structured outputs from its first token.
            vLLM starts the grammar once the reasoning has ended, kvpilot from the first token,
            so such an output is the answer: it holds reasoning only if it opens a reasoning
            block itself.
    """

    def __init__(
        self, chat_template_kwargs: Mapping[str, Any] | None = None, constrained: bool = False
    ) -> None:
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.constrained = constrained

    start_tag: str | None = None
    """The text that opens the reasoning block, None where the parser has none; the default
    ``reasoning_start_str`` of the engine's ``reasoning_config`` (vLLM's parser's
    ``reasoning_start_str``), which the thinking token budget counts from."""
    end_tag: str | None = None
    """The text that closes the reasoning block, None where the parser has none; the default
    ``reasoning_end_str`` (the tokens forced once a thinking budget is spent), and always the
    end the budget watches for."""

    keeps_special_tokens = False
    """Whether the parser must see special tokens in the text (Qwen3's tags are special
    tokens; vLLM keeps them for its parser), as ``ToolParser.keeps_special_tokens``."""

    def adjust_request(self, params: SamplingParams) -> None:
        """Change the request's sampling before it is submitted (default: keep special tokens
        in the text where ``keeps_special_tokens``)."""
        if self.keeps_special_tokens:
            params.skip_special_tokens = False

    def extract_reasoning_streaming(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        """The delta to send for newly generated text.

        Args:
            delta_text: text generated since the last call.
            finished: the output is complete: flush whatever is held back.

        Returns:
            ``reasoning`` and/or ``content`` (never an empty string), or None when nothing is
            ready yet.
        """
        raise NotImplementedError

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output; either is None when empty."""
        delta = self.extract_reasoning_streaming(model_output, finished=True)
        if delta is None:
            return None, None
        return delta.reasoning, delta.content

    def count_reasoning_tokens(
        self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]
    ) -> int:
        """How many of a whole output's tokens are reasoning (``reasoning_tokens`` in the
        usage); 0 by default, for a parser that cannot tell.

        Args:
            token_ids: ``[num_output_tokens]`` the output's token ids.
            decode: the text of a prefix of them, as the output's text was decoded.
        """
        return 0
