"""Choose the model's dtype from ``--dtype`` and the KV cache's from ``--kv-cache-dtype`` (vLLM's
spellings) and the device."""

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


_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The oldest GPU whose Triton compile has each format: E4M3 ("fp8e4nv") from Ada/Hopper (8.9)
# on, E5M2 from Ampere (8.0) on (tests/kernels/gpu_compile.py compiles both kernels so).
_MIN_TRITON_CAPABILITY = {
    torch.float8_e4m3fn: (8, 9),
    torch.float8_e5m2: (8, 0),
}


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device, attention_backend: str
) -> torch.dtype:
    """Map a ``--kv-cache-dtype`` value (vLLM's) to the paged cache's torch dtype.

    ``"auto"`` is the model dtype; ``"fp8"`` and ``"fp8_e4m3"`` are ``torch.float8_e4m3fn``
    (OCP E4M3), ``"fp8_e5m2"`` is ``torch.float8_e5m2``: one byte per element, scaled per
    layer and tensor (``kvpilot.engine.attention.layer``).

    Args:
        kv_cache_dtype: ``"auto"``, ``"fp8"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
        model_dtype: the activations' dtype (``resolve_dtype``).
        device: where the cache lives.
        attention_backend: ``"torch"`` or ``"triton"``.

    Raises:
        ValueError: an unknown name, or an fp8 format the ``triton`` backend cannot compile
            for the GPU: E4M3 below compute capability 8.9, E5M2 below 8.0 (the message names
            the GPU and what to use instead).
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        known = ", ".join(["auto", *_KV_CACHE_DTYPES])
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; use one of {known}")
    cache_dtype = _KV_CACHE_DTYPES[kv_cache_dtype]
    if device.type == "cuda" and attention_backend == "triton":
        capability = torch.cuda.get_device_capability(device)
        needed = _MIN_TRITON_CAPABILITY[cache_dtype]
        if capability < needed:
            instead = (
                "fp8_e5m2, " if capability >= _MIN_TRITON_CAPABILITY[torch.float8_e5m2] else ""
            )
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} needs a GPU of compute capability "
                f">= {needed[0]}.{needed[1]} for the triton attention backend; "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]} "
                f"(use --kv-cache-dtype {instead}auto, or --attention-backend torch)"
            )
    return cache_dtype
