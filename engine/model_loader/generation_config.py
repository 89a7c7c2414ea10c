"""The sampling defaults a model's creator recommends, from its ``generation_config.json``.

As vLLM's ``--generation-config auto`` (its default): a request that leaves ``temperature``,
``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty`` unset gets the model's value where its
generation config has one, else the engine's own default (``SamplingParams``'); its
``max_new_tokens`` is the output limit of requests that set none.
``--generation-config vllm`` ignores the model's; a folder reads that folder's file instead;
``--override-generation-config`` replaces entries of either.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The ``generation_config.json`` keys read, each named as the ``SamplingParams`` field."""

MAX_NEW_TOKENS = "max_new_tokens"
"""transformers' output limit, read (as vLLM reads it) as ``SamplingParams.max_tokens``: the
offline default, and the server's for requests that set none (chat)."""

GENERATION_CONFIG_CHOICES = ("auto", "vllm")
"""``--generation-config`` values besides a folder."""


def read_sampling_defaults(
    model_dir: pathlib.Path,
    generation_config: str = "auto",
    override_generation_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The sampling defaults for a model.

    Args:
        model_dir: the model's folder.
        generation_config: ``auto`` (the model's ``generation_config.json``), ``vllm`` (none:
            the engine's defaults) or a folder holding a ``generation_config.json``.
        override_generation_config: entries that replace or add to the file's (vLLM's
            ``--override-generation-config``: ``{"temperature": 0.5}``; with ``vllm``, the
            only ones); only :data:`SAMPLING_FIELDS` and ``max_new_tokens`` are read.

    Returns:
        ``{field: value}`` for the :data:`SAMPLING_FIELDS` set, and ``max_tokens`` from
        ``max_new_tokens`` (may be empty).

    Raises:
        ValueError: a folder without a ``generation_config.json``, or a file that is not a
            JSON object.
    """
    config, path = {}, None
    if generation_config != "vllm":
        folder = model_dir if generation_config == "auto" else pathlib.Path(generation_config)
        path = folder / "generation_config.json"
        if path.is_file():
            config = json.loads(path.read_text())
            if not isinstance(config, dict):
                raise ValueError(f"generation_config: {path} is not a JSON object")
        elif generation_config != "auto":
            raise ValueError(f"generation_config: {path} does not exist")
    config = {**config, **(override_generation_config or {})}
    defaults = {key: config[key] for key in SAMPLING_FIELDS if config.get(key) is not None}
    if isinstance(config.get(MAX_NEW_TOKENS), int) and config[MAX_NEW_TOKENS] > 0:
        defaults["max_tokens"] = config[MAX_NEW_TOKENS]
    if defaults:
        logger.info(
            "Default sampling parameters from %s: %s (--generation-config vllm to use the "
            "engine's)",
            "the overrides" if path is None or not path.is_file() else path,
            defaults,
        )
    return defaults


def add_sampling_defaults(model_dir: pathlib.Path, defaults: dict[str, Any]) -> None:
    """Write ``defaults`` into ``model_dir``'s ``generation_config.json`` (created if absent),
    keeping its other keys: how the built-in default model carries its model card's
    recommended sampling."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **defaults}, indent=2, sort_keys=True) + "\n")
