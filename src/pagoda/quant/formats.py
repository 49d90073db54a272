"""The weight formats pagoda reads and writes: llama.cpp's tensor types and their block layouts.

A quantized row of `n` values is `n / block_size` blocks of `type_size` bytes each (llama.cpp's
`ggml-common.h` layouts, little-endian; `d`/`dmin` scales are IEEE fp16):

| type | values/block | bytes | layout | value |
|---|---|---|---|---|
| F32, F16, BF16 | 1 | 4, 2, 2 | the number itself | |
| Q8_0 | 32 | 34 | d, qs[32] int8 | d * q |
| Q4_0 | 32 | 18 | d, qs[16]: value j in the low nibble of byte j, j+16 in the high one | d * (q - 8) |
| Q4_1 | 32 | 20 | d, m, qs[16] | d * q + m |
| Q5_0 | 32 | 22 | d, qh (uint32: bit j is the 5th bit of value j), qs[16] | d * (q - 16) |
| Q5_1 | 32 | 24 | d, m, qh, qs[16] | d * q + m |
| Q4_K | 256 | 144 | d, dmin, 12 bytes of eight 6-bit (scale, min) pairs, qs[128] | d*sc*q - dmin*m per 32 |
| Q5_K | 256 | 176 | d, dmin, scales[12], qh[32], qs[128] | as Q4_K with a 5th bit |
| Q6_K | 256 | 210 | ql[128], qh[64], int8 scales[16], d | d * sc * (q - 32) per 16 |

`FILE_TYPES` are the mixtures `pagoda quantize --type` writes (llama.cpp's `llama_ftype` names).
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType, LlamaFileType

GGMLType = GGMLQuantizationType

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
# Block quantizations whose integer dot products pagoda implements.
QUANT_TYPES = (
    GGMLType.Q8_0,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
)
SUPPORTED_TYPES = FLOAT_TYPES + QUANT_TYPES
K_QUANT_TYPES = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)

# `pagoda quantize --type` → (llama.cpp file type, the type most weights get).
FILE_TYPES: dict[str, tuple[LlamaFileType, GGMLType]] = {
    "f32": (LlamaFileType.ALL_F32, GGMLType.F32),
    "bf16": (LlamaFileType.MOSTLY_BF16, GGMLType.BF16),
    "f16": (LlamaFileType.MOSTLY_F16, GGMLType.F16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, GGMLType.Q8_0),
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, GGMLType.Q4_0),
    "q4_1": (LlamaFileType.MOSTLY_Q4_1, GGMLType.Q4_1),
    "q5_0": (LlamaFileType.MOSTLY_Q5_0, GGMLType.Q5_0),
    "q5_1": (LlamaFileType.MOSTLY_Q5_1, GGMLType.Q5_1),
    "q4_k_m": (LlamaFileType.MOSTLY_Q4_K_M, GGMLType.Q4_K),
    "q5_k_m": (LlamaFileType.MOSTLY_Q5_K_M, GGMLType.Q5_K),
    "q6_k": (LlamaFileType.MOSTLY_Q6_K, GGMLType.Q6_K),
}

# `LLM(model=HF_FOLDER, quantization=...)`: every weight matrix quantized to this type at load.
LOAD_TIME_TYPES: dict[str, GGMLType] = {
    "q8_0": GGMLType.Q8_0,
    "q4_0": GGMLType.Q4_0,
    "q4_k": GGMLType.Q4_K,
}

# llama.cpp's replacement when a row length is not a multiple of a type's block size
# (`tensor_type_fallback`); a row that fits none of them is stored as F16.
FALLBACK_TYPES: dict[GGMLType, GGMLType] = {
    GGMLType.Q4_K: GGMLType.Q5_0,
    GGMLType.Q5_K: GGMLType.Q5_1,
    GGMLType.Q6_K: GGMLType.Q8_0,
}


def type_name(qtype: int) -> str:
    try:
        return GGMLType(qtype).name
    except ValueError:
        return f"type id {int(qtype)}"


def check_supported(qtype: int, what: str) -> GGMLType:
    """`qtype` as a GGMLType, or ValueError naming `what` and the unsupported type."""
    try:
        member = GGMLType(qtype)
    except ValueError:
        member = None
    if member not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(
            f"{what} has tensor type {type_name(qtype)}, which pagoda does not support ({supported})"
        )
    return member


def block_size(qtype: GGMLType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: GGMLType) -> int:
    return GGML_QUANT_SIZES[qtype][1]


def row_bytes(qtype: GGMLType, n: int) -> int:
    """Bytes of one row of `n` values; ValueError if `n` is not a whole number of blocks."""
    bs = block_size(qtype)
    if n % bs:
        raise ValueError(f"a {qtype.name} row needs a multiple of {bs} values, got {n}")
    return n // bs * type_size(qtype)


def bits_per_weight(qtype: GGMLType) -> float:
    return 8 * type_size(qtype) / block_size(qtype)


def fits(qtype: GGMLType, n: int) -> bool:
    return n % block_size(qtype) == 0


def with_fallback(qtype: GGMLType, n: int) -> GGMLType:
    """The type a row of `n` values gets when `qtype` is asked for (llama.cpp's fallback rule)."""
    if fits(qtype, n):
        return qtype
    fallback = FALLBACK_TYPES.get(qtype)
    if fallback is not None and fits(fallback, n):
        return fallback
    return GGMLType.F16


__all__ = [
    "FALLBACK_TYPES",
    "FILE_TYPES",
    "FLOAT_TYPES",
    "K_QUANT_TYPES",
    "LOAD_TIME_TYPES",
    "QK_K",
    "QUANT_TYPES",
    "SUPPORTED_TYPES",
    "GGMLType",
    "bits_per_weight",
    "block_size",
    "check_supported",
    "fits",
    "row_bytes",
    "type_name",
    "type_size",
    "with_fallback",
]
