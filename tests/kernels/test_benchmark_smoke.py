"""``benchmarks/kernels_gpu.py --smoke``: the GPU benchmark script runs end to end at tiny
shapes on CPU (interpreter), so it is known to work before a GPU is lent to run it for real."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "kernels_gpu.py"


def test_smoke_run_reports_correct_kernels(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    kernels = {row["kernel"].split(" ")[0] for row in results["correctness"]}
    assert kernels == {
        "rms_norm", "silu_and_mul", "gelu_and_mul", "rotary_embedding",
        "reshape_and_cache", "unified_attention",
    }  # fmt: skip
    assert all(row["ok"] for row in results["correctness"]), results["correctness"]
    # The flex_attention peer reads the same paged cache and must agree with the reference.
    for row in results["decode_flex"] + results["prefill"]:
        assert row["flex_error"] == "" and row["flex_max_err"] < 1e-4, row
    assert all(row["triton_us"] > 0 for row in results["decode"] + results["decode_fp8"])
    assert {"reshape_and_cache fp8_e4m3 (bytes)", "unified_attention fp8_e4m3 cache, mixed"} <= {
        row["kernel"] for row in results["correctness"]
    }
    assert "## Decode attention: HBM bandwidth" in done.stdout
