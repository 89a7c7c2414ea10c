"""Our PyTorch model implementations, found by the Hugging Face ``architectures`` name."""

from __future__ import annotations

import importlib

from transformers import PretrainedConfig

from kvpilot.engine.model_shape import MODEL_TYPE_ARCHITECTURES, engine_architecture

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
    """The class implementing ``config``'s architecture (``model_shape.engine_architecture``:
    ``architectures[0]``, or the one its ``model_type`` stands for, as the planner sizes it).

    Raises:
        ValueError: the architecture is missing or not supported (both named in the message,
            with the supported list).
    """
    model_type = getattr(config, "model_type", None)
    name = engine_architecture(getattr(config, "architectures", None), model_type)
    if name is None:
        raise ValueError(
            f"model config has no 'architectures' entry (and model_type {model_type!r} is none "
            f"of {', '.join(MODEL_TYPE_ARCHITECTURES)}); supported: {', '.join(MODEL_REGISTRY)}"
        )
    if name not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model architecture {name!r}; supported: {', '.join(MODEL_REGISTRY)}"
        )
    module_name, class_name = MODEL_REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
