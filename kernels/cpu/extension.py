"""Building and loading the C++ CPU kernels of this folder, shared by their wrappers.

Each kernel's source sits beside its wrapper (package data) and is compiled on first use by
:func:`torch.utils.cpp_extension.load` into torch's extension cache (``$TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``), which needs a C++ compiler and the ``ninja`` executable
on ``PATH``; later processes load the cached build. A build that fails logs one warning and
gives None, and the callers keep their torch path. Each kernel has an environment variable that
turns it off without trying to build it.

torch serialises builds with a lock *file* in the build folder (``FileBaton``), taken by every
process that loads the extension, cached or not; a process killed while it holds it (an engine
pod's container restarted during start-up, a test interrupted) leaves the file behind, and
every later load waits for it forever. So each load here first takes an ``flock`` on
``<build folder>.flock``, which the kernel releases when its holder dies: holding it, no other
kvpilot process is inside torch's build, so a leftover lock file is stale and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pathlib
import platform
from collections.abc import Iterator, Sequence
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

        folder = build_folder(name)
        with _exclusive(folder):
            return cpp_extension.load(
                name=name,
                sources=[str(source)],
                extra_cflags=CFLAGS + list(extra_cflags),
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
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


def build_folder(name: str) -> pathlib.Path:
    """Where extension ``name`` is built and cached: ``<torch's extension root>/kvpilot/
    <name>-torch<version>`` (the root is ``$TORCH_EXTENSIONS_DIR`` or torch's default), one
    folder per torch version, since a build is only valid for the torch it was built against."""
    import torch
    from torch.utils import cpp_extension

    version = torch.__version__.replace("+", "_")
    return (
        pathlib.Path(cpp_extension.get_default_build_root()) / "kvpilot" / f"{name}-torch{version}"
    )


@contextlib.contextmanager
def _exclusive(folder: pathlib.Path) -> Iterator[None]:
    """Hold the ``flock`` of ``folder`` (made if missing) and remove torch's stale lock file."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".flock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
