"""Rotary position embeddings (Su et al. 2021, "RoFormer"), with every RoPE scaling in the config.

The inverse frequencies come from transformers' ``ROPE_INIT_FUNCTIONS`` (linear, dynamic, yarn,
longrope, llama3, ...) applied to the model config, so any ``rope_type`` transformers knows works
here with the same numbers. On the torch path cos/sin are computed like Hugging Face's rotary
modules (float32 ``position * inv_freq``, cast to the activation dtype) and applied in the
activation dtype, so results match transformers bit for bit in float32 and round the same way
in 16-bit; on the CPU the fused C++ kernel (``kvpilot.kernels.cpu.elementwise.rotary_neox``,
``KVPILOT_CPU_ELEMENTWISE=0`` turns it off) computes the same values in one pass. On the Triton
path the same float32 cos/sin (attention scaling included) are tabulated once per position
(vLLM's ``cos_sin_cache``) and the ``rotary_embedding`` kernel rotates q and k in place in
float32, rounding once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvpilot.engine.layers.custom_op import CustomOp
from kvpilot.kernels._utils import rows_contiguous
from kvpilot.kernels.cpu import elementwise


def _default_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    base = config.rope_parameters["rope_theta"]
    # Only the first partial_rotary_factor of each head rotates (Phi-4-mini: 0.75).
    dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (base**exponents), 1.0


def _longrope_inv_freq(
    config: PretrainedConfig, max_model_len: int | None
) -> tuple[torch.Tensor, float]:
    # LongRoPE (Ding et al. 2024): transformers rescales by ``long_factor`` for sequences longer
    # than original_max_position_embeddings and by ``short_factor`` otherwise, switching per
    # forward call. Cached keys would then hold two rotations, so (as vLLM does) one set is
    # chosen for the engine's whole life: long iff max_model_len exceeds the original context.
    original = int(config.rope_parameters["original_max_position_embeddings"])
    max_len = max_model_len or config.max_position_embeddings
    seq_len = original + 1 if max_len > original else None
    return ROPE_INIT_FUNCTIONS["longrope"](config, device="cpu", seq_len=seq_len)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _dynamic_inv_freq(
    config: PretrainedConfig, max_model_len: int | None
) -> tuple[torch.Tensor, float]:
    # Dynamic NTK scaling: transformers raises the base once a forward call's sequence outgrows
    # max_position_embeddings, so cached keys would hold two rotations; one set is chosen for
    # the engine's whole life instead, the frequencies for max_model_len (vLLM's static form of
    # it when max_model_len is the derived max_position_embeddings x factor; transformers' own
    # up to max_position_embeddings).
    return ROPE_INIT_FUNCTIONS["dynamic"](config, device="cpu", seq_len=max_model_len)


@dataclass(frozen=True)
class RotaryPositions:
    """One forward pass's positions, prepared once by :meth:`RotaryEmbedding.prepare` and
    rotated with by every layer.

    Attributes:
        positions: ``[num_tokens]`` int64 absolute positions.
        cos, sin: ``[num_tokens, 1, rotary_dim]`` in the activation dtype on the torch path
            (the head axis broadcasts); None on the Triton path, whose kernel reads the layer's
            ``cos_sin_cache``.
    """

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class RotaryEmbedding(CustomOp):
    """Rotates query and key heads by absolute position (GPT-NeoX / HF Llama layout: the two
    halves of the rotary features turn against each other, HF's ``rotate_half``).

    One instance serves every layer of a model: :meth:`prepare` once per forward pass, then
    ``self(rope, query, key)`` in each attention layer.

    Frequencies never switch as a sequence grows, since cached keys were rotated with the old
    ones. ``rope_type`` ``"dynamic"`` uses its frequencies for ``max_model_len`` (transformers'
    up to ``max_position_embeddings``; vLLM's static NTK base when ``max_model_len`` is the
    derived ``max_position_embeddings x factor``). ``"longrope"`` (Phi-3) uses
    its long factors when ``max_model_len`` exceeds ``original_max_position_embeddings`` and its
    short factors otherwise, for every position (vLLM's rule): transformers picks per forward
    call by the longest position in it, so the two agree whenever transformers' calls stay on
    one side of the original context.

    Args:
        config: the model config; ``config.rope_parameters`` (transformers' standardised form of
            ``rope_theta`` / ``rope_scaling``) selects the frequencies, and
            ``config.max_position_embeddings`` bounds the Triton path's positions.
        head_dim: features per head; the first ``2 * len(inv_freq)`` of them are rotated.
        kernel_backend: ``"torch"`` or ``"triton"`` (see :class:`CustomOp`).
        max_model_len: the longest sequence the engine serves, tokens (default: the config's
            ``max_position_embeddings``); ``"longrope"`` and ``"dynamic"`` pick their
            frequencies by it, and the Triton path's table covers it.

    Attributes:
        inv_freq: ``[rotary_dim / 2]`` float32 inverse frequencies, radians per position.
        attention_scaling: factor on cos and sin (YaRN's and LongRoPE's attention factor; 1
            otherwise).
        max_position: rows of the Triton path's ``cos_sin_cache`` (positions must be below):
            the larger of ``max_position_embeddings`` and ``max_model_len``.

    Raises:
        ValueError: a ``rope_type`` transformers does not know (the message names it).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        kernel_backend: str = "torch",
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(kernel_backend)
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, attention_scaling = _default_inv_freq(config, head_dim)
        elif rope_type == "longrope":
            inv_freq, attention_scaling = _longrope_inv_freq(config, max_model_len)
        elif rope_type == "dynamic":
            inv_freq, attention_scaling = _dynamic_inv_freq(config, max_model_len)
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
        self.max_position = max(int(config.max_position_embeddings), max_model_len or 0)
        self._cos_sin_cache: torch.Tensor | None = None
        self.cpu_kernel = elementwise.enabled()

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        """``[max_position, rotary_dim]`` float32 on ``inv_freq``'s device: row ``p`` holds
        ``cos(p * inv_freq)`` then ``sin(p * inv_freq)``, each times ``attention_scaling``
        (the ``rotary_embedding`` kernel's layout). Built on first use, then kept."""
        if self._cos_sin_cache is None or self._cos_sin_cache.device != self.inv_freq.device:
            t = torch.arange(self.max_position, dtype=torch.float32, device=self.inv_freq.device)
            # The same float32 products and cos/sin as cos_sin(): the two paths see one table.
            freqs = t[:, None] * self.inv_freq[None, :]
            self._cos_sin_cache = torch.cat(
                (freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling),
                dim=-1,
            )
        return self._cos_sin_cache

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions`` ``[num_tokens]`` (int64), as Hugging Face computes them.

        Returns:
            ``(cos, sin)``, each ``[num_tokens, 1, rotary_dim]`` in ``dtype`` (the head axis
            broadcasts), for :func:`apply_rotary_emb`.
        """
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryPositions:
        """What every layer of one forward pass rotates with: ``positions`` ``[num_tokens]``
        (int64), and on the torch path their cos/sin in the activation ``dtype``, computed
        once rather than per layer."""
        if self.kernel_backend == "triton":
            return RotaryPositions(positions)
        return RotaryPositions(positions, *self.cos_sin(positions, dtype))

    def forward_native(
        self, rope: RotaryPositions, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` ``[num_tokens, num_heads, head_dim]`` and ``key``
        ``[num_tokens, num_kv_heads, head_dim]`` by ``rope`` from :meth:`prepare`.

        Returns:
            ``(query, key)`` rotated, new tensors shaped and typed like the inputs.
        """
        if (
            self.cpu_kernel
            and rope.cos is not None
            and query.dim() == key.dim() == 3
            and rows_contiguous(query)
            and rows_contiguous(key)
            and elementwise.supports(rope.cos, rope.sin)
            and query.dtype == key.dtype == rope.cos.dtype
            and query.is_cpu
            and key.is_cpu
        ):
            return elementwise.rotary_neox(query, key, rope.cos, rope.sin)
        return apply_rotary_emb(query, rope.cos, rope.sin), apply_rotary_emb(
            key, rope.cos, rope.sin
        )

    def forward_triton(
        self, rope: RotaryPositions, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`forward_native`, in one kernel that rotates ``query`` and ``key`` in place
        (each contiguous in its last dimension; views of a fused QKV output are fine).

        Returns:
            ``(query, key)``: the input tensors, rotated.

        Raises:
            ValueError: from the kernel's input checks (shapes, dtypes, layout, or on the host a
                position not below ``max_position``).
        """
        from kvpilot.kernels.rotary_embedding import rotary_embedding

        rotary_embedding(rope.positions, query, key, self.cos_sin_cache, is_neox=True)
        return query, key


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` by ``cos``/``sin`` from
    :meth:`RotaryEmbedding.cos_sin` (its first ``rotary_dim`` features; the rest pass through).

    Returns:
        A new tensor shaped and typed like ``x``.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
