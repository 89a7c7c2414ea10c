"""Building and loading the C++ CPU kernels of this folder, shared by their wrappers.

Each kernel's source sits beside its wrapper (package data) and is compiled on first use by
:func:`torch.utils.cpp_extension.load` into torch's extension cache (``$TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``), which needs a C++ compiler and the ``ninja`` executable
on ``PATH``; later processes load the cached build. A build that fails logs one warning and
gives None, and the callers keep their torch path. Each kernel has an environment variable that
turns it off without trying to build it.
"""

from __future__ import annotations

import logging
import os
import pathlib
import platform
from collections.abc import Sequence
from types import ModuleType

logger = logging.getLogger("kvpilot.kernels")

# GCC keeps AVX-512 code at 256-bit vectors unless told otherwise; this applies only to a
# source's AVX-512 code (the other targets have no 512-bit registers).
CFLAGS = ["-O3", "-fopenmp"] + (
    ["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []
)


def env_enabled(env_var: str) -> bool:
    """Whether ``$env_var`` allows a kernel: unset, or anything but ``0``/``false``/``off``/
    ``no``."""
    return os.environ.get(env_var, "1").strip().lower() not in ("0", "false", "off", "no")


def build(
    name: str,
    source: pathlib.Path,
    what: str,
    fallback: str,
    extra_cflags: Sequence[str] = (),
) -> ModuleType | None:
    """The extension ``name`` compiled from ``source`` (or loaded from the cache), or None
    after one warning ``"<what> unavailable (<error>); <fallback>"`` when it cannot be built or
    loaded. Callers cache the result (one build attempt, one warning per process)."""
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=CFLAGS + list(extra_cflags),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja, a failed build, a bad cached library
        message = str(exc).strip()
        logger.warning(
            "%s unavailable (%s: %s); %s",
            what,
            type(exc).__name__,
            message.splitlines()[-1] if message else "",
            fallback,
        )
        return None
