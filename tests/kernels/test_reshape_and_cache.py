"""``reshape_and_cache`` (Triton, interpreter on CPU) against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels.reshape_and_cache import reshape_and_cache

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # 3 KV heads of 24 dims: both padded inside the kernel's blocks.
    k_cache = torch.randn(5, 4, 3, 24, generator=gen).to(dtype)
    v_cache = torch.randn(5, 4, 3, 24, generator=gen).to(dtype)
    # Key and value as views of a fused [num_tokens, 2, 3, 24] buffer (strided tokens).
    kv = torch.randn(6, 2, 3, 24, generator=gen).to(dtype)
    key, value = kv[:, 0], kv[:, 1]
    # Out-of-order slots, a padding token (-1), the first and the last slot of the cache.
    slots = torch.tensor([13, -1, 0, 19, 6, 7])
    k_want, v_want = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, k_want, v_want, slots)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_want, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_want, atol=0, rtol=0)


def test_casts_to_cache_dtype() -> None:
    key = torch.randn(2, 1, 16)
    k_cache, v_cache = (
        torch.zeros(1, 4, 1, 16, dtype=torch.float16),
        torch.zeros(1, 4, 1, 16, dtype=torch.float16),
    )
    reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([3, 1], dtype=torch.int32))
    torch.testing.assert_close(k_cache[0, 3], key[0].half(), atol=0, rtol=0)
    torch.testing.assert_close(v_cache[0, 1], key[1].half(), atol=0, rtol=0)
    assert not k_cache[0, 0].any() and not k_cache[0, 2].any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slot_mapping": torch.tensor([0, 8])}, r"slot_mapping entries must lie in \[-1, 8\)"),
        ({"slot_mapping": torch.tensor([0, -2])}, r"slot_mapping entries must lie in \[-1, 8\)"),
        ({"slot_mapping": torch.tensor([0])}, "slot_mapping must have shape"),
        ({"key": torch.zeros(2, 2, 8)}, "key must have shape"),
        ({"value": torch.zeros(3, 2, 16)}, "value must have shape"),
        ({"v_cache": torch.zeros(2, 4, 2, 16, dtype=torch.float16)}, "v_cache must have dtype"),
        ({"k_cache": torch.zeros(4, 2, 2, 16).transpose(0, 1)}, "k_cache must be contiguous"),
    ],
)
def test_bad_input_names_argument(kwargs: dict, message: str) -> None:
    args = {
        "key": torch.zeros(2, 2, 16),
        "value": torch.zeros(2, 2, 16),
        "k_cache": torch.zeros(2, 4, 2, 16),
        "v_cache": torch.zeros(2, 4, 2, 16),
        "slot_mapping": torch.tensor([0, 1]),
    }
    args.update(kwargs)
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**args)
    torch.testing.assert_close(args["k_cache"], before, atol=0, rtol=0)  # nothing written
