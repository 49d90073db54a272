"""`pagoda quantize HF_FOLDER OUT.gguf --type TYPE`: write a Hugging Face checkpoint as a GGUF file
that llama.cpp and transformers load. Only argparse is imported at module level."""

from __future__ import annotations

import argparse
import sys
from typing import Any

# Kept equal to pagoda.quant.formats.FILE_TYPES (a test checks it) without importing torch here.
FILE_TYPE_CHOICES = ("f32", "bf16", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m", "q6_k")

_EPILOG = """\
types (llama.cpp's file types):
  f32, bf16, f16     every weight matrix in that float type
  q8_0, q4_0, q4_1,  every weight matrix in that type, the output (or tied embedding) in Q6_K
  q5_0, q5_1         (q8_0 keeps Q8_0)
  q4_k_m, q5_k_m     Q4_K / Q5_K, with attn_v and ffn_down in Q6_K on the first and last eighth
                     of the layers and every third layer between, the output in Q6_K
  q6_k               Q6_K everywhere
  A row length that a type's blocks do not divide falls back as llama-quantize does (Q4_K to
  Q5_0, Q5_K to Q5_1, Q6_K to Q8_0), else to F16. Norms and biases stay F32.
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "quantize",
        help="write a Hugging Face model folder as a GGUF file (f32, bf16, q8_0, q4_0, q4_k_m, ...)",
        description="Convert (and quantize) a Hugging Face model folder into one GGUF file, with its "
        "tokenizer and chat template, as llama.cpp's converter and llama-quantize would.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="Hugging Face model folder (config.json, safetensors, tokenizer.json)")
    parser.add_argument("output", help="the GGUF file to write")
    parser.add_argument(
        "--type", dest="file_type", choices=FILE_TYPE_CHOICES, default="q8_0", help="(default q8_0)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: MODEL)")
    parser.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    if not args.output.lower().endswith(".gguf"):
        return _fail(f"the output file must end in .gguf, got {args.output!r}")
    if Path(args.output).exists() and not args.force:
        return _fail(f"{args.output!r} exists; pass --force to overwrite it")
    from pagoda.models.gguf_export import export_gguf
    from pagoda.tokenizer.gguf import add_tokenizer_to_gguf

    tokenizer_dir = args.tokenizer or args.model
    partial = Path(args.output + ".part")  # renamed when complete: never a half-written OUTPUT
    try:
        summary = export_gguf(
            args.model,
            partial,
            args.file_type,
            lambda writer, vocab_size: add_tokenizer_to_gguf(writer, tokenizer_dir, vocab_size),
            progress=not args.quiet,
        )
        partial.replace(args.output)
    except (ValueError, OSError) as exc:
        partial.unlink(missing_ok=True)
        return _fail(str(exc))
    types = ", ".join(f"{n} {name}" for name, n in sorted(summary.type_counts.items(), key=lambda kv: -kv[1]))
    print(
        f"wrote {args.output}: {summary.architecture}, {args.file_type}, {summary.tensors} tensors ({types}), "
        f"{summary.nbytes / 2**20:.1f} MiB of tensor data"
    )
    return 0


def _fail(message: str) -> int:
    print(f"pagoda quantize: error: {message}", file=sys.stderr)
    return 2
