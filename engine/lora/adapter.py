"""Reading a PEFT LoRA adapter folder into per-projection weights for our stacked layers.

PEFT's ``save_pretrained`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` with
names such as ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (``[rank,
in_features]``) and ``...lora_B.weight`` (``[out_features, rank]``). Our models stack q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj``; the model's ``stacked_params_mapping`` (the same
table its checkpoint loader uses) turns ``...q_proj`` into ``(...qkv_proj, "q")``.

The scaling of Hu et al. 2021 (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA,
Kalajdzievski 2023) is folded into ``B`` once here, as vLLM does, so the per-token delta is just
``x A^T B^T``; PEFT's ``rank_pattern`` and ``alpha_pattern`` give per-projection ranks and alphas.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file

from kvpilot.engine.lora.errors import LoRAAdapterError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

# PEFT module names of the projections a decoder layer has (attention and MLP).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_PEFT_PREFIX = "base_model.model."
# A Hugging Face Hub repository id (``org/name``), as the model resolver accepts.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_NAME = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])\.weight")

# (stacked module suffix, PEFT module suffix, shard id): a model's ``stacked_params_mapping``.
StackedMapping = Iterable[tuple[str, str, str | int]]


@dataclass(frozen=True)
class LoRAWeights:
    """The low-rank pair of one projection (one stacked shard of it, for q/k/v and gate/up).

    Attributes:
        lora_a: ``[rank, in_features]`` in the adapter's dtype (float32 unless ``load_adapter``
            was given another; whole, unsharded layer).
        lora_b: ``[out_features, rank]``, the same dtype, already multiplied by ``scaling``.
        scaling: ``lora_alpha / rank`` (or ``/ sqrt(rank)`` with rsLoRA).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter, on the host, ready to be copied into a slot.

    Attributes:
        name: the adapter's name.
        path: the folder it was read from.
        rank: the largest rank of its projections.
        digest: sha256 (hex) of ``adapter_config.json`` and ``adapter_model.safetensors``: two
            adapters with the same digest compute the same K/V, so it keys the prefix cache.
        weights: ``(module path in our model, shard id or None) -> LoRAWeights``, e.g.
            ``("model.layers.0.self_attn.qkv_proj", "q")`` or
            ``("model.layers.0.mlp.down_proj", None)``.
    """

    name: str
    path: pathlib.Path
    rank: int
    digest: str
    weights: dict[tuple[str, str | int | None], LoRAWeights]

    def by_projection(self) -> dict[str, dict[str | int | None, LoRAWeights]]:
        """Module path -> {shard id -> weights}: the parts of each adapted projection."""
        grouped: dict[str, dict[str | int | None, LoRAWeights]] = {}
        for (module, shard_id), weights in self.weights.items():
            grouped.setdefault(module, {})[shard_id] = weights
        return grouped

    @property
    def num_bytes(self) -> int:
        """Host memory held by the weights (bytes)."""
        return sum(
            w.lora_a.numel() * w.lora_a.element_size() + w.lora_b.numel() * w.lora_b.element_size()
            for w in self.weights.values()
        )


def load_adapter(
    name: str,
    path: str | pathlib.Path,
    stacked_params_mapping: StackedMapping,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Read a PEFT LoRA adapter folder.

    Args:
        name: the adapter's name (for messages and :attr:`LoRAAdapter.name`).
        path: folder with ``adapter_config.json`` and ``adapter_model.safetensors``, or a
            Hugging Face Hub id of one.
        stacked_params_mapping: the model's ``(stacked, part, shard id)`` table, e.g.
            ``LlamaForCausalLM.stacked_params_mapping``.
        dtype: the weights' dtype (vLLM's ``--lora-dtype``); the scaling is folded into ``B``
            in float32, then rounded once to it.

    Returns:
        The adapter, with ``dtype`` weights on the CPU and the scaling folded into ``B``.

    Raises:
        LoRAAdapterError: a missing folder or file; a config that is not LoRA or uses DoRA,
            LoRA biases, ``modules_to_save`` or ``fan_in_fan_out``; a weight of a module other
            than q/k/v/o/gate/up/down projections; a module with only one of A and B; shapes
            that disagree (``A`` ``[r, in]``, ``B`` ``[out, r]``).
    """
    folder = resolve_adapter_path(name, path)
    missing = missing_adapter_files(folder)
    if missing:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {folder} has no {missing[0]} (a PEFT LoRA folder holds "
            f"{CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    config_file, weights_file = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_file} is not JSON: {exc}") from exc
    _check_config(name, config)
    try:
        tensors = load_file(weights_file)
    except Exception as exc:  # safetensors raises its own error types for a corrupt file
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {weights_file}: {exc}") from exc
    pairs = _pair_tensors(name, tensors)
    mapping = tuple(stacked_params_mapping)
    weights: dict[tuple[str, str | int | None], LoRAWeights] = {}
    for module, (lora_a, lora_b) in sorted(pairs.items()):
        scaling = _scaling(config, module, lora_a.shape[0])
        weights[_our_module(module, mapping)] = LoRAWeights(
            lora_a=lora_a.to(dtype).contiguous(),
            lora_b=(lora_b.float() * scaling).to(dtype).contiguous(),
            scaling=scaling,
        )
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    return LoRAAdapter(
        name=name,
        path=folder,
        rank=max(w.rank for w in weights.values()),
        digest=_digest(config_file, weights_file),
        weights=weights,
    )


def missing_adapter_files(folder: pathlib.Path) -> list[str]:
    """The files of a PEFT LoRA folder (``adapter_config.json``, ``adapter_model.safetensors``)
    that ``folder`` lacks: all of them when it does not exist."""
    return [name for name in (CONFIG_NAME, WEIGHTS_NAME) if not (folder / name).is_file()]


def resolve_adapter_path(name: str, path: str | pathlib.Path) -> pathlib.Path:
    """The local folder of an adapter: ``path`` itself, or a Hugging Face Hub id downloaded
    through huggingface_hub (only the two adapter files; ``HF_TOKEN``/``HF_HOME`` honoured).

    Raises:
        LoRAAdapterError: neither an existing folder nor a Hub id that could be fetched.
    """
    folder = pathlib.Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists() or not _HUB_ID.match(str(path)):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is not a folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return pathlib.Path(
            snapshot_download(str(path), allow_patterns=[CONFIG_NAME, WEIGHTS_NAME])
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {path} is not a local folder and could not be fetched "
            f"from the Hugging Face Hub: {exc}"
        ) from exc


def _check_config(name: str, config: dict[str, Any]) -> None:
    def fail(problem: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r}: {problem}")

    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type is {config.get('peft_type')!r}; only 'LORA' is supported")
    if config.get("use_dora"):
        raise fail("uses DoRA (use_dora); only plain LoRA is supported")
    if config.get("bias", "none") != "none":
        raise fail(f"trains biases (bias={config.get('bias')!r}); only bias='none' is supported")
    if config.get("modules_to_save"):
        raise fail(f"saves whole modules ({config['modules_to_save']}); not supported")
    if config.get("fan_in_fan_out"):
        raise fail("stores transposed weights (fan_in_fan_out); not supported")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise fail(f"lora_alpha must be a number, got {alpha!r}")


def _pair_tensors(
    name: str, tensors: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT module key (``model.layers.0.self_attn.q_proj``) -> ``(A [r, in], B [out, r])``."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_NAME.fullmatch(key.removeprefix(_PEFT_PREFIX))
        if match is None:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A/B matrix of a linear "
                f"projection (embedding and other adapters are not supported)"
            )
        module = match.group("module")
        target = module.rsplit(".", 1)[-1]
        if target not in SUPPORTED_TARGETS:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: targets {module!r}; supported target modules are "
                f"{', '.join(SUPPORTED_TARGETS)}"
            )
        parts.setdefault(module, {})[match.group("part")] = tensor
    pairs = {}
    for module, found in parts.items():
        if set(found) != {"A", "B"}:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {module} has lora_{''.join(found)} but not both A and B"
            )
        lora_a, lora_b = found["A"], found["B"]
        if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != lora_b.shape[1]:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {module} has lora_A {tuple(lora_a.shape)} and lora_B "
                f"{tuple(lora_b.shape)}; expected [rank, in] and [out, rank]"
            )
        pairs[module] = (lora_a, lora_b)
    return pairs


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling of one module: its ``alpha_pattern`` entry (else ``lora_alpha``) over its
    rank, or over ``sqrt(rank)`` with ``use_rslora``. Patterns match as PEFT's
    ``get_pattern_key`` does: a regex anchored at a module-name boundary and at the end."""
    alpha = config["lora_alpha"]
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _our_module(module: str, mapping: tuple[tuple[str, str, str | int], ...]) -> tuple[str, Any]:
    for stacked, part, shard_id in mapping:
        if module.endswith(part):
            return module.removesuffix(part) + stacked, shard_id
    return module, None


def _digest(*files: pathlib.Path) -> str:
    digest = hashlib.sha256()
    for file in files:
        # The length first, so that bytes moved from one file to the next change the digest.
        digest.update(file.stat().st_size.to_bytes(8, "little"))
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
