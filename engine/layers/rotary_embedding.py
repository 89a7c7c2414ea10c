"""Rotary position embeddings (Su et al. 2021, "RoFormer"), with every RoPE scaling in the config.

The inverse frequencies come from transformers' ``ROPE_INIT_FUNCTIONS`` (linear, dynamic, yarn,
longrope, llama3, ...) applied to the model config, so any ``rope_type`` transformers knows works
here with the same numbers. cos/sin are computed like Hugging Face's rotary modules (float32
``position * inv_freq``, cast to the activation dtype) and applied in the activation dtype, so
results match transformers bit for bit in float32 and round the same way in 16-bit.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _default_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    base = config.rope_parameters["rope_theta"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (base**exponents), 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotating heads by absolute position (GPT-NeoX / HF Llama layout).

    ``rope_type`` ``"dynamic"`` and ``"longrope"`` use their frequencies for the config's
    context length (what transformers uses up to ``original_max_position_embeddings``); they do
    not switch frequencies as a sequence grows, since cached keys were rotated with the old ones.

    Args:
        config: the model config; ``config.rope_parameters`` (transformers' standardised form of
            ``rope_theta`` / ``rope_scaling``) selects the frequencies.
        head_dim: features per head; the first ``2 * len(inv_freq)`` of them are rotated.

    Raises:
        ValueError: a ``rope_type`` transformers does not know (the message names it).
    """

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, attention_scaling = _default_inv_freq(config, head_dim)
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu")
        else:
            raise ValueError(
                f"unsupported rope_type {rope_type!r}; known: default, {', '.join(ROPE_INIT_FUNCTIONS)}"
            )
        # Computed on CPU like transformers does (same rounding), then kept on the device being
        # built on (the loader builds inside a ``torch.device`` context) so that the forward
        # pass never copies it across devices.
        inv_freq = inv_freq.to(torch.get_default_device(), torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = float(attention_scaling)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions`` ``[num_tokens]`` (int64), shared by every layer.

        Returns:
            ``(cos, sin)``, each ``[num_tokens, 1, rotary_dim]`` in ``dtype`` (the head axis
            broadcasts), for :func:`apply_rotary_emb`.
        """
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` by ``cos``/``sin`` from
    :class:`RotaryEmbedding` (its first ``rotary_dim`` features; the rest pass through).

    Returns:
        A new tensor shaped and typed like ``x``.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
