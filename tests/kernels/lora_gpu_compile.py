"""Compile, for an NVIDIA GPU, the launches ``lora_shrink`` / ``lora_expand`` make at real model
shapes; no GPU needed (the recorder and compiler of ``gpu_compile.py`` beside this file).

Run as a script with ``TRITON_INTERPRET=0``; prints one JSON object per launch, as
``gpu_compile.py`` does. Usage: ``python tests/kernels/lora_gpu_compile.py [capability]``.
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from gpu_compile import _Recorder, compile_recorded  # noqa: E402

from kvpilot.kernels import lora_expand, lora_shrink  # noqa: E402


def _cases() -> list[tuple[str, callable]]:
    """Llama-3-8B's q/k/v projection (4096 -> 6144) with 4 slots of rank 16 per stacked part."""
    bf16, fp32 = torch.bfloat16, torch.float32
    slots = torch.tensor([0, -1, 3, 3, 1], dtype=torch.int32)

    def case(dtype: torch.dtype, rank: int) -> callable:
        def run() -> None:
            x = torch.zeros(5, 4096, dtype=dtype)
            shrunk = lora_shrink.lora_shrink(x, torch.zeros(4, rank, 4096, dtype=dtype), slots)
            y = torch.zeros(5, 6144, dtype=dtype)
            lora_expand.lora_expand(shrunk, torch.zeros(4, 6144, rank, dtype=dtype), slots, y)

        return run

    return [
        ("llama3-8b qkv bf16 rank 3x16", case(bf16, 48)),
        ("llama3-8b qkv fp32 rank 3x16", case(fp32, 48)),
        ("llama3-8b o bf16 rank 8", case(bf16, 8)),
        ("llama3-8b qkv bf16 rank 3x64", case(bf16, 192)),
    ]


def main(capability: int) -> None:
    recorders = {}
    for module, name in (
        (lora_shrink, "_lora_shrink_kernel"),
        (lora_expand, "_lora_expand_kernel"),
    ):
        recorders[name] = _Recorder(getattr(module, name))
        setattr(module, name, recorders[name])
    compile_recorded(_cases(), recorders, capability)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
