"""``kvpilot ray-node`` with real Ray: a leader waits for its group's worker to join its Ray
head, then becomes the kvpilot command it was given, with ``RAY_ADDRESS`` set (what a
LeaderWorkerSet group's pods do; tests/operator/test_leaderworkerset.py renders them)."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

from kvpilot import __version__ as kvpilot_version
from kvpilot.ports import free_port

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def kill_ray_under(temp_dir: pathlib.Path) -> None:
    """SIGKILL the Ray processes of the cluster whose session lives under ``temp_dir`` (not
    ``ray stop``, which stops every Ray cluster on the machine)."""
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if str(temp_dir).encode() in cmdline:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_leader_waits_for_its_worker_then_runs_the_command():
    # A short path: Ray's socket paths must stay under the OS limit of 107 bytes.
    temp_dir = pathlib.Path("/tmp") / f"kvp-ray-{os.getpid()}"
    port = free_port()
    leader = worker = None
    kvpilot = [sys.executable, "-m", "kvpilot", "ray-node"]
    # Token authentication off: a token a previous Ray left in ~/.ray would otherwise turn it
    # on for the head, and the worker here is given none.
    env = {**os.environ, "RAY_TMPDIR": str(temp_dir), "RAY_AUTH_MODE": "disabled"}
    try:
        leader = subprocess.Popen(
            [
                *kvpilot, "leader", "--nodes", "2", "--port", str(port),
                "--node-ip-address", "127.0.0.1", "--wait-timeout", "240",
                "--", "--version",
            ],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        # The worker may start before the head is up: Ray retries the connection.
        worker = subprocess.Popen(
            [*kvpilot, "worker", "--address", f"127.0.0.1:{port}", "--node-ip-address",
             "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        out, _ = leader.communicate(timeout=300)
        assert leader.returncode == 0, out
        assert "2 Ray nodes alive; starting kvpilot --version" in out, out
        # The leader became ``kvpilot --version`` (after the head and the worker were up).
        assert out.rstrip().splitlines()[-1] == f"kvpilot {kvpilot_version}", out
        assert worker.poll() is None  # the worker's Ray node keeps running (--block)
    finally:
        for proc in (worker, leader):
            if proc is not None and proc.poll() is None:
                proc.kill()
        kill_ray_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
