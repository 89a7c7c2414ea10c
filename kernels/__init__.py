"""Kernels for the engine's hot path.

``kvpilot.kernels.reference`` holds the PyTorch implementation of every kernel: it is the CPU
path of the engine and the oracle the Triton kernels are tested against. The Triton versions,
with the same signatures, live beside it (one kernel a file) and run on CUDA, or on CPU under
``TRITON_INTERPRET=1``.
"""
