"""Gated activations of the MLPs (Shazeer 2020, "GLU Variants Improve Transformer"): SwiGLU
(Llama, Qwen, Mistral, Granite, Phi-3) and GeGLU (Gemma)."""

from __future__ import annotations

import torch

from kvpilot.engine.layers.custom_op import CustomOp
from kvpilot.kernels import reference
from kvpilot.kernels.cpu import elementwise


class SiluAndMul(CustomOp):
    """``silu(gate) * up`` on the stacked output of a gate/up projection.

    On the CPU the torch path runs the fused C++ kernel (``kvpilot.kernels.cpu.elementwise``)
    when it is built and takes the tensor; ``KVPILOT_CPU_ELEMENTWISE=0`` turns it off.

    Args:
        kernel_backend: ``"torch"`` or ``"triton"`` (see :class:`CustomOp`).
    """

    def __init__(self, kernel_backend: str = "torch") -> None:
        super().__init__(kernel_backend)
        self.cpu_kernel = elementwise.enabled()

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., 2 * d]`` (gate, then up) -> ``[..., d]``, same dtype."""
        if self.cpu_kernel and x.dim() > 0 and x.shape[-1] % 2 == 0 and elementwise.supports(x):
            return elementwise.silu_and_mul(x)
        return reference.silu_and_mul(x)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        """As :meth:`forward_native`, in one kernel; ``x`` contiguous in its last dimension.

        Raises:
            ValueError: from the kernel's input checks (an odd last dimension, a strided one).
        """
        from kvpilot.kernels.activation import silu_and_mul

        return silu_and_mul(x)


class GeluAndMul(CustomOp):
    """``gelu(gate) * up`` on the stacked output of a gate/up projection (GeGLU; vLLM's
    ``GeluAndMul``), GELU exact or with PyTorch's tanh approximation (Hendrycks & Gimpel 2016).

    Gemma's MLP (``hidden_act`` ``gelu_pytorch_tanh``) computes ``act(gate(x)) * up(x)`` with
    ``F.gelu(..., approximate="tanh")`` in the activation dtype; this does the same on the
    stacked projection, so results round alike.

    Args:
        approximate: ``"none"`` (exact, erf) or ``"tanh"``.
        kernel_backend: ``"torch"`` or ``"triton"`` (see :class:`CustomOp`).

    Raises:
        ValueError: another ``approximate``, or an unknown ``kernel_backend``.
    """

    def __init__(self, approximate: str = "none", kernel_backend: str = "torch") -> None:
        super().__init__(kernel_backend)
        if approximate not in ("none", "tanh"):
            raise ValueError(f"unknown GELU approximation {approximate!r}; 'none' or 'tanh'")
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., 2 * d]`` (gate, then up) -> ``[..., d]``, same dtype."""
        return reference.gelu_and_mul(x, self.approximate)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        """As :meth:`forward_native`, in one kernel; ``x`` contiguous in its last dimension.

        Raises:
            ValueError: from the kernel's input checks (an odd last dimension, a strided one).
        """
        from kvpilot.kernels.activation import gelu_and_mul

        return gelu_and_mul(x, self.approximate)


# ``hidden_act`` of a Hugging Face config -> the gated activation over a stacked gate/up output.
_ACT_AND_MUL = {
    "silu": lambda backend: SiluAndMul(backend),
    "gelu": lambda backend: GeluAndMul("none", backend),
    "gelu_pytorch_tanh": lambda backend: GeluAndMul("tanh", backend),
}


def get_act_and_mul(hidden_act: str, kernel_backend: str = "torch") -> CustomOp:
    """The gated activation named by a config's ``hidden_act`` (vLLM's ``get_act_and_mul_fn``).

    Args:
        hidden_act: ``"silu"``, ``"gelu"`` or ``"gelu_pytorch_tanh"``.
        kernel_backend: ``"torch"`` or ``"triton"``.

    Raises:
        ValueError: another activation (the message lists the supported ones).
    """
    if hidden_act not in _ACT_AND_MUL:
        raise ValueError(
            f"unsupported hidden_act {hidden_act!r}; supported: {', '.join(_ACT_AND_MUL)}"
        )
    return _ACT_AND_MUL[hidden_act](kernel_backend)
