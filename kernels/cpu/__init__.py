"""CPU kernels written in C++ (PyTorch extensions compiled on first use), each with its Python
wrapper beside its source."""

from __future__ import annotations


def prepare() -> list[str]:
    """Build (or load from the cache) every CPU kernel its environment variable allows, so
    that the engine pays for it at start-up, before it reports ready, and not on its first
    request (a pod's cache starts empty: the first build takes about a minute). A kernel that
    cannot be built is left to its wrapper's one warning, and its callers keep the torch path.

    Returns:
        The names of the kernels now loaded.
    """
    from kvpilot.kernels.cpu import elementwise, paged_attention

    loaded = []
    for kernel in (paged_attention, elementwise):
        if kernel.enabled() and kernel.load_extension() is not None:
            loaded.append(kernel.EXTENSION_NAME)
    return loaded
