"""GGUF models as llama.cpp writes them (`llama` — Llama and Mistral —, `qwen2`, `qwen3`): the
architecture from the metadata, and the tensors renamed to the Hugging Face checkpoint names the
model code loads.

llama.cpp's converter reorders the rows of Llama's q/k projections (its rotary embedding pairs
neighbouring dimensions, transformers' pairs the two halves of a head); `llama_qk_rows` gives
that permutation, applied here in reverse (on the raw rows, so quantized tensors stay as they are).
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import torch

from pagoda.layers.rotary import RopeConfig
from pagoda.models.config import ModelArchConfig
from pagoda.models.registry import ModelFamily, get_model_family
from pagoda.quant.gguf_file import GGUFFile
from pagoda.quant.tensor import GGMLTensor

# general.architecture → (HF architecture, gguf arch enum). llama.cpp writes Mistral as `llama`.
GGUF_ARCHITECTURES: dict[str, tuple[str, gguf.MODEL_ARCH]] = {
    "llama": ("LlamaForCausalLM", gguf.MODEL_ARCH.LLAMA),
    "qwen2": ("Qwen2ForCausalLM", gguf.MODEL_ARCH.QWEN2),
    "qwen3": ("Qwen3ForCausalLM", gguf.MODEL_ARCH.QWEN3),
}
HF_TO_GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_FREQS = "rope_freqs.weight"
_DEFAULT_CONTEXT = 4096


def gguf_arch_name(f: GGUFFile) -> str:
    arch = f.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {f.path!r} holds a {arch!r} model; pagoda runs {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def parse_gguf_config(f: GGUFFile) -> tuple[ModelFamily, ModelArchConfig]:
    """The model's architecture from the file's `{arch}.*` metadata and its tensors."""
    arch = gguf_arch_name(f)
    family = get_model_family(GGUF_ARCHITECTURES[arch][0])
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    hidden = f.require_int(key("embedding_length"))
    num_layers = f.require_int(key("block_count"))
    num_heads = f.require_int(key("attention.head_count"))
    num_kv_heads = f.require_int(key("attention.head_count_kv"), default=num_heads)
    if hidden % num_heads and f.get(key("attention.key_length")) is None:
        raise ValueError(
            f"GGUF file {f.path!r}: embedding_length {hidden} is not a multiple of head_count {num_heads}"
        )
    head_dim = f.require_int(key("attention.key_length"), default=hidden // num_heads)
    value_dim = f.require_int(key("attention.value_length"), default=head_dim)
    if value_dim != head_dim:
        raise ValueError(
            f"GGUF file {f.path!r}: key_length {head_dim} != value_length {value_dim} is not supported"
        )
    rope_dims = f.require_int(key("rope.dimension_count"), default=head_dim)
    if rope_dims != head_dim:
        raise ValueError(
            f"GGUF file {f.path!r}: rope.dimension_count {rope_dims} != head dim {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    scaling = f.get(key("rope.scaling.type"))
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF file {f.path!r}: rope scaling {scaling!r} is not supported")
    factors = None
    if f.has_tensor(ROPE_FREQS):
        freqs = f.read(ROPE_FREQS)
        factors = tuple(float(v) for v in freqs.tolist())
    rope = RopeConfig(theta=f.require_float(key("rope.freq_base"), default=10000.0), freq_factors=factors)

    embed_shape = _tensor_shape(f, "token_embd.weight")
    if embed_shape[1] != hidden:
        raise ValueError(f"GGUF file {f.path!r}: token_embd.weight has width {embed_shape[1]}, not {hidden}")
    config = ModelArchConfig(
        architecture=family.architecture,
        hidden_size=hidden,
        intermediate_size=f.require_int(key("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=embed_shape[0],
        max_position_embeddings=f.require_int(key("context_length"), default=_DEFAULT_CONTEXT),
        rms_norm_eps=f.require_float(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=not f.has_tensor("output.weight"),
        rope=rope,
        # llama.cpp runs these architectures with full attention on every layer.
        layer_sliding_windows=(None,) * num_layers,
        qkv_bias=f.has_tensor("blk.0.attn_q.bias"),
        o_proj_bias=f.has_tensor("blk.0.attn_output.bias"),
        mlp_bias=f.has_tensor("blk.0.ffn_down.bias"),
        qk_norm=f.has_tensor("blk.0.attn_q_norm.weight"),
    )
    return family, config


def _tensor_shape(f: GGUFFile, name: str) -> tuple[int, ...]:
    if not f.has_tensor(name):
        raise ValueError(f"GGUF file {f.path!r} has no tensor {name!r}")
    return f.tensor_shape(name)


def hf_checkpoint_names(config: ModelArchConfig) -> list[str]:
    """Every tensor name a Hugging Face checkpoint of this architecture may hold."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        names += [f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names += [f"{layer}.self_attn.{proj}.weight", f"{layer}.self_attn.{proj}.bias"]
        names += [f"{layer}.self_attn.q_norm.weight", f"{layer}.self_attn.k_norm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names += [f"{layer}.mlp.{proj}.weight", f"{layer}.mlp.{proj}.bias"]
    return names


def gguf_tensor_name(hf_name: str, arch: str, num_layers: int) -> str | None:
    """llama.cpp's name for a Hugging Face checkpoint tensor (gguf's own name map)."""
    name_map = _name_map(arch, num_layers)
    return name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def _name_map(arch: str, num_layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(GGUF_ARCHITECTURES[arch][1], num_layers)


def llama_qk_rows(rows: int, num_heads: int) -> torch.Tensor:
    """Index `p` with `gguf_rows = hf_rows[p]`: llama.cpp's converter interleaves the two halves
    of each head (`w.reshape(heads, 2, d/2, ...).swapaxes(1, 2)`)."""
    head_dim = rows // num_heads
    return torch.arange(rows).reshape(num_heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)


def llama_qk_rows_inverse(rows: int, num_heads: int) -> torch.Tensor:
    """Index `q` with `hf_rows = gguf_rows[q]`."""
    return torch.argsort(llama_qk_rows(rows, num_heads))


def iter_gguf_checkpoint(
    f: GGUFFile, config: ModelArchConfig
) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
    """The file's tensors under their Hugging Face names (2-D ones as GGMLTensors, in their own
    types), with Llama's q/k rows put back in transformers' order."""
    arch = gguf_arch_name(f)
    to_hf = {}
    for hf_name in hf_checkpoint_names(config):
        gguf_name = gguf_tensor_name(hf_name, arch, config.num_layers)
        if gguf_name is not None:
            to_hf[gguf_name] = hf_name
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    for name in f.tensor_names():
        if name == ROPE_FREQS:
            continue  # read into the rope config
        hf_name = to_hf.get(name)
        if hf_name is None:
            raise ValueError(
                f"GGUF file {f.path!r}: tensor {name!r} is not part of a {arch} model pagoda runs"
            )
        tensor = f.read(name)
        proj = hf_name.split(".")[-2]
        if arch == "llama" and proj in heads:
            index = llama_qk_rows_inverse(tensor.shape[0], heads[proj])
            tensor = tensor.take_rows(index) if isinstance(tensor, GGMLTensor) else tensor[index]
        yield hf_name, tensor
