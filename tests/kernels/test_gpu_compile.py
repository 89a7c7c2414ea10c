"""Every kernel launch the wrappers make compiles for NVIDIA GPUs (sm_80, sm_90), without a GPU,
within the device's shared memory and without register spills.

See ``gpu_compile.py`` beside this file: the interpreter never compiles, so this is what
catches ``tl.dot`` shapes, loop-carried type changes, shared-memory overruns and launch
configurations that spill, on CPU.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.kernel

SCRIPT = pathlib.Path(__file__).with_name("gpu_compile.py")
# Largest shared memory one block may use (bytes): H100 (sm_90), A100 (sm_80).
SHARED_LIMITS = {90: 232448, 80: 166912}


@pytest.mark.parametrize("capability", [90, 80])
def test_all_launches_compile(capability: int) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(capability)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    kernels = {r["kernel"] for r in results}
    assert kernels == {
        "_unified_attention_kernel",
        "_merge_splits_kernel",
        "_reshape_and_cache_kernel",
        "_rms_norm_kernel",
        "_rotary_embedding_kernel",
        "_act_and_mul_kernel",
    }
    failed = [f"{r['case']} / {r['kernel']}: {r['error']}" for r in results if not r["ok"]]
    assert not failed, "\n".join(failed)
    too_big = [r for r in results if r["shared_bytes"] > SHARED_LIMITS[capability]]
    assert not too_big, too_big
    # The shipped launch configurations keep every kernel in registers at these shapes.
    spilling = [r for r in results if r["spill_bytes"] or r["registers"] <= 0]
    assert not spilling, spilling
