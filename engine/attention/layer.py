"""The attention layer of a model: its softmax scale, sliding window, backend and KV scales.

vLLM's ``Attention`` layer: every model's attention module calls it with the new tokens' rotated
q, k, v and its layer's cache. It owns the per-tensor scales of an fp8 KV cache, ``k_scale``
and ``v_scale`` (float32 buffers, 1.0 unless the checkpoint or ``--calculate-kv-scales`` sets
them), under vLLM's names (``model.layers.N.self_attn.attn.k_scale``), so the scales a
quantization tool wrote into a checkpoint load by name (:func:`load_kv_scale`).
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.attention.backends import AttentionBackend
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.layers.weight_loading import CheckpointTensor, shape_of
from kvpilot.kernels.reference import is_fp8

# vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT: a calculated scale maps the first step's largest
# |k| to 200 and |v| to 100, leaving fp8 E4M3 (max 448) headroom for larger later values.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0

# Checkpoint name suffix -> the layer's scale buffers it fills (vLLM's
# ``maybe_remap_kv_scale_name``): compressed-tensors / llm-compressor write the k/v
# projections' output scales, ModelOpt and vLLM's own FP8 format ``self_attn.k_scale``, older
# AutoFP8 checkpoints one ``kv_scale`` for both.
_KV_SCALE_SUFFIXES = {
    ".self_attn.k_proj.output_scale": ("k_scale",),
    ".self_attn.v_proj.output_scale": ("v_scale",),
    ".self_attn.k_scale": ("k_scale",),
    ".self_attn.v_scale": ("v_scale",),
    ".self_attn.kv_scale": ("k_scale", "v_scale"),
}
# Scales of quantized queries and attention probabilities (FP8 attention, which this engine
# does not run: queries stay in the activation dtype); skipped.
_IGNORED_SUFFIXES = (
    ".self_attn.q_proj.output_scale",
    ".self_attn.q_scale",
    ".self_attn.prob_output_scale",
)


class Attention(nn.Module):
    """Write the new K/V into the layer's paged cache and attend, through the shared backend.

    Args:
        backend: the attention backend shared by all layers.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: attend to at most this many latest positions (tokens), or None.

    Attributes:
        k_scale, v_scale: ``[]`` float32 buffers, the dequantization scales of an fp8 cache
            (``k ~ stored * k_scale``); unused with a float cache.
        calculate_kv_scales: when True, the next forward pass with an fp8 cache sets the scales
            from its keys and values (``max |k| / 200``, ``max |v| / 100``, vLLM's rule) and
            turns this off; the engine sets it after its profiling pass, so the first real
            step's tokens decide.
    """

    def __init__(
        self, backend: AttentionBackend, scale: float, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.backend = backend
        self.scale = scale
        self.sliding_window = sliding_window
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.calculate_kv_scales = False

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``query`` ``[num_tokens, num_heads, head_dim]``, ``key``/``value`` ``[num_tokens,
        num_kv_heads, head_dim]`` (rotated) -> ``[num_tokens, num_heads, head_dim]``."""
        if self.calculate_kv_scales and is_fp8(kv_cache[0].dtype):
            self.k_scale.copy_(_scale_from_amax(key, K_SCALE_CONSTANT))
            self.v_scale.copy_(_scale_from_amax(value, V_SCALE_CONSTANT))
            self.calculate_kv_scales = False
        return self.backend.forward(
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            scale=self.scale,
            sliding_window=self.sliding_window,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )


def _scale_from_amax(x: torch.Tensor, constant: float) -> torch.Tensor:
    """``max |x| / constant`` as a float32 scalar, on the device (no host sync); 1.0 for an
    all-zero ``x``, whose scale would otherwise be 0 (and every later value infinite)."""
    amax = x.detach().abs().amax().float()
    return torch.where(amax > 0, amax / constant, torch.ones_like(amax))


def enable_kv_scale_calculation(model: nn.Module) -> int:
    """Set ``calculate_kv_scales`` on every :class:`Attention` layer of ``model`` (vLLM's
    ``--calculate-kv-scales``); returns how many layers there are."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.calculate_kv_scales = True
    return len(layers)


def load_kv_scale(model: nn.Module, name: str, tensor: CheckpointTensor) -> bool:
    """Load a checkpoint's KV cache scale into its layer's ``k_scale`` / ``v_scale``.

    Args:
        model: the model (its :class:`Attention` layers sit at ``<prefix>.self_attn.attn``).
        name: the checkpoint tensor's name, e.g. ``model.layers.3.self_attn.k_proj.output_scale``.
        tensor: the tensor (or a lazy slice of it): one value, per-tensor scaling.

    Returns:
        True when ``name`` is a KV-cache (or query/probability) scale, loaded or deliberately
        skipped; False for any other weight, which the caller loads.

    Raises:
        ValueError: a scale that is not a single positive value (per-head or per-channel KV
            scales are not supported), or one whose layer does not exist.
    """
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    for suffix, buffers in _KV_SCALE_SUFFIXES.items():
        if not name.endswith(suffix):
            continue
        shape = shape_of(tensor)
        if 1 != int(torch.Size(shape).numel()):
            raise ValueError(
                f"checkpoint KV scale {name!r} has shape {shape}: only per-tensor scales (one "
                "value) are supported"
            )
        value = tensor[()].float().reshape(())  # a lazy slice reads its one value here
        if not bool(torch.isfinite(value)) or float(value) <= 0:
            raise ValueError(f"checkpoint KV scale {name!r} must be positive, got {float(value)}")
        layer_name = name[: -len(suffix)] + ".self_attn.attn"
        try:
            layer = model.get_submodule(layer_name)
        except AttributeError as exc:
            raise ValueError(f"checkpoint KV scale {name!r} matches no attention layer") from exc
        for buffer in buffers:
            getattr(layer, buffer).copy_(value)
        return True
    return False
