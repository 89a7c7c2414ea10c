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

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config"]


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
    if quantization is not None and quantization not in _METHODS:
        raise ValueError(
            f"quantization method {quantization!r} is not supported; supported: {supported}"
        )
    method = None
    if hf_quant_config:
        if not isinstance(hf_quant_config, dict):
            raise ValueError("quantization_config must be a JSON object")
        method = str(hf_quant_config.get("quant_method", "")).lower()
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
