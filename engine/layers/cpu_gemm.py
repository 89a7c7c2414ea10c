"""The matrix multiply of every linear layer: oneDNN with a pre-packed weight for float32 on CPU.

``F.linear`` on a float32 CPU tensor calls the BLAS the wheel was built with (MKL), which on
some CPUs (AMD's among them) runs a slower code path; oneDNN's brgemm kernels use the CPU's
widest vector units, and with the weight reordered once into oneDNN's blocked layout they ran
2.3-3x faster than ``F.linear`` here (AMD EPYC, AVX-512), prefill and decode shapes alike. vLLM's
CPU backend packs its linear weights for oneDNN for the same reason. Both compute in float32
(no reduced-precision math mode), only the order of the additions differs.

The packed copy is kept on the weight tensor and rebuilt when the weight changes (another data
pointer or an in-place update, seen through ``Tensor._version``); it doubles the memory of the
linear weights. Other dtypes and devices go to ``F.linear`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)


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
        weight: ``[out_features, in_features]``, same dtype and device as ``x``.
        bias: ``[out_features]`` or None.

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.
    """
    if not (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, x.shape[-1]), _packed(weight), bias, "none", [], ""
    )
    return out.view(*x.shape[:-1], weight.shape[0])
