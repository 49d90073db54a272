"""Build a model from a HF checkpoint folder (config.json + safetensors)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagoda.attention.backend import get_attention_backend
from pagoda.models.base import CausalLM
from pagoda.models.hf_config import parse_hf_config, read_hf_config

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attention_backend: str = "torch",
) -> CausalLM:
    """Instantiate the architecture named in `config.json` and load its safetensors weights."""
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(map(str, _SUPPORTED_DTYPES))}")
    backend = get_attention_backend(attention_backend)
    family, config = parse_hf_config(read_hf_config(model_dir))
    files = checkpoint_files(model_dir)
    with torch.device(device):
        model = family.model_cls(config, backend, dtype)
    model.load_weights(iter_checkpoint(files))
    model.process_weights_after_loading()
    return model.eval()


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """`model.safetensors`, or the shards listed by `model.safetensors.index.json`."""
    root = Path(model_dir)
    index_path = root / _INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"cannot read shard index {str(index_path)!r}: {err!r}") from None
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(path.name) for path in files if not path.is_file()]
        if missing:
            raise ValueError(f"shards listed in {_INDEX_FILE} are missing from {str(root)!r}: {missing}")
        return files
    single = root / _SINGLE_FILE
    if single.is_file():
        return [single]
    raise ValueError(f"no {_SINGLE_FILE} or {_INDEX_FILE} in model directory {str(root)!r}")


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    yield name, f.get_tensor(name)
        except SafetensorError as err:
            raise ValueError(f"cannot read safetensors file {str(path)!r}: {err}") from None
