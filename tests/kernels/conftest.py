"""Fixtures of the kernel tests: a tiny random Llama checkpoint the whole engine can load."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir: Callable[..., pathlib.Path]) -> pathlib.Path:
    """Folder of the suite's tiny float32 Llama (tests/conftest.py) with SmolLM2's tokenizer."""
    return tiny_model_dir("llama")
