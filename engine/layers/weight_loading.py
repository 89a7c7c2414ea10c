"""Copying checkpoint tensors, or only this rank's piece of them, into parameters.

A checkpoint tensor arrives either as a ``torch.Tensor`` or as a lazy safetensors slice
(``safe_open(...).get_slice(name)``); indexing the latter reads only the requested rows or
columns from the file, so a tensor-parallel rank never reads (or holds) the other ranks' shards.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class LazySlice(Protocol):
    """What the loaders use of a safetensors ``PySafeSlice``."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


CheckpointTensor = torch.Tensor | LazySlice


def shape_of(loaded: CheckpointTensor) -> tuple[int, ...]:
    """The full shape of a checkpoint tensor, read without loading it."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def load_shard(
    target: torch.Tensor,
    loaded: CheckpointTensor,
    expected_shape: tuple[int, ...],
    dim: int = 0,
    start: int = 0,
) -> None:
    """Copy ``loaded[start : start + target.shape[dim]]`` along ``dim`` into ``target``.

    Only that piece is read from a lazy slice. Casts dtype and device.

    Args:
        target: the parameter's region to fill (a view), in place.
        loaded: the whole checkpoint tensor.
        expected_shape: the shape the whole checkpoint tensor must have.
        dim: the sharded dimension.
        start: first index of this rank's piece along ``dim``.

    Raises:
        ValueError: ``loaded`` does not have ``expected_shape`` (the message gives both).
    """
    shape = shape_of(loaded)
    if shape != tuple(expected_shape):
        raise ValueError(f"has shape {shape}, the model expects {tuple(expected_shape)}")
    size = target.shape[dim]
    if isinstance(loaded, torch.Tensor):
        piece = loaded.narrow(dim, start, size)
    else:
        index = [slice(None)] * len(shape)
        index[dim] = slice(start, start + size)
        piece = loaded[tuple(index)]
    target.copy_(piece)


def copy_weight(target: torch.Tensor, loaded: CheckpointTensor) -> None:
    """Copy the whole of ``loaded`` into ``target`` (casting dtype/device), in place.

    Raises:
        ValueError: the shapes differ (the message gives both).
    """
    load_shard(target, loaded, tuple(target.shape))
