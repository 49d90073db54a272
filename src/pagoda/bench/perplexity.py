"""`pagoda bench perplexity MODEL --text FILE [--reference MODEL]`: what a format costs in quality.

As llama.cpp's `llama-perplexity`: the text is tokenized once and cut into chunks of `--ctx-size`
tokens; each chunk is evaluated on its own (a fresh context; its first token replaced by BOS
where the tokenizer adds one) and only the predictions of its second half are scored, so every
scored token sees at least half a chunk of context. Perplexity is exp(mean negative
log-likelihood) over the scored tokens.

With `--reference MODEL` (e.g. the bf16 folder a Q4_K_M file came from) both models see the same
tokens, and the mean KL divergence KL(reference || model) and the share of positions whose most
likely next token is the same (top-1 agreement) are reported too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# The logits of this many positions are materialized at once (a vocabulary of 150k is 600 KB a row).
_LOGIT_ROWS = 128


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "perplexity",
        help="chunked perplexity of a model over a text file, and KL divergence against a reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="Hugging Face model folder or .gguf file")
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--reference", help="model to compare against (KL divergence, top-1 agreement)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: MODEL's)")
    p.add_argument("--quantization", choices=("q8_0", "q4_0", "q4_k"), help="quantize MODEL at load")
    p.add_argument("--dtype", default="auto", help="activation dtype: auto, float32, bfloat16 (default auto)")
    p.add_argument("--ctx-size", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--max-chunks", type=int, help="score at most this many chunks (default: all)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--result-file", help="write the figures as JSON here")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class PerplexityResult:
    model: str
    reference: str | None
    perplexity: float
    num_tokens: int  # scored tokens
    num_chunks: int
    ctx_size: int
    seconds: float
    reference_perplexity: float | None = None
    kl_divergence: float | None = None
    top1_agreement: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class _Scorer:
    """One model evaluating whole chunks in a private paged KV cache (one sequence at a time)."""

    def __init__(self, path: str, dtype, quantization: str | None, ctx_size: int) -> None:
        import torch

        from pagoda.engine.resolve import resolve_dtype
        from pagoda.models.loader import load_model

        self.torch = torch
        self.block_size = 16
        self.num_blocks = -(-ctx_size // self.block_size)
        self.model = load_model(path, resolve_dtype(dtype, path), quantization=quantization)
        if ctx_size > self.model.config.max_position_embeddings:
            raise ValueError(
                f"--ctx-size {ctx_size} exceeds {path!r}'s {self.model.config.max_position_embeddings} positions"
            )
        self.model.bind_kv_cache(self.model.allocate_kv_caches(self.num_blocks, self.block_size))
        self.vocab_size = self.model.config.vocab_size
        self.weight_format = self.model.weight_format

    def log_probs(self, tokens: list[int], first: int):
        """float32 log-softmax `[len(tokens) - 1 - first, V]`: the predictions from positions
        first .. len - 2 (of tokens first + 1 .. len - 1)."""
        from pagoda.attention.metadata import AttentionMetadata

        torch = self.torch
        n = len(tokens)
        bs = self.block_size
        blocks = -(-n // bs)
        positions = torch.arange(n)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),  # blocks 0..k-1 in order: slot = position
            block_tables=torch.arange(blocks, dtype=torch.int32).unsqueeze(0),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            num_decodes=0,
            seq_lens_cpu=[n],
            query_start_loc_cpu=[0, n],
            block_size=bs,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(tokens), positions, meta)
            rows = hidden[first : n - 1]
            parts = [
                self.model.compute_logits(rows[i : i + _LOGIT_ROWS]).log_softmax(-1)
                for i in range(0, rows.shape[0], _LOGIT_ROWS)
            ]
        return torch.cat(parts)


def tokenize_text(tokenizer, text: str) -> tuple[list[int], int | None]:
    """The text's tokens (without special tokens) and the BOS id the tokenizer would prepend."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    with_special = tokenizer.encode("a", add_special_tokens=True)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and with_special and with_special[0] == bos
    return tokens, bos if adds_bos else None


def chunks(tokens: list[int], ctx_size: int, bos: int | None, max_chunks: int | None) -> list[list[int]]:
    count = len(tokens) // ctx_size
    if max_chunks is not None:
        count = min(count, max_chunks)
    out = []
    for i in range(count):
        chunk = tokens[i * ctx_size : (i + 1) * ctx_size]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        out.append(chunk)
    return out


def measure(
    model: str,
    text: str,
    *,
    reference: str | None = None,
    tokenizer: str | None = None,
    quantization: str | None = None,
    dtype: str = "auto",
    ctx_size: int = 512,
    max_chunks: int | None = None,
    log=print,
) -> PerplexityResult:
    import torch

    from pagoda.tokenizer import load_tokenizer

    if ctx_size < 8:
        raise ValueError(f"--ctx-size must be >= 8, got {ctx_size}")
    if max_chunks is not None and max_chunks < 1:
        raise ValueError(f"--max-chunks must be >= 1, got {max_chunks}")
    tok = load_tokenizer(tokenizer or model)
    tokens, bos = tokenize_text(tok, text)
    pieces = chunks(tokens, ctx_size, bos, max_chunks)
    if not pieces:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one chunk of --ctx-size {ctx_size}")
    scorer = _Scorer(model, dtype, quantization, ctx_size)
    ref = _Scorer(reference, dtype, None, ctx_size) if reference else None
    if ref is not None and ref.vocab_size != scorer.vocab_size:
        raise ValueError(
            f"the reference has a vocabulary of {ref.vocab_size}, the model {scorer.vocab_size}: not comparable"
        )
    if ref is not None and reference is not None:
        ref_tokens, _ = tokenize_text(load_tokenizer(tokenizer or reference), text)
        if ref_tokens != tokens:
            raise ValueError(
                "the reference's tokenizer splits the text differently: pass one --tokenizer for both"
            )
    log(f"model: {model} ({scorer.weight_format})")
    if ref is not None:
        log(f"reference: {reference} ({ref.weight_format})")
    first = ctx_size // 2
    nll = ref_nll = kl = 0.0
    agree = count = 0
    start = time.perf_counter()
    for index, chunk in enumerate(pieces):
        targets = torch.tensor(chunk[first + 1 :])
        logp = scorer.log_probs(chunk, first)
        nll -= float(logp.gather(1, targets.unsqueeze(1)).sum())
        if ref is not None:
            ref_logp = ref.log_probs(chunk, first)
            ref_nll -= float(ref_logp.gather(1, targets.unsqueeze(1)).sum())
            kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
            agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
        count += len(targets)
        log(f"[{index + 1}/{len(pieces)}] perplexity {math.exp(nll / count):.4f}")
    seconds = time.perf_counter() - start
    return PerplexityResult(
        model=model,
        reference=reference,
        perplexity=math.exp(nll / count),
        num_tokens=count,
        num_chunks=len(pieces),
        ctx_size=ctx_size,
        seconds=round(seconds, 3),
        reference_perplexity=math.exp(ref_nll / count) if ref is not None else None,
        kl_divergence=kl / count if ref is not None else None,
        top1_agreement=agree / count if ref is not None else None,
    )


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        text = Path(args.text).read_text(encoding="utf-8")
        if args.result_file and not Path(args.result_file).resolve().parent.is_dir():
            raise ValueError(f"the folder of --result-file {args.result_file!r} does not exist")
        result = measure(
            args.model,
            text,
            reference=args.reference,
            tokenizer=args.tokenizer,
            quantization=args.quantization,
            dtype=args.dtype,
            ctx_size=args.ctx_size,
            max_chunks=args.max_chunks,
        )
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"pagoda bench perplexity: error: {exc}", file=sys.stderr)
        return 2
    line = f"perplexity {result.perplexity:.4f} over {result.num_tokens} tokens ({result.num_chunks} chunks)"
    if result.kl_divergence is not None:
        line += (
            f"; reference perplexity {result.reference_perplexity:.4f}, "
            f"KL divergence {result.kl_divergence:.6f}, top-1 agreement {100 * result.top1_agreement:.2f}%"
        )
    print(line)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
        print(f"result written to {args.result_file}")
    return 0
