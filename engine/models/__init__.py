"""Our PyTorch model implementations, found by the Hugging Face ``architectures`` name."""

from __future__ import annotations

import importlib

from transformers import PretrainedConfig

from kvpilot.engine.model_shape import MODEL_TYPE_ARCHITECTURES

# HF architectures name -> "module:Class"; modules are imported on first use.
MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "kvpilot.engine.models.llama:LlamaForCausalLM",
    # The spelling of early Llama checkpoints' configs.
    "LLaMAForCausalLM": "kvpilot.engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kvpilot.engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kvpilot.engine.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "kvpilot.engine.models.qwen3:Qwen3ForCausalLM",
    "GraniteForCausalLM": "kvpilot.engine.models.granite:GraniteForCausalLM",
    "Phi3ForCausalLM": "kvpilot.engine.models.phi3:Phi3ForCausalLM",
    "GemmaForCausalLM": "kvpilot.engine.models.gemma:GemmaForCausalLM",
    "MixtralForCausalLM": "kvpilot.engine.models.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "kvpilot.engine.models.qwen3_moe:Qwen3MoeForCausalLM",
}


def get_model_class(config: PretrainedConfig) -> type:
    """The class implementing ``config.architectures[0]`` (one name alone read as a list of
    one), or, for a config without ``architectures``, the one its ``model_type`` stands for
    (``MODEL_TYPE_ARCHITECTURES``, as the planner sizes it).

    Raises:
        ValueError: the architecture is missing or not supported (both named in the message,
            with the supported list).
    """
    architectures = getattr(config, "architectures", None) or []
    if isinstance(architectures, str):
        architectures = [architectures]
    model_type = getattr(config, "model_type", None)
    if not architectures and model_type in MODEL_TYPE_ARCHITECTURES:
        architectures = [MODEL_TYPE_ARCHITECTURES[model_type]]
    if not architectures:
        raise ValueError(
            f"model config has no 'architectures' entry (and model_type {model_type!r} is none "
            f"of {', '.join(MODEL_TYPE_ARCHITECTURES)}); supported: {', '.join(MODEL_REGISTRY)}"
        )
    name = architectures[0]
    if name not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model architecture {name!r}; supported: {', '.join(MODEL_REGISTRY)}"
        )
    module_name, class_name = MODEL_REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
