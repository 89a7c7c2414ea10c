"""``rotary_embedding`` (Triton, interpreter on CPU) against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels.rotary_embedding import rotary_embedding

pytestmark = pytest.mark.kernel


def _cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])  # the whole head, and a partial rotary
def test_matches_reference(dtype: torch.dtype, is_neox: bool, rot_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    # 6 query heads, 2 KV heads (neither a power of two's worth of padding), head_dim 32.
    q = torch.randn(5, 6, 32, generator=gen).to(dtype)
    k = torch.randn(5, 2, 32, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 7, 63, 30])
    cache = _cos_sin_cache(64, rot_dim)
    q_want, k_want = q.clone(), k.clone()
    reference.rotary_embedding(positions, q_want, k_want, cache, is_neox)
    assert rotary_embedding(positions, q, k, cache, is_neox) is None  # in place
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 1e-3}
    torch.testing.assert_close(q, q_want, **tol)
    torch.testing.assert_close(k, k_want, **tol)


def test_views_of_fused_qkv_int32_positions() -> None:
    # q and k as strided views of one [num_tokens, (4 + 2 + 2) * 16] projection output.
    qkv = torch.randn(3, 8 * 16, generator=torch.Generator().manual_seed(1))
    want = qkv.clone()
    positions = torch.tensor([5, 0, 2], dtype=torch.int32)
    cache = _cos_sin_cache(8, 16)
    q, k = qkv[:, :64].view(3, 4, 16), qkv[:, 64:96].view(3, 2, 16)
    rotary_embedding(positions, q, k, cache)
    q_want, k_want = want[:, :64].reshape(3, 4, 16), want[:, 64:96].reshape(3, 2, 16)
    reference.rotary_embedding(positions.long(), q_want, k_want, cache)
    torch.testing.assert_close(q, q_want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k, k_want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(qkv[:, 96:], want[:, 96:], atol=0, rtol=0)  # V untouched


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"positions": torch.tensor([0, 8])}, r"positions entries must lie in \[0, 8\)"),
        ({"positions": torch.tensor([0, 1, 2])}, "positions must have shape"),
        ({"positions": torch.tensor([0.0, 1.0])}, "positions must have dtype"),
        ({"cos_sin_cache": torch.zeros(8, 6)[:, :5]}, "rot_dim must be even"),
        ({"cos_sin_cache": torch.zeros(8, 32)}, "rot_dim must be even and in"),
        ({"k": torch.zeros(2, 2, 8)}, "k must have shape"),
        ({"k": torch.zeros(2, 2, 16, dtype=torch.float16)}, "k must have dtype"),
        ({"q": torch.zeros(2, 16)}, "q must be 3-D"),
    ],
)
def test_bad_input_names_argument(kwargs: dict, message: str) -> None:
    args = {
        "positions": torch.tensor([0, 1]),
        "q": torch.zeros(2, 4, 16),
        "k": torch.zeros(2, 2, 16),
        "cos_sin_cache": torch.zeros(8, 16),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        rotary_embedding(args["positions"], args["q"], args["k"], args["cos_sin_cache"])
