"""The C++ CPU GEMM kernel (``kvpilot.kernels.cpu.gemm``): values against float64, its documented
summation order bit for bit, batch and thread-count invariance, and the packed weight's
contract.

The kernel needs AVX-512; elsewhere these tests are skipped and the engine keeps oneDNN.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from kvpilot.engine.layers import cpu_gemm
from kvpilot.kernels import reference
from kvpilot.kernels.cpu import elementwise, gemm

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="the CPU GEMM kernel needs AVX-512 (and a C++ compiler)"
)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _order_of_the_docs(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x`` ``[M, K]`` times ``w`` ``[N, K]``^T in the kernel's documented order, emulated in
    numpy: partial sums over chunks of 128 features, each in k order from zero with one
    rounding per multiply-add (the product is exact in float64, the sum rounded to float32),
    added in chunk order."""
    M, K = x.shape
    out = np.zeros((M, w.shape[0]), dtype=np.float32)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    for start in range(0, K, 128):
        partial = np.zeros_like(out)
        for k in range(start, min(K, start + 128)):
            product = x64[:, k, None] * w64[None, :, k]  # exact: 24 + 24 bits
            partial = (product + partial.astype(np.float64)).astype(np.float32)
        out = partial if start == 0 else (out + partial).astype(np.float32)
    return out


@pytest.mark.parametrize(
    ("M", "N", "K"),
    [
        (1, 32, 128),
        (3, 33, 300),
        (7, 31, 257),
        (13, 64, 129),
        (32, 40, 1),
        (45, 70, 300),
        # 9 and 12 micro-kernel calls a panel, chunk by chunk (the last chunk short)
        (100, 33, 300),
        (144, 64, 257),
        # three passes over the panels of 161, 160 and 160 rows
        (481, 33, 129),
        # 65 rows and more: panels two at a time, 6 rows a call (3 panels: a pair, then one
        # alone; 5 panels over two threads: a thread's odd one alone)
        (65, 95, 300),
        (200, 160, 129),
    ],
)
def test_the_summation_order_is_the_documented_one_bit_for_bit(M, N, K):
    x, w = _randn(M, K, seed=M), _randn(N, K, seed=N)
    got = gemm.packed_linear(x, gemm.pack_weight(w))
    want = _order_of_the_docs(x.numpy(), w.numpy())
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("N", [1, 31, 32, 33, 100, 576])
@pytest.mark.parametrize("K", [1, 5, 127, 128, 129, 576, 1536])
def test_values_match_float64(N, K):
    w = _randn(N, K, seed=N * 1000 + K)
    packed = gemm.pack_weight(w)
    for M in (1, 2, 5, 7, 12, 13, 33, 250):
        x = _randn(M, K, seed=M)
        want = x.double() @ w.double().T
        # float32 sums of K terms: error grows with K and the terms' size.
        torch.testing.assert_close(
            gemm.packed_linear(x, packed).double(), want, atol=2e-5 * K, rtol=1e-5
        )


def test_a_row_gives_the_same_bits_in_any_batch_and_with_any_thread_count():
    w = _randn(200, 600, seed=1)
    packed = gemm.pack_weight(w)
    rows = _randn(260, 600, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([gemm.packed_linear(rows[i : i + 1], packed) for i in range(len(rows))])
        torch.set_num_threads(2)
        for M in (2, 3, 6, 7, 12, 16, 31, 32, 33, 64, 100, 144, 145, 250, 260):
            start = (7 * M) % (len(rows) - M + 1)
            batch = gemm.packed_linear(rows[start : start + M], packed)
            assert torch.equal(batch, alone[start : start + M]), M
    finally:
        torch.set_num_threads(threads)


def test_bias_leading_dimensions_and_empty_inputs():
    w, b = _randn(40, 70, seed=3), _randn(40, seed=4)
    packed = gemm.pack_weight(w)
    x = _randn(2, 3, 70, seed=5)
    got = gemm.packed_linear(x, packed, b)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, x @ w.T + b, atol=1e-5, rtol=1e-5)
    assert gemm.packed_linear(torch.empty(0, 70), packed).shape == (0, 40)
    # No input features: every output is the bias (a sum of nothing is 0).
    empty = gemm.pack_weight(torch.empty(8, 0))
    assert torch.equal(gemm.packed_linear(torch.empty(3, 0), empty), torch.zeros(3, 8))


def test_a_mismatched_input_is_a_clear_error():
    packed = gemm.pack_weight(_randn(16, 64, seed=6))
    with pytest.raises(RuntimeError, match="x has 63 features, the weight 64"):
        gemm.packed_linear(_randn(2, 63, seed=7), packed)
    with pytest.raises(RuntimeError, match="float32"):
        gemm.packed_linear(_randn(2, 64, seed=7).double(), packed)
    with pytest.raises(RuntimeError, match="2-D float32 CPU tensor"):
        gemm.pack_weight(torch.zeros(4, 4, dtype=torch.bfloat16))


def test_a_packed_weight_is_a_parameter_of_its_shape_that_only_multiplies():
    w = _randn(70, 48, seed=8)
    param = nn.Parameter(gemm.pack_weight(w), requires_grad=False)
    assert isinstance(param, nn.Parameter) and isinstance(param, gemm.PackedWeight)
    assert (param.shape, param.dtype, param.device.type) == ((70, 48), torch.float32, "cpu")
    assert param.panels.shape == (3, 48, 32)  # ceil(70 / 32) panels, the last zero-padded
    assert torch.equal(param.panels[2, :, 6:], torch.zeros(48, 26))
    assert "PackedWeight(shape=(70, 48)" in repr(param)
    with pytest.raises(RuntimeError, match="only multiplies"):
        param + 1
    x = _randn(5, 48, seed=9)
    assert torch.equal(cpu_gemm.linear(x, param), gemm.packed_linear(x, param))


@pytest.mark.parametrize(("d", "K"), [(1, 1), (5, 7), (16, 128), (17, 300), (40, 129), (1536, 576)])
def test_a_gated_packing_gives_the_same_bits_and_swiglu_in_one_pass(d, K):
    """16 gate and their 16 up rows a panel: the product is the plain packing's, and
    packed_silu_and_mul is packed_linear then the elementwise kernel's silu_and_mul bit for bit
    (d = 5, 17, 40: the last features of a row take std::exp, as ATen's silu does)."""
    w = _randn(2 * d, K, seed=d + K)
    plain, gated = gemm.pack_weight(w), gemm.pack_weight(w, gated=True)
    assert gated.gated and gated.panels.shape == plain.panels.shape
    # Panel 0 holds gate row 0 in column 0 and up row 0 (row d of W) in column 16.
    assert torch.equal(gated.panels[0, :, 0], w[0]) and torch.equal(gated.panels[0, :, 16], w[d])
    for M in (1, 5, 13, 32, 64, 65, 145, 250):
        x = _randn(M, K, seed=M)
        product = gemm.packed_linear(x, plain)
        assert torch.equal(gemm.packed_linear(x, gated), product), M
        want = (
            elementwise.silu_and_mul(product)
            if elementwise.available()
            else reference.silu_and_mul(product)
        )
        got = gemm.packed_silu_and_mul(x, gated)
        if elementwise.available():
            assert torch.equal(got, want), M
        else:
            torch.testing.assert_close(got, want)


def test_silu_and_mul_needs_a_gated_packing_of_an_even_weight():
    with pytest.raises(RuntimeError, match="gated=True"):
        gemm.packed_silu_and_mul(_randn(2, 64, seed=1), gemm.pack_weight(_randn(32, 64, seed=2)))
    with pytest.raises(RuntimeError, match="an even number of rows"):
        gemm.pack_weight(_randn(33, 64, seed=3), gated=True)


def test_the_mlp_of_a_swiglu_model_runs_its_silu_in_the_gemm():
    """After prepacking, a Llama MLP's gate_up weight is packed gated and its output is the
    unfused path's bit for bit; a projection wrapped for LoRA still multiplies it as [gate | up]."""
    from transformers import LlamaConfig

    from kvpilot.engine.layers.linear import prepack_linear_weights
    from kvpilot.engine.models.llama import LlamaMLP

    config = LlamaConfig(hidden_size=64, intermediate_size=40, hidden_act="silu")
    mlp = LlamaMLP(config)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(_randn(*param.shape, seed=param.numel()))
    x = _randn(7, 64, seed=11)
    gate_up = mlp.gate_up_proj(x)
    unfused = mlp.down_proj(mlp.act_fn(gate_up))
    prepack_linear_weights(mlp)
    assert mlp.gate_up_proj.pack_gated == elementwise.available()
    assert cpu_gemm.is_gated(mlp.gate_up_proj.weight) == mlp.gate_up_proj.pack_gated
    assert torch.equal(mlp(x), unfused)
    # What a LoRA wrapper calls: the projection alone, [gate | up] as before packing.
    assert torch.equal(mlp.gate_up_proj(x), gate_up)


def test_the_benchmark_runs_at_a_tiny_size():
    script = pathlib.Path(__file__).parents[2] / "benchmarks" / "cpu_gemm.py"
    done = subprocess.run(
        [sys.executable, str(script), "--layers", "1", "--vocab", "100", "--rows", "1,5",
         "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        row for row in map(str.split, done.stdout.splitlines()) if row and row[-1].endswith("x")
    ]
    assert [row[0] for row in rows] == ["1", "5"], done.stdout
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows), done.stdout
