"""The matrix multiply of every linear layer: oneDNN with a pre-packed weight for float32 on CPU.

``F.linear`` on a float32 CPU tensor calls the BLAS the wheel was built with (MKL), which on
some CPUs (AMD's among them) runs a slower code path; oneDNN's brgemm kernels use the CPU's
widest vector units, and with the weight reordered once into oneDNN's blocked layout they ran
2.3-3x faster than ``F.linear`` here (AMD EPYC, AVX-512), prefill and decode shapes alike. vLLM's
CPU backend packs its linear weights for oneDNN for the same reason. Both compute in float32
(no reduced-precision math mode), only the order of the additions differs.

Once the weights are loaded, the engine replaces each linear layer's weight by its packed copy
(:func:`prepack`), so the packed layout is the only copy in memory. A weight that also serves
as something else (the input embedding table tied to the LM head) stays dense; its packed copy
is kept on the tensor and rebuilt when it changes (another data pointer or an in-place update,
seen through ``Tensor._version``). Other dtypes and devices go to ``F.linear`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of a float32 CPU ``weight``, or None where oneDNN is not used.

    The result is an opaque ``torch._mkldnn`` tensor of the same shape and dtype (no strides,
    no storage): only :func:`linear` reads it, so the caller drops the dense weight for it.

    Args:
        weight: ``[out_features, in_features]``.
    """
    if not (_ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.float32):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered for oneDNN, cached on the tensor until it changes."""
    key = (weight.data_ptr(), weight._version)
    cached = getattr(weight, "_kvpilot_onednn", None)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        weight._kvpilot_onednn = cached
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
    if weight.is_mkldnn:
        packed = weight
    elif _eligible(x, weight):
        packed = _packed(weight)
    else:
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, x.shape[-1]), packed, bias, "none", [], ""
    )
    return out.view(*x.shape[:-1], weight.shape[0])
