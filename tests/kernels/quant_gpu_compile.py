"""Compile, for an NVIDIA GPU, the launches ``int4_gemm`` / ``fp8_scaled_mm`` make at
Llama-3-8B's shapes; no GPU needed (the recorder and compiler of ``gpu_compile.py`` beside
this file). Run as a script with ``TRITON_INTERPRET=0``; prints one JSON object per launch, as
``gpu_compile.py`` does. Usage: ``python tests/kernels/quant_gpu_compile.py [capability]``.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from gpu_compile import _Recorder, compile_recorded  # noqa: E402

from kvpilot.kernels import fp8_matmul, int4_matmul  # noqa: E402

FP8 = torch.float8_e4m3fn


def _cases(capability: int) -> list[tuple[str, Callable[[], None]]]:
    """Llama-3-8B's gate/up projection (4096 -> 2 x 14336) in each format, prefill batch."""
    bf16, fp16 = torch.bfloat16, torch.float16
    k, n, m = 4096, 28672, 64

    def int4(dtype: torch.dtype, zeros: bool, act_order: bool) -> Callable[[], None]:
        def run() -> None:
            int4_matmul.int4_gemm(
                torch.zeros(m, k, dtype=dtype),
                torch.zeros(n, k // 8, dtype=torch.int32),
                torch.zeros(n, k // 128, dtype=dtype),
                torch.zeros(n, k // 128, dtype=torch.uint8) if zeros else None,
                torch.zeros(k, dtype=torch.int32) if act_order else None,
                128,
            )

        return run

    def fp8(block: tuple[int, int], act_group: int | None, x_dtype=FP8) -> Callable[[], None]:
        def run() -> None:
            groups = 1 if act_group is None else k // act_group
            fp8_matmul.fp8_scaled_mm(
                torch.zeros(m, k, dtype=x_dtype),
                torch.zeros(m, groups),
                torch.zeros(n, k, dtype=FP8),
                torch.zeros(-(-n // block[0]), -(-k // block[1])),
                block,
                bf16,
            )

        return run

    cases = [
        ("int4 awq bf16", int4(bf16, True, False)),
        ("int4 gptq act-order fp16", int4(fp16, True, True)),
        ("int4 compressed-tensors symmetric bf16", int4(bf16, False, False)),
    ]
    if capability >= 89:
        # Triton compiles e4m3 only from Ada on; older GPUs take the PyTorch path.
        cases += [
            ("fp8 per-channel per-token", fp8((1, k), None)),
            ("fp8 block 128 group 128", fp8((128, 128), 128)),
            ("fp8 weight-only bf16", fp8((1, k), None, bf16)),
        ]
    return cases


def main(capability: int) -> None:
    recorders = {}
    for module, name in (
        (int4_matmul, "_int4_gemm_kernel"),
        (fp8_matmul, "_fp8_scaled_mm_kernel"),
    ):
        recorders[name] = _Recorder(getattr(module, name))
        setattr(module, name, recorders[name])
    compile_recorded(_cases(capability), recorders, capability)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
