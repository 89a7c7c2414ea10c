"""Transparent huge pages for the KV cache and the packed weights (kernels/cpu/huge_pages.py)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from kvpilot.kernels.cpu import huge_pages

MIB = 1024 * 1024
THP_SETTING = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed THP mode (``always``, ``madvise``, ``never``), or None off Linux."""
    if not THP_SETTING.exists():
        return None
    text = THP_SETTING.read_text()
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.parametrize(
    ("address", "nbytes", "want"),
    [
        (0, 4 * MIB, (0, 4 * MIB)),  # aligned: all of it
        (64, 4 * MIB, (2 * MIB, 2 * MIB)),  # the partial pages at both ends are left out
        (2 * MIB - 1, 2 * MIB + 2, (2 * MIB, 2 * MIB)),
        (4096, 3 * MIB, (2 * MIB, 0)),  # no whole page inside
        (2 * MIB, MIB, (2 * MIB, 0)),
        (10 * MIB + 5, 0, (12 * MIB, 0)),
    ],
)
def test_the_interior_is_the_whole_pages_inside(address, nbytes, want):
    start, length = huge_pages.interior(address, nbytes)
    assert (start, length) == want
    assert start % huge_pages.HUGE_PAGE == 0 and length % huge_pages.HUGE_PAGE == 0
    if length:
        assert address <= start and start + length <= address + nbytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_a_large_buffer_is_advised_where_the_system_has_thp():
    tensor = torch.empty(16 * MIB // 4)
    advised = huge_pages.advise(tensor)
    start, length = huge_pages.interior(tensor.data_ptr(), tensor.nbytes)
    if _thp_mode() in ("madvise", "always"):
        assert advised == length >= 14 * MIB
    else:  # THP off (never) or not built into the kernel: refused, nothing changes
        assert advised in (0, length)
    assert huge_pages.advise(torch.empty(100)) == 0  # smaller than a page
    assert huge_pages.advise(torch.empty(4 * MIB, device="meta")) == 0


def test_zeros_and_empty_are_tensors_like_torchs():
    zeros = huge_pages.zeros((3, 5 * MIB // 4), torch.float32)
    assert zeros.shape == (3, 5 * MIB // 4) and zeros.dtype == torch.float32
    assert zeros.is_contiguous() and not zeros.any()
    empty = huge_pages.empty((7,), torch.bfloat16)
    assert empty.shape == (7,) and empty.dtype == torch.bfloat16


def test_the_environment_variable_turns_the_advice_off(monkeypatch):
    tensor = torch.empty(16 * MIB // 4)
    monkeypatch.setenv(huge_pages.ENV_VAR, "0")
    assert huge_pages.advise(tensor) == 0
    monkeypatch.setenv(huge_pages.ENV_VAR, "off")
    assert huge_pages.advise(tensor) == 0
    assert not huge_pages.zeros((4 * MIB,), torch.float32).any()  # still zeros, 4 KiB pages
