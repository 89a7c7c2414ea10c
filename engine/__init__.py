"""The kvpilot inference engine: paged KV cache, continuous batching, OpenAI-compatible server.

The offline API mirrors vLLM's::

    from kvpilot.engine import LLM, SamplingParams
    llm = LLM()  # the built-in default model, SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

Names are imported lazily so that ``import kvpilot.engine`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LLM": "kvpilot.engine.llm",
    "LLMEngine": "kvpilot.engine.llm_engine",
    "SamplingParams": "kvpilot.engine.sampling_params",
    "StructuredOutputsParams": "kvpilot.engine.sampling_params",
    "RequestOutput": "kvpilot.engine.outputs",
    "CompletionOutput": "kvpilot.engine.outputs",
    "TextPrompt": "kvpilot.engine.input_processor",
    "TokensPrompt": "kvpilot.engine.input_processor",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpilot.engine' has no attribute {name!r}")
