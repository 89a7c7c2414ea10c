"""The ``deepseek_r1`` reasoning parser (vLLM's ``DeepSeekR1ReasoningParser``): DeepSeek-R1 and
its distillations think in ``<think>`` ... ``</think>``, and their chat template opens
``<think>`` in the prompt, so the output often begins inside the block:

    The user wants the weather in Paris.</think>It is sunny in Paris.

Everything up to ``</think>`` is reasoning, the rest content; without ``</think>`` the whole
output is reasoning and there is no content, as vLLM's parser reads it
(``BaseThinkingReasoningParser`` has the rules).
"""

from __future__ import annotations

from kvpilot.engine.server.reasoning_parsers.basic_parsers import BaseThinkingReasoningParser


class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    """``<think>`` ... ``</think>`` reasoning, the output starting inside the block (vLLM's
    ``DeepSeekR1ReasoningParser``, read from the text rather than from token ids, so any
    tokenizer works: vLLM refuses one without ``<think>`` and ``</think>`` tokens).

    Args:
        chat_template_kwargs: unused (DeepSeek-R1 has no thinking switch).
        constrained: see ``ReasoningParser``.
    """
