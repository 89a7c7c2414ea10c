"""Layers with a PyTorch and a Triton implementation, chosen once when the layer is built.

vLLM's ``CustomOp``: a layer defines ``forward_native`` (plain PyTorch, the CPU path and the
reference) and ``forward_triton`` (the ``kvpilot.kernels`` Triton kernels: the GPU path, or the
CPU under ``TRITON_INTERPRET=1``); ``forward`` calls the one chosen. The engine passes its
attention backend's name (``--attention-backend``), so one switch selects the whole GPU path:
attention and the layers around it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# The implementations a layer can run; the same names as the attention backends.
KERNEL_BACKENDS = ("torch", "triton")


class CustomOp(nn.Module):
    """A layer that runs :meth:`forward_native` or :meth:`forward_triton`.

    Subclasses implement both with the same signature and results (the Triton path to the
    rounding its kernel documents); the Triton kernels are imported on first use, so the torch
    path never loads Triton.

    Args:
        kernel_backend: ``"torch"`` runs :meth:`forward_native`, ``"triton"``
            :meth:`forward_triton`.

    Attributes:
        kernel_backend: the implementation this layer runs.

    Raises:
        ValueError: an unknown ``kernel_backend`` (the message lists the known ones).
    """

    def __init__(self, kernel_backend: str = "torch") -> None:
        super().__init__()
        if kernel_backend not in KERNEL_BACKENDS:
            known = ", ".join(KERNEL_BACKENDS)
            raise ValueError(f"unknown kernel backend {kernel_backend!r}; available: {known}")
        self.kernel_backend = kernel_backend
        self._use_triton = kernel_backend == "triton"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the chosen implementation."""
        if self._use_triton:
            return self.forward_triton(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The PyTorch implementation."""
        raise NotImplementedError

    def forward_triton(self, *args: Any, **kwargs: Any) -> Any:
        """The Triton implementation."""
        raise NotImplementedError
