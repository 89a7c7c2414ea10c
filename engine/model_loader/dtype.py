"""Choose the model's dtype from ``--dtype`` (vLLM's spellings) and the device."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, config: PretrainedConfig | None = None
) -> torch.dtype:
    """Map a ``--dtype`` value to a torch dtype.

    ``"auto"`` is float32 on CPU (fast and exact there, and what transformers computes in for
    the token-exact comparisons); on a GPU it is the checkpoint's 16-bit dtype when it has one,
    else bfloat16 where the GPU supports it, else float16.

    Args:
        dtype: ``"auto"``, ``"float32"``/``"float"``, ``"float16"``/``"half"``,
            ``"bfloat16"``, or a torch dtype among those.
        device: where the model will run.
        config: the model's config (its ``dtype``/``torch_dtype`` guides ``"auto"`` on GPU).

    Raises:
        ValueError: an unknown dtype name (the message lists the accepted ones).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _NAMES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {sorted(_NAMES)}")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
        checkpoint = getattr(config, "dtype", None) if config is not None else None
        if isinstance(checkpoint, str):
            checkpoint = _NAMES.get(checkpoint)
        if checkpoint == torch.float16 or (checkpoint == torch.bfloat16 and bf16_ok):
            return checkpoint
        return torch.bfloat16 if bf16_ok else torch.float16
    if dtype not in _NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto' or one of {sorted(_NAMES)}")
    return _NAMES[dtype]
