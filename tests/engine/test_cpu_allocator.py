"""The CPU engine's allocator tuning: freed activations are reused without new page faults."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# Five steps of four layers' activations, shaped like a 2,048-token prefill of SmolLM2-135M (a
# 25 MB gate/up output, a 12.6 MB SiLU-and-mul output, the 4.7 MB hidden states), allocated and
# freed in a forward pass's order; prints the minor page faults the steps after the first took.
PROGRAM = """
import resource, torch
from kvpilot.engine.executor.cpu_allocator import tune_for_cpu_engine
print(tune_for_cpu_engine())
def step():
    hidden = torch.ones(2048, 576)
    for _ in range(4):
        gate_up = torch.ones(2048, 3072)
        act = torch.ones(2048, 1536)
        del gate_up
        hidden = torch.ones(2048, 576) + act[:, :576]
        del act
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(tuning: str) -> tuple[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env={**os.environ, "KVPILOT_CPU_MALLOC_TUNING": tuning},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    tuned, faults = done.stdout.split()
    return tuned, int(faults)


def test_freed_activations_are_reused_without_page_faults():
    # One step's activations are ~42 MB, 10,000 pages of 4 KiB; untuned, glibc gives most of
    # them back to the kernel each step (65,120 faults in 5 steps here).
    untuned, untuned_faults = page_faults("0")
    tuned, faults = page_faults("1")
    assert (untuned, tuned) == ("False", "True")
    assert faults < 10_000 < untuned_faults


# 400 MB of 4 MB blocks (under glibc's mmap threshold once tuned, so in the heap) freed but one
# block in ten, so that the heap's top stays in use; prints the resident kB after the frees and
# after release_free_memory.
TRIM_PROGRAM = """
from kvpilot.engine.executor.cpu_allocator import release_free_memory, tune_for_cpu_engine
import torch
def rss():
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmRSS")))
tune_for_cpu_engine()
blocks = [torch.ones(1024 * 1024) for _ in range(100)]
kept = blocks[9::10]
del blocks
freed = rss()
print(release_free_memory(), freed, rss())
"""


def test_memory_freed_for_good_goes_back_to_the_system():
    done = subprocess.run(
        [sys.executable, "-c", TRIM_PROGRAM], capture_output=True, text=True, timeout=120,
        check=True,
    )  # fmt: skip
    released, freed, after = done.stdout.split()
    assert released == "True"
    # 90 freed blocks of 4 MB stay resident in the tuned heap until released.
    assert int(freed) - int(after) > 300_000
