"""Reading GGUF files (with the `gguf` package): metadata values and tensors.

Errors are ValueErrors that name the file and the key, tensor or type at fault.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, LlamaFileType

from pagoda.quant.formats import FLOAT_TYPES, GGMLType, check_supported
from pagoda.quant.tensor import GGMLTensor

GGUF_SUFFIX = ".gguf"
_MISSING = object()


def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    return str(path).lower().endswith(GGUF_SUFFIX)


class GGUFFile:
    """A GGUF file opened for reading; tensor data is read from a memory map on demand."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        if not Path(self.path).is_file():
            raise ValueError(f"GGUF file {self.path!r} does not exist")
        try:
            self._reader = GGUFReader(self.path)
        except Exception as exc:  # the reader raises ValueError, struct errors, IndexError, ...
            raise ValueError(f"cannot read GGUF file {self.path!r}: {exc}") from None
        self._tensors = {t.name: t for t in self._reader.tensors}

    # ---- metadata ------------------------------------------------------------------------------
    def metadata_keys(self) -> list[str]:
        return list(self._reader.fields)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` (str, int, float, bool or a list of them), or `default`."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise ValueError(f"GGUF file {self.path!r}: cannot decode metadata {key!r}: {exc}") from None

    def require(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise ValueError(f"GGUF file {self.path!r} has no metadata key {key!r}")
        return value

    def require_int(self, key: str, default: Any = _MISSING, minimum: int = 1) -> int:
        value = self.get(key, default)
        if value is _MISSING:
            raise ValueError(f"GGUF file {self.path!r} has no metadata key {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(
                f"GGUF file {self.path!r}: {key!r} must be an integer >= {minimum}, got {value!r}"
            )
        return value

    def require_float(self, key: str, default: Any = _MISSING) -> float:
        value = self.get(key, default)
        if value is _MISSING:
            raise ValueError(f"GGUF file {self.path!r} has no metadata key {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"GGUF file {self.path!r}: {key!r} must be a number, got {value!r}")
        return float(value)

    def value_type(self, key: str) -> GGUFValueType | None:
        field = self._reader.fields.get(key)
        return field.types[0] if field is not None and field.types else None

    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"GGUF file {self.path!r}: general.architecture must be a string, got {arch!r}")
        return arch

    @functools.cached_property
    def file_type(self) -> str:
        """The file's type name as llama.cpp gives it (e.g. `MOSTLY_Q4_K_M`), or one made from the
        tensor types it holds when `general.file_type` is absent."""
        value = self.get("general.file_type")
        if isinstance(value, int):
            try:
                return LlamaFileType(value).name
            except ValueError:
                pass
        counts: dict[str, int] = {}
        for t in self._tensors.values():
            if len(t.shape) == 2:
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
        return max(counts, key=counts.__getitem__) if counts else "unknown"

    def describe(self) -> str:
        """A short format line, e.g. `GGUF MOSTLY_Q4_K_M (Q4_K 76%, Q6_K 14%, ...)` of 2-D weights."""
        counts: dict[str, int] = {}
        for t in self._tensors.values():
            if len(t.shape) >= 2:
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
        total = sum(counts.values()) or 1
        mix = ", ".join(
            f"{name} {100 * n / total:.0f}%" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])
        )
        return f"GGUF {self.file_type} ({mix})"

    # ---- tensors -------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape in PyTorch order (rows first)."""
        return tuple(int(d) for d in reversed(self._info(name).shape.tolist()))

    def tensor_type(self, name: str) -> GGMLType:
        return check_supported(self._info(name).tensor_type, f"GGUF tensor {name!r}")

    def tensor_nbytes(self, name: str) -> int:
        return int(self._info(name).n_bytes)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of all tensor data in the file."""
        return sum(int(t.n_bytes) for t in self._tensors.values())

    def read(self, name: str) -> torch.Tensor | GGMLTensor:
        """A 2-D tensor as a `GGMLTensor` (its bytes copied out of the file, any type), a 1-D one as
        a float32 tensor."""
        info = self._info(name)
        qtype = self.tensor_type(name)
        shape = self.tensor_shape(name)
        raw = np.ascontiguousarray(info.data).view(np.uint8)
        data = torch.from_numpy(raw.copy())
        if len(shape) == 2:
            return GGMLTensor(qtype, data.reshape(shape[0], -1), (shape[0], shape[1]))
        if len(shape) == 1:
            if qtype not in FLOAT_TYPES:
                raise ValueError(
                    f"GGUF tensor {name!r} is a 1-D {qtype.name} tensor; pagoda reads 1-D ones as floats"
                )
            return GGMLTensor(qtype, data.reshape(1, -1), (1, shape[0])).dequantize().reshape(shape[0])
        raise ValueError(f"GGUF tensor {name!r} has shape {shape}; pagoda reads 1-D and 2-D tensors only")

    def _info(self, name: str):
        info = self._tensors.get(name)
        if info is None:
            raise ValueError(f"GGUF file {self.path!r} has no tensor {name!r}")
        return info


def default_dtype(path: str | os.PathLike[str]) -> torch.dtype:
    """The activation dtype for `dtype="auto"`: float32 for a file of F32 or F16 weight matrices (F16
    does not convert to bf16 losslessly, and CPUs compute fp16 slowly), else bfloat16."""
    f = GGUFFile(path)
    types = {f.tensor_type(n) for n in f.tensor_names() if len(f.tensor_shape(n)) == 2}
    if types <= {GGMLType.F32, GGMLType.F16}:
        return torch.float32
    return torch.bfloat16
