"""CPU kernels written in C++ (PyTorch extensions compiled on first use), each with its Python
wrapper beside its source."""
