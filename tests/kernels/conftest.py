"""Fixtures of the kernel tests: a tiny random Llama checkpoint the whole engine can load.

A trimmed copy of ``tests/engine/conftest.py``'s ``tiny_model_dir`` (test folders do not import
each other): transformers initialises a 2-layer Llama (hidden 64, 4 query heads, 2 KV heads,
head_dim 16) and saves it beside SmolLM2's tokenizer files.
"""

from __future__ import annotations

import pathlib
import shutil

import pytest
import torch
import transformers

from kvpilot.engine.model_loader import resolve_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Folder of a tiny float32 Llama with SmolLM2's tokenizer (vocabulary 49152)."""
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer_dir = resolve_model(None)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder
