"""Which type each tensor of a GGUF file gets for a file type: llama.cpp's mixtures.

For the K-quant "M" mixtures (`llama-quantize`'s `llama_tensor_get_type`, no importance matrix):

- `output.weight` — or `token_embd.weight` when the head is tied to it — is Q6_K in every
  quantized file type except Q8_0 (which keeps Q8_0), and Q8_0 when its rows are not a multiple
  of the default type's block;
- Q4_K_M and Q5_K_M raise `attn_v` and `ffn_down` to Q6_K in the first and last eighth of the
  layers and in every third layer between them (`use_more_bits`);
- every other weight matrix takes the file type's default (Q4_K for Q4_K_M, Q5_K for Q5_K_M).

Then a type whose block does not divide the row length falls back (Q4_K → Q5_0, Q5_K → Q5_1,
Q6_K → Q8_0, anything else → F16). Norm weights, biases and other 1-D tensors stay F32. Float
file types (f32, bf16, f16) store every weight matrix in that type.
"""

from __future__ import annotations

from pagoda.quant.formats import FILE_TYPES, FLOAT_TYPES, GGMLType, block_size, with_fallback

_MORE_BITS_FILE_TYPES = ("q4_k_m", "q5_k_m")


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits in the M mixtures."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], file_type: str, num_layers: int, tied: bool) -> GGMLType:
    """The type `pagoda quantize --type file_type` gives GGUF tensor `name` of `shape` (rows first)."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    default = FILE_TYPES[file_type][1]
    if len(shape) != 2 or not name.endswith(".weight") or name.endswith("_norm.weight"):
        return GGMLType.F32
    if default in FLOAT_TYPES:
        return default
    cols = shape[1]
    qtype = default
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if cols % block_size(default):
            qtype = GGMLType.Q8_0
        elif default != GGMLType.Q8_0:
            qtype = GGMLType.Q6_K
    elif file_type in _MORE_BITS_FILE_TYPES and name.endswith((".attn_v.weight", ".ffn_down.weight")):
        layer = int(name.split(".")[1])
        if use_more_bits(layer, num_layers):
            qtype = GGMLType.Q6_K
    return with_fallback(qtype, cols)
