"""Writing a Hugging Face checkpoint as a GGUF file the way llama.cpp's converter and
`llama-quantize` would: the same architecture keys, tensor names, Llama q/k row order, llama3
rope factors (`rope_freqs.weight`) and per-tensor types (`pagoda.quant.mixtures`).

Tensors are planned from the safetensors headers first (GGUF puts every tensor's type and size
before the data), then converted and written one at a time, so memory holds one tensor at once.
The tokenizer's metadata comes from a callback (the tokenizer package writes it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from pagoda.layers.rotary import RopeConfig
from pagoda.models.config import ModelArchConfig
from pagoda.models.gguf import HF_TO_GGUF_ARCH, ROPE_FREQS, gguf_tensor_name, llama_qk_rows
from pagoda.models.hf_config import parse_hf_config, read_hf_config
from pagoda.models.loader import checkpoint_files
from pagoda.quant.formats import FILE_TYPES, GGMLType, row_bytes
from pagoda.quant.mixtures import tensor_type
from pagoda.quant.quantize import quantize

logger = logging.getLogger(__name__)

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class PlannedTensor:
    hf_name: str | None  # None: made here (rope_freqs)
    name: str
    shape: tuple[int, ...]  # rows first
    qtype: GGMLType
    source: Path | None

    @property
    def nbytes(self) -> int:
        rows = math.prod(self.shape[:-1])
        return rows * row_bytes(self.qtype, self.shape[-1])


@dataclass(frozen=True)
class ExportSummary:
    path: str
    architecture: str
    file_type: str
    tensors: int
    nbytes: int
    type_counts: dict[str, int]  # tensors per type


def llama3_rope_factors(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """llama.cpp's `rope_freqs` for llama3 scaling: the divisor of each inverse frequency
    (computed in float32, as llama.cpp's converter does, so the files agree byte for byte)."""
    freqs = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    middle = 1 / ((1 - smooth) / rope.factor + smooth)
    factors = torch.where(wavelen > old / rope.low_freq_factor, torch.full_like(freqs, rope.factor), middle)
    return torch.where(wavelen < old / rope.high_freq_factor, torch.ones_like(freqs), factors)


def plan_tensors(
    model_dir: str | Path, config: ModelArchConfig, arch: str, file_type: str
) -> list[PlannedTensor]:
    """Every tensor the file will hold, with its GGUF name, shape and type."""
    plan: list[PlannedTensor] = []
    names_seen: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if hf_name.endswith(_SKIPPED_SUFFIXES):
                    continue
                if config.tie_word_embeddings and hf_name == "lm_head.weight":
                    continue  # the tied head is the embedding (as llama.cpp's converter does)
                name = gguf_tensor_name(hf_name, arch, config.num_layers)
                if name is None:
                    raise ValueError(f"checkpoint tensor {hf_name!r} has no GGUF name for a {arch} model")
                shape = tuple(f.get_slice(hf_name).get_shape())
                qtype = tensor_type(name, shape, file_type, config.num_layers, config.tie_word_embeddings)
                plan.append(PlannedTensor(hf_name, name, shape, qtype, path))
                names_seen.add(name)
    if "token_embd.weight" not in names_seen:
        raise ValueError(f"checkpoint in {str(model_dir)!r} has no embedding (model.embed_tokens.weight)")
    if config.rope.rope_type == "llama3":
        plan.append(PlannedTensor(None, ROPE_FREQS, (config.head_dim // 2,), GGMLType.F32, None))
    return plan


def _add_model_metadata(
    writer: gguf.GGUFWriter, config: ModelArchConfig, hf: dict, arch: str, name: str, file_type: str
) -> None:
    """The keys llama.cpp's converter writes for these architectures."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope.theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if "head_dim" in hf or config.head_dim * config.num_heads != config.hidden_size:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(FILE_TYPES[file_type][0])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _tensor_data(planned: PlannedTensor, config: ModelArchConfig, arch: str) -> torch.Tensor:
    """The planned tensor's bytes, converted from the checkpoint."""
    if planned.hf_name is None:
        values = llama3_rope_factors(config.rope, config.head_dim)
    else:
        with safe_open(str(planned.source), framework="pt", device="cpu") as f:
            values = f.get_tensor(planned.hf_name).to(torch.float32)
        proj = planned.hf_name.split(".")[-2]
        if arch == "llama" and proj in ("q_proj", "k_proj"):
            heads = config.num_heads if proj == "q_proj" else config.num_kv_heads
            values = values[llama_qk_rows(values.shape[0], heads)]
    rows = values.reshape(-1, values.shape[-1]) if values.dim() > 1 else values.reshape(1, -1)
    return quantize(rows, planned.qtype)


def export_gguf(
    model_dir: str | Path,
    out_path: str | Path,
    file_type: str,
    add_tokenizer: Callable[[gguf.GGUFWriter, int], None],
    progress: bool = True,
) -> ExportSummary:
    """Write the checkpoint in `model_dir` to `out_path` as a GGUF file of `file_type` (a key of
    `pagoda.quant.formats.FILE_TYPES`); `add_tokenizer(writer, vocab_size)` adds the tokenizer."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown --type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    hf = read_hf_config(model_dir)
    _, config = parse_hf_config(hf)
    arch = HF_TO_GGUF_ARCH.get(config.architecture)
    if arch is None:
        raise ValueError(
            f"cannot write {config.architecture} as GGUF; supported: {', '.join(HF_TO_GGUF_ARCH)}"
        )
    if any(w is not None for w in config.layer_sliding_windows):
        logger.warning(
            "the model uses sliding-window attention, which a GGUF %r file cannot express: "
            "llama.cpp and pagoda run the file with full attention",
            arch,
        )
    if config.rope.rope_type not in ("default", "llama3"):
        raise ValueError(f"rope type {config.rope.rope_type!r} cannot be written as GGUF")
    out = Path(out_path)
    if not out.parent.is_dir():
        raise ValueError(f"the folder of {str(out)!r} does not exist")
    plan = plan_tensors(model_dir, config, arch, file_type)

    writer = gguf.GGUFWriter(str(out), arch)
    try:
        _add_model_metadata(writer, config, hf, arch, Path(model_dir).resolve().name, file_type)
        add_tokenizer(writer, config.vocab_size)
        for planned in plan:
            byte_shape = (*planned.shape[:-1], row_bytes(planned.qtype, planned.shape[-1]))
            writer.add_tensor_info(
                planned.name, byte_shape, np.dtype(np.uint8), planned.nbytes, raw_dtype=planned.qtype
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(p.nbytes for p in plan)
        with tqdm(
            total=total, unit="B", unit_scale=True, desc=f"Writing {out.name}", disable=not progress
        ) as bar:
            for planned in plan:
                writer.write_tensor_data(_tensor_data(planned, config, arch).contiguous().numpy())
                bar.update(planned.nbytes)
    finally:
        writer.close()
    counts: dict[str, int] = {}
    for planned in plan:
        counts[planned.qtype.name] = counts.get(planned.qtype.name, 0) + 1
    return ExportSummary(str(out), arch, file_type, len(plan), sum(p.nbytes for p in plan), counts)
