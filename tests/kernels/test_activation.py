"""``silu_and_mul`` and ``gelu_and_mul`` (one Triton kernel, interpreter on CPU) against their
PyTorch references, and the references against transformers' activations."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from transformers.activations import ACT2FN

from kvpilot.kernels import reference
from kvpilot.kernels.activation import gelu_and_mul, silu_and_mul

pytestmark = pytest.mark.kernel

# name -> (Triton kernel, its reference, transformers' ``hidden_act`` of the gate)
ACTIVATIONS: dict[str, tuple[Callable, Callable, str]] = {
    "silu": (silu_and_mul, reference.silu_and_mul, "silu"),
    "gelu": (gelu_and_mul, reference.gelu_and_mul, "gelu"),
    "gelu_tanh": (
        functools.partial(gelu_and_mul, approximate="tanh"),
        functools.partial(reference.gelu_and_mul, approximate="tanh"),
        "gelu_pytorch_tanh",  # Gemma's
    ),
}


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul(4).to(dtype)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        (3, 2 * 37),  # odd d: the column block is masked
        (2, 3, 2 * 24),  # leading batch dimensions
        (2, 2 * 1100),  # d above one program's 1024 columns: two column blocks
    ],
)
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, activation: str) -> None:
    kernel, ref, _ = ACTIVATIONS[activation]
    x = _randn(*shape, dtype=dtype)
    out = kernel(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert out.dtype == dtype
    # float32: exp/erf may differ from PyTorch's in the last bits (the tanh GELU is evaluated
    # as a sigmoid); float16: one rounding step.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 1e-3}
    torch.testing.assert_close(out, ref(x), **tol)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_reference_matches_transformers(activation: str) -> None:
    # The reference is the gate activation of transformers' MLPs (Gemma's gelu_pytorch_tanh
    # included) times the up projection, on the stacked gate/up output.
    _, ref, hidden_act = ACTIVATIONS[activation]
    x = _randn(4, 2 * 37)
    torch.testing.assert_close(ref(x), ACT2FN[hidden_act](x[:, :37]) * x[:, 37:], atol=0, rtol=0)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_strided_rows(activation: str) -> None:
    # Rows of a wider buffer: only the last dimension has to be contiguous.
    kernel, ref, _ = ACTIVATIONS[activation]
    x = _randn(4, 100)[:, :64]
    torch.testing.assert_close(kernel(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [silu_and_mul, gelu_and_mul])
@pytest.mark.parametrize(
    ("x", "message"),
    [
        (torch.zeros(2, 7), "even last dimension"),
        (torch.zeros(2, 8, dtype=torch.int32), "dtype"),
        (torch.zeros(8, 2).t(), "contiguous in its last dimension"),
        ("not a tensor", "torch.Tensor"),
    ],
)
def test_bad_input_names_x(kernel: Callable, x: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        kernel(x)
    assert f"{kernel.__name__}: x" in str(info.value)


def test_unknown_gelu_approximation_is_named() -> None:
    with pytest.raises(ValueError, match="gelu_and_mul: approximate must be 'none' or 'tanh'"):
        gelu_and_mul(torch.zeros(2, 8), approximate="sigmoid")
