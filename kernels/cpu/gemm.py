"""The float32 matrix multiply of the linear layers on the CPU (a C++ PyTorch extension).

``y = x W^T`` for ``x`` ``[M, K]`` and a weight ``W`` ``[N, K]`` packed once (:func:`pack_weight`)
into panels of 32 output features stored k-major, so that each panel streams from memory as
one run of 64-byte vectors. AVX-512 micro-kernels multiply up to 12 rows of ``x`` against a
panel with fused multiply-adds; the panels are split over ATen's OpenMP threads
(``torch.set_num_threads``). A gate/up projection packed ``gated`` (16 gate and their 16 up
features a panel) also gives SwiGLU in the same pass (:func:`packed_silu_and_mul`).

The summation order is fixed by ``K`` alone: the input features are cut into chunks of 128 (the
last may be shorter), each chunk's partial sum is taken in order from zero, and the partial
sums are added in chunk order. It does not depend on ``M``, on the other rows, or on the
thread count, so a row's result is the same bit for bit in any batch (batch invariance: a
request's tokens do not depend on the requests scheduled beside it), where oneDNN's blocking
changes with ``M``. Against oneDNN (``torch.ops.mkldnn._linear_pointwise`` with a packed weight,
what the engine used before) it ran 1.15-1.35x faster at decode batch sizes (8-64 rows) and
within a few percent at prefill sizes; at 1-4 rows both read the weights at the memory's
bandwidth (``benchmarks/cpu_gemm.py``; figures in docs/benchmarks.md).

The source is ``gemm.cpp`` beside this file (package data), prebuilt or built on first use
like the other CPU kernels (:mod:`kvpilot.kernels.cpu.extension`). It needs AVX-512F (and FMA):
:func:`available` is False elsewhere, as it is when the build fails (one warning) or when
``KVPILOT_CPU_GEMM=0`` turns it off, and the engine then keeps oneDNN.
"""

from __future__ import annotations

import functools
import logging
import math
import pathlib
from types import ModuleType

import torch

from kvpilot.kernels.cpu import extension, huge_pages

ENV_VAR = "KVPILOT_CPU_GEMM"
SOURCE = pathlib.Path(__file__).with_name("gemm.cpp")
EXTENSION_NAME = "kvpilot_cpu_gemm"
KERNEL = extension.Kernel(
    EXTENSION_NAME,
    SOURCE,
    "CPU GEMM kernel",
    "float32 linear layers keep oneDNN",
    headers=(SOURCE.with_name("silu.h"), SOURCE.with_name("x86.h")),
)
PANEL = 32
"""Output features per panel of a packed weight."""
# What the kernel writes (gemm.cpp's Output): the product, or SwiGLU of a gated weight.
LINEAR, SILU_AND_MUL = 0, 1


def enabled() -> bool:
    """Whether ``$KVPILOT_CPU_GEMM`` allows the kernel (unset or anything but
    ``0``/``false``/``off``/``no``)."""
    return extension.env_enabled(ENV_VAR)


load_extension = extension.loader(KERNEL)


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: enabled, built (builds on the first call) and an AVX-512
    CPU."""
    return enabled() and extension.cpu_supported(load_extension)


class PackedWeight(torch.Tensor):
    """A linear layer's weight ``[out_features, in_features]`` float32, held only as the
    kernel's panels: a tensor of that shape, dtype and device for whoever asks (``.shape``,
    ``nn.Parameter``, LoRA's sizing), whose uses are :func:`packed_linear` and, gated,
    :func:`packed_silu_and_mul`.

    Attributes:
        panels: ``[ceil(out_features / 32), in_features, 32]`` float32, contiguous: 32 rows a
            panel, or, ``gated``, 16 gate rows and their 16 up rows; rows past the weight's
            zero.
        gated: whether the weight is a stacked gate/up projection ``[gate; up]`` packed for
            :func:`packed_silu_and_mul` (see :func:`pack_weight`).

    Any other operation on it raises ``RuntimeError`` naming the operation: the dense values
    are not kept.
    """

    panels: torch.Tensor
    gated: bool

    @staticmethod
    def __new__(cls, panels: torch.Tensor, out_features: int, gated: bool = False) -> PackedWeight:
        weight = torch.Tensor._make_wrapper_subclass(
            cls,
            (out_features, panels.shape[1]),
            dtype=panels.dtype,
            device=panels.device,
            requires_grad=False,
        )
        weight.panels = panels
        weight.gated = gated
        return weight

    def __repr__(self) -> str:  # the default one would read the values
        gated = ", gated" if self.gated else ""
        return f"PackedWeight(shape={tuple(self.shape)}, dtype={self.dtype}{gated})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # nn.Parameter detaches its data; nothing else has a meaning for a packed weight.
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return PackedWeight(args[0].panels, args[0].shape[0], args[0].gated)
        raise RuntimeError(
            f"a packed linear weight only multiplies (kvpilot.kernels.cpu.gemm.packed_linear); "
            f"{func} is not supported"
        )


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The panels' shape of a packed ``[out_features, in_features]`` weight, gated or not:
    ``(ceil(out_features / 32), in_features, 32)``."""
    return (math.ceil(out_features / PANEL), in_features, PANEL)


def pack_weight(
    weight: torch.Tensor, out: torch.Tensor | None = None, gated: bool = False
) -> PackedWeight:
    """``weight`` ``[out_features, in_features]`` float32 on the CPU, packed for the kernel (a
    copy; ``weight`` is not kept).

    Args:
        weight: ``[out_features, in_features]`` float32 on the CPU.
        out: where to pack it: a contiguous float32 CPU tensor of :func:`packed_shape` (a slice
            of one buffer for all of a model's weights, say); None for a new tensor, in
            transparent huge pages where the system gives them
            (:mod:`~kvpilot.kernels.cpu.huge_pages`).
        gated: ``weight`` is a gate/up projection ``[gate; up]`` (``out_features = 2 d``):
            each panel then holds 16 gate rows and the 16 up rows of the same features, so
            that :func:`packed_silu_and_mul` finishes SwiGLU in the GEMM; :func:`packed_linear`
            still gives ``[gate | up]``.

    Raises:
        RuntimeError: the kernel is not available (see :func:`available`), or another dtype,
            device or rank, an odd ``out_features`` with ``gated``, or an ``out`` of another
            shape (the message names it).
    """
    ext = _extension()
    if weight.dim() != 2:
        raise RuntimeError(f"kvpilot cpu gemm: the weight must be 2-D, not {weight.dim()}-D")
    if out is None:
        out = torch.empty(packed_shape(*weight.shape))
        huge_pages.advise(out)  # streamed from memory every decode step
    with torch.no_grad():
        ext.pack_weight(weight.detach(), out, gated)
    return PackedWeight(out, weight.shape[0], gated)


def packed_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + b`` in the kernel's fixed summation order (see the module docstring).

    Args:
        x: ``[..., in_features]`` float32 on the CPU (copied first if not contiguous).
        weight: from :func:`pack_weight`.
        bias: ``[out_features]`` float32, added after the sum, or None.

    Returns:
        ``[..., out_features]`` float32, a new tensor.

    Raises:
        RuntimeError: the kernel is not available, or shapes, dtypes or devices that do not
            match (the message names them).
    """
    out = _run(x, weight, weight.shape[0], LINEAR)
    if bias is not None:
        out += bias
    return out


def packed_silu_and_mul(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer") of a gate/up projection in one
    pass: ``silu(x Wg^T) * (x Wu^T)`` for ``W = [Wg; Wu]`` packed ``gated``.

    The same bits as :func:`packed_linear` followed by
    :func:`kvpilot.kernels.cpu.elementwise.silu_and_mul` (both sums in the kernel's order, then
    ``g / (1 + exp(-g))`` with SLEEF's ``expf`` in the chunks ATen's silu takes, rounded, times
    ``u``), without writing the ``[..., 2 d]`` projection out and reading it back.

    Args:
        x: ``[..., in_features]`` float32 on the CPU (copied first if not contiguous).
        weight: ``[2 d, in_features]`` from :func:`pack_weight` with ``gated=True``.

    Returns:
        ``[..., d]`` float32, a new tensor.

    Raises:
        RuntimeError: the kernel is not available, a weight not packed gated, or shapes,
            dtypes or devices that do not match (the message names them).
    """
    if not weight.gated:
        raise RuntimeError("kvpilot cpu gemm: silu_and_mul needs a weight packed with gated=True")
    return _run(x, weight, weight.shape[0] // 2, SILU_AND_MUL)


def _run(x: torch.Tensor, weight: PackedWeight, width: int, output: int) -> torch.Tensor:
    """The kernel's ``output`` for ``x`` ``[..., K]``: ``[..., width]``, a new tensor."""
    # A packed weight means the kernel was available when it was packed: no other check a call
    # (this runs four times a layer and step).
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the CPU GEMM kernel could not be built")
    rows = (
        x
        if x.dim() == 2 and x.is_contiguous()
        else x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous()
    )
    out = torch.empty((rows.shape[0], width), dtype=x.dtype, device=x.device)
    ext.packed_linear(out, rows, weight.panels, weight.shape[0], weight.gated, output)
    return out if rows is x else out.view(*x.shape[:-1], width)


def _extension() -> ModuleType:
    if not available():
        raise RuntimeError(
            "the CPU GEMM kernel is not available (switched off, not built, or no AVX-512)"
        )
    return load_extension()


if __name__ == "__main__":
    # ``python -m kvpilot.kernels.cpu.gemm``: load the kernel now (building it into torch's
    # cache if the prebuilt folder lacks it); ``python -m kvpilot.kernels.cpu`` also installs it
    # into the prebuilt folder.
    logging.basicConfig(level=logging.INFO)
    print("CPU GEMM kernel:", "available" if available() else "unavailable (oneDNN)")
