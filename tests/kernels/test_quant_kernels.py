"""``int4_gemm`` / ``fp8_scaled_mm`` (Triton, interpreter on CPU) against their PyTorch
references, on small shapes with ragged edges (M, N not multiples of the tile)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from kvpilot.kernels import quant_reference
from kvpilot.kernels.fp8_matmul import fp8_scaled_mm
from kvpilot.kernels.int4_matmul import int4_gemm

pytestmark = pytest.mark.kernel


def _int4_case(m: int, n: int, k: int, group: int, zeros: bool, act_order: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    qweight = (values.view(n, k // 8, 8) << shifts).sum(-1, dtype=torch.int32)
    num_groups = k // group
    scales = torch.rand(n, num_groups, generator=g) * 0.1 + 0.01
    qzeros = torch.randint(0, 16, (n, num_groups), generator=g).to(torch.uint8) if zeros else None
    g_idx = None
    if act_order:
        # GPTQ act-order: the i-th quantized column (in a permuted order) is in group i // G.
        perm = torch.randperm(k, generator=g)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = torch.arange(k, dtype=torch.int32) // group
    return x, values, qweight, scales, qzeros, g_idx


@pytest.mark.parametrize(
    "m,n,k,group,zeros,act_order",
    [(5, 40, 64, 32, True, False), (19, 24, 96, 32, False, False), (3, 48, 128, 64, True, True)],
)
def test_int4_gemm_matches_the_reference(m, n, k, group, zeros, act_order) -> None:
    x, values, qweight, scales, qzeros, g_idx = _int4_case(m, n, k, group, zeros, act_order)
    # The reference's dequantization against the definition, from the unpacked values.
    groups = g_idx.long() if g_idx is not None else torch.arange(k) // group
    z = 8 if qzeros is None else qzeros[:, groups].int()
    dense = (values - z).float() * scales[:, groups]
    expected = x @ dense.T
    reference = quant_reference.int4_gemm(x, qweight, scales, qzeros, g_idx, group)
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)
    got = int4_gemm(x, qweight, scales, qzeros, g_idx, group)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_int4_gemm_in_float16() -> None:
    x, _, qweight, scales, qzeros, _ = _int4_case(7, 32, 64, 32, True, False)
    x, scales = x.half(), scales.half()
    got = int4_gemm(x, qweight, scales, qzeros, None, 32)
    reference = quant_reference.int4_gemm(x.float(), qweight, scales.float(), qzeros, None, 32)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), reference, rtol=1e-2, atol=1e-2)


def test_int4_gemm_refuses_bad_shapes() -> None:
    x, _, qweight, scales, qzeros, _ = _int4_case(2, 32, 64, 32, True, False)
    with pytest.raises(ValueError, match="qweight must have shape"):
        int4_gemm(x[:, :32], qweight, scales, qzeros, None, 32)
    with pytest.raises(ValueError, match="group_size 16 needs more than 2 scales"):
        int4_gemm(x, qweight, scales, qzeros, None, 16)


def _fp8_weight(n: int, k: int, block: tuple[int, int], g: torch.Generator):
    weight = (torch.randn(n, k, generator=g) * 2).to(quant_reference.FP8_DTYPE)
    shape = (-(-n // block[0]), -(-k // block[1]))
    scales = torch.rand(*shape, generator=g) * 0.01 + 0.001
    return weight, scales


@pytest.mark.parametrize(
    "m,n,k,block,act_group",
    [
        (5, 40, 64, (1, 64), None),  # per-channel weights, per-token activations
        (9, 50, 96, (32, 32), 32),  # block weights (a partial last row block), 1x32 groups
        (3, 64, 128, (64, 64), 64),
    ],
)
def test_fp8_scaled_mm_matches_the_reference(m, n, k, block, act_group) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g)
    x_q, x_scales = quant_reference.quantize_fp8_dynamic(x, act_group)
    weight, w_scales = _fp8_weight(n, k, block, g)
    reference = quant_reference.fp8_scaled_mm(x_q, x_scales, weight, w_scales, block, torch.float32)
    # Quantizing is close to the float product (e4m3 keeps 3 mantissa bits).
    dense = weight.float() * quant_reference.expand_block_scales(w_scales, block, (n, k))
    assert (reference - x @ dense.T).abs().max() < 0.1 * (x @ dense.T).abs().max()
    got = fp8_scaled_mm(x_q, x_scales, weight, w_scales, block, torch.float32)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_fp8_scaled_mm_weight_only_and_half_output() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=g)
    weight, w_scales = _fp8_weight(32, 64, (1, 64), g)
    ones = torch.ones(6, 1)
    reference = quant_reference.fp8_scaled_mm(x, ones, weight, w_scales, (1, 64), torch.float32)
    got = fp8_scaled_mm(x, ones, weight, w_scales, (1, 64), torch.float16)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), reference, rtol=1e-2, atol=1e-2)


def test_fp8_scaled_mm_refuses_straddling_groups() -> None:
    g = torch.Generator().manual_seed(3)
    x_q, x_scales = quant_reference.quantize_fp8_dynamic(torch.randn(2, 64, generator=g), 16)
    weight, w_scales = _fp8_weight(32, 64, (1, 64), g)
    with pytest.raises(ValueError, match="activation group 16 is not a multiple of 32"):
        fp8_scaled_mm(x_q, x_scales, weight, w_scales, (1, 64), torch.float32)


@pytest.mark.parametrize("capability,num_launches", [(90, 6), (80, 3)])
def test_launches_compile_for_nvidia_gpus(capability: int, num_launches: int) -> None:
    """Every launch the wrappers make at Llama-3-8B's shapes compiles for sm_90 (and the int4
    ones for sm_80), within the device's shared memory and without register spills."""
    script = pathlib.Path(__file__).with_name("quant_gpu_compile.py")
    done = subprocess.run(
        [sys.executable, str(script), str(capability)],
        env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == num_launches
    assert [r for r in results if not r["ok"]] == []
    assert [r for r in results if r["shared_bytes"] > 166912] == []
    assert [r for r in results if r["spill_bytes"] or r["registers"] <= 0] == []
