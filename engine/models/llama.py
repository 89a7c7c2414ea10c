"""The Llama family in PyTorch on the paged KV cache: Llama 1-3, Mistral, and the base of Qwen2/3.

Touvron et al. 2023 ("LLaMA"): pre-norm decoder with RMSNorm, rotary embeddings, SwiGLU MLP and
grouped-query attention (Ainslie et al. 2023). Parameter names follow Hugging Face's so
checkpoints load by name, except that q/k/v and gate/up are stacked (vLLM's ``qkv_proj`` and
``gate_up_proj``); :attr:`LlamaForCausalLM.stacked_params_mapping` is the one place that knows.
Under tensor parallelism (Megatron-LM, Shoeybi et al. 2019) the layers hold this rank's shard
(:mod:`kvpilot.engine.layers.linear`, :mod:`kvpilot.engine.layers.embedding`) and their weight
loaders read only that shard of each checkpoint tensor.
The float operations mirror transformers' ``modeling_llama`` in order, so logits agree with it
to rounding and greedy decoding picks the same tokens.

Under pipeline parallelism (:mod:`kvpilot.engine.distributed.pipeline`) a stage builds only its
decoder layers (the embedding on the first stage, the final norm and the LM head on the last,
every other module a parameterless ``PPMissingLayer``) and loads only their weights; a tied LM
head on a last stage that is not also the first gets its own copy of the embedding table.

Variants differ only in what subclasses override: :meth:`LlamaForCausalLM.attention_options`
(biases, q/k norm, sliding window, attention scale: per layer) and
:meth:`LlamaForCausalLM.model_options` (embedding, residual and logits scales, the norm: per
model; the MLP of each layer, a mixture of experts for Mixtral and Qwen3-MoE); the MLP's gated
activation follows the config's ``hidden_act``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PretrainedConfig

from kvpilot.engine.attention import AttentionMetadata, get_attention_backend
from kvpilot.engine.attention.backends import AttentionBackend
from kvpilot.engine.attention.layer import Attention, load_kv_scale
from kvpilot.engine.distributed import get_pp_state
from kvpilot.engine.distributed.pipeline import (
    IntermediateTensors,
    PPMissingLayer,
    get_pp_indices,
)
from kvpilot.engine.layers.activation import SiluAndMul, get_act_and_mul
from kvpilot.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvpilot.engine.layers.layernorm import RMSNorm
from kvpilot.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvpilot.engine.layers.rotary_embedding import RotaryEmbedding, RotaryPositions
from kvpilot.engine.layers.weight_loading import CheckpointTensor, copy_weight
from kvpilot.engine.models import cpu_decoder

if TYPE_CHECKING:
    from kvpilot.engine.layers.quantization import QuantizationConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AttentionOptions:
    """What distinguishes one family member's attention layer.

    Attributes:
        qkv_bias: q/k/v projections have biases (Qwen2; Llama when ``attention_bias``).
        o_bias: the output projection has a bias (Llama when ``attention_bias``).
        qk_norm: per-head RMSNorm of q and k before rotation (Qwen3).
        sliding_window: attend to at most this many latest positions (tokens), or None.
        scale: the factor on ``q . k`` before the softmax, or None for ``head_dim ** -0.5``
            (Granite's ``attention_multiplier``).
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    scale: float | None = None


@dataclass(frozen=True)
class ModelOptions:
    """What distinguishes one family member outside its attention layers.

    Attributes:
        embedding_multiplier: factor on the token embeddings (Granite's
            ``embedding_multiplier``; Gemma's ``sqrt(hidden_size)`` rounded to the model dtype).
        residual_multiplier: factor on each attention and MLP output before it joins the
            residual stream (Granite).
        logits_scaling: the logits are divided by it, in the model dtype (Granite).
        norm: the RMSNorm class of every norm (Gemma's ``1 + weight`` one).
        mlp: builds layer ``layer_idx``'s MLP, ``mlp(config, layer_idx, kernel_backend)``
            (a mixture of experts for Mixtral and Qwen3-MoE); None for :class:`LlamaMLP`.
    """

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    norm: type[RMSNorm] = RMSNorm
    mlp: Callable[[PretrainedConfig, int, str], nn.Module] | None = None


def config_sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The sliding window (tokens) of layer ``layer_idx``, or None for full attention.

    Uses ``config.layer_types`` when present (Qwen2/3: ``"sliding_attention"`` layers), else
    ``config.sliding_window`` for every layer (Mistral).
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types and layer_types[layer_idx] != "sliding_attention"):
        return None
    return int(window)


def head_dim_of(config: PretrainedConfig) -> int:
    """``config.head_dim`` when set (Qwen3, Mistral Nemo), else hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Self-attention of one layer: stacked qkv projection, RoPE, paged attention, output.

    Under tensor parallelism ``num_heads`` and ``num_kv_heads`` are this rank's heads; the
    output projection sums the ranks' partial results.

    Args:
        config: the model config.
        options: biases, q/k norm and sliding window of this layer.
        backend: the attention backend shared by all layers.
        rotary_emb: the rotary embedding shared by all layers.
        quant_config: the checkpoint's weight quantization, or None.
        prefix: this module's name (``model.layers.0.self_attn``).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        options: AttentionOptions,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5 if options.scale is None else options.scale
        self.sliding_window = options.sliding_window
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            options.qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            options.o_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        kernel_backend = rotary_emb.kernel_backend
        self.q_norm = self.k_norm = None
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernel_backend)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernel_backend)
        self.rotary_emb = rotary_emb
        self.attn = Attention(backend, self.scale, self.sliding_window)

    def forward(
        self,
        rope: RotaryPositions,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(rope, q, k)
        out = self.attn(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))`` with gate/up stacked; SwiGLU for
    ``hidden_act`` ``silu``, GeGLU for the GELUs (Gemma).

    Args:
        config: the model config.
        kernel_backend: the activation's implementation, ``"torch"`` or ``"triton"``.
        quant_config: the checkpoint's weight quantization, or None.
        prefix: this module's name (``model.layers.0.mlp``).

    Raises:
        ValueError: an unsupported ``hidden_act`` (named in the message).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        kernel_backend: str = "torch",
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [size, size],
            bias,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.act_fn = get_act_and_mul(config.hidden_act, kernel_backend)
        # SwiGLU with the CPU kernels: the GEMM applies the SiLU as it writes gate and up.
        self.gate_up_proj.pack_gated = (
            isinstance(self.act_fn, SiluAndMul) and self.act_fn.cpu_kernel
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden_size]`` -> same shape."""
        gate_up = self.gate_up_proj  # a LoRA wrapper once adapters target it
        fused = (
            gate_up.forward_silu_and_mul(x)
            if isinstance(gate_up, MergedColumnParallelLinear)
            else None
        )
        return self.down_proj(self.act_fn(gate_up(x)) if fused is None else fused)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h += m * attn(norm(h)); h += m * mlp(norm(h))`` (``m`` is the residual
    multiplier, 1 but for Granite).

    The residual stream is carried beside the block's output and added by the next norm
    (vLLM's ``RMSNorm.forward(x, residual)``), so the Triton path fuses each add into a norm
    kernel; the sums are the same as HF's ``residual + hidden``, rounded alike.

    Args:
        config: the model config.
        options: biases, q/k norm, sliding window and scale of this layer's attention.
        backend: the attention backend shared by all layers.
        rotary_emb: the rotary embedding shared by all layers; its ``kernel_backend`` is this
            layer's norms' and activation's too.
        model_options: the norm class, the residual multiplier and the MLP builder.
        layer_idx: this layer's index (the MLP may differ per layer).
        quant_config: the checkpoint's weight quantization, or None.
        prefix: this module's name (``model.layers.0``).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        options: AttentionOptions,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        model_options: ModelOptions,
        layer_idx: int = 0,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        kernel_backend = rotary_emb.kernel_backend
        self.self_attn = LlamaAttention(
            config, options, backend, rotary_emb, quant_config, f"{prefix}.self_attn"
        )
        if model_options.mlp is None:
            self.mlp = LlamaMLP(config, kernel_backend, quant_config, f"{prefix}.mlp")
        elif quant_config is not None:
            raise ValueError(
                f"quantized mixture-of-experts checkpoints are not supported "
                f"({quant_config.get_name()}); use the unquantized checkpoint"
            )
        else:
            self.mlp = model_options.mlp(config, layer_idx, kernel_backend)
        norm = model_options.norm
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps, kernel_backend)
        self.post_attention_layernorm = norm(
            config.hidden_size, config.rms_norm_eps, kernel_backend
        )
        self.residual_multiplier = model_options.residual_multiplier

    def forward(
        self,
        rope: RotaryPositions,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on ``[num_tokens, hidden_size]`` activations.

        Args:
            rope: this forward pass's positions.
            hidden: the previous block's output (the embeddings for the first block).
            residual: the residual stream before ``hidden`` is added to it; None for the first
                block.

        Returns:
            ``(hidden, residual)``: this block's MLP output and the residual stream it is still
            to be added to.
        """
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self._scaled(self.self_attn(rope, hidden, kv_cache, attn_metadata))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self._scaled(self.mlp(hidden)), residual

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        # Granite's ``residual + out * residual_multiplier``: the product, then the norm's add.
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix), or this pipeline
    stage's part of them.

    Args:
        config: the model config.
        options: one :class:`AttentionOptions` per layer.
        backend: the attention backend shared by all layers.
        kernel_backend: the norms', activations' and rotary embedding's implementation,
            ``"torch"`` or ``"triton"`` (:class:`~kvpilot.engine.layers.custom_op.CustomOp`).
        model_options: embedding and residual multipliers and the norm class.
        max_model_len: the longest sequence served, tokens (the rotary embedding's LongRoPE and
            dynamic-NTK frequencies depend on it); None for the config's
            ``max_position_embeddings``.
        quant_config: the checkpoint's weight quantization of the decoder layers' linear
            layers, or None; the embedding and the LM head stay in the compute dtype.

    Attributes:
        start_layer, end_layer: the decoder layers ``[start, end)`` this stage holds (all of
            them without pipeline parallelism); the others are ``PPMissingLayer``.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        options: list[AttentionOptions],
        backend: AttentionBackend,
        kernel_backend: str = "torch",
        model_options: ModelOptions = ModelOptions(),
        max_model_len: int | None = None,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        pp = get_pp_state()
        self.start_layer, self.end_layer = get_pp_indices(len(options), pp.rank, pp.world_size)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            if pp.is_first_rank
            else PPMissingLayer()
        )
        self.embedding_multiplier = model_options.embedding_multiplier
        self.rotary_emb = RotaryEmbedding(
            config, head_dim_of(config), kernel_backend, max_model_len
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                layer_options,
                backend,
                self.rotary_emb,
                model_options,
                i,
                quant_config,
                f"model.layers.{i}",
            )
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i, layer_options in enumerate(options)
        )
        self.norm = (
            model_options.norm(config.hidden_size, config.rms_norm_eps, kernel_backend)
            if pp.is_last_rank
            else PPMissingLayer()
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """``input_ids`` ``[num_tokens]`` -> final-normed hidden ``[num_tokens, hidden_size]``
        on the last stage, the activations for the next stage on the others.

        Args:
            kv_caches: one pair per layer of this stage (``end_layer - start_layer``).
            intermediate_tensors: the previous stage's activations (None on the first stage,
                which embeds ``input_ids``).
            logits_indices: ``[n]`` int64 rows to return, on the last stage (``[n,
                hidden_size]``, the same values as those rows of the whole), or None for all.
                The plain CPU path (:mod:`cpu_decoder`) skips the other rows' output
                projection and MLP in the last layer; the module path selects them at the end.
        """
        if intermediate_tensors is None:
            hidden = self.embed_tokens(input_ids)
            if self.embedding_multiplier != 1.0:
                hidden = hidden * self.embedding_multiplier
            residual = None
        else:
            hidden, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        rope = self.rotary_emb.prepare(positions, hidden.dtype)
        layers = self.layers[self.start_layer : self.end_layer]
        plain = self._plain_layers(layers) if len(layers) else None
        if isinstance(self.norm, PPMissingLayer):
            logits_indices = None  # the next stage needs every row
        out = None
        if plain is not None:  # the same kernels without the modules, where the step allows
            backend = layers[0].self_attn.attn.backend
            out = cpu_decoder.forward(
                plain,
                backend,
                rope,
                hidden,
                residual,
                kv_caches,
                attn_metadata,
                logits_indices,
            )
        if out is not None:
            hidden, residual = out
        else:
            for layer, kv_cache in zip(layers, kv_caches, strict=True):
                hidden, residual = layer(rope, hidden, residual, kv_cache, attn_metadata)
            if logits_indices is not None:
                hidden, residual = hidden[logits_indices], residual[logits_indices]
        if isinstance(self.norm, PPMissingLayer):
            return IntermediateTensors(hidden, residual)
        return self.norm(hidden, residual)[0]

    def _plain_layers(self, layers: nn.ModuleList) -> list[cpu_decoder.PlainLayer] | None:
        """``layers`` for :func:`cpu_decoder.forward`, or None when one is not plain; worked out
        on the first step and again when the first layer's projection or its weight is replaced
        (the CPU packing once the weights are loaded, LoRA wrappers)."""
        qkv_proj = layers[0].self_attn.qkv_proj
        key = (id(qkv_proj), id(getattr(qkv_proj, "weight", None)))
        cached = getattr(self, "_plain", None)
        if cached is None or cached[0] != key:
            cached = (key, cpu_decoder.plain_layers(layers))
            self._plain = cached
        return cached[1]


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over the paged KV cache (HF ``architectures`` name reused).

    Args:
        config: the Hugging Face config of the checkpoint.
        attention_backend: attention backend name, ``"torch"`` or ``"triton"``; the norms,
            activations and rotary embedding run the same path (the Triton kernels with
            ``"triton"``).
        max_model_len: the longest sequence the engine serves, tokens; None for the config's
            ``max_position_embeddings`` (only LongRoPE's and dynamic NTK's frequencies depend on
            it).
        quant_config: the checkpoint's weight quantization
            (:func:`~kvpilot.engine.layers.quantization.get_quantization_config`), or None.

    Attributes:
        config: the Hugging Face config.
        num_layers, num_kv_heads, head_dim, vocab_size: sizes the KV cache and sampler need;
            ``num_layers`` is this pipeline stage's and ``num_kv_heads`` this rank's (the KV
            cache holds only those layers and heads).
        dtype: the parameters' dtype (the default dtype at construction).
        supports_pp: the class splits into pipeline stages (vLLM's ``SupportsPP``).
    """

    supports_pp = True

    # (stacked parameter, checkpoint name part, shard id)
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(
        self,
        config: PretrainedConfig,
        attention_backend: str = "torch",
        max_model_len: int | None = None,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim_of(config)
        self.vocab_size = config.vocab_size
        self.dtype = torch.get_default_dtype()
        backend = get_attention_backend(attention_backend)
        options = [self.attention_options(config, i) for i in range(config.num_hidden_layers)]
        model_options = self.model_options(config, self.dtype)
        self.logits_scaling = model_options.logits_scaling
        self.model = LlamaModel(
            config, options, backend, backend.name, model_options, max_model_len, quant_config
        )
        self.num_layers = self.model.end_layer - self.model.start_layer
        self.num_kv_heads = self.model.layers[self.model.start_layer].self_attn.num_kv_heads
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        pp = get_pp_state()
        if not pp.is_last_rank:
            self.lm_head = PPMissingLayer()
        elif self.tie_word_embeddings and pp.is_first_rank:
            # Built on "meta" (no memory) because its weight is replaced by the shared table.
            with torch.device("meta"):
                self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            # Untied, or tied on a last stage without the embedding: loaded from the table.
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    @classmethod
    def attention_options(cls, config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        """Llama: biases follow ``attention_bias``; Mistral's ``sliding_window`` applies."""
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(
            qkv_bias=bias, o_bias=bias, sliding_window=config_sliding_window(config, layer_idx)
        )

    @classmethod
    def model_options(cls, config: PretrainedConfig, dtype: torch.dtype) -> ModelOptions:
        """Llama: no extra scales, the plain RMSNorm.

        Args:
            config: the model config.
            dtype: the parameters' dtype (Gemma rounds its embedding scale to it).
        """
        return ModelOptions()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Run the new tokens of a mixed prefill/decode batch (this stage's layers).

        Args:
            input_ids: ``[num_tokens]`` int64.
            positions: ``[num_tokens]`` int64 absolute positions.
            kv_caches: one ``(k_cache, v_cache)`` per layer of this stage, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype or fp8
                (``--kv-cache-dtype``); the new tokens' K/V are written at
                ``attn_metadata.slot_mapping``.
            attn_metadata: the batch layout.
            intermediate_tensors: the previous stage's activations; None on the first stage.
            logits_indices: ``[n]`` int64, the rows whose hidden states the caller needs (those
                the LM head reads); None for all. Only those are returned, and on the CPU's
                plain path the last layer computes the others no further than their K/V and
                attention.

        Returns:
            Hidden states ``[num_tokens, hidden_size]`` (``[n, hidden_size]`` with
            ``logits_indices``), model dtype, on the last stage; the activations for the next
            stage on the others.
        """
        return self.model(
            input_ids, positions, kv_caches, attn_metadata, intermediate_tensors, logits_indices
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[n, hidden_size]`` -> logits ``[n, vocab_size]`` float32 (divided by
        ``logits_scaling`` in the model dtype first, as Granite does)."""
        logits = self.lm_head(hidden)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits.float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden).argmax(dim=-1)`` (``[n, hidden_size]`` -> ``[n]`` int64),
        bit for bit, without every logit where the CPU's greedy head applies
        (``ParallelLMHead.greedy_tokens``); -1 for a row it leaves undecided; None where it
        does not apply (a ``logits_scaling``, whose division can tie logits, another dtype or
        device, tensor parallelism)."""
        if self.logits_scaling != 1.0 or isinstance(self.lm_head, PPMissingLayer):
            return None
        return self.lm_head.greedy_tokens(hidden)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names), or this rank's shards of them, into
        the parameters.

        Args:
            weights: ``(name, tensor)`` pairs, e.g. from ``iterate_safetensors``; a lazy
                safetensors slice in place of a tensor is read only where this rank's shard is.

        Returns:
            The names of the parameters that were filled completely (stacked ones once all
            their shards came).

        Raises:
            ValueError: a tensor with no matching parameter, or with the wrong shape.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards_seen: dict[str, set[str | int]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or load_kv_scale(self, name, tensor):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                # Some tied checkpoints store the shared table twice.
                continue
            target, shard_id = self._param_name(self._stage_name(name))
            if target is None:
                continue  # another pipeline stage's weight
            if target not in params:
                raise ValueError(f"checkpoint weight {name!r} matches no parameter of this model")
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            try:
                if shard_id is not None:
                    loader(param, tensor, shard_id)
                elif loader is not None:
                    loader(param, tensor)
                else:
                    with torch.no_grad():
                        copy_weight(param.data, tensor)
            except ValueError as exc:
                raise ValueError(f"checkpoint weight {name!r} {exc}") from exc
            loaded.add(target)
            if shard_id is not None:
                shards_seen.setdefault(target, set()).add(shard_id)
        # A stacked parameter counts as loaded only once every one of its shards arrived.
        incomplete = {t for t, seen in shards_seen.items() if seen != self._shards_of(t)}
        return loaded - incomplete

    def _shards_of(self, param_name: str) -> set[str | int]:
        return {
            shard_id
            for stacked, _, shard_id in self.stacked_params_mapping
            if stacked in param_name
        }

    def _stage_name(self, name: str) -> str | None:
        """The checkpoint name as this pipeline stage holds it: None for another stage's
        weight; the embedding table as ``lm_head.weight`` on a last stage with a tied head
        and no embedding of its own."""
        pp = get_pp_state()
        if pp.world_size == 1:
            return name
        if name.startswith("model.embed_tokens."):
            if pp.is_first_rank:
                return name
            tied_head = self.tie_word_embeddings and pp.is_last_rank
            return "lm_head.weight" if tied_head and name.endswith(".weight") else None
        if name.startswith("model.layers."):
            index = int(name.split(".", 3)[2])
            return name if self.model.start_layer <= index < self.model.end_layer else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if pp.is_last_rank else None
        return name

    def _param_name(self, name: str | None) -> tuple[str | None, str | int | None]:
        if name is None:
            return None, None
        for stacked, part, shard_id in self.stacked_params_mapping:
            if part in name:
                return name.replace(part, stacked), shard_id
        return name, None
