"""``python -m kvpilot.kernels.cpu``: build every C++ CPU kernel and install it into the
prebuilt-kernel folder (:mod:`kvpilot.kernels.cpu.prebuilt`), so that no later process, an
engine pod with an empty HOME included, compiles it at its first request.

``make install`` runs it into ``.venv/share/kvpilot/cpu-kernels``, the engine image into
``/opt/kvpilot/share/kvpilot/cpu-kernels`` (``$KVPILOT_CPU_KERNELS_DIR`` chooses another
folder). Each kernel is compiled into torch's build cache first (or taken from it when cached
there), then copied. A kernel this machine does not use (switched off by its environment
variable; the elementwise kernels off x86-64) is skipped. Prints one line per kernel; exits 1
if one failed to build or install, after trying the others.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

from kvpilot.kernels.cpu import elementwise, extension, gemm, greedy_head, paged_attention, prebuilt

# The wrappers of the CPU kernels: each has ``KERNEL`` (an ``extension.Kernel``) and
# ``enabled()``.
WRAPPERS: tuple[ModuleType, ...] = (paged_attention, elementwise, gemm, greedy_head)


def main() -> int:
    """Prebuild every enabled kernel into :func:`prebuilt.folder`; 0 when all succeeded, else
    1 (each failure printed with its error)."""
    logging.basicConfig(level=logging.INFO)
    failed = 0
    for wrapper in WRAPPERS:
        kernel = wrapper.KERNEL
        if not wrapper.enabled():
            print(f"{kernel.name}: skipped (not used on this machine or switched off)")
            continue
        try:
            path = extension.prebuild(kernel)
        except Exception as exc:  # a missing compiler, a failed build, an unwritable folder
            failed += 1
            print(f"{kernel.name}: FAILED ({type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        print(f"{kernel.name}: prebuilt at {path}")
    print(f"prebuilt CPU kernels folder: {prebuilt.folder()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
