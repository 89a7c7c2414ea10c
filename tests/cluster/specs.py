"""LLMDeployment specs the cluster tests share (pure data)."""

from __future__ import annotations

from typing import Any

NO_ENGINE = "registry.example/kvpilot-test/no-engine:1"
"""An image the kubelet stand-in starts no process for: the pod is ready at once (tests of the
operator's logic that need no engine answering)."""


def engineless(source: str, gpu: str = "L4", **extra: Any) -> dict[str, Any]:
    """A spec for the model at ``source`` on ``gpu`` whose pods run no engine (``NO_ENGINE``);
    ``extra`` adds or replaces top-level spec fields."""
    return {"model": {"source": source}, "gpu": {"type": gpu}, "image": NO_ENGINE, **extra}
