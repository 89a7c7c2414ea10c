"""The token embedding table (also the output head when a model ties them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvpilot.engine.layers.linear import copy_weight
from torch import nn


class VocabEmbedding(nn.Module):
    """Token id -> embedding row.

    Args:
        vocab_size: rows of the table (tokens).
        hidden_size: embedding width.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy the checkpoint's table into ``param``; ValueError on a shape mismatch."""
        with torch.no_grad():
            copy_weight(param.data, loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``: ``[num_tokens]`` int64 -> ``[num_tokens, hidden_size]``."""
        return F.embedding(input_ids, self.weight)
