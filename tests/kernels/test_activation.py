"""``silu_and_mul`` (Triton, interpreter on CPU) against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels.activation import silu_and_mul

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        (3, 2 * 40),  # d not a power of two: the column block is masked
        (2, 3, 2 * 24),  # leading batch dimensions
        (2, 2 * 1100),  # d above one program's 1024 columns: two column blocks
    ],
)
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).mul(4).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert out.dtype == dtype
    # float32: exp may differ from PyTorch's in the last bit; float16: one rounding step.
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 1e-3}
    torch.testing.assert_close(out, reference.silu_and_mul(x), **tol)


def test_strided_rows() -> None:
    # Rows of a wider buffer: only the last dimension has to be contiguous.
    buffer = torch.randn(4, 100)
    x = buffer[:, :64]
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (torch.zeros(2, 7), "even last dimension"),
        (torch.zeros(2, 8, dtype=torch.int32), "dtype"),
        (torch.zeros(8, 2).t(), "contiguous in its last dimension"),
        ("not a tensor", "torch.Tensor"),
    ],
)
def test_bad_input_names_x(x: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        silu_and_mul(x)
    assert "silu_and_mul: x" in str(info.value)
