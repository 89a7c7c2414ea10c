"""Linear projections whose weights are filled from Hugging Face checkpoints.

Following vLLM, projections that read the same input are stacked into one matrix (q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``): one matmul instead of several. Each parameter
carries a ``weight_loader(param, loaded, shard_id)`` that copies one checkpoint tensor into its
place, so the model's name mapping stays a table and tensor parallelism can later shard here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def copy_weight(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``target`` (casting dtype/device), in place.

    Raises:
        ValueError: the shapes differ (the message gives both).
    """
    if target.shape != loaded.shape:
        raise ValueError(
            f"has shape {tuple(loaded.shape)}, the model expects {tuple(target.shape)}"
        )
    target.copy_(loaded)


class Linear(nn.Module):
    """``y = x W^T + b`` with uninitialised parameters (they are always loaded).

    Args:
        input_size, output_size: feature sizes.
        bias: whether a bias vector is present.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def shard_range(self, shard_id: str | int) -> tuple[int, int]:
        """Output rows ``[start, end)`` of a stacked shard; the whole output when not stacked."""
        return 0, self.output_size

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """Copy one checkpoint tensor (or one stacked shard of it) into ``param``.

        Raises:
            ValueError: the tensor's shape does not match its place.
        """
        with torch.no_grad():
            if shard_id is None:
                copy_weight(param.data, loaded)
            else:
                start, end = self.shard_range(shard_id)
                copy_weight(param.data[start:end], loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., input_size]`` -> ``[..., output_size]``."""
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output (e.g. gate and up).

    Args:
        input_size: input features.
        output_sizes: output features of each stacked projection, in order; shard ``i`` of the
            checkpoint fills rows ``sum(output_sizes[:i]) : sum(output_sizes[:i+1])``.
        bias: whether the projections have biases.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes

    def shard_range(self, shard_id: str | int) -> tuple[int, int]:
        start = sum(self.output_sizes[: int(shard_id)])
        return start, start + self.output_sizes[int(shard_id)]


class QKVLinear(Linear):
    """Query, key and value projections stacked along the output: ``[q | k | v]``.

    Args:
        hidden_size: input features.
        head_dim: features per head.
        num_heads: query heads.
        num_kv_heads: key/value heads (fewer than ``num_heads`` under grouped-query attention).
        bias: whether q/k/v have biases (Qwen2).
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def shard_range(self, shard_id: str | int) -> tuple[int, int]:
        starts = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        return starts[str(shard_id)], starts[str(shard_id)] + sizes[str(shard_id)]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[num_tokens, q_size + 2 * kv_size]`` -> q, k, v views."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
