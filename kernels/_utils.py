"""Input checks shared by the kernel wrappers (Triton, and the layouts the CPU kernels take).

A Triton kernel trusts its arguments: a wrong dtype or shape gives garbage, an out-of-range
index an illegal memory access (or, under ``TRITON_INTERPRET=1``, a crashed process). The
wrappers therefore check everything a kernel relies on and raise ``ValueError`` naming the
argument, before anything is launched or written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# What a paged KV cache may be stored in: the activation dtypes, or fp8 with per-tensor scales.
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)

# A GPU compile of tl.dot needs every operand dimension >= 16; the interpreter does not check.
MIN_DOT_DIM = 16


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_to_fp32(dtype: torch.dtype) -> bool:
    """Whether a kernel must compute on ``dtype`` values only after casting them to float32.

    The interpreter handles bfloat16 as raw 16-bit integers (triton-lang/triton issue 11584),
    so bf16 is cast right after loading there; on a GPU native bf16 is kept for tensor cores.
    """
    return dtype == torch.bfloat16 and interpreting()


def check_tensor(
    fn: str,
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
) -> None:
    """Raise ``ValueError`` unless ``t`` is a tensor of the given rank, dtype and shape.

    Args:
        fn: the public function's name, for the message.
        name: the argument's name, for the message.
        t: the value passed.
        ndim: required number of dimensions.
        dtypes: allowed dtypes.
        shape: required sizes; ``None`` entries are free.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{fn}: {name} must have dtype in ({allowed}), got {t.dtype}")
    if shape is not None:
        if len(shape) != t.dim() or any(
            want is not None and want != got for want, got in zip(shape, t.shape, strict=True)
        ):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{fn}: {name} must have shape {want}, got {tuple(t.shape)}")


def rows_contiguous(x: torch.Tensor) -> bool:
    """Whether each token's ``[num_heads, head_dim]`` of a ``[num_tokens, num_heads, head_dim]``
    tensor is contiguous (views of a fused QKV output are): the layout the CPU kernels read."""
    return x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


def check_inner_contiguous(fn: str, name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the last dimension of ``t`` has stride 1."""
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{fn}: {name} must be contiguous in its last dimension, got strides {t.stride()}"
        )


def check_contiguous(fn: str, name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``t`` is contiguous."""
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got strides {t.stride()}")


def check_same_device(fn: str, tensors: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless all ``tensors`` (name -> tensor) are on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        found = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"{fn}: all tensors must be on one device, got {found}")


def check_index_range(fn: str, name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Raise ``ValueError`` if an entry of ``t`` lies outside ``[low, high)``.

    Reading a CUDA tensor's values would synchronise the device on every call of a hot-path
    kernel, so only host tensors (the CPU and interpreter path) are checked; on a GPU the
    caller (the model runner) is responsible for valid indices.
    """
    if t.device.type != "cpu" or t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        raise ValueError(
            f"{fn}: {name} entries must lie in [{low}, {high}), got values in [{lo}, {hi}]"
        )


def check_dot_dims(fn: str, dims: dict[str, int]) -> None:
    """Raise ``ValueError`` if a ``tl.dot`` operand dimension (name -> size) is below 16.

    The interpreter multiplies any shape, but a GPU compile rejects dimensions under 16; this
    keeps a block-size choice that works on CPU from failing only on the GPU.
    """
    small = {name: size for name, size in dims.items() if size < MIN_DOT_DIM}
    if small:
        raise ValueError(f"{fn}: tl.dot dimensions must be >= {MIN_DOT_DIM}, got {small}")


def check_number(fn: str, name: str, value: object, *, positive: bool) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number (``> 0`` if ``positive``,
    else ``>= 0``)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{fn}: {name} must be a finite {kind} number, got {value!r}")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def check_scales(fn: str, k_scale: object, v_scale: object, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``k_scale`` and ``v_scale`` (the dequantization scales of an
    fp8 KV cache) are one-element float32 tensors on ``device``."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"{fn}: an fp8 KV cache needs {name} (a float32 scalar tensor)")
        check_tensor(fn, name, scale, dtypes=(torch.float32,))
        if scale.numel() != 1:
            raise ValueError(f"{fn}: {name} must hold one value, got shape {tuple(scale.shape)}")
        if scale.device != device:
            raise ValueError(f"{fn}: {name} is on {scale.device}, the cache on {device}")
