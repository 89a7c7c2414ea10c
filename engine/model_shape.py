"""The shape of a decoder-only transformer, read from a Hugging Face ``config.json``.

One description of a model's sizes, shared by the engine (which shards heads across
tensor-parallel ranks and allocates its KV cache from it) and the operator's planner (which
decides how many GPUs a replica needs). Both call the same functions here, so the sizing the
operator plans is the sizing the engine does. Pure Python: no torch, no transformers, no I/O.

Sharding follows vLLM's Megatron-style tensor parallelism (Shoeybi et al., 2019, "Megatron-LM"):
query heads, MLP intermediate channels and vocabulary rows are split across ranks; KV heads are
split when there are at least as many as ranks and replicated (one per rank) otherwise; norms
and the MoE router are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.engine.layers.quantization import QUANTIZATION_METHODS

# Bytes per element of each dtype name vLLM accepts for ``--dtype``. "auto" is its size on a GPU,
# where it is never float32 (``ModelShape.resolve_dtype`` gives the concrete dtype per device).
DTYPE_BYTES: dict[str, int] = {
    "auto": 2,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float32": 4,
    "float": 4,
}

# Architectures the kvpilot engine implements (engine/models/ MODEL_REGISTRY: the Llama family and
# its relatives Granite, Phi-3 and Gemma; a test keeps the two equal). The planner refuses others,
# so the operator never starts pods that cannot load their model.
SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "LlamaForCausalLM",
        "LLaMAForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GraniteForCausalLM",
        "Phi3ForCausalLM",
        "GemmaForCausalLM",
    }
)
# The same family by ``model_type``, for configs without ``architectures`` (those transformers
# builds from GGUF metadata, as for the built-in default model).
SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "gemma"}
)
# Model types whose config classes tie the LM head to the embeddings unless config.json says
# otherwise (Gemma's configs leave it out); the others default to untied.
_TIED_BY_DEFAULT_MODEL_TYPES = ("gemma",)

# RoPE scalings whose frequencies are already fitted to max_position_embeddings; the others
# stretch the trained context by ``factor`` (vLLM's ``_get_and_verify_max_len``).
_ROPE_TYPES_WITHOUT_EXTENSION = ("default", "su", "longrope", "llama3", "mrope")

# config.json keys of mixture-of-experts layouts other than Mixtral's: shared experts (Qwen-MoE,
# DeepSeek) and dense/sparse layer interleaving change the weight count in ways this module does
# not model, so such configs are refused rather than sized wrongly.
_UNSUPPORTED_MOE_KEYS = ("num_experts", "n_routed_experts", "moe_intermediate_size")


class UnsupportedModelError(ValueError):
    """The config describes a model this module cannot size (MLA attention, an unknown MoE)."""


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer (Llama family and its relatives Granite, Phi-3 and
    Gemma, which have the same weights; Mixtral-style MoE counted explicitly).

    Attributes:
        num_layers: decoder layers (``num_hidden_layers``).
        hidden_size: model width, elements.
        num_attention_heads: query heads.
        num_key_value_heads: KV heads (equal to ``num_attention_heads`` without GQA/MQA).
        head_dim: elements per head (config ``head_dim``, else ``hidden_size //
            num_attention_heads``).
        vocab_size: vocabulary rows of the embedding and the LM head.
        intermediate_size: MLP width; for MoE models, the width of one expert.
        tie_word_embeddings: the LM head reuses the input embedding matrix (the config's
            ``tie_word_embeddings``; when absent, true for Gemma, false for the others).
        max_position_embeddings: the longest context the model was trained for, tokens.
        derived_max_model_len: the longest context the model supports, tokens: vLLM's
            "derived max_model_len", ``max_position_embeddings`` stretched by a linear, dynamic
            or YaRN ``rope_scaling`` factor (YaRN from ``original_max_position_embeddings``).
        architectures: the config's ``architectures`` list, e.g. ``("LlamaForCausalLM",)``.
        model_type: the config's ``model_type``, e.g. ``"llama"``.
        num_experts: MoE experts per layer (Mixtral ``num_local_experts``); 0 for dense models.
        num_experts_per_tok: experts routed to per token; 0 for dense models.
        qkv_bias: q/k/v projections have biases (Qwen2 always; others by ``attention_bias``).
        o_proj_bias: the output projection has a bias (Llama/Qwen3 ``attention_bias``).
        mlp_bias: gate/up/down projections have biases (Llama ``mlp_bias``).
        qk_norm: per-head RMSNorm on queries and keys (Qwen3).
        torch_dtype: the checkpoint's dtype name (``torch_dtype`` or ``dtype``), if stated.
        quantization_method: ``quantization_config.quant_method`` (e.g. ``"awq"``), if any.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    derived_max_model_len: int
    architectures: tuple[str, ...]
    model_type: str
    num_experts: int = 0
    num_experts_per_tok: int = 0
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str | None = None
    quantization_method: str | None = None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        """Read a Hugging Face ``config.json`` (already parsed into a dict).

        Multimodal configs whose language model sits under ``text_config`` are read from there.
        Mixtral-style MoE (``num_local_experts``) is handled explicitly: every expert's weights
        are counted, and the router is a replicated ``[num_experts, hidden_size]`` matrix.

        Raises:
            ValueError: a required key is missing or a size is not a positive integer (the
                message names the key).
            UnsupportedModelError: multi-head latent attention (``kv_lora_rank``) or an MoE
                layout other than Mixtral's (``num_experts``, ``n_routed_experts``,
                ``moe_intermediate_size``): their KV and weight sizes are not modelled here.
        """
        if not isinstance(config, dict):
            raise ValueError(f"model config must be a JSON object, got {type(config).__name__}")
        text = config
        if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
            text = {**config["text_config"], "architectures": config.get("architectures")}
        model_type = str(text.get("model_type") or config.get("model_type") or "")
        if text.get("kv_lora_rank"):
            raise UnsupportedModelError(
                f"model_type {model_type!r} uses multi-head latent attention (kv_lora_rank); "
                "its KV cache size is not modelled"
            )
        for key in _UNSUPPORTED_MOE_KEYS:
            if text.get(key):
                raise UnsupportedModelError(
                    f"model_type {model_type!r} has a mixture-of-experts layout ({key}) other "
                    "than Mixtral's; only num_local_experts is supported"
                )

        hidden_size = _positive_int(text, "hidden_size")
        num_attention_heads = _positive_int(text, "num_attention_heads")
        num_key_value_heads = (
            _positive_int(text, "num_key_value_heads")
            if text.get("num_key_value_heads") is not None
            else num_attention_heads
        )
        if text.get("head_dim") is not None:
            head_dim = _positive_int(text, "head_dim")
        elif hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size {hidden_size} is not divisible by num_attention_heads "
                f"{num_attention_heads} and the config gives no head_dim"
            )
        else:
            head_dim = hidden_size // num_attention_heads
        if num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {num_attention_heads} is not a multiple of "
                f"num_key_value_heads {num_key_value_heads}"
            )

        num_experts = int(text.get("num_local_experts") or 0)
        attention_bias = bool(text.get("attention_bias", False))
        is_qwen2 = model_type == "qwen2"
        quantization = text.get("quantization_config") or config.get("quantization_config")
        architectures = config.get("architectures") or text.get("architectures") or ()
        max_position_embeddings = _positive_int(text, "max_position_embeddings")
        return cls(
            num_layers=_positive_int(text, "num_hidden_layers"),
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            vocab_size=_positive_int(text, "vocab_size"),
            intermediate_size=_positive_int(text, "intermediate_size"),
            tie_word_embeddings=bool(
                config.get(
                    "tie_word_embeddings",
                    text.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT_MODEL_TYPES),
                )
            ),
            max_position_embeddings=max_position_embeddings,
            derived_max_model_len=_derived_max_model_len(text, max_position_embeddings),
            architectures=tuple(str(a) for a in architectures),
            model_type=model_type,
            num_experts=num_experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0) if num_experts else 0,
            # Qwen2's attention has q/k/v biases and no o_proj bias, whatever the config says.
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(text.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            torch_dtype=_dtype_name(text.get("torch_dtype") or text.get("dtype")),
            quantization_method=(
                str(quantization.get("quant_method")) if isinstance(quantization, dict) else None
            ),
        )

    @property
    def is_moe(self) -> bool:
        """Whether the MLP is a mixture of experts."""
        return self.num_experts > 0

    @property
    def is_supported_by_engine(self) -> bool:
        """Whether the kvpilot engine implements this model (``SUPPORTED_ARCHITECTURES``, dense,
        unquantized or quantized in a format of ``QUANTIZATION_METHODS``)."""
        if self.is_moe or self.quantization_method not in (None, *QUANTIZATION_METHODS):
            return False
        if self.architectures:
            # The engine builds the first listed architecture, as transformers does.
            return self.architectures[0] in SUPPORTED_ARCHITECTURES
        return self.model_type in SUPPORTED_MODEL_TYPES

    def resolve_dtype(self, dtype: str, device: str = "cuda") -> str:
        """The concrete dtype ``--dtype dtype`` gives on ``device``, as the kvpilot engine picks it.

        ``"auto"`` is float32 on ``"cpu"``; on a GPU it is the checkpoint's 16-bit dtype, else
        bfloat16 (every catalogue GPU supports it; vLLM would pick float16 for a float32
        checkpoint). Aliases map to canonical names (``"half"`` -> ``"float16"``, ``"float"`` ->
        ``"float32"``).

        Raises:
            ValueError: ``dtype`` is not a key of ``DTYPE_BYTES``.
        """
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
        if dtype == "auto":
            if device == "cpu":
                return "float32"
            return self.torch_dtype if self.torch_dtype in ("float16", "bfloat16") else "bfloat16"
        return {"half": "float16", "float": "float32"}.get(dtype, dtype)

    def kv_heads_per_rank(self, tensor_parallel_size: int = 1) -> int:
        """KV heads stored on each rank: split when ``kv_heads >= tp``, else one replica each."""
        check_tensor_parallel_size(self, tensor_parallel_size)
        return max(1, self.num_key_value_heads // tensor_parallel_size)

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """KV cache bytes one token occupies on one GPU.

        ``2 (K and V) * num_layers * kv_heads_per_rank * head_dim * dtype_bytes``; with
        ``tensor_parallel_size`` larger than the KV head count each rank keeps one full head, as
        vLLM does, so the per-GPU size stops shrinking there.

        Raises:
            ValueError: invalid ``tensor_parallel_size`` (see ``check_tensor_parallel_size``) or
                ``dtype_bytes`` not positive.
        """
        _check_dtype_bytes(dtype_bytes)
        kv_heads = self.kv_heads_per_rank(tensor_parallel_size)
        return 2 * self.num_layers * kv_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        """Total parameter count, exact for the Llama family (Granite, Phi-3, Gemma included) and
        Mixtral.

        Counts the embedding (once when tied, twice otherwise), per layer q/k/v/o projections
        with their biases, Qwen3's q/k norms, the gated MLP (``gate``, ``up``, ``down``; per
        expert for MoE, plus the ``[num_experts, hidden_size]`` router), the two RMSNorms, and
        the final norm. E.g. SmolLM2-135M: 134,515,008; Llama-3-8B: 8,030,261,248.
        """
        return self._parameters_per_rank(1)

    def weight_bytes(self, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """Weight bytes held by one GPU when the model is split over ``tensor_parallel_size``.

        Sharded: embedding and LM head rows (rounded up), query heads, KV heads (replicated
        below one head per rank), MLP channels (of every expert). Replicated: norms, router.
        Vocabulary padding (vLLM pads to a multiple of 64 rows) is not counted: under 0.1%.

        Raises:
            ValueError: invalid ``tensor_parallel_size`` or ``dtype_bytes`` not positive.
        """
        _check_dtype_bytes(dtype_bytes)
        return self._parameters_per_rank(tensor_parallel_size) * dtype_bytes

    def _parameters_per_rank(self, tp: int) -> int:
        check_tensor_parallel_size(self, tp)
        hidden, head_dim = self.hidden_size, self.head_dim
        q_heads = self.num_attention_heads // tp
        kv_heads = self.kv_heads_per_rank(tp)
        vocab_rows = -(-self.vocab_size // tp)
        intermediate = self.intermediate_size // tp

        q_out, kv_out = q_heads * head_dim, kv_heads * head_dim
        attention = hidden * (q_out + 2 * kv_out) + q_out * hidden
        if self.qkv_bias:
            attention += q_out + 2 * kv_out
        if self.o_proj_bias:
            # A row-parallel layer's bias is added once, after the all-reduce: replicated.
            attention += hidden
        if self.qk_norm:
            attention += 2 * head_dim
        mlp_one = 3 * hidden * intermediate
        if self.mlp_bias:
            mlp_one += 2 * intermediate + hidden
        mlp = mlp_one * self.num_experts + hidden * self.num_experts if self.is_moe else mlp_one
        layer = attention + mlp + 2 * hidden
        embeddings = vocab_rows * hidden * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + hidden


def check_tensor_parallel_size(spec: ModelShape, tensor_parallel_size: int) -> None:
    """Check that ``spec`` can be split over ``tensor_parallel_size`` ranks (vLLM's rule).

    Query heads and MLP channels must divide evenly; KV heads must either divide evenly or
    divide ``tensor_parallel_size`` (each KV head is then replicated on ``tp / kv_heads`` ranks).

    Raises:
        ValueError: naming the size that does not divide and both numbers.
    """
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if spec.num_attention_heads % tp:
        raise ValueError(
            f"num_attention_heads {spec.num_attention_heads} is not divisible by "
            f"tensor_parallel_size {tp}"
        )
    if spec.intermediate_size % tp:
        raise ValueError(
            f"intermediate_size {spec.intermediate_size} is not divisible by "
            f"tensor_parallel_size {tp}"
        )
    kv = spec.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"num_key_value_heads {kv} and tensor_parallel_size {tp}: neither divides the other"
        )


def _positive_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if value is None:
        raise ValueError(f"model config is missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model config {key!r} must be a positive integer, got {value!r}")
    return value


def _derived_max_model_len(config: dict[str, Any], max_position_embeddings: int) -> int:
    # transformers 5 writes "rope_parameters"; older configs "rope_scaling".
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    factor = rope.get("factor")
    if rope_type in _ROPE_TYPES_WITHOUT_EXTENSION or not factor:
        return max_position_embeddings
    base = max_position_embeddings
    if rope_type == "yarn":
        base = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    return int(base * float(factor))


def _dtype_name(value: Any) -> str | None:
    # transformers writes "bfloat16"; some older exports write "torch.bfloat16".
    return str(value).removeprefix("torch.") if value else None


def _check_dtype_bytes(dtype_bytes: int) -> None:
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be a positive integer, got {dtype_bytes!r}")
