"""Compile, for an NVIDIA GPU, the launches ``fused_experts`` makes at real model shapes; no GPU
needed (the recorder and compiler of ``gpu_compile.py`` beside this file).

Qwen3-30B-A3B's experts (hidden 2048, moe_intermediate 768) and Mixtral-8x7B's per rank at
tensor parallel 8 (hidden 4096, intermediate 14336 / 8): the expert count only sizes the grid,
so 4 experts stand for 128 or 8. Run as a script with ``TRITON_INTERPRET=0``; prints one JSON
object per launch, as ``gpu_compile.py`` does. Usage:
``python tests/kernels/moe_gpu_compile.py [capability]``.
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from gpu_compile import _Recorder, compile_recorded  # noqa: E402

from kvpilot.kernels import fused_moe  # noqa: E402


def _cases() -> list[tuple[str, callable]]:
    def case(dtype: torch.dtype, num_tokens: int, hidden: int, intermediate: int) -> callable:
        def run() -> None:
            ids = torch.arange(num_tokens * 2).view(num_tokens, 2) % 4
            fused_moe.fused_experts(
                torch.zeros(num_tokens, hidden, dtype=dtype),
                torch.zeros(4, 2 * intermediate, hidden, dtype=dtype),
                torch.zeros(4, hidden, intermediate, dtype=dtype),
                torch.full((num_tokens, 2), 0.5),
                ids,
                None,
                lambda gate_up: gate_up[:, :intermediate].contiguous(),
            )

        return run

    bf16 = torch.bfloat16
    return [
        ("qwen3-30b-a3b bf16 decode", case(bf16, 4, 2048, 768)),
        ("qwen3-30b-a3b bf16 prefill", case(bf16, 200, 2048, 768)),
        ("qwen3-30b-a3b fp16 decode", case(torch.float16, 4, 2048, 768)),
        ("qwen3-30b-a3b fp32 decode", case(torch.float32, 4, 2048, 768)),
        ("mixtral-8x7b tp8 bf16 decode", case(bf16, 4, 4096, 14336 // 8)),
    ]


def main(capability: int) -> None:
    recorder = _Recorder(fused_moe._fused_moe_kernel)
    fused_moe._fused_moe_kernel = recorder
    compile_recorded(_cases(), {"_fused_moe_kernel": recorder}, capability)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
