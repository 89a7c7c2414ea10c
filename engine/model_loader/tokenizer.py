"""The tokenizer (with its chat template) and end-of-sequence ids of a model folder."""

from __future__ import annotations

import json
import pathlib

from transformers import CONFIG_MAPPING, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase


def load_tokenizer(
    model_dir: pathlib.Path | str, revision: str | None = None, token: str | bool | None = None
) -> PreTrainedTokenizerBase:
    """Load the folder's tokenizer through transformers (chat template included when present).

    ``model_dir`` may also be a Hub id (``revision`` and ``token`` then apply, vLLM's
    ``--tokenizer-revision`` and ``--hf-token``), or the built-in model's name
    (``DEFAULT_MODEL_NAME``, unless a folder of that name exists), as ``resolve_model`` reads it.

    Raises:
        FileNotFoundError: the folder has no tokenizer files.
    """
    from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME

    if str(model_dir) == DEFAULT_MODEL_NAME and not pathlib.Path(model_dir).exists():
        from kvpilot.engine.model_loader.resolve import resolve_model

        model_dir = resolve_model(None)
    model_dir = pathlib.Path(model_dir)
    if not model_dir.exists() and str(model_dir).startswith(("/", ".", "~")):
        raise FileNotFoundError(f"tokenizer folder {model_dir} does not exist")
    config = _checked_config(model_dir)
    try:
        return AutoTokenizer.from_pretrained(
            model_dir, revision=revision, token=token, **({"config": config} if config else {})
        )
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"no usable tokenizer in {model_dir}: {exc}") from exc


def _checked_config(model_dir: pathlib.Path) -> PretrainedConfig | None:
    """A local folder's config as the engine reads it (``read_model_config``: the dtype checked
    and named as torch names it), for transformers to use rather than read config.json again,
    which fails on a dtype it cannot look up in torch (``"torch.bfloat16"``, ``""``) that the
    engine and the planner accept. None without a config.json of a ``model_type`` transformers
    knows (a Hub id, a tokenizer-only folder): transformers then reads what it needs.

    Raises:
        ValueError: a config.json the engine refuses (e.g. a dtype no checkpoint is stored in).
    """
    from kvpilot.engine.model_loader.weights import read_model_config

    path = model_dir / "config.json"
    if not path.is_file():
        return None
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (ValueError, AttributeError):
        return None  # not a JSON object: transformers says what it makes of it
    return read_model_config(model_dir)[1] if model_type in CONFIG_MAPPING else None


def get_eos_token_ids(model_dir: pathlib.Path | str) -> set[int]:
    """The token ids that end generation.

    Taken from the first source that names any: generation_config.json (chat models often list
    several there, e.g. Llama 3's ``<|eot_id|>``), then config.json, then the tokenizer.

    Returns:
        A set of token ids; empty when no source names one.
    """
    model_dir = pathlib.Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            ids = _as_id_set(json.loads(path.read_text()).get("eos_token_id"))
            if ids:
                return ids
    return _as_id_set(load_tokenizer(model_dir).eos_token_id)


def _as_id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}
