"""The shape of a decoder-only transformer, read from a Hugging Face ``config.json``.

One description of a model's sizes, shared by the engine (which shards heads across
tensor-parallel ranks and allocates its KV cache from it) and the operator's planner (which
decides how many GPUs a replica needs). Both call the same functions here, so the sizing the
operator plans is the sizing the engine does. Pure Python: no torch, no transformers, no I/O.

Sharding follows vLLM's Megatron-style tensor parallelism (Shoeybi et al., 2019, "Megatron-LM"):
query heads, MLP intermediate channels and vocabulary rows are split across ranks; KV heads are
split when there are at least as many as ranks and replicated (one per rank) otherwise; norms
and the MoE router are replicated; every expert's MLP channels are split (vLLM's default for
MoE without expert parallelism; with it, whole experts per rank hold the same bytes). Pipeline
stages take contiguous layers as vLLM's ``get_pp_indices`` does. Weight bytes follow the
checkpoint's quantization (``kvpilot.engine.weight_quantization``); KV bytes the KV cache's
dtype, and for DeepSeek's multi-head latent attention (DeepSeek-V2, arXiv:2405.04434) the
compressed latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvpilot.engine.layers.quantization import normalize_quantization_config
from kvpilot.engine.weight_quantization import (
    UnsupportedQuantizationError,
    WeightQuantization,
    online_quantization,
    parse_quantization_config,
)

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

# The dtypes a checkpoint's config.json may state (``torch_dtype``; ``dtype`` as transformers 5
# writes it), by torch's names, each with its canonical name: the engine's three model dtypes
# and their aliases, and the float8 formats FP8 checkpoints state (their quantization_config
# sizes them). Any other name is refused, never sized as bfloat16.
CHECKPOINT_DTYPES: dict[str, str] = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}

KV_CACHE_DTYPE_BYTES: dict[str, int | None] = {
    "auto": None,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
"""Bytes per element of each ``--kv-cache-dtype`` value (vLLM's); ``auto`` (None) is the model
dtype's."""

# Architectures the kvpilot engine implements (engine/models/ MODEL_REGISTRY: the Llama family and
# its relatives Granite, Phi-3 and Gemma, and the MoE models Mixtral and Qwen3-MoE; a test keeps
# the two equal). The planner refuses others, so the operator never starts pods that cannot load
# their model.
DENSE_ARCHITECTURES: frozenset[str] = frozenset(
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
MOE_ARCHITECTURES: frozenset[str] = frozenset({"MixtralForCausalLM", "Qwen3MoeForCausalLM"})
SUPPORTED_ARCHITECTURES: frozenset[str] = DENSE_ARCHITECTURES | MOE_ARCHITECTURES
# The supported families by ``model_type``, for configs without ``architectures`` (those
# transformers builds from GGUF metadata, as for the built-in default model; hand-written ones):
# the architecture the engine builds for each (``engine_architecture``).
MODEL_TYPE_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# Model types whose config classes tie the LM head to the embeddings unless config.json says
# otherwise (Gemma's configs leave it out); the others default to untied.
_TIED_BY_DEFAULT_MODEL_TYPES = ("gemma",)
# Attention with q/k/v biases and no o_proj bias whatever the config says; per-head q/k norms.
_QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_moe")
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
# Fused projections in the checkpoint (the names quantization configs exclude by).
_FUSED_PROJECTION_MODEL_TYPES = ("phi3",)

# RoPE scalings whose frequencies are already fitted to max_position_embeddings; the others
# stretch the trained context by ``factor`` (vLLM's ``_get_and_verify_max_len``).
_ROPE_TYPES_WITHOUT_EXTENSION = ("default", "su", "longrope", "llama3", "mrope")

# MoE layouts by the config key of their expert count: Mixtral's experts (w1/w3/w2 under
# ``block_sparse_moe``), Qwen-MoE's (``mlp.experts``, optional shared expert with a sigmoid gate,
# dense layers by ``mlp_only_layers``/``decoder_sparse_step``), DeepSeek's (``mlp.experts``,
# ``n_shared_experts`` always-on experts, the first ``first_k_dense_replace`` layers dense).
MIXTRAL, QWEN_MOE, DEEPSEEK_MOE = "mixtral", "qwen_moe", "deepseek"


class UnsupportedModelError(ValueError):
    """The config describes a model this module cannot size (an MoE layout without its expert
    width)."""


@dataclass(frozen=True)
class _Linear:
    """One linear layer of a decoder layer as one rank holds it.

    ``split`` is how tensor parallelism cuts it: ``"column"`` (output channels), ``"row"``
    (input channels) or ``"replicated"``; ``count`` is the number of such layers (experts).
    Sizes are per rank, elements."""

    name: str
    in_features: int
    out_features: int
    split: str
    count: int = 1
    bias: int = 0


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer (Llama family and its relatives Granite, Phi-3 and
    Gemma, which have the same weights; MoE in Mixtral's, Qwen-MoE's and DeepSeek's layouts;
    DeepSeek's multi-head latent attention), and how its checkpoint stores them.

    Attributes:
        num_layers: decoder layers (``num_hidden_layers``).
        hidden_size: model width, elements.
        num_attention_heads: query heads.
        num_key_value_heads: KV heads (equal to ``num_attention_heads`` without GQA/MQA).
        head_dim: elements per head (config ``head_dim``, else ``hidden_size //
            num_attention_heads``; with MLA ``qk_nope_head_dim + qk_rope_head_dim``).
        vocab_size: vocabulary rows of the embedding and the LM head.
        intermediate_size: dense MLP width; for Mixtral, the width of one expert.
        tie_word_embeddings: the LM head reuses the input embedding matrix (the config's
            ``tie_word_embeddings``; when absent, true for Gemma, false for the others).
        max_position_embeddings: the longest context the model was trained for, tokens.
        derived_max_model_len: the longest context the model supports, tokens: vLLM's
            "derived max_model_len", ``max_position_embeddings`` stretched by a linear, dynamic
            or YaRN ``rope_scaling`` factor (YaRN from ``original_max_position_embeddings``).
        architectures: the config's ``architectures`` list, e.g. ``("LlamaForCausalLM",)``.
        model_type: the config's ``model_type``, e.g. ``"llama"``.
        num_experts: routed experts per MoE layer (``num_local_experts``, ``num_experts``,
            ``n_routed_experts``); 0 for dense models.
        num_experts_per_tok: experts routed to per token; 0 for dense models.
        moe_layout: ``MIXTRAL``, ``QWEN_MOE`` or ``DEEPSEEK_MOE``; None for dense models.
        moe_intermediate_size: width of one routed expert (Mixtral: ``intermediate_size``).
        shared_expert_intermediate_size: width of the always-on shared expert MLP (Qwen2-MoE
            ``shared_expert_intermediate_size``; DeepSeek ``n_shared_experts *
            moe_intermediate_size``); 0 without one.
        dense_layers: indices of the layers of an MoE model whose MLP is dense
            (``intermediate_size`` wide).
        kv_lora_rank: MLA's compressed KV width (DeepSeek-V2/V3); 0 for standard attention.
        q_lora_rank: MLA's compressed query width; 0 when queries are projected directly.
        qk_rope_head_dim: MLA's rotary part of each query/key head (cached with the latent).
        v_head_dim: MLA's value head width.
        qkv_bias: q/k/v projections have biases (Qwen2 always; others by ``attention_bias``).
        o_proj_bias: the output projection has a bias (Llama/Qwen3 ``attention_bias``).
        mlp_bias: gate/up/down projections have biases (Llama ``mlp_bias``).
        qk_norm: per-head RMSNorm on queries and keys (Qwen3).
        torch_dtype: the checkpoint's dtype (``torch_dtype`` or ``dtype``), by its canonical
            name (``checkpoint_dtype``), if stated.
        quantization_method: ``quantization_config.quant_method``, lower-cased (e.g.
            ``"awq"``), if any.
        quantization: how the checkpoint stores its linear weights, if quantized in a format
            ``weight_quantization`` sizes; None when unquantized or unsizable.
        quantization_error: why a quantized checkpoint cannot be sized (names the method or
            scheme, or says it is missing), else None.
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
    moe_layout: str | None = None
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str | None = None
    quantization_method: str | None = None
    quantization: WeightQuantization | None = None
    quantization_error: str | None = None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        """Read a Hugging Face ``config.json`` (already parsed into a dict).

        Multimodal configs whose language model sits under ``text_config`` are read from there.
        MoE layouts (Mixtral ``num_local_experts``; Qwen2/Qwen3-MoE ``num_experts`` with
        ``moe_intermediate_size``, shared experts, ``mlp_only_layers`` and
        ``decoder_sparse_step``; DeepSeek ``n_routed_experts`` with ``n_shared_experts`` and
        ``first_k_dense_replace``) and DeepSeek's multi-head latent attention (``kv_lora_rank``)
        are read explicitly. A ``quantization_config`` is parsed by
        :func:`~kvpilot.engine.weight_quantization.parse_quantization_config`; one it cannot
        size is kept as ``quantization_error`` (for the planner to refuse by name), not raised.

        Raises:
            ValueError: a required key is missing, a size is not a positive integer, or the
                dtype is not one of ``CHECKPOINT_DTYPES`` (the message names the key).
            UnsupportedModelError: ``num_experts`` or ``n_routed_experts`` without
                ``moe_intermediate_size``: an MoE layout not modelled here; or a config that
                cannot be sized (as for ValueError) of an architecture the engine does not
                implement (the message names it and what is supported).
        """
        if not isinstance(config, dict):
            raise ValueError(f"model config must be a JSON object, got {type(config).__name__}")
        try:
            return cls._read_hf_config(config)
        except UnsupportedModelError:
            raise
        except ValueError as exc:
            # A config kvpilot cannot size is, first of all, often a model it does not run (GPT-2's
            # n_layer, Whisper's encoder_layers): say that, not which Llama key is missing.
            text = _text_config(config)
            architectures = _architecture_names(config.get("architectures")) or _architecture_names(
                text.get("architectures")
            )
            model_type = str(text.get("model_type") or config.get("model_type") or "")
            error = (architectures or model_type) and _architecture_error(architectures, model_type)
            if not error:
                raise
            raise UnsupportedModelError(error) from exc

    @classmethod
    def _read_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        """:meth:`from_hf_config` for a dict, its architecture not checked."""
        text = _text_config(config)
        model_type = str(text.get("model_type") or config.get("model_type") or "")
        num_layers = _positive_int(text, "num_hidden_layers")
        hidden_size = _positive_int(text, "hidden_size")
        num_attention_heads = _positive_int(text, "num_attention_heads")
        num_key_value_heads = (
            _positive_int(text, "num_key_value_heads")
            if text.get("num_key_value_heads") is not None
            else num_attention_heads
        )
        mla = _mla(text)
        if mla:
            head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        elif text.get("head_dim") is not None:
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

        attention_bias = bool(text.get("attention_bias", False))
        is_qwen2 = model_type in _QKV_BIAS_MODEL_TYPES
        quantization = text.get("quantization_config") or config.get("quantization_config")
        try:
            quantization = normalize_quantization_config(quantization)
        except ValueError as exc:
            quantization, parsed, error = None, None, str(exc)
        else:
            try:
                parsed, error = parse_quantization_config(quantization), None
            except UnsupportedQuantizationError as exc:
                parsed, error = None, str(exc)
        method = quantization.get("quant_method") if quantization else None
        method = None if method is None else str(method)
        architectures = _architecture_names(config.get("architectures")) or _architecture_names(
            text.get("architectures")
        )
        max_position_embeddings = _positive_int(text, "max_position_embeddings")
        return cls(
            num_layers=num_layers,
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
            architectures=architectures,
            model_type=model_type,
            **_moe(text, model_type, num_layers),
            kv_lora_rank=mla.get("kv_lora_rank", 0),
            q_lora_rank=mla.get("q_lora_rank", 0),
            qk_rope_head_dim=mla.get("qk_rope_head_dim", 0),
            v_head_dim=mla.get("v_head_dim", 0),
            # Qwen2's attention has q/k/v biases and no o_proj bias, whatever the config says.
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(text.get("mlp_bias", False)),
            qk_norm=model_type in _QK_NORM_MODEL_TYPES,
            torch_dtype=checkpoint_dtype(text),
            quantization_method=method,
            quantization=parsed,
            quantization_error=error,
        )

    @property
    def is_moe(self) -> bool:
        """Whether the MLP is a mixture of experts."""
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def expert_intermediate_size(self) -> int:
        """Width of one routed expert (``intermediate_size`` for dense models)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def is_supported_by_engine(self) -> bool:
        """Whether the kvpilot engine implements this model (``SUPPORTED_ARCHITECTURES``,
        unquantized or in one of ``SUPPORTED_QUANTIZATION_METHODS``)."""
        return self.engine_support_error() is None

    def engine_support_error(self) -> str | None:
        """Why the kvpilot engine cannot serve this model (naming the architecture or the
        quantization method and what is supported), or None if it can: the architecture
        first, then the quantization (:meth:`quantization_support_error`)."""
        return self.architecture_error() or self.quantization_support_error()

    def architecture_error(self) -> str | None:
        """Why the kvpilot engine cannot build this architecture (naming it and the supported
        ones), or None if it can."""
        return _architecture_error(self.architectures, self.model_type)

    def quantization_support_error(self) -> str | None:
        """Why the kvpilot engine cannot load this quantization (a method it does not
        implement, or any quantization of a mixture of experts, whose experts it runs
        unquantized only), or None if it can."""
        if self.quantization_error is not None:
            return self.quantization_error
        if self.num_experts and self.quantization_method is not None:
            return (
                f"a quantized mixture of experts ({self.quantization_method}) is not supported "
                "by the kvpilot engine: serve the unquantized checkpoint, without --quantization"
            )
        return None

    def quantized_as(self, method: str | None) -> ModelShape:
        """This model as ``--quantization method`` loads it (vLLM's rule).

        None keeps the checkpoint's own quantization. A checkpoint quantized with ``method``
        is unchanged; an unquantized one with ``fp8`` is quantized while loading (one scale per
        tensor, :func:`~kvpilot.engine.weight_quantization.online_quantization`).

        Raises:
            UnsupportedQuantizationError: the checkpoint is quantized with another method
                (both named), or ``method`` needs a checkpoint in its format.
        """
        if method is None or method == self.quantization_method:
            return self
        if self.quantization_method is not None:
            raise UnsupportedQuantizationError(
                f"the checkpoint is quantized with {self.quantization_method}, not {method}: "
                "--quantization must match the checkpoint's quantization_config"
            )
        return replace(self, quantization_method=method, quantization=online_quantization(method))

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

    def pipeline_stage_layers(self, pipeline_parallel_size: int = 1) -> list[range]:
        """The decoder layers of each pipeline stage, as vLLM's ``get_pp_indices`` splits them:
        ``num_layers // pp`` each, the remainder one more each on the stages before the last
        (which also holds the final norm and the LM head).

        Raises:
            ValueError: ``pipeline_parallel_size`` not in ``1..num_layers``.
        """
        pp = pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or not 1 <= pp <= self.num_layers:
            raise ValueError(
                f"pipeline_parallel_size must be an integer in 1..num_layers "
                f"{self.num_layers}, got {pp!r}"
            )
        sizes = [self.num_layers // pp] * pp
        for i in range(2, self.num_layers % pp + 2):
            sizes[-i] += 1
        starts = [sum(sizes[:i]) for i in range(pp)]
        return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]

    def kv_bytes_per_token(
        self,
        dtype_bytes: int,
        tensor_parallel_size: int = 1,
        *,
        pipeline_parallel_size: int = 1,
        pipeline_rank: int = 0,
    ) -> int:
        """KV cache bytes one token occupies on one GPU.

        Standard attention: ``2 (K and V) * layers * kv_heads_per_rank * head_dim *
        dtype_bytes``; with ``tensor_parallel_size`` larger than the KV head count each rank
        keeps one full head, as vLLM does, so the per-GPU size stops shrinking there.
        Multi-head latent attention (DeepSeek-V2/V3) caches one compressed latent per token
        and layer, ``(kv_lora_rank + qk_rope_head_dim) * dtype_bytes``, on every rank (vLLM
        replicates it across tensor-parallel ranks). ``layers`` are those of pipeline stage
        ``pipeline_rank`` (:meth:`pipeline_stage_layers`); all of them without pipelining.
        ``dtype_bytes`` is the KV cache dtype's (1 for ``--kv-cache-dtype fp8``).

        Raises:
            ValueError: invalid ``tensor_parallel_size`` (see ``check_tensor_parallel_size``),
                pipeline sizes, or ``dtype_bytes`` not positive.
        """
        _check_dtype_bytes(dtype_bytes)
        layers = len(self.pipeline_stage_layers(pipeline_parallel_size)[pipeline_rank])
        if self.is_mla:
            check_tensor_parallel_size(self, tensor_parallel_size)
            return layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        kv_heads = self.kv_heads_per_rank(tensor_parallel_size)
        return 2 * layers * kv_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        """Total parameter count, exact for the Llama family (Granite, Phi-3, Gemma included),
        Mixtral, Qwen2/Qwen3-MoE and DeepSeek-V2/V3 (as transformers builds them).

        Counts the embedding (once when tied, twice otherwise), per layer the attention
        projections with their biases (MLA's low-rank projections and their norms), Qwen3's
        q/k norms, the gated MLP (``gate``, ``up``, ``down``; per expert for MoE, plus the
        ``[num_experts, hidden_size]`` router and any shared expert), the two RMSNorms, and the
        final norm. E.g. SmolLM2-135M: 134,515,008; Llama-3-8B: 8,030,261,248.
        """
        return self._stage_weights(1, self.pipeline_stage_layers(1)[0], True, True, None, 1)

    def num_active_parameters(self) -> int:
        """Parameters one token runs through: :meth:`num_parameters` with only
        ``num_experts_per_tok`` of each MoE layer's routed experts (shared experts, router,
        attention and embeddings all count). Equal to :meth:`num_parameters` for dense models;
        e.g. Mixtral-8x7B 12.9B of 46.7B, Qwen3-30B-A3B 3.3B of 30.5B."""
        return self._stage_weights(
            1, self.pipeline_stage_layers(1)[0], True, True, None, 1, active_only=True
        )

    def weight_bytes(
        self,
        dtype_bytes: int,
        tensor_parallel_size: int = 1,
        *,
        pipeline_parallel_size: int = 1,
        pipeline_rank: int = 0,
    ) -> int:
        """Weight bytes held by one GPU of pipeline stage ``pipeline_rank`` when the model is
        split over ``tensor_parallel_size`` ranks per stage.

        Sharded: embedding and LM head rows (rounded up), query heads, KV heads (replicated
        below one head per rank), MLP channels (of every expert). Replicated: norms, router.
        Vocabulary padding (vLLM pads to a multiple of 64 rows) is not counted: under 0.1%.
        The first stage holds the embedding, the last the final norm and the LM head (its own
        copy when tied and pipelined).

        Bytes per weight: ``dtype_bytes`` (the checkpoint's, as ``--dtype`` resolves it), except
        the linear layers the checkpoint's quantization stores quantized
        (:class:`~kvpilot.engine.weight_quantization.WeightQuantization`: packed weights plus
        scales and zero points); embeddings, LM head, norms, biases and routers stay at
        ``dtype_bytes``.

        Raises:
            ValueError: invalid ``tensor_parallel_size``, pipeline sizes, or ``dtype_bytes`` not
                positive.
            UnsupportedQuantizationError: the checkpoint is quantized in a format that cannot be
                sized (``quantization_error``).
        """
        _check_dtype_bytes(dtype_bytes)
        if self.quantization_error is not None:
            raise UnsupportedQuantizationError(self.quantization_error or "unknown quantization")
        stages = self.pipeline_stage_layers(pipeline_parallel_size)
        return self._stage_weights(
            tensor_parallel_size,
            stages[pipeline_rank],
            pipeline_rank == 0,
            pipeline_rank == len(stages) - 1,
            self.quantization,
            dtype_bytes,
            tied=self.tie_word_embeddings and len(stages) == 1,
        )

    def layer_linears(self, layer: int, tensor_parallel_size: int = 1) -> list[_Linear]:
        """The linear layers of decoder layer ``layer`` on one rank, with transformers' module
        names (``model.layers.{layer}.self_attn.q_proj``), per-rank sizes and how each is split.
        Routers and the shared-expert gate are left out: vLLM never quantizes them (they are in
        :meth:`_layer_other_parameters`)."""
        tp, hidden = tensor_parallel_size, self.hidden_size
        prefix = f"model.layers.{layer}"
        heads = self.num_attention_heads // tp
        linears = self._attention_linears(prefix, heads, tp)
        bias = 2 if self.mlp_bias else 0

        def mlp(
            where: str, width: int, count: int = 1, names=("gate_proj", "up_proj", "down_proj")
        ):
            local = width // tp
            gate, up, down = (f"{prefix}.{where}.{name}" for name in names)
            if self.model_type in _FUSED_PROJECTION_MODEL_TYPES:
                fused = [_Linear(f"{prefix}.{where}.gate_up_proj", hidden, 2 * local, "column")]
            else:
                fused = [
                    _Linear(gate, hidden, local, "column", count, local if bias else 0),
                    _Linear(up, hidden, local, "column", count, local if bias else 0),
                ]
            return [*fused, _Linear(down, local, hidden, "row", count, hidden if bias else 0)]

        if not self.is_moe or layer in self.dense_layers:
            return linears + mlp("mlp", self.intermediate_size)
        if self.moe_layout == MIXTRAL:
            experts = mlp(
                "block_sparse_moe.experts.0",
                self.expert_intermediate_size,
                self.num_experts,
                ("w1", "w3", "w2"),
            )
        else:
            experts = mlp("mlp.experts.0", self.expert_intermediate_size, self.num_experts)
        if self.shared_expert_intermediate_size:
            where = "mlp.shared_expert" if self.moe_layout == QWEN_MOE else "mlp.shared_experts"
            experts += mlp(where, self.shared_expert_intermediate_size)
        return linears + experts

    def _attention_linears(self, prefix: str, heads: int, tp: int) -> list[_Linear]:
        hidden, attn = self.hidden_size, f"{prefix}.self_attn"
        if self.is_mla:
            qk_head = self.head_dim
            if self.q_lora_rank:
                query = [
                    _Linear(f"{attn}.q_a_proj", hidden, self.q_lora_rank, "replicated"),
                    _Linear(f"{attn}.q_b_proj", self.q_lora_rank, heads * qk_head, "column"),
                ]
            else:
                query = [_Linear(f"{attn}.q_proj", hidden, heads * qk_head, "column")]
            nope = self.head_dim - self.qk_rope_head_dim
            latent = self.kv_lora_rank + self.qk_rope_head_dim
            return query + [
                _Linear(f"{attn}.kv_a_proj_with_mqa", hidden, latent, "replicated"),
                _Linear(
                    f"{attn}.kv_b_proj",
                    self.kv_lora_rank,
                    heads * (nope + self.v_head_dim),
                    "column",
                ),
                _Linear(f"{attn}.o_proj", heads * self.v_head_dim, hidden, "row"),
            ]
        q_out = heads * self.head_dim
        # Not kv_heads_per_rank: its check of tp sizes these very layers.
        kv_out = max(1, self.num_key_value_heads // tp) * self.head_dim
        o = _Linear(f"{attn}.o_proj", q_out, hidden, "row")
        if self.model_type in _FUSED_PROJECTION_MODEL_TYPES:
            out = q_out + 2 * kv_out
            bias = out if self.qkv_bias else 0
            return [_Linear(f"{attn}.qkv_proj", hidden, out, "column", bias=bias), o]
        q_bias, kv_bias = (q_out, kv_out) if self.qkv_bias else (0, 0)
        return [
            _Linear(f"{attn}.q_proj", hidden, q_out, "column", bias=q_bias),
            _Linear(f"{attn}.k_proj", hidden, kv_out, "column", bias=kv_bias),
            _Linear(f"{attn}.v_proj", hidden, kv_out, "column", bias=kv_bias),
            o,
        ]

    def _layer_other_parameters(self, layer: int) -> int:
        """Parameters of a decoder layer outside :meth:`layer_linears` (all replicated): the
        two norms, q/k norms, MLA's latent norms, a row-parallel bias (added once, after the
        all-reduce), the MoE router and Qwen2-MoE's shared-expert gate."""
        hidden = self.hidden_size
        other = 2 * hidden
        if self.o_proj_bias:
            other += hidden
        if self.qk_norm:
            other += 2 * self.head_dim
        if self.is_mla:
            other += self.kv_lora_rank + self.q_lora_rank
        if self.is_moe and layer not in self.dense_layers:
            other += hidden * self.num_experts
            if self.moe_layout == QWEN_MOE and self.shared_expert_intermediate_size:
                other += hidden
        return other

    def _stage_weights(
        self,
        tp: int,
        layers: range,
        first: bool,
        last: bool,
        quantization: WeightQuantization | None,
        dtype_bytes: int,
        *,
        tied: bool | None = None,
        active_only: bool = False,
    ) -> int:
        check_tensor_parallel_size(self, tp)
        tied = self.tie_word_embeddings if tied is None else tied
        hidden = self.hidden_size
        vocab_rows = -(-self.vocab_size // tp)
        total = 0
        if first:
            total += vocab_rows * hidden * dtype_bytes
        if last:
            total += (0 if tied else vocab_rows * hidden * dtype_bytes) + hidden * dtype_bytes
        if quantization is None or not quantization.ignore:
            # Layers differ only by name: size one of each kind (dense, MoE) and multiply.
            kinds: dict[bool, list[int]] = {}
            for layer in layers:
                kinds.setdefault(layer in self.dense_layers, []).append(layer)
            sized = [(same[0], len(same)) for same in kinds.values()]
        else:
            sized = [(layer, 1) for layer in layers]
        for layer, repeat in sized:
            total += repeat * self._layer_bytes(layer, tp, quantization, dtype_bytes, active_only)
        return total

    def _layer_bytes(
        self,
        layer: int,
        tp: int,
        quantization: WeightQuantization | None,
        dtype_bytes: int,
        active_only: bool,
    ) -> int:
        total = self._layer_other_parameters(layer) * dtype_bytes
        for linear in self.layer_linears(layer, tp):
            count = linear.count
            if active_only and count > 1:
                count = self.num_experts_per_tok
            if quantization is not None and quantization.quantizes(linear.name):
                one = quantization.linear_bytes(
                    linear.in_features, linear.out_features, dtype_bytes
                )
            else:
                one = linear.in_features * linear.out_features * dtype_bytes
            total += count * (one + linear.bias * dtype_bytes)
        return total


def check_tensor_parallel_size(spec: ModelShape, tensor_parallel_size: int) -> None:
    """Check that ``spec`` can be split over ``tensor_parallel_size`` ranks (vLLM's rule).

    Query heads and MLP channels (of the dense MLP, each expert and the shared expert) must
    divide evenly; KV heads must either divide evenly or divide ``tensor_parallel_size`` (each
    KV head is then replicated on ``tp / kv_heads`` ranks). A quantized checkpoint's shards must
    also hold whole groups (group size along the input of AWQ/GPTQ/W4A16 layers) or whole
    blocks (fp8 128x128), as vLLM checks when it creates the layers.

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
    widths = []
    if not spec.is_moe or spec.moe_layout == MIXTRAL or spec.dense_layers:
        widths.append(("intermediate_size", spec.intermediate_size))
    if spec.moe_intermediate_size:
        widths.append(("moe_intermediate_size", spec.moe_intermediate_size))
    if spec.shared_expert_intermediate_size:
        widths.append(("shared expert intermediate size", spec.shared_expert_intermediate_size))
    for name, width in widths:
        if width % tp:
            raise ValueError(f"{name} {width} is not divisible by tensor_parallel_size {tp}")
    kv = spec.num_key_value_heads
    if not spec.is_mla and kv % tp and tp % kv:
        raise ValueError(
            f"num_key_value_heads {kv} and tensor_parallel_size {tp}: neither divides the other"
        )
    if tp > 1 and spec.quantization is not None:
        _check_quantized_shards(spec, spec.quantization, tp)


def _check_quantized_shards(spec: ModelShape, quantization: WeightQuantization, tp: int) -> None:
    rows, cols = quantization.shard_alignment()
    if (rows, cols) == (1, 1):
        return
    kinds = {"column": ("output channels", rows), "row": ("input channels", cols)}
    sparse = [i for i in range(spec.num_layers) if i not in spec.dense_layers][:1]
    for layer in dict.fromkeys((*sparse, *spec.dense_layers[:1])):
        for linear in spec.layer_linears(layer, tp):
            if linear.split not in kinds or not quantization.quantizes(linear.name):
                continue
            what, multiple = kinds[linear.split]
            size = linear.out_features if linear.split == "column" else linear.in_features
            if size % multiple:
                raise ValueError(
                    f"{quantization.description}: {linear.name.split('.', 3)[-1]} has {size} "
                    f"{what} per rank at tensor_parallel_size {tp}, not a multiple of "
                    f"{multiple}"
                )


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of ``config`` that describes the language model: ``text_config`` (multimodal
    configs) when the top level has no ``num_hidden_layers``, else ``config`` itself."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def engine_architecture(architectures: Any, model_type: Any) -> str | None:
    """The architecture the engine builds for a config's ``architectures`` and ``model_type``
    (as read from it, either may be None): the first listed, as transformers builds it (one
    name alone read as a list of one), or, without any, the one ``model_type`` stands for
    (``MODEL_TYPE_ARCHITECTURES``); None when neither names one. The planner's check and the
    engine's model class both come from here, so what one sizes the other builds."""
    names = _architecture_names(architectures)
    return names[0] if names else MODEL_TYPE_ARCHITECTURES.get(str(model_type or ""))


def _architecture_names(value: Any) -> tuple[str, ...]:
    """A config's ``architectures`` as a tuple of names (one name alone taken as a list of one;
    anything else, or none, as an empty tuple)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(str(a) for a in value if a)
    return ()


def _architecture_error(architectures: tuple[str, ...], model_type: str) -> str | None:
    """Why the engine cannot build a model of these ``architectures`` (its first, as
    transformers builds it) or, without any, this ``model_type``; None if it can."""
    if engine_architecture(architectures, model_type) in SUPPORTED_ARCHITECTURES:
        return None
    named = (
        repr("/".join(architectures) or model_type)
        if architectures or model_type
        else "a config with neither 'architectures' nor 'model_type'"
    )
    return (
        f"{named} is not implemented by the kvpilot engine; supported: "
        f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )


def _moe(text: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of :class:`ModelShape` from a config (empty for dense models)."""
    if text.get("num_local_experts"):
        experts = int(text["num_local_experts"])
        return {
            "num_experts": experts,
            "num_experts_per_tok": int(text.get("num_experts_per_tok") or 0),
            "moe_layout": MIXTRAL,
        }
    key = "num_experts" if text.get("num_experts") else "n_routed_experts"
    if not text.get(key):
        return {}
    if not text.get("moe_intermediate_size"):
        raise UnsupportedModelError(
            f"model_type {model_type!r} has a mixture-of-experts layout ({key}) without "
            "moe_intermediate_size; only Mixtral's, Qwen-MoE's and DeepSeek's are modelled"
        )
    moe_width = _positive_int(text, "moe_intermediate_size")
    if key == "num_experts":
        step = int(text.get("decoder_sparse_step") or 1)
        only_dense = set(text.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(num_layers) if i in only_dense or (i + 1) % step)
        shared = int(text.get("shared_expert_intermediate_size") or 0)
        layout = QWEN_MOE
    else:
        dense = tuple(range(min(num_layers, int(text.get("first_k_dense_replace") or 0))))
        shared = int(text.get("n_shared_experts") or 0) * moe_width
        layout = DEEPSEEK_MOE
    return {
        "num_experts": int(text[key]),
        "num_experts_per_tok": int(text.get("num_experts_per_tok") or 0),
        "moe_layout": layout,
        "moe_intermediate_size": moe_width,
        "shared_expert_intermediate_size": shared,
        "dense_layers": dense,
    }


def _mla(text: dict[str, Any]) -> dict[str, int]:
    """Multi-head latent attention's sizes (empty without ``kv_lora_rank``)."""
    if not text.get("kv_lora_rank"):
        return {}
    return {
        "kv_lora_rank": _positive_int(text, "kv_lora_rank"),
        "q_lora_rank": int(text.get("q_lora_rank") or 0),
        "qk_nope_head_dim": _positive_int(text, "qk_nope_head_dim"),
        "qk_rope_head_dim": _positive_int(text, "qk_rope_head_dim"),
        "v_head_dim": _positive_int(text, "v_head_dim"),
    }


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


def checkpoint_dtype(config: dict[str, Any]) -> str | None:
    """The canonical name of the dtype a config.json states, or None when it states none.

    Read from ``torch_dtype``, else from ``dtype`` (transformers 5's name); a ``"torch."``
    prefix (some older exports write ``"torch.bfloat16"``) is dropped, and an alias is named as
    ``CHECKPOINT_DTYPES`` maps it (``"half"`` is ``"float16"``). ``"auto"``, as transformers
    reads it, states none.

    Raises:
        ValueError: a dtype that is not a key of ``CHECKPOINT_DTYPES`` (the message names the
            field, its value and the accepted names).
    """
    field = "torch_dtype" if config.get("torch_dtype") not in (None, "") else "dtype"
    value = config.get(field)
    if value in (None, "", "auto"):
        return None
    name = CHECKPOINT_DTYPES.get(str(value).removeprefix("torch."))
    if name is None:
        raise ValueError(
            f"{field!r} (the checkpoint's dtype) must be one of "
            f"{', '.join(CHECKPOINT_DTYPES)}, got {value!r}"
        )
    return name


def _check_dtype_bytes(dtype_bytes: int) -> None:
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be a positive integer, got {dtype_bytes!r}")
