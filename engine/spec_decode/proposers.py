"""Build the proposer a ``SpeculativeConfig`` names, checking a draft model at start-up."""

from __future__ import annotations

import json
import pathlib

import torch

from kvpilot.engine.attention.layer import enable_kv_scale_calculation
from kvpilot.engine.model_shape import ModelShape
from kvpilot.engine.spec_decode.config import DRAFT_MODEL, SpeculativeConfig
from kvpilot.engine.spec_decode.draft_model_proposer import (
    DraftModelProposer,
    check_draft_vocabulary,
)
from kvpilot.engine.spec_decode.ngram_proposer import NgramProposer

Proposer = NgramProposer | DraftModelProposer


def resolve_draft_model(
    config: SpeculativeConfig, target_dir: pathlib.Path, tensor_parallel_size: int = 1
) -> pathlib.Path | None:
    """The draft model's folder (None for methods without one), once its vocabulary is
    checked against the target's.

    Raises:
        FileNotFoundError: the draft model does not exist.
        ValueError: the draft's vocabulary or tokenizer differs from the target's, or the
            target is sharded (the draft runs beside the target's cache, in this process).
    """
    from kvpilot.engine.model_loader import resolve_model

    if config.method != DRAFT_MODEL:
        return None
    if tensor_parallel_size != 1:
        raise ValueError(
            "speculative_config: method 'draft_model' needs tensor_parallel_size 1, got "
            f"{tensor_parallel_size}; use method 'ngram' with tensor parallelism"
        )
    draft_dir = resolve_model(config.model, config.revision)
    check_draft_vocabulary(target_dir, draft_dir)
    return draft_dir


def draft_kv_bytes_per_token(draft_dir: pathlib.Path | None, itemsize: int) -> int:
    """Bytes of the draft model's K and V per token over all its layers (0 without a draft):
    its cache shares the target's blocks, so every block costs both."""
    if draft_dir is None:
        return 0
    spec = ModelShape.from_hf_config(json.loads((draft_dir / "config.json").read_text()))
    return spec.kv_bytes_per_token(itemsize)


def num_lookahead_tokens(config: SpeculativeConfig | None) -> int:
    """KV slots a proposer writes past a request's tokens: a draft model's proposals."""
    return config.num_speculative_tokens if config and config.method == DRAFT_MODEL else 0


def build_proposer(
    config: SpeculativeConfig,
    draft_dir: pathlib.Path | None,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    num_blocks: int,
    block_size: int,
    kv_cache_dtype: torch.dtype | None = None,
    calculate_kv_scales: bool = False,
) -> Proposer:
    """The n-gram proposer, or the draft model loaded with its own cache of ``num_blocks``
    blocks (the target's count, the same block ids) in ``kv_cache_dtype`` (None: ``dtype``),
    its fp8 scales calculated on its first step when ``calculate_kv_scales``."""
    if config.method != DRAFT_MODEL:
        return NgramProposer(
            config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens
        )
    from kvpilot.engine.model_loader import load_model

    model = load_model(draft_dir, dtype, device, attention_backend=attention_backend)
    if calculate_kv_scales:
        enable_kv_scale_calculation(model)
    return DraftModelProposer(
        model, num_blocks, block_size, device, config.num_speculative_tokens, kv_cache_dtype
    )
