"""Fused elementwise ops of a decoder layer on the CPU (a C++ PyTorch extension): RMSNorm with the
residual add, SiLU-and-mul and the GPT-NeoX rotary embedding; and the sampler's greedy argmax.

The engine's torch path runs each of these as several PyTorch ops, each a pass over memory and
a dispatch; here each is one pass per row (vLLM's CPU build fuses them likewise). Each follows
its PyTorch expression operation for operation, rounding where it rounds:

- :func:`rms_norm` (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"):
  ``kvpilot.kernels.reference.rms_norm``, the residual sum and the ``weight_offset`` (Gemma)
  variant included. The sum of squares is added up in the order of ATen's CPU sum kernel, so
  float32 and bfloat16 results equal the reference's bit for bit.
- :func:`silu_and_mul` (Shazeer 2020, "GLU Variants Improve Transformer"):
  ``reference.silu_and_mul``, ``silu(g) = g / (1 + exp(-g))`` with SLEEF's ``expf`` (the one
  ATen's vectorized SiLU calls) on whole vectors and ``std::exp`` on the rest of a row; results
  equal the reference's or differ by an ulp of ``exp``.
- :func:`rotary_neox` (Su et al. 2021, "RoFormer"): ``apply_rotary_emb`` of
  ``kvpilot.engine.layers.rotary_embedding`` (Hugging Face's ``x * cos + rotate_half(x) * sin``,
  each product and the sum rounded to the dtype, no fused multiply-add), partial rotary
  included; bit for bit the torch path's.

Rows are split over ATen's OpenMP threads (``torch.set_num_threads``) only when a call has at
least 32768 elements per thread's share; a decode step's rows stay on the calling thread. The
row loops are compiled for AVX-512, AVX2 and baseline x86-64 (picked at load time) without
fused multiply-adds, so every CPU rounds alike.

The source is ``elementwise.cpp`` beside this file (package data), prebuilt or built on first use
like the other CPU kernels (:mod:`kvpilot.kernels.cpu.extension`): when the build fails,
:func:`load_extension` logs one warning and returns None, and the engine's layers keep their
torch path. ``KVPILOT_CPU_ELEMENTWISE=0`` turns the kernels off without trying to build them;
they are used on x86-64 only (where ATen's summation order is the one reproduced).
"""

from __future__ import annotations

import logging
import pathlib
import platform
from types import ModuleType

import torch

from kvpilot.kernels.cpu import extension

ENV_VAR = "KVPILOT_CPU_ELEMENTWISE"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SOURCE = pathlib.Path(__file__).with_name("elementwise.cpp")
EXTENSION_NAME = "kvpilot_cpu_elementwise"
# No fused multiply-add: each product and sum rounds as PyTorch's separate ops do.
CFLAGS = ["-ffp-contract=off"]
KERNEL = extension.Kernel(
    EXTENSION_NAME,
    SOURCE,
    "CPU elementwise kernels",
    "RMSNorm, SiLU-and-mul and the rotary embedding keep the torch path",
    tuple(CFLAGS),
    (SOURCE.with_name("silu.h"),),
)


# The machines whose ATen summation order the kernel reproduces (8 float lanes, whatever the
# AVX level); other CPUs (ATen's NEON or SVE vectors) keep the torch path.
MACHINES = ("x86_64", "AMD64")


def enabled() -> bool:
    """Whether the kernels are used: an x86-64 CPU and ``$KVPILOT_CPU_ELEMENTWISE`` unset or
    anything but ``0``/``false``/``off``/``no``."""
    return platform.machine() in MACHINES and extension.env_enabled(ENV_VAR)


load_extension = extension.loader(KERNEL)


def available() -> bool:
    """Whether the kernels can run: enabled and built (builds on first call)."""
    return enabled() and load_extension() is not None


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors as they are: all on the CPU, contiguous, one
    float32 or bfloat16 dtype, and the extension built (the layers' test for their fast path;
    views such as per-head ones cut out of a fused projection are left to the torch path)."""
    dtype = tensors[0].dtype
    if dtype not in SUPPORTED_DTYPES:
        return False
    for t in tensors:  # a plain loop: this runs several times per layer and step
        if not t.is_cpu or t.dtype != dtype or not t.is_contiguous():
            return False
    return load_extension() is not None


def _extension() -> ModuleType:
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the CPU elementwise extension could not be built")
    return ext


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of ``x``, or of ``x + residual``: ``reference.rms_norm``'s contract.

    Args:
        x: ``[..., hidden_size]``, contiguous, float32 or bfloat16 on the CPU.
        weight: ``[hidden_size]``, contiguous, ``x``'s dtype.
        eps: added to the mean square before the reciprocal square root.
        residual: optional, ``x``'s shape and dtype, contiguous; ``x + residual`` (rounded to
            the dtype) is normalised and returned as the new residual. Neither input is
            written.
        weight_offset: 0.0 scales by ``weight`` after rounding the normalised row to the dtype
            (Llama); otherwise by ``weight_offset + weight`` in float32, rounding once (Gemma:
            1.0).

    Returns:
        ``out`` shaped like ``x`` in its dtype, or ``(out, x + residual)``, both new tensors.

    Raises:
        RuntimeError: the extension could not be built (see :func:`available`), or a device,
            dtype, shape or layout it does not take (the message names it).
    """
    ext = _extension()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = None if residual is None else torch.empty_like(out)
    ext.rms_norm(out, x, weight, float(eps), new_residual, residual, float(weight_offset))
    return out if new_residual is None else (out, new_residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a stacked gate/up output: ``silu(x[..., :d]) * x[..., d:]``.

    Args:
        x: ``[..., 2 * d]``, contiguous, float32 or bfloat16 on the CPU.

    Returns:
        A new ``[..., d]`` tensor, ``x``'s dtype.

    Raises:
        RuntimeError: the extension could not be built, or an odd last dimension, a strided
            ``x``, another device or dtype (the message names it).
    """
    ext = _extension()
    if x.dim() == 0 or x.shape[-1] % 2:
        raise RuntimeError(
            f"silu_and_mul: x's last dimension must be even (gate, then up), got {tuple(x.shape)}"
        )
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    ext.silu_and_mul(out, x)
    return out


def rotary_neox(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key`` as ``apply_rotary_emb`` does (GPT-NeoX / Hugging Face
    ``rotate_half`` layout): their first ``rotary_dim`` features turn, the rest pass through.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, float32 or bfloat16 on the CPU, each
            token's ``[num_heads, head_dim]`` contiguous (a view of a fused QKV output is fine).
        key: ``[num_tokens, num_kv_heads, head_dim]``, likewise.
        cos, sin: ``[num_tokens, 1, rotary_dim]`` (or ``[num_tokens, rotary_dim]``),
            contiguous, ``query``'s dtype (``RotaryEmbedding.cos_sin``); ``rotary_dim`` even
            and at most ``head_dim``.

    Returns:
        ``(query, key)`` rotated, new contiguous tensors shaped and typed like the inputs.

    Raises:
        RuntimeError: the extension could not be built, or a device, dtype, shape or layout it
            does not take (the message names it).
    """
    ext = _extension()
    outs = []
    for x in (query, key):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ext.rotary_neox(out, x, cos, sin)
        outs.append(out)
    return outs[0], outs[1]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` of float32 rows: the first index of each row's largest
    value, or of its first NaN (ranked above every number, as torch ranks it). Greedy
    sampling's pick; ATen's CPU argmax compares an element at a time (~0.9 ms for 32 rows of
    a 49,152-token vocabulary on one thread), this finds the maximum a vector at a time, then
    the first element equal to it (~0.1 ms).

    Args:
        x: ``[rows, n]`` float32 on the CPU, ``n >= 1`` (copied first if not contiguous).

    Returns:
        ``[rows]`` int64 indices, a new tensor.

    Raises:
        RuntimeError: the extension could not be built, or another dtype, rank or device, or
            empty rows.
    """
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _extension().argmax(out, x.contiguous())
    return out


if __name__ == "__main__":
    # ``python -m kvpilot.kernels.cpu.elementwise``: load the kernels now (building them into
    # torch's cache if the prebuilt folder lacks them); ``python -m kvpilot.kernels.cpu`` also
    # installs them into the prebuilt folder.
    logging.basicConfig(level=logging.INFO)
    print("CPU elementwise kernels:", "built" if available() else "unavailable (torch path)")
