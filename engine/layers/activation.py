"""SwiGLU's gated activation (Shazeer 2020, "GLU Variants Improve Transformer")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` on the stacked output of a gate/up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., 2 * d]`` (gate, then up) -> ``[..., d]``, same dtype."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
