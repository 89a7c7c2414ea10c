"""The prebuilt-kernel folder: CPU kernels built ahead of time, loaded without a build or a lock.

``python -m kvpilot.kernels.cpu`` (``make install``, the engine image) copies each built
extension library here with a stamp, a small JSON file recording the build's
:func:`fingerprint`: the source's sha256, the compiler and linker flags, torch's version, the
machine, and Python's version and extension suffix. A process whose fingerprint of a kernel
equals its stamp imports the library straight from this folder (:func:`load`): nothing is
compiled, locked or written, so the folder can be read-only (an engine pod's image). A missing
or stale stamp (another source, flags or torch) leaves the kernel to torch's build cache.

The folder is ``$KVPILOT_CPU_KERNELS_DIR``, default ``<sys.prefix>/share/kvpilot/cpu-kernels``
(inside the virtual environment, or ``/opt/kvpilot`` in the image). Per kernel ``<name>`` it
holds ``<name>.so`` and ``<name>.json``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import platform
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger("kvpilot.kernels")

ENV_VAR = "KVPILOT_CPU_KERNELS_DIR"


def folder() -> pathlib.Path:
    """The prebuilt-kernel folder: ``$KVPILOT_CPU_KERNELS_DIR`` when set and not empty, else
    ``<sys.prefix>/share/kvpilot/cpu-kernels``. It need not exist."""
    configured = os.environ.get(ENV_VAR, "").strip()
    if configured:
        return pathlib.Path(configured)
    return pathlib.Path(sys.prefix) / "share" / "kvpilot" / "cpu-kernels"


def fingerprint(
    source: pathlib.Path, cflags: Sequence[str], ldflags: Sequence[str]
) -> dict[str, Any]:
    """What a build of ``source`` with these flags depends on, as JSON-ready values: a library
    built under one fingerprint is loaded only under an equal one.

    Raises:
        OSError: ``source`` cannot be read.
    """
    import torch

    return {
        "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
    }


def library_path(name: str, root: pathlib.Path | None = None) -> pathlib.Path:
    """The library of kernel ``name`` in ``root`` (default :func:`folder`)."""
    return (root or folder()) / f"{name}.so"


def stamp_path(name: str, root: pathlib.Path | None = None) -> pathlib.Path:
    """The stamp (JSON ``{"fingerprint": ...}``) of kernel ``name`` in ``root`` (default
    :func:`folder`)."""
    return (root or folder()) / f"{name}.json"


def load(name: str, expected: dict[str, Any]) -> ModuleType | None:
    """Extension module ``name`` imported from the prebuilt folder when its stamp records
    ``expected`` (a :func:`fingerprint`), else None: silently when the stamp is missing, after
    an info line when it is stale or unreadable, after a warning when the library fails to
    import. Never raises; reads only. torch is imported first (the library links against it).
    """
    stamp = stamp_path(name)
    try:
        recorded = json.loads(stamp.read_text())["fingerprint"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.info("prebuilt %s: unreadable stamp %s (%s); building it", name, stamp, exc)
        return None
    if not isinstance(recorded, dict):
        logger.info("prebuilt %s: unreadable stamp %s (no fingerprint); building it", name, stamp)
        return None
    if recorded != expected:
        changed = sorted(
            k for k in expected.keys() | recorded.keys() if recorded.get(k) != expected.get(k)
        )
        logger.info("prebuilt %s is stale (%s differ); building it", name, ", ".join(changed))
        return None
    library = library_path(name)
    try:
        import torch  # noqa: F401  (the library resolves its symbols against the loaded torch)

        spec = importlib.util.spec_from_file_location(name, library)
        if spec is None or spec.loader is None:
            raise ImportError(f"no loader for {library}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as exc:  # a truncated or foreign library, a missing symbol
        logger.warning(
            "prebuilt %s at %s failed to load (%s); building it instead",
            name,
            library,
            describe(exc),
        )
        return None


def describe(exc: BaseException) -> str:
    """``"<type>: <last line of its message>"``, for a one-line warning (a compiler's error
    ends with its last line)."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[-1] if message else ''}"


def install(
    name: str, library: pathlib.Path, built: dict[str, Any], root: pathlib.Path | None = None
) -> pathlib.Path:
    """Copy ``library`` (the built extension ``name``) into ``root`` (default :func:`folder`,
    made if missing) and write its stamp recording ``built`` (its :func:`fingerprint`); each
    file is written to a temporary name and renamed into place, the stamp last, so a reader
    sees either the old pair or the new one. Both are world-readable (an image built as root
    runs as another user). Returns the installed library's path.

    Raises:
        OSError: ``library`` cannot be read or ``root`` cannot be written.
    """
    root = root or folder()
    root.mkdir(parents=True, exist_ok=True)
    target = library_path(name, root)
    _write_atomically(target, library.read_bytes())
    stamp = json.dumps({"fingerprint": built}, indent=2, sort_keys=True) + "\n"
    _write_atomically(stamp_path(name, root), stamp.encode())
    return target


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        pathlib.Path(temporary).unlink(missing_ok=True)
        raise
