"""Running a GPU-compile script beside this file (``gpu_compile.py`` and its siblings) from a
test, and the checks every compiled launch must pass."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

# Largest shared memory one block may use (bytes): H100 (sm_90), A100 (sm_80).
SHARED_LIMITS = {90: 232448, 80: 166912}


def compiled_launches(script: str, capability: int) -> list[dict]:
    """Run ``script`` (a file name beside this one) for ``capability`` without the interpreter
    and return its JSON lines (one per compiled launch)."""
    done = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).with_name(script)), str(capability)],
        env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def assert_compiled_cleanly(results: list[dict], capability: int) -> None:
    """Every launch compiled, fits the device's shared memory and keeps to registers."""
    assert [r for r in results if not r["ok"]] == []
    assert [r for r in results if r["shared_bytes"] > SHARED_LIMITS[capability]] == []
    assert [r for r in results if r["spill_bytes"] or r["registers"] <= 0] == []
