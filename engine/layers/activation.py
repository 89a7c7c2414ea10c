"""SwiGLU's gated activation (Shazeer 2020, "GLU Variants Improve Transformer")."""

from __future__ import annotations

import torch

from kvpilot.engine.layers.custom_op import CustomOp
from kvpilot.kernels import reference


class SiluAndMul(CustomOp):
    """``silu(gate) * up`` on the stacked output of a gate/up projection.

    Args:
        kernel_backend: ``"torch"`` or ``"triton"`` (see :class:`CustomOp`).
    """

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., 2 * d]`` (gate, then up) -> ``[..., d]``, same dtype."""
        return reference.silu_and_mul(x)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        """As :meth:`forward_native`, in one kernel; ``x`` contiguous in its last dimension.

        Raises:
            ValueError: from the kernel's input checks (an odd last dimension, a strided one).
        """
        from kvpilot.kernels.activation import silu_and_mul

        return silu_and_mul(x)
