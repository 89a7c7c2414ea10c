"""Quantized weights: the formats a checkpoint's ``quantization_config`` may name, and the
one ``--quantization`` forces.

vLLM's names (``quant_method`` / ``--quantization``): ``fp8`` (:mod:`.fp8`),
``compressed-tensors`` (:mod:`.compressed_tensors`), ``awq`` (:mod:`.awq`), ``gptq``
(:mod:`.gptq`). Every format is converted after loading into one of two layouts, int4
weight-only (:mod:`.int4_utils`) or fp8 (:mod:`.fp8_utils`), each with a Triton kernel for the
GPU (``kvpilot.kernels.int4_matmul``, ``kvpilot.kernels.fp8_matmul``) and a dequantize-then-
matmul path for the CPU (``kvpilot.kernels.quant_reference``).

This module imports no torch until a format is built, so the CLI can list the names.
"""

from __future__ import annotations

import importlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpilot.engine.layers.quantization.base_config import QuantizationConfig

# --quantization name -> "module:Class".
_METHODS: dict[str, str] = {
    "fp8": "kvpilot.engine.layers.quantization.fp8:Fp8Config",
    "compressed-tensors": "kvpilot.engine.layers.quantization.compressed_tensors:CompressedTensorsConfig",
    "awq": "kvpilot.engine.layers.quantization.awq:AWQConfig",
    "gptq": "kvpilot.engine.layers.quantization.gptq:GPTQConfig",
}
QUANTIZATION_METHODS: tuple[str, ...] = tuple(_METHODS)

__all__ = [
    "QUANTIZATION_METHODS",
    "QuantizationConfig",
    "get_quantization_config",
    "normalize_quantization_config",
]


def normalize_quantization_config(config: Any) -> dict[str, Any] | None:
    """A checkpoint's ``quantization_config`` as an object with a lower-case ``quant_method``
    (vLLM compares the names lower-cased: ``"FP8"`` is ``fp8``).

    Some configs carry it as a string: a JSON object's text is parsed, any other string is the
    method's name (``"fp8"`` is ``{"quant_method": "fp8"}``). Torch-free: the planner uses it.

    Args:
        config: ``config.json``'s ``quantization_config`` (an object, a string, or None).

    Returns:
        A new dict (the input is not changed), or None without a config (None, ``{}``, ``""``).

    Raises:
        ValueError: a string that starts as JSON but does not parse to an object, or a value
            that is neither an object nor a string (its type named).
    """
    if isinstance(config, str):
        text = config.strip()
        if text.startswith(("{", "[", '"')):
            try:
                config = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"quantization_config is a string that is not valid JSON: {exc}"
                ) from None
            if not isinstance(config, dict):
                raise ValueError(
                    "quantization_config is a JSON string that is not an object, got "
                    f"{type(config).__name__}"
                )
        else:
            config = {"quant_method": text} if text else None
    if not config:
        return None
    if not isinstance(config, dict):
        raise ValueError(
            "quantization_config must be an object (or a method name, or an object's JSON "
            f"text), got {type(config).__name__}"
        )
    config = dict(config)
    method = config.get("quant_method")
    if isinstance(method, str):
        config["quant_method"] = method.strip().lower()
    return config


def missing_method_message() -> str:
    """What a ``quantization_config`` without ``quant_method`` is told (engine and planner)."""
    return (
        "quantization_config has no quant_method: the quantization method is missing "
        f"(the kvpilot engine loads {', '.join(QUANTIZATION_METHODS)})"
    )


def get_quantization_config(
    hf_quant_config: dict[str, Any] | None, quantization: str | None = None
) -> QuantizationConfig | None:
    """The quantization format to load a checkpoint with.

    Args:
        hf_quant_config: the checkpoint's ``quantization_config`` (``config.json``), or None.
        quantization: ``--quantization``: None follows the checkpoint; a name must agree with
            the checkpoint's ``quant_method`` (vLLM's rule), except ``fp8`` on an unquantized
            checkpoint, which quantizes it while loading.

    Returns:
        The parsed format, or None for an unquantized model.

    Raises:
        ValueError: an unsupported ``quant_method`` or ``--quantization`` (named, with the
            supported list), a ``--quantization`` that contradicts the checkpoint, or a
            setting of the format this engine does not support.
    """
    supported = ", ".join(QUANTIZATION_METHODS)
    if quantization is not None:
        quantization = quantization.lower()
    if quantization is not None and quantization not in _METHODS:
        raise ValueError(
            f"quantization method {quantization!r} is not supported; supported: {supported}"
        )
    method = None
    hf_quant_config = normalize_quantization_config(hf_quant_config)
    if hf_quant_config:
        if hf_quant_config.get("quant_method") is None:
            raise ValueError(missing_method_message())
        method = str(hf_quant_config["quant_method"])
        if method not in _METHODS:
            raise ValueError(
                f"the checkpoint's quantization method {method!r} is not supported; "
                f"supported: {supported}"
            )
        if quantization is not None and quantization != method:
            raise ValueError(
                f"quantization {quantization!r} does not match the checkpoint's "
                f"quantization_config quant_method {method!r}"
            )
    elif quantization is not None:
        if quantization != "fp8":
            raise ValueError(
                f"quantization {quantization!r} needs a checkpoint quantized with it; only fp8 "
                "quantizes an unquantized checkpoint while loading"
            )
        method, hf_quant_config = (
            "fp8",
            {"quant_method": "fp8", "is_checkpoint_fp8_serialized": False},
        )
    if method is None:
        return None
    module_name, class_name = _METHODS[method].split(":")
    config_cls = getattr(importlib.import_module(module_name), class_name)
    return config_cls.from_config(hf_quant_config)
