"""One line describing the machine a benchmark ran on (benchmarks print it beside their figures)."""

from __future__ import annotations

import os
import platform


def describe_machine() -> str:
    """CPU model, logical cores, OS, and torch's version and GPU when torch is installed.

    Example: ``"AMD EPYC 9R14, 2 logical cores, Linux 6.18.44, torch 2.13.0+cpu"``.
    """
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    parts = [cpu, f"{os.cpu_count()} logical cores", f"{platform.system()} {platform.release()}"]
    try:
        import torch
    except ImportError:
        return ", ".join(parts)
    parts.append(f"torch {torch.__version__}")
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return ", ".join(parts)
