"""Plain Llama decoder layers on the CPU kernels, called in a row without the module tree.

:class:`~kvpilot.engine.models.llama.LlamaDecoderLayer` reaches the CPU kernels through ten
module calls a layer (two norms, the projections, the rotary embedding, the attention layer and
its backend, the MLP), each dispatching and checking again which kernel takes its tensors. On a
two-thread decode step of SmolLM2-135M (32 sequences, ~50 ms) that Python costs ~2 ms while the
second core waits for the next kernel. Where every layer is plain (below), this module runs the
same kernels in the same order with those decisions taken once a step: the same bits as the
module path (``tests/engine/test_cpu_decoder.py`` compares the tokens and logprobs of mixed
steps).

A layer is plain when it is float32 with every projection packed for
:mod:`kvpilot.kernels.cpu.gemm` (no bias, no LoRA wrapper, no quantization, no tensor
parallelism), its norms are :class:`~kvpilot.engine.layers.layernorm.RMSNorm` on the CPU
kernel (not Gemma's offset one), its MLP is SwiGLU with the gate/up projection packed gated, it
has no q/k norm and a residual multiplier of 1, and its attention runs the CPU paged-attention
kernel; a step takes this path when every one of its tokens goes to that kernel (a float32
cache, prompts in tiles: ``StepPlan.in_place`` with no rows left to SDPA). Anything else takes
the module path: Qwen2's biases, Qwen3's q/k norm, Gemma, Granite, mixtures of experts, LoRA,
fp8 caches, GPUs.

``KVPILOT_CPU_DECODER=0`` (or ``false``, ``off``, ``no``) keeps every step on the module path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.attention.layer import Attention
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.layers.layernorm import RMSNorm
from kvpilot.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvpilot.engine.layers.rotary_embedding import RotaryPositions
from kvpilot.kernels.cpu import elementwise, extension, gemm, paged_attention

ENV_VAR = "KVPILOT_CPU_DECODER"


@dataclass(frozen=True)
class PlainLayer:
    """What one plain decoder layer's kernels read (see the module docstring).

    Attributes:
        input_norm, post_norm: ``[hidden_size]`` float32 RMSNorm weights, before attention
            and before the MLP.
        input_eps, post_eps: their epsilons.
        qkv: ``[q_size + 2 kv_size, hidden_size]`` stacked projection, packed.
        o: ``[hidden_size, q_size]`` output projection, packed.
        gate_up: ``[2 intermediate_size, hidden_size]``, packed gated (SwiGLU in the GEMM).
        down: ``[hidden_size, intermediate_size]``, packed.
        num_heads, num_kv_heads, head_dim: this layer's attention heads (query, key/value)
            and their size (features).
        scale: the factor on ``q . k`` before the softmax.
        sliding_window: tokens a query attends to (its own included), or None for all.
    """

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: gemm.PackedWeight
    o: gemm.PackedWeight
    gate_up: gemm.PackedWeight
    down: gemm.PackedWeight
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None


def enabled() -> bool:
    """Whether ``$KVPILOT_CPU_DECODER`` allows this path (unset, or anything but
    ``0``/``false``/``off``/``no``)."""
    return extension.env_enabled(ENV_VAR)


def _packed(linear: nn.Module, kind: type, gated: bool = False) -> gemm.PackedWeight | None:
    """``linear``'s packed weight when it is exactly a ``kind`` layer (no LoRA wrapper) with no
    bias and no tensor parallelism, packed ``gated`` or not; else None."""
    weight = getattr(linear, "weight", None)
    if (
        type(linear) is not kind
        or linear.bias is not None
        or linear.tp_size != 1
        or not isinstance(weight, gemm.PackedWeight)
        or weight.gated != gated
    ):
        return None
    return weight


def _norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is Llama's RMSNorm on the CPU kernel with a float32 weight."""
    return (
        type(norm) is RMSNorm
        and norm.cpu_kernel
        and norm.weight.dtype == torch.float32
        and norm.weight.is_cpu
    )


def plain_layer(layer: nn.Module) -> PlainLayer | None:
    """``layer`` (a ``LlamaDecoderLayer``) as a :class:`PlainLayer`, or None when it is not
    plain (see the module docstring)."""
    attn, mlp = layer.self_attn, layer.mlp
    weights = (
        _packed(attn.qkv_proj, QKVParallelLinear),
        _packed(attn.o_proj, RowParallelLinear),
        _packed(getattr(mlp, "gate_up_proj", None), MergedColumnParallelLinear, gated=True),
        _packed(getattr(mlp, "down_proj", None), RowParallelLinear),
    )
    inner = attn.attn
    if (
        any(w is None for w in weights)
        or layer.residual_multiplier != 1.0
        or attn.q_norm is not None
        or not attn.rotary_emb.cpu_kernel
        or attn.rotary_emb.kernel_backend != "torch"
        or not (_norm(layer.input_layernorm) and _norm(layer.post_attention_layernorm))
        or type(inner) is not Attention
        or inner.calculate_kv_scales
        or type(inner.backend) is not TorchAttentionBackend
        or not inner.backend.paged_decode_kernel
    ):
        return None
    qkv, o, gate_up, down = weights
    return PlainLayer(
        input_norm=layer.input_layernorm.weight,
        input_eps=layer.input_layernorm.eps,
        post_norm=layer.post_attention_layernorm.weight,
        post_eps=layer.post_attention_layernorm.eps,
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        scale=inner.scale,
        sliding_window=inner.sliding_window,
    )


def plain_layers(layers: Sequence[nn.Module]) -> list[PlainLayer] | None:
    """Every layer of ``layers`` as a :class:`PlainLayer`, or None unless all of them are
    plain and the path is :func:`enabled`."""
    if not enabled():
        return None
    plain = [plain_layer(layer) for layer in layers]
    return None if any(p is None for p in plain) else plain


def forward(
    layers: Sequence[PlainLayer],
    backend: TorchAttentionBackend,
    rope: RotaryPositions,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    attn_metadata: AttentionMetadata,
    logits_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decoder layers on ``[num_tokens, hidden_size]`` activations, as
    ``LlamaDecoderLayer.forward`` layer after layer, or None (nothing computed, nothing
    written) when this step does not take the path: a ``hidden`` that is not float32 on the
    CPU, a cache the paged-attention kernel does not take, or tokens it leaves to SDPA.

    Args:
        layers: one per cache of ``kv_caches``, from :func:`plain_layers`.
        backend: the layers' attention backend (its step plan is shared with the module path).
        rope: this step's positions, cos and sin (``RotaryEmbedding.prepare``).
        hidden: the embeddings, or the previous stage's activations.
        residual: the residual stream before ``hidden`` joins it; None before the first layer.
        kv_caches: each layer's ``(k_cache, v_cache)``, ``[num_blocks, block_size,
            num_kv_heads, head_dim]``; the step's keys and values are written into them.
        attn_metadata: the batch layout.
        logits_indices: ``[n]`` int64, the rows whose hidden states are returned (those the LM
            head reads), or None for every row. The last layer then writes every row's keys
            and values and attends for every row, but takes only these through its output
            projection and MLP (most of its FLOPs): the other rows' outputs would be read by
            nothing. Each row's result is the same bits either way (the kernels treat rows on
            their own).

    Returns:
        ``(hidden, residual)`` after the last layer, ``[num_tokens, hidden_size]`` each, or
        ``[n, hidden_size]`` with ``logits_indices``; or None.
    """
    k_cache = kv_caches[0][0]
    if (
        hidden.dtype != torch.float32
        or rope.cos is None
        or not backend.uses_kernel(hidden, k_cache)
        or not paged_attention.tiles_prompts(hidden, k_cache)
        or not elementwise.supports(
            hidden, rope.cos, rope.sin, *([] if residual is None else [residual])
        )
    ):
        return None
    plan = backend.plan(attn_metadata, k_cache.shape[1], True, True).in_place
    if plan is None or plan.rows is not None:
        return None
    num_tokens = hidden.shape[0]
    last = len(layers) - 1
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
        if residual is None:
            normed, residual = (
                elementwise.rms_norm(hidden, layer.input_norm, layer.input_eps),
                hidden,
            )
        else:
            normed, residual = elementwise.rms_norm(
                hidden, layer.input_norm, layer.input_eps, residual
            )
        qkv = gemm.packed_linear(normed, layer.qkv)
        q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = elementwise.rotary_neox(
            q.view(num_tokens, layer.num_heads, layer.head_dim),
            k.view(num_tokens, layer.num_kv_heads, layer.head_dim),
            rope.cos,
            rope.sin,
        )
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        paged_attention.reshape_and_cache(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
        out = paged_attention.paged_attention(
            q,
            k_cache,
            v_cache,
            plan.block_tables,
            plan.seq_lens,
            layer.scale,
            layer.sliding_window,
            query_start_loc=plan.query_start_loc,
            prompt_seqs=plan.prompt_seqs,
        )
        out = out.view(num_tokens, q_size)
        if i == last and logits_indices is not None:
            out, residual = out[logits_indices], residual[logits_indices]
        hidden = gemm.packed_linear(out, layer.o)
        normed, residual = elementwise.rms_norm(hidden, layer.post_norm, layer.post_eps, residual)
        hidden = gemm.packed_linear(gemm.packed_silu_and_mul(normed, layer.gate_up), layer.down)
    return hidden, residual
