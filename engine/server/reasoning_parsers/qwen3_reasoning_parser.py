"""The ``qwen3`` reasoning parser (vLLM 0.32's ``qwen3``): Qwen3 thinks in ``<think>`` ...
``</think>``, like DeepSeek-R1 (``BaseThinkingReasoningParser``), with the differences vLLM's
Qwen3 parser makes:

- ``chat_template_kwargs={"enable_thinking": false}`` turns thinking off in Qwen3's template,
  and the parser off with it: the whole output is content, any tag included;
- a ``<tool_call>`` ends the reasoning even without ``</think>``, and is content (for the
  ``hermes`` tool parser to read);
- special tokens stay in the text (vLLM sets ``skip_special_tokens`` false for it).

As in vLLM 0.32, the output starts inside the block (Qwen3's thinking templates open it in the
prompt): without ``</think>`` it is all reasoning.
"""

from __future__ import annotations

from kvpilot.engine.server.reasoning_parsers.basic_parsers import BaseThinkingReasoningParser


class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    """``<think>`` ... ``</think>`` reasoning, ended early by ``<tool_call>``; off when the
    request's ``enable_thinking`` template variable is false (vLLM 0.32's ``qwen3``,
    ``Qwen3Parser`` behind its reasoning adapter).

    Args:
        chat_template_kwargs: the request's merged template variables; ``enable_thinking``
            (default true) is read.
        constrained: see ``ReasoningParser``.
    """

    implicit_end_tags = ("<tool_call>",)
    keeps_special_tokens = True  # as vLLM does for this parser

    def thinking_enabled(self) -> bool:
        """``enable_thinking`` from the request's template variables (default true)."""
        return bool(self.chat_template_kwargs.get("enable_thinking", True))
