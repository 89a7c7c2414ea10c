"""Build one of our model classes and fill it from a folder's safetensors, one tensor at a time."""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
from collections.abc import Iterator
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import CONFIG_MAPPING, PretrainedConfig

from kvpilot.engine.layers.quantization import get_quantization_config
from kvpilot.engine.layers.weight_loading import CheckpointTensor
from kvpilot.engine.model_shape import checkpoint_dtype
from kvpilot.engine.models import get_model_class

logger = logging.getLogger(__name__)


def read_model_config(
    model_dir: pathlib.Path, hf_overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any], PretrainedConfig]:
    """The folder's ``config.json``, read once: as the raw dict (what ``ModelShape`` reads) and
    as the transformers config of its ``model_type`` built from that same dict (what
    ``AutoConfig.from_pretrained`` builds).

    ``hf_overrides`` (vLLM's ``--hf-overrides``) replaces entries of the file before either is
    built; an entry naming a nested config (``text_config``) updates it key by key, as vLLM
    applies them. The checkpoint's dtype is checked as the planner checks it
    (``checkpoint_dtype``) and handed to both by its canonical name; a legacy ``"su"`` RoPE
    scaling is read as ``"longrope"`` (its later name).

    Raises:
        OSError: the file cannot be read; ValueError: not JSON, an unknown ``model_type``, a
            dtype the planner refuses, or a value transformers refuses (one from
            ``hf_overrides`` named with it).
    """
    raw = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    raw = _override(raw, hf_overrides or {})
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{model_dir}/config.json: unknown model_type {model_type!r}")
    try:
        raw = _with_longrope_named(_with_canonical_dtype(raw))
        return raw, CONFIG_MAPPING[model_type].from_dict(raw)
    except (StrictDataclassError, TypeError, ValueError, KeyError) as exc:
        where = " with hf_overrides" if hf_overrides else ""
        # A KeyError's str() is its message quoted.
        why = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise ValueError(f"{model_dir}/config.json{where}: {why}") from None


def _with_longrope_named(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with a ``rope_scaling`` of type ``"su"`` (Phi-3-mini-128k's first release)
    renamed ``"longrope"``, as vLLM renames it: transformers reads ``"su"`` as LongRoPE but then
    misses the top-level ``original_max_position_embeddings`` it finds for ``"longrope"``."""
    rope = config.get("rope_scaling")
    if not isinstance(rope, dict) or "su" not in (rope.get("type"), rope.get("rope_type")):
        return config
    renamed = {k: v for k, v in rope.items() if k not in ("type", "rope_type")}
    return {**config, "rope_scaling": {**renamed, "rope_type": "longrope"}}


def _with_canonical_dtype(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the dtype it states as ``dtype``, by its canonical name, or with neither
    key when it states none (``""``, ``"auto"``): transformers looks the name up in torch, so an
    unknown one, an empty one or an old export's ``"torch.bfloat16"`` would fail there with an
    ``AttributeError`` rather than a message naming the field.

    Raises:
        ValueError: a dtype ``checkpoint_dtype`` refuses.
    """
    dtype = checkpoint_dtype(config)
    rest = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}
    return rest if dtype is None else {**rest, "dtype": dtype}


def _override(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``overrides`` applied: a nested config (a dict with its own
    ``model_type``) is updated recursively, any other entry replaced whole."""
    out = dict(config)
    for key, value in overrides.items():
        nested = out.get(key)
        if isinstance(nested, dict) and "model_type" in nested and isinstance(value, dict):
            out[key] = _override(nested, value)
        else:
            out[key] = value
    return out


def iterate_safetensors(
    model_dir: pathlib.Path, lazy: bool = False
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield ``(Hugging Face weight name, tensor on CPU)`` for every tensor of every shard.

    With ``lazy`` a safetensors slice is yielded instead of the tensor: nothing is read until
    it is indexed, so a tensor-parallel rank reads only its own shard of each tensor.

    When ``model.safetensors.index.json`` exists only the shards it lists are read (some
    repositories also ship other safetensors, e.g. Mistral's ``consolidated.safetensors``).
    Tensors are read one at a time (memory stays at one tensor beyond the model), with a
    progress bar over the tensors.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        files = [model_dir / name for name in sorted(shards)]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    handles = [safe_open(f, framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc=f"Loading weights of {model_dir.name}", unit="tensor") as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_slice(name) if lazy else handle.get_tensor(name)
                bar.update()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: pathlib.Path | str,
    dtype: torch.dtype,
    device: torch.device | str,
    attention_backend: str = "torch",
    max_model_len: int | None = None,
    config: PretrainedConfig | None = None,
    quantization: str | None = None,
    load_format: str = "auto",
) -> torch.nn.Module:
    """Instantiate our implementation of the folder's architecture and load its weights.

    Parameters are allocated directly in ``dtype`` on ``device`` (no random initialisation, no
    float32 copy first), then each checkpoint tensor is copied into place by the model's own
    ``load_weights`` (which knows how q/k/v and gate/up stack into one matrix). Under tensor
    parallelism (``kvpilot.engine.distributed`` set up in this process) the model holds this
    rank's shard and only that shard of each tensor is read from disk.

    Args:
        model_dir: a folder from :func:`~kvpilot.engine.model_loader.resolve_model`.
        dtype: parameter and activation dtype (float32, float16 or bfloat16).
        device: where the parameters live.
        attention_backend: name for
            :func:`~kvpilot.engine.attention.get_attention_backend` (``"torch"`` or
            ``"triton"``); the norms, activations and rotary embedding run the same path.
        max_model_len: the longest sequence the engine serves, tokens; None for the config's
            ``max_position_embeddings``. LongRoPE models (Phi-3-128k, Phi-3.5) use their long
            rotary factors when it exceeds ``original_max_position_embeddings``; dynamic-NTK
            models take the frequencies for it.
        config: the folder's config already read (:func:`read_model_config`); read here when
            None.
        quantization: ``--quantization``: None loads the checkpoint's own
            ``quantization_config`` (or none); a method name must agree with it (see
            :func:`~kvpilot.engine.layers.quantization.get_quantization_config`). Quantized
            layers keep their packed weights; each layer's method converts them once every
            tensor is loaded (``process_weights_after_loading``).
        load_format: ``auto`` or ``safetensors`` read the checkpoint; ``dummy`` fills every
            parameter uniformly in [-1e-3, 1e-3] from a fixed seed instead (vLLM's dummy
            format: for profiling; the folder needs no weights).

    Returns:
        The model in eval mode (see ``kvpilot.engine.models`` for its interface).

    Raises:
        ValueError: an unsupported architecture or quantization format (named in the message),
            weights that are missing from the checkpoint or do not fit the config, or
            ``dummy`` weights for a model whose checkpoint is stored quantized (AWQ, GPTQ,
            fp8).
    """
    model_dir = pathlib.Path(model_dir)
    if config is None:
        config = read_model_config(model_dir)[1]
    model_cls = get_model_class(config)
    quant_config = get_quantization_config(
        getattr(config, "quantization_config", None), quantization
    )
    extra = {} if quant_config is None else {"quant_config": quant_config}
    device = torch.device(device)
    with _default_dtype(dtype), device:
        model = model_cls(
            config, attention_backend=attention_backend, max_model_len=max_model_len, **extra
        )
    if load_format == "dummy":
        _fill_dummy(model)
    else:
        loaded = model.load_weights(iterate_safetensors(model_dir, lazy=True))
        missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
        if missing:
            raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing)}")
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()


@torch.no_grad()
def _fill_dummy(model: torch.nn.Module) -> None:
    """Every parameter uniform in [-1e-3, 1e-3], the same on every run and every rank (an
    online ``--quantization fp8`` then quantizes them as it would a checkpoint's).

    Raises:
        ValueError: a parameter stored quantized (a pre-quantized checkpoint's format).
    """
    stored = sorted(
        {str(p.dtype) for p in model.parameters() if not p.is_floating_point() or p.itemsize == 1}
    )
    if stored:
        raise ValueError(
            f"load_format dummy: this model's weights are stored quantized ({', '.join(stored)}), "
            "which random values cannot stand for; load its checkpoint"
        )
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        values = torch.rand(param.shape, generator=generator, dtype=torch.float32)
        param.copy_(values.mul_(2e-3).sub_(1e-3))
