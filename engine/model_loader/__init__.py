"""Find, convert and load models: local folders, Hugging Face Hub ids and the built-in default.

``DEFAULT_MODEL_NAME`` is importable without torch (the engine's config module reads it); every
other name is loaded on first use so that ``import kvpilot.engine.model_loader`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_LAZY = {
    "resolve_model": "kvpilot.engine.model_loader.resolve",
    "get_cache_dir": "kvpilot.engine.model_loader.resolve",
    "convert_gguf": "kvpilot.engine.model_loader.gguf_conversion",
    "load_model": "kvpilot.engine.model_loader.weights",
    "read_model_config": "kvpilot.engine.model_loader.weights",
    "iterate_safetensors": "kvpilot.engine.model_loader.weights",
    "resolve_dtype": "kvpilot.engine.model_loader.dtype",
    "resolve_kv_cache_dtype": "kvpilot.engine.model_loader.dtype",
    "load_tokenizer": "kvpilot.engine.model_loader.tokenizer",
    "get_eos_token_ids": "kvpilot.engine.model_loader.tokenizer",
    "read_sampling_defaults": "kvpilot.engine.model_loader.generation_config",
}

__all__ = ["DEFAULT_MODEL_NAME", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpilot.engine.model_loader' has no attribute {name!r}")
