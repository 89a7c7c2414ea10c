"""Building and loading the C++ CPU kernels of this folder, shared by their wrappers.

Each kernel (a :class:`Kernel`: its name, its source beside its wrapper as package data, its
flags) is loaded by :func:`build`, which tries, in order:

1. the prebuilt-kernel folder (:mod:`kvpilot.kernels.cpu.prebuilt`; ``$KVPILOT_CPU_KERNELS_DIR``,
   default ``<sys.prefix>/share/kvpilot/cpu-kernels``), filled by ``python -m
   kvpilot.kernels.cpu`` at ``make install`` and in the engine image: when the kernel's stamp
   there matches this process's fingerprint (source, flags, torch, machine, Python), its library
   is imported as it is, without a compiler, a lock or a write, so a fresh pod with an empty
   HOME (and a read-only root filesystem) starts serving without compiling anything;
2. otherwise (missing, stale, or a library that fails to import, with one warning), torch's
   build cache: :func:`torch.utils.cpp_extension.load` compiles the source (about a minute on
   2 cores) into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), which needs a
   C++ compiler and the ``ninja`` executable on ``PATH``, and later processes load that build.

A build that fails logs one warning and gives None, and the callers keep their torch path. Each
kernel has an environment variable that turns it off without trying to build it.

torch serialises builds with a lock *file* in the build folder (``FileBaton``), taken by every
process that loads the extension, cached or not; a process killed while it holds it (an engine
pod's container restarted during start-up, a test interrupted) leaves the file behind, and
every later load waits for it forever. So each load here first takes an ``flock`` on
``<build folder>.flock``, which the kernel releases when its holder dies: holding it, no other
kvpilot process is inside torch's build, so a leftover lock file is stale and is removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import platform
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from kvpilot.kernels.cpu import prebuilt

logger = logging.getLogger("kvpilot.kernels")

# GCC keeps AVX-512 code at 256-bit vectors unless told otherwise; this applies only to a
# source's AVX-512 code (the other targets have no 512-bit registers).
CFLAGS = ["-O3", "-fopenmp"] + (
    ["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []
)
LDFLAGS = ("-fopenmp",)  # a tuple: cpp_extension.load appends to the list it is given


def env_enabled(env_var: str) -> bool:
    """Whether ``$env_var`` allows a kernel: unset, or anything but ``0``/``false``/``off``/
    ``no``."""
    return os.environ.get(env_var, "1").strip().lower() not in ("0", "false", "off", "no")


def cpu_supported(load_extension: Callable[[], ModuleType | None]) -> bool:
    """Whether a kernel whose extension has a ``supported()`` check (the CPU's instruction
    sets) loads and runs on this CPU (builds on the first call)."""
    ext = load_extension()
    return ext is not None and bool(ext.supported())


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One C++ CPU kernel: extension ``name`` (its ``TORCH_EXTENSION_NAME``) compiled from
    ``source`` with :data:`CFLAGS` plus ``extra_cflags``; ``what`` and ``fallback`` make its
    warning ``"<what> unavailable (<error>); <fallback>"``. ``headers`` are the files of this
    folder that ``source`` includes (package data too)."""

    name: str
    source: pathlib.Path
    what: str
    fallback: str
    extra_cflags: tuple[str, ...] = ()
    headers: tuple[pathlib.Path, ...] = ()

    @property
    def cflags(self) -> list[str]:
        """All its compiler flags: :data:`CFLAGS`, then its own, then, with ``headers``, a
        ``-DKVPILOT_HEADERS_SHA256=...`` of their contents: torch's build cache and the
        prebuilt stamp see the source file and the flags only, so a changed header changes the
        flags and the kernel is rebuilt (raises OSError if a header is unreadable)."""
        flags = CFLAGS + list(self.extra_cflags)
        if self.headers:
            digest = hashlib.sha256(b"".join(h.read_bytes() for h in self.headers)).hexdigest()
            flags.append(f"-DKVPILOT_HEADERS_SHA256={digest[:16]}")
        return flags

    def fingerprint(self) -> dict[str, Any]:
        """Its build's :func:`prebuilt.fingerprint` (raises OSError if the source is
        unreadable)."""
        return prebuilt.fingerprint(self.source, self.cflags, LDFLAGS)


def build(kernel: Kernel) -> ModuleType | None:
    """The extension of ``kernel``: imported from the prebuilt folder when its stamp there is
    current, else compiled into (or loaded from) torch's build cache by :func:`jit_build`; None
    after one warning ``"<what> unavailable (<error>); <fallback>"`` when it cannot be built or
    loaded. Never raises. Callers cache the result (one build attempt, one warning per
    process)."""
    try:
        module = prebuilt.load(kernel.name, kernel.fingerprint())
        if module is not None:
            return module
        return jit_build(kernel)
    except Exception as exc:  # a missing compiler or ninja, a failed build, a bad cached library
        logger.warning(
            "%s unavailable (%s); %s", kernel.what, prebuilt.describe(exc), kernel.fallback
        )
        return None


def loader(kernel: Kernel) -> Callable[[], ModuleType | None]:
    """A kernel wrapper's ``load_extension()``: :func:`build` of ``kernel`` on the first call of
    the process, the same result after (one build attempt, one warning per process;
    ``.cache_clear()`` forgets it)."""

    @functools.cache
    def load_extension() -> ModuleType | None:
        """The compiled extension, loaded on the first call of the process (from the prebuilt
        folder, else built into torch's cache), or None after logging one warning when it
        cannot be built or loaded (see :func:`kvpilot.kernels.cpu.extension.build`)."""
        return build(kernel)

    return load_extension


def jit_build(kernel: Kernel) -> ModuleType:
    """The extension of ``kernel`` from torch's build cache, compiled first if the cache lacks a
    current build (about a minute on 2 cores), under the kernel's ``flock``.

    Raises:
        Exception: whatever the build or the import raises (a missing compiler or ninja, a
            compile error, an unwritable cache folder).
    """
    from torch.utils import cpp_extension

    folder = build_folder(kernel.name)
    with _exclusive(folder):
        return cpp_extension.load(
            name=kernel.name,
            sources=[str(kernel.source)],
            extra_cflags=kernel.cflags,
            extra_ldflags=list(LDFLAGS),
            build_directory=str(folder),
            verbose=False,
        )


def prebuild(kernel: Kernel, root: pathlib.Path | None = None) -> pathlib.Path:
    """Build ``kernel`` by :func:`jit_build` (a cached build is reused) and install its library
    and stamp into the prebuilt folder ``root`` (default :func:`prebuilt.folder`); returns the
    installed library's path.

    Raises:
        Exception: the build fails (see :func:`jit_build`).
        OSError: ``root`` cannot be written.
    """
    library = pathlib.Path(jit_build(kernel).__file__)
    return prebuilt.install(kernel.name, library, kernel.fingerprint(), root)


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
