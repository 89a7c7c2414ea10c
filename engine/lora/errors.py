"""The errors of an adapter the engine cannot use.

This module imports no torch: the server tells them apart to answer the request that named the
adapter (``kvpilot.engine.server.serving_models``).
"""

from __future__ import annotations


class LoRAAdapterError(ValueError):
    """An adapter folder that cannot be used: missing files, an unsupported PEFT feature, a
    target this engine cannot adapt, or weights that do not fit the model."""


class LoRAAdapterGoneError(LoRAAdapterError):
    """A registered adapter whose host copy was dropped (``--max-cpu-loras``) and whose files
    are gone when it is read again: the engine has unloaded it, and it must be loaded again."""
