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


class _NarrowedSlice:
    """``length`` indices of a lazy slice from ``start`` along ``dim``, still lazy: indexing it
    reads only the indexed part of the parent (see :func:`narrow`)."""

    def __init__(self, parent: LazySlice, dim: int, start: int, length: int) -> None:
        self.parent, self.dim, self.start, self.length = parent, dim, start, length

    def get_shape(self) -> list[int]:
        shape = list(self.parent.get_shape())
        shape[self.dim] = self.length
        return shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = list(index) if isinstance(index, tuple) else [index]
        index += [slice(None)] * (self.dim + 1 - len(index))
        piece = index[self.dim]
        if not isinstance(piece, slice) or piece.step not in (None, 1):
            raise TypeError(f"a narrowed checkpoint slice takes contiguous slices, got {piece!r}")
        first, stop, _ = piece.indices(self.length)
        index[self.dim] = slice(self.start + first, self.start + max(first, stop))
        return self.parent[tuple(index)]


def narrow(loaded: CheckpointTensor, dim: int, start: int, length: int) -> CheckpointTensor:
    """``loaded``'s indices ``[start, start + length)`` along ``dim``, as ``Tensor.narrow``; a
    lazy slice stays lazy (nothing is read until the result is indexed).

    Raises:
        ValueError: the range is not inside ``loaded``'s size along ``dim``.
    """
    size = shape_of(loaded)[dim]
    if start < 0 or length < 0 or start + length > size:
        raise ValueError(f"has {size} rows along dim {dim}, fewer than {start} + {length}")
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    return _NarrowedSlice(loaded, dim, start, length)


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
