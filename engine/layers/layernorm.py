"""Root-mean-square layer norm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")."""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.layers.custom_op import CustomOp
from kvpilot.kernels import reference
from kvpilot.kernels.cpu import elementwise


class RMSNorm(CustomOp):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, optionally after adding
    the residual stream (vLLM's ``RMSNorm.forward(x, residual) -> (out, residual)``).

    Follows Hugging Face's ``LlamaRMSNorm`` operation for operation (normalise in float32, cast
    back to the input dtype, then scale) so that 16-bit results round the same way; the
    residual sum is rounded to the input dtype, as ``residual + x`` is in Hugging Face's
    decoder layers. Both paths round alike (the Triton kernel's documented contract). On the
    CPU the torch path runs the fused C++ kernel (``kvpilot.kernels.cpu.elementwise``, the same
    values) when it is built and takes the tensors; ``KVPILOT_CPU_ELEMENTWISE=0`` turns it off.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square before the reciprocal square root.
        kernel_backend: ``"torch"`` or ``"triton"`` (see :class:`CustomOp`).
    """

    # Added to the weight before scaling (``rms_norm``'s ``weight_offset``); Gemma's is 1.0.
    weight_offset = 0.0

    def __init__(self, hidden_size: int, eps: float, kernel_backend: str = "torch") -> None:
        super().__init__(kernel_backend)
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self.cpu_kernel = elementwise.enabled()

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` ``[..., hidden_size]``, or ``x + residual`` when ``residual`` (same
        shape and dtype) is given.

        Returns:
            ``out`` shaped like ``x`` in ``x``'s dtype (for a weight of that dtype), or
            ``(out, x + residual)``: the normalised sum and the new residual stream.
        """
        if self.cpu_kernel and elementwise.supports(
            x, self.weight, *(() if residual is None else (residual,))
        ):
            return elementwise.rms_norm(x, self.weight, self.eps, residual, self.weight_offset)
        return reference.rms_norm(
            x, self.weight, self.eps, residual, weight_offset=self.weight_offset
        )

    def forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`forward_native`, the residual add fused into the norm's kernel.

        Raises:
            ValueError: from the kernel's input checks (dtype, shape or layout; the message
                names the argument).
        """
        from kvpilot.kernels.rms_norm import rms_norm

        return rms_norm(x, self.weight, self.eps, residual, weight_offset=self.weight_offset)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm (Gemma Team 2024, "Gemma: Open Models Based on Gemini Research and
    Technology"): ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, optionally after adding the
    residual stream.

    Checkpoints store ``weight`` as the offset from 1 (zeros are the identity scale). Follows
    Hugging Face's ``GemmaRMSNorm``: normalised and scaled in float32, rounded to the input dtype
    once at the end (where :class:`RMSNorm` rounds before scaling); the residual sum is rounded
    to the input dtype, as ``residual + x`` is in Gemma's decoder layers. Both paths are
    :class:`RMSNorm`'s with ``weight_offset`` 1.0: the reference and the Triton ``rms_norm``
    kernel (the residual add fused) round alike; ``out`` is in the input dtype.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square before the reciprocal square root.
        kernel_backend: ``"torch"`` or ``"triton"`` (see :class:`CustomOp`).
    """

    weight_offset = 1.0
