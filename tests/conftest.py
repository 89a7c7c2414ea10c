"""Suite-wide settings and shared fixtures.

Settings: Triton's interpreter on CPU-only machines, and the torch thread count
(``KVPILOT_NUM_THREADS``, default 2).

Fixtures: ``default_model_dir``, the converted SmolLM2-135M-Instruct folder (converted once into
``$KVPILOT_CACHE_DIR``; later sessions reuse it); ``tiny_model_dir(architecture,
**config_overrides)``, a tiny randomly initialised checkpoint saved by transformers (2 layers,
hidden 64, 4 query heads, 2 KV heads, head_dim 16), with SmolLM2's tokenizer and chat template
beside it so the whole engine can run on it. Folders are built once per session per argument
set; treat them as read-only.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable

import pytest
import torch
import transformers

from kvpilot.engine.model_loader import resolve_model

# The real control plane's fixtures (kube, namespace, crd, tiny_model_source): tests/cluster/.
pytest_plugins = ["tests.cluster.fixtures"]

# Must be set before the first Triton launch: kernels run in the interpreter
# when there is no GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("KVPILOT_NUM_THREADS", "2")))

# architecture -> transformers config class name
TINY_ARCHITECTURES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "granite": "GraniteConfig",
    "phi3": "Phi3Config",
    "gemma": "GemmaConfig",
    "mixtral": "MixtralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
}

# SmolLM2's tokenizer: 49152 tokens, <|im_start|> = 1, <|im_end|> = 2 (its EOS).
TINY_CONFIG = dict(
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

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def default_model_dir() -> pathlib.Path:
    """The default model's Hugging Face folder (``resolve_model(None)``)."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: pathlib.Path
) -> Callable[..., pathlib.Path]:
    """Factory: ``tiny_model_dir("qwen3", seed=0, **config_overrides) -> folder``.

    ``architecture`` is a key of ``TINY_ARCHITECTURES`` (``llama``, ``mistral``, ``qwen2``,
    ``qwen3``, ``granite``, ``phi3``, ``gemma``, ``mixtral``, ``qwen3_moe``); overrides go to the transformers config (e.g.
    ``tie_word_embeddings=False``, ``rope_scaling={...}``, ``num_hidden_layers=3``). Weights are
    float32, initialised by transformers from ``seed``.
    """
    built: dict[tuple, pathlib.Path] = {}

    def build(architecture: str = "llama", seed: int = 0, **overrides) -> pathlib.Path:
        if architecture not in TINY_ARCHITECTURES:
            raise ValueError(f"tiny_model_dir: unknown architecture {architecture!r}")
        key = (architecture, seed, repr(sorted(overrides.items())))
        if key in built:
            return built[key]
        config_cls = getattr(transformers, TINY_ARCHITECTURES[architecture])
        config = config_cls(**{**TINY_CONFIG, **overrides})
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        folder = tmp_path_factory.mktemp(f"tiny-{architecture}")
        model.save_pretrained(folder)
        for name in _TOKENIZER_FILES:
            if (default_model_dir / name).is_file():
                shutil.copy(default_model_dir / name, folder / name)
        built[key] = folder
        return folder

    return build
