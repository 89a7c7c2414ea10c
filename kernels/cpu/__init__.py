"""CPU kernels written in C++ (PyTorch extensions), each with its Python wrapper beside its
source: loaded from the prebuilt-kernel folder that ``python -m kvpilot.kernels.cpu`` fills
(:mod:`kvpilot.kernels.cpu.prebuilt`), else compiled on first use (:mod:`.extension`)."""
