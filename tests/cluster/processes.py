"""Local processes that stop with the process that started them.

Each one gets its own process group (so a signal reaches its children too), its output in a log
file, and ``PR_SET_PDEATHSIG``: if the starting process dies without cleaning up (a CI timeout,
a killed pytest), the kernel sends SIGKILL to the child, so no API server or engine outlives the
run.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import signal
import subprocess
from collections.abc import Mapping, Sequence

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(
    command: Sequence[str],
    log_path: pathlib.Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: pathlib.Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``command`` with stdout and stderr appended to ``log_path``.

    ``env`` replaces the environment when given. The thread that calls this must outlive the
    child (Linux sends the death signal when the creating thread exits).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            preexec_fn=_die_with_parent,
        )


def stop(process: subprocess.Popen[bytes], grace_seconds: float = 10.0) -> int:
    """SIGTERM ``process``'s group, SIGKILL after ``grace_seconds``; returns its exit code."""
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()
    _signal_group(process, signal.SIGKILL)  # stragglers of the group
    return process.returncode


def kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process``'s whole group at once (a crash, not a shutdown)."""
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
