"""``rms_norm`` (Triton, interpreter on CPU) against its PyTorch reference, Llama's scaling by
``weight`` and Gemma's by ``1 + weight`` (``weight_offset``), and the Gemma reference against
transformers' ``GemmaRMSNorm``."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from kvpilot.kernels import reference
from kvpilot.kernels.rms_norm import rms_norm

pytestmark = pytest.mark.kernel


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("hidden", [72, 37])  # the row block of 128 (64) is masked
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_reference(
    dtype: torch.dtype, with_residual: bool, hidden: int, weight_offset: float
) -> None:
    x = _randn(5, hidden, dtype=dtype, seed=0)
    weight = _randn(hidden, dtype=dtype, seed=1)
    residual = _randn(5, hidden, dtype=dtype, seed=2) if with_residual else None
    x_before = x.clone()
    got = rms_norm(x, weight, 1e-5, residual, weight_offset=weight_offset)
    want = reference.rms_norm(x, weight, 1e-5, residual, weight_offset=weight_offset)
    assert (got[0] if with_residual else got).dtype == dtype
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    if with_residual:
        torch.testing.assert_close(got[0], want[0], **tol)
        # x + residual is rounded to x's dtype exactly as PyTorch adds
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
    else:
        torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)  # the input is left alone


def test_leading_dims_and_promoted_weight() -> None:
    # Per-head norms (Qwen3's q_norm) pass [num_tokens, num_heads, head_dim]; a float32 weight
    # on float16 activations promotes the result to float32, as `weight * h` does in PyTorch.
    x = _randn(3, 4, 16, dtype=torch.float16, seed=3)
    weight = _randn(16, dtype=torch.float32, seed=4)
    got = rms_norm(x, weight, 1e-6)
    want = reference.rms_norm(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_gemma_offset_keeps_x_dtype() -> None:
    # Gemma scales by (1 + weight) in float32 and rounds to x's dtype whatever the weight's.
    x = _randn(3, 4, 16, dtype=torch.float16, seed=3)
    weight = _randn(16, dtype=torch.float32, seed=4)
    got = rms_norm(x, weight, 1e-6, weight_offset=1.0)
    want = reference.rms_norm(x, weight, 1e-6, weight_offset=1.0)
    assert got.dtype == want.dtype == torch.float16
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemma_reference_matches_transformers(dtype: torch.dtype) -> None:
    # weight_offset 1.0 is transformers' GemmaRMSNorm, after Gemma's `residual + x`.
    norm = GemmaRMSNorm(37, eps=1e-6).to(dtype)
    norm.weight.data = _randn(37, dtype=dtype, seed=9)
    x, residual = _randn(5, 37, dtype=dtype, seed=10), _randn(5, 37, dtype=dtype, seed=11)
    want = norm(x)
    got = reference.rms_norm(x, norm.weight, 1e-6, weight_offset=1.0)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    got, new_residual = reference.rms_norm(x, norm.weight, 1e-6, residual, weight_offset=1.0)
    torch.testing.assert_close(new_residual, residual + x, atol=0, rtol=0)
    torch.testing.assert_close(got, norm(residual + x), atol=0, rtol=0)


def test_permuted_input_with_residual() -> None:
    # A dense but permuted x is read row by row; both outputs come back in x's logical order.
    x = _randn(4, 3, 16, dtype=torch.float32, seed=5).transpose(0, 1)
    residual = _randn(3, 4, 16, dtype=torch.float32, seed=6)
    weight = _randn(16, dtype=torch.float32, seed=7)
    got, got_residual = rms_norm(x, weight, 1e-5, residual)
    want, want_residual = reference.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)


def test_zero_row_is_finite() -> None:
    x = torch.zeros(2, 32)
    torch.testing.assert_close(rms_norm(x, torch.ones(32), 1e-6), torch.zeros(2, 32))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight": torch.ones(31)}, "weight must have shape"),
        ({"residual": torch.zeros(4, 31)}, "residual must have shape"),
        ({"residual": torch.zeros(4, 32, dtype=torch.float16)}, "residual must have dtype"),
        ({"eps": -1.0}, "eps must be a finite non-negative"),
        ({"eps": float("nan")}, "eps must be a finite non-negative"),
        ({"x": torch.zeros(32, 4).t()}, "x must be contiguous in its last dimension"),
        ({"x": torch.zeros(4, 70000)}, "hidden_size must be <= 65536"),
        ({"weight_offset": 0.5}, "weight_offset must be 0.0 or 1.0, got 0.5"),
        ({"weight_offset": True}, "weight_offset must be 0.0 or 1.0, got True"),
    ],
)
def test_bad_input_names_argument(kwargs: dict, message: str) -> None:
    args = {"x": torch.zeros(4, 32), "weight": torch.ones(32), "eps": 1e-6, "residual": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        rms_norm(**args)
