"""Checkpoint tensors as the weight loaders receive them, and the shard hook that cuts out the
part one tensor-parallel rank holds.

A safetensors checkpoint arrives as `LazyTensor`s (safetensors' slice handles): `narrow` reads
only the shard's bytes, so no rank ever holds a full copy of a split weight. A GGUF weight
(`GGMLTensor`) splits on its raw rows; a split of its columns must fall on whole quantization
blocks, else loading fails with a clear error."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.quant.formats import block_size, type_size
from pagoda.quant.tensor import GGMLTensor


class LazyTensor:
    """A checkpoint tensor not read yet: wraps a safetensors slice handle (`safe_open(...).get_slice`),
    valid while its file is open."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.shape = tuple(int(d) for d in handle.get_shape())

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        """The whole tensor, or `length` entries from `start` along `dim` (0 or 1)."""
        if dim is None:
            return self._handle[:]
        index = slice(start, start + length)
        return self._handle[index] if dim == 0 else self._handle[:, index]


CheckpointTensor = torch.Tensor | GGMLTensor | LazyTensor


def materialize(loaded: CheckpointTensor) -> torch.Tensor | GGMLTensor:
    """The tensor itself (read from the file if it is lazy)."""
    return loaded.read() if isinstance(loaded, LazyTensor) else loaded


def narrow(
    loaded: CheckpointTensor, dim: int, start: int, length: int, what: str
) -> torch.Tensor | GGMLTensor:
    """`length` rows (dim 0) or columns (dim 1) of a checkpoint tensor from `start`: the shard
    hook of the tensor-parallel layers. A 1-D tensor (a bias) narrows along its only dimension."""
    shape = tuple(loaded.shape)
    if dim >= len(shape) or start < 0 or start + length > shape[dim]:
        raise ValueError(f"{what}: cannot take {length} entries from {start} of dim {dim} of shape {shape}")
    if start == 0 and length == shape[dim]:
        return materialize(loaded)
    if isinstance(loaded, LazyTensor):
        return loaded.read(dim, start, length)
    if isinstance(loaded, GGMLTensor):
        return _narrow_ggml(loaded, dim, start, length, what)
    return loaded.narrow(dim, start, length).clone()  # a copy, so the full tensor can be freed


def _narrow_ggml(t: GGMLTensor, dim: int, start: int, length: int, what: str) -> GGMLTensor:
    rows, cols = t.shape
    if dim == 0:
        return GGMLTensor(t.qtype, t.data.narrow(0, start, length).clone(), (length, cols))
    block = block_size(t.qtype)
    if start % block or length % block:
        raise ValueError(
            f"{what}: a tensor-parallel split of its {cols} columns into {length} per rank does not "
            f"fall on whole {t.qtype.name} blocks of {block} values; choose a tensor-parallel size "
            f"that divides {cols // block} blocks, or a checkpoint in another type"
        )
    nbytes = type_size(t.qtype)
    data = t.data.narrow(1, start // block * nbytes, length // block * nbytes).contiguous()
    return GGMLTensor(t.qtype, data, (rows, length))
