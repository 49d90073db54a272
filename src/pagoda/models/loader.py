"""Build a model from a HF checkpoint folder (config.json + safetensors) or a GGUF file.

The weight format (`pagoda.quant.methods`) is chosen here, before the model is built: dense for
safetensors, GGUF tensors as stored for a GGUF file, or `quantization` at load time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagoda.attention.backend import get_attention_backend
from pagoda.distributed import SINGLE, ParallelGroup
from pagoda.json_input import read_json_object
from pagoda.layers.sharding import LazyTensor
from pagoda.models.base import CausalLM
from pagoda.models.gguf import iter_gguf_checkpoint, parse_gguf_config
from pagoda.models.hf_config import parse_hf_config, read_hf_config
from pagoda.models.weight_report import weight_report
from pagoda.quant.gguf_file import GGUFFile, is_gguf_path
from pagoda.quant.methods import GGUFFormat, WeightFormat, load_time_format, use_weight_format

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attention_backend: str = "torch",
    quantization: str | None = None,
    tp: ParallelGroup = SINGLE,
) -> CausalLM:
    """Instantiate the architecture named in `config.json` and load its safetensors weights
    (quantized to `quantization` at load if given), or those of a `.gguf` file. Under tensor
    parallelism (`tp`, on every rank) each rank loads only its shard of the split weights."""
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(map(str, _SUPPORTED_DTYPES))}")
    backend = get_attention_backend(attention_backend)
    fmt: WeightFormat
    if is_gguf_path(model_dir):
        if quantization is not None:
            raise ValueError(
                "quantization applies to safetensors checkpoints; a GGUF file keeps its own types"
            )
        gguf_file = GGUFFile(model_dir)
        family, config = parse_gguf_config(gguf_file)
        weights = iter_gguf_checkpoint(gguf_file, config)
        fmt = GGUFFormat()
        source = f"GGUF {gguf_file.file_type}"
    else:
        family, config = parse_hf_config(read_hf_config(model_dir))
        weights = iter_checkpoint(checkpoint_files(model_dir))
        fmt = WeightFormat() if quantization is None else load_time_format(quantization)
        source = "safetensors" if quantization is None else f"safetensors quantized to {quantization} at load"
    with torch.device(device), use_weight_format(fmt):
        model = family.model_cls(config, backend, dtype, tp)
    model.load_weights(weights)
    model.process_weights_after_loading()
    # e.g. "GGUF MOSTLY_Q4_K_M: Q4_K 71%, Q6_K 17%, ...; 380.2 MiB of weights"
    model.weight_format = f"{source}: {weight_report(model).describe()}"
    return model.eval()


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """`model.safetensors`, or the shards listed by `model.safetensors.index.json`."""
    root = Path(model_dir)
    index_path = root / _INDEX_FILE
    if index_path.is_file():
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"shard index {str(index_path)!r} has no 'weight_map' of tensor names to files")
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(path.name) for path in files if not path.is_file()]
        if missing:
            raise ValueError(f"shards listed in {_INDEX_FILE} are missing from {str(root)!r}: {missing}")
        return files
    single = root / _SINGLE_FILE
    if single.is_file():
        return [single]
    raise ValueError(f"no {_SINGLE_FILE} or {_INDEX_FILE} in model directory {str(root)!r}")


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, LazyTensor]]:
    """Each tensor as a `LazyTensor`, read by the parameter's loader (only its shard of it);
    valid until the next one is drawn."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    yield name, LazyTensor(f.get_slice(name))
        except SafetensorError as err:
            raise ValueError(f"cannot read safetensors file {str(path)!r}: {err}") from None
