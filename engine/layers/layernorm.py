"""Root-mean-square layer norm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    Follows Hugging Face's ``LlamaRMSNorm`` operation for operation (normalise in float32, cast
    back to the input dtype, then scale) so that 16-bit results round the same way.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., hidden_size]`` -> same shape and dtype."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
