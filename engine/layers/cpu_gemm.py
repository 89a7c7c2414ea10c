"""The matrix multiply of every linear layer: for float32 on the CPU, kvpilot's packed-panel
kernel where the CPU has AVX-512, else oneDNN with a pre-packed weight.

``F.linear`` on a float32 CPU tensor calls the BLAS the wheel was built with (MKL), which on
some CPUs (AMD's among them) runs a slower code path. Two faster paths, both computing in
float32 (no reduced-precision math):

- :mod:`kvpilot.kernels.cpu.gemm` (AVX-512): 1.15-1.35x oneDNN at decode batch sizes, within a
  few percent of it at prefill sizes, at the memory's bandwidth for a few rows; and its
  summation order depends on ``K`` alone, so a row's result does not depend on the batch it
  is in (batch invariance);
- oneDNN's brgemm kernels (``torch.ops.mkldnn._linear_pointwise``) with the weight reordered
  once into oneDNN's blocked layout, 2.3-3x faster than ``F.linear`` here (AMD EPYC); vLLM's
  CPU backend packs its linear weights for oneDNN too. Used where the kernel is not available.

Once the weights are loaded, the engine replaces each linear layer's weight by its packed copy
(:func:`prepack`), so the packed layout is the only copy in memory. A weight that also serves
as something else (the input embedding table tied to the LM head) stays dense; its packed copy
is kept on the tensor and rebuilt when it changes (another data pointer or an in-place update,
seen through ``Tensor._version``). Other dtypes and devices go to ``F.linear`` unchanged.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from kvpilot.kernels.cpu import gemm, greedy_head, huge_pages

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and (_ONEDNN or gemm.available())
    )


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (float32 on the CPU) in the layout :func:`linear` multiplies fastest here."""
    with torch.no_grad():
        if gemm.available():
            return gemm.pack_weight(weight)
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def prepack(
    weights: list[torch.Tensor], gated: list[bool] | None = None
) -> list[torch.Tensor | None]:
    """The packed copies of float32 CPU weights; None for each where neither the kernel nor
    oneDNN is used (another dtype or device).

    Each result has its weight's shape and dtype and no dense values: a
    :class:`kvpilot.kernels.cpu.gemm.PackedWeight` (AVX-512) or an opaque ``torch._mkldnn``
    tensor. Only :func:`linear` (and, gated, :func:`silu_and_mul`) reads it, so the caller
    drops the dense weight for it. The kernel's panels of all the weights are slices of one
    buffer in transparent huge pages where the system gives them
    (:mod:`kvpilot.kernels.cpu.huge_pages`): a decode step streams them all from memory, and
    most single weights are too small to hold a whole 2 MiB page.

    Args:
        weights: each ``[out_features, in_features]``.
        gated: for each weight, whether it is a stacked gate/up projection ``[gate; up]`` to
            pack for :func:`silu_and_mul` (the kernel only; oneDNN packs it as it is); None:
            none is.
    """
    gated = gated or [False] * len(weights)
    eligible = [w.device.type == "cpu" and w.dtype == torch.float32 for w in weights]
    if not (gemm.available() or _ONEDNN):
        return [None] * len(weights)
    if not gemm.available():
        return [_pack(w) if ok else None for w, ok in zip(weights, eligible, strict=True)]
    # None for another dtype or device (a quantized layer's weight, of any shape).
    shapes = [
        gemm.packed_shape(*w.shape) if ok else None for w, ok in zip(weights, eligible, strict=True)
    ]
    sizes = [0 if shape is None else math.prod(shape) for shape in shapes]
    arena = huge_pages.empty((sum(sizes),), torch.float32)
    starts = itertools.accumulate(sizes, initial=0)
    return [
        None if shape is None else gemm.pack_weight(w, arena[at : at + size].view(shape), gate)
        for w, gate, shape, at, size in zip(weights, gated, shapes, starts, sizes, strict=False)
    ]


def is_packed(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a packed copy from :func:`prepack` (no dense values)."""
    return isinstance(weight, gemm.PackedWeight) or weight.is_mkldnn


def is_gated(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a gate/up projection packed for :func:`silu_and_mul`."""
    return isinstance(weight, gemm.PackedWeight) and weight.gated


def silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a gate/up projection, ``silu(x Wg^T) * (x Wu^T)``, in one pass of the kernel:
    the bits of :func:`linear` followed by the SiLU-and-mul activation.

    Args:
        x: ``[..., in_features]`` float32 on the CPU.
        weight: ``[2 d, in_features]``, packed gated by :func:`prepack` (see :func:`is_gated`).

    Returns:
        ``[..., d]`` float32.

    Raises:
        RuntimeError: a weight not packed gated, or mismatched shapes (the message says which).
    """
    return gemm.packed_silu_and_mul(x, weight)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` packed, cached on the tensor until it changes."""
    key = (weight.data_ptr(), weight._version)
    cached = getattr(weight, "_kvpilot_packed", None)
    if cached is None or cached[0] != key:
        cached = (key, _pack(weight))
        weight._kvpilot_packed = cached
    return cached[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b``, as ``F.linear``.

    Args:
        x: ``[..., in_features]``.
        weight: ``[out_features, in_features]``, same dtype and device as ``x``; dense, or
            already packed by :func:`prepack` (then ``x`` must be float32 on the CPU).
        bias: ``[out_features]`` or None.

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.
    """
    if is_packed(weight):
        packed = weight
    elif _eligible(x, weight):
        packed = _packed(weight)
    else:
        return F.linear(x, weight, bias)
    if isinstance(packed, gemm.PackedWeight):
        return gemm.packed_linear(x, packed, bias)
    out = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, x.shape[-1]), packed, bias, "none", [], ""
    )
    return out.view(*x.shape[:-1], weight.shape[0])


def greedy_tokens(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """Each row's ``argmax(linear(x, weight))`` (the first index of the largest float32
    product) from :mod:`kvpilot.kernels.cpu.greedy_head`: a bfloat16 screen with a rigorous
    bound and the float32 products of the few columns it cannot rule out, in the GEMM kernel's
    order, so the same indices as the full product, bit for bit.

    Args:
        x: ``[M, in_features]`` float32 on the CPU (the LM head's input rows).
        weight: ``[out_features, in_features]`` float32, dense or packed by :func:`prepack`.
            Its screen (a bfloat16 copy, half the float32 weight's bytes) is built on the first
            call and kept on the packed weight.

    Returns:
        ``[M]`` int64, -1 for a row the screen leaves undecided (a value that is not finite,
        or logits all nearly equal); None where the screen does not apply: another dtype or
        device, the GEMM kernel not in use, or a CPU without AVX-512 BF16 (see
        :func:`greedy_head.available`).
    """
    if not (x.dim() == 2 and greedy_head.available()):
        return None
    if is_packed(weight):
        packed = weight
    elif _eligible(x, weight):
        packed = _packed(weight)
    else:
        return None
    if not isinstance(packed, gemm.PackedWeight) or packed.gated:
        return None
    if not hasattr(packed, "_kvpilot_screen"):
        packed._kvpilot_screen = greedy_head.build_screen(packed)
    if packed._kvpilot_screen is None:  # a weight that is not finite
        return None
    return greedy_head.greedy_tokens(x, packed, packed._kvpilot_screen)
