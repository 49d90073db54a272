"""`pagoda bench offline`: in-process throughput and latency, against a baseline in the same run.

Workloads: `batch` (many requests at once), `single` (one stream), `prefill` (one long prompt),
compared with transformers `generate` on the same prompts, dtype and threads (or, with
`--baseline llama.cpp`, llama-cpp-python on the same GGUF file); and `shared-prefix` and
`multi-turn`, run with the prefix cache on and off; `structured` with jump-forward on and off;
`spec` (greedy) with speculative decoding on (`--speculative-config`, default n-gram lookup;
`--draft-model PATH` or `--draft-layers N`: a draft model) and off, checking that the outputs are the same and reporting the acceptance rate, the mean accepted
length and the forward passes saved; `code-edit` (greedy) with OpenAI's predicted outputs on and
off: the prediction is the model's own greedy output for the prompt with a few short spans
changed (an editor's earlier version of the file), reporting the accepted / rejected prediction
tokens; `tp`, one stream at tensor-parallel size 1 and
`--tensor-parallel-size` N in alternating runs, with the per-token latency and rank 0's collective
cost per step (bench/tensor_parallel.py). `--tensor-parallel-size` and `--threads-per-rank` also
run any other workload's engine on N ranks.

`--model` takes a Hugging Face folder or a GGUF file; `--quantization` quantizes a folder's
weights at load, and `--gguf TYPE` writes the (default random) model as a GGUF file of TYPE
with `pagoda quantize` first (cached next to it), so that pagoda and llama.cpp run one file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

from pagoda.cli_args import add_arguments, arg, values_from

WORKLOADS = (
    "batch",
    "single",
    "prefill",
    "shared-prefix",
    "multi-turn",
    "structured",
    "spec",
    "code-edit",
    "tp",
)
# The spec workload's proposer unless --speculative-config names one.
DEFAULT_SPEC_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 8,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
# Qwen2.5-0.5B's shape: the default model when none is given (random weights).
DEFAULT_SHAPE = dict(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    tie_word_embeddings=True,
)
_DEFAULTS = {  # workload -> (num_prompts, input_len, output_len)
    "batch": (32, 256, 128),
    "single": (1, 128, 128),
    "prefill": (1, 2048, 1),
    "shared-prefix": (64, 64, 32),
    "multi-turn": (16, 64, 32),
    "structured": (64, 32, 512),
    "spec": (1, 16, 496),  # one stream; 512 tokens in all fit the demo model's context
    "code-edit": (1, 64, 448),
    "tp": (1, 128, 64),  # one stream at tensor-parallel size 1 and N (bench/tensor_parallel.py)
}
# A record with long fixed keys, bounded strings and enums: what structured extraction looks like.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 24},
        "customer_membership_level": {"enum": ["bronze", "silver", "gold", "platinum"]},
        "shipping_address_country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "order_contains_fragile_items": {"type": "boolean"},
        "preferred_delivery_time_window": {"enum": ["morning", "afternoon", "evening"]},
        "number_of_items_in_order": {"type": "integer", "minimum": 1, "maximum": 99},
        "customer_support_ticket_summary": {"type": "string", "maxLength": 40},
    },
    "required": [
        "customer_full_name",
        "customer_membership_level",
        "shipping_address_country_code",
        "order_contains_fragile_items",
        "preferred_delivery_time_window",
        "number_of_items_in_order",
        "customer_support_ticket_summary",
    ],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class OfflineArgs:
    """The flags of `bench offline` beyond the engine's (OFFLINE_ENGINE_FLAGS)."""

    model: str | None = arg(
        None, help="HF model folder or GGUF file", default_text="random weights with Qwen2.5-0.5B's shape"
    )
    workload: str = arg("batch", help="what to run", choices=WORKLOADS)
    num_prompts: int | None = arg(
        None, help="requests (conversations for multi-turn)", default_text="the workload's"
    )
    input_len: int | None = arg(
        None, help="prompt tokens (the question, for shared-prefix)", default_text="the workload's"
    )
    output_len: int | None = arg(None, help="generated tokens per request", default_text="the workload's")
    prefix_len: int = arg(1024, help="shared system prompt tokens (shared-prefix)")
    num_turns: int = arg(4, help="turns per conversation (multi-turn)")
    vocab_size: int = arg(151936, help="vocabulary of the default random model")
    threads: int | None = arg(None, help="torch threads", default_text="torch's choice")
    baseline: str = arg(
        "transformers",
        help="batch, single, prefill: what to compare with on the same prompts: transformers `generate`, "
        "llama-cpp-python on the same GGUF file, or none",
        choices=("transformers", "llama.cpp", "none"),
    )
    baseline_isa: str = arg(
        "native",
        help="transformers baseline: `native` runs it in this process with every instruction set torch "
        "finds; `avx2` runs it in a subprocess with torch and oneDNN capped at AVX2 "
        "(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2), what transformers does on an AVX2-only "
        "machine: the comparison for PAGODA_CPU_ISA=avx2",
        choices=("native", "avx2"),
    )
    gguf: str | None = arg(
        None,
        help="run the model as a GGUF file of this type (q8_0, q4_0, q4_k_m, bf16, ...), written once "
        "by pagoda quantize next to the model",
        metavar="TYPE",
    )
    draft_model: str | None = arg(
        None,
        help="spec: verify the drafts of this draft model (speculative method draft_model)",
        metavar="PATH",
    )
    draft_layers: int | None = arg(
        None,
        help="spec: a draft model of the target's first N layers (see --draft-weights), written next "
        "to the target once",
        metavar="N",
    )
    draft_weights: str = arg(
        "truncated",
        help="--draft-layers: a truncated copy of the target (its embedding, first N layers, norm and "
        "LM head) or a random model of its family and shape",
        choices=("truncated", "random"),
    )
    num_speculative_tokens: int = arg(4, help="spec with a draft model: tokens it proposes a step")
    seed: int = arg(0, help="seed of the prompts and of the engine")
    result_file: str | None = arg(None, help="write the figures as JSON here")


# EngineArgs fields the benchmark passes on to the engine, with the benchmark's defaults. The
# baseline runs transformers in the same dtype, so the dtype must name one.
OFFLINE_ENGINE_FLAGS = (
    "dtype",
    "quantization",
    "max_num_batched_tokens",
    "max_num_seqs",
    "kv_cache_memory_gb",
    "jump_forward_max_running",
    "speculative_config",
    "tensor_parallel_size",
    "threads_per_rank",
)
OFFLINE_ENGINE_DEFAULTS = {"dtype": "bfloat16", "kv_cache_memory_gb": 2.0}


def register(subparsers) -> None:
    from pagoda.config import EngineArgs

    p = subparsers.add_parser(
        "offline",
        help="in-process engine benchmark against a baseline in the same run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # `--no-baseline`: the older spelling of `--baseline none` (declared first: `--baseline` sets the default).
    p.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_const",
        const="none",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    add_arguments(p, OfflineArgs)
    add_arguments(
        p.add_argument_group("engine"),
        EngineArgs,
        include=OFFLINE_ENGINE_FLAGS,
        defaults=OFFLINE_ENGINE_DEFAULTS,
        choices={"dtype": ("bfloat16", "float32", "float16")},
    )
    p.set_defaults(func=run)


@dataclass
class RunResult:
    name: str
    seconds: float
    output_tokens: int
    input_tokens: int
    ttfts: list[float]
    computed_tokens: int | None = None

    def row(self) -> dict:
        return {
            "name": self.name,
            "seconds": round(self.seconds, 3),
            "output_tok_per_s": round(self.output_tokens / self.seconds, 2),
            "input_tok_per_s": round(self.input_tokens / self.seconds, 2),
            "mean_ttft_s": round(statistics.fmean(self.ttfts), 4) if self.ttfts else None,
            "computed_tokens": self.computed_tokens,
        }


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    n, input_len, output_len = _DEFAULTS[args.workload]
    n = args.num_prompts or n
    input_len = args.input_len or input_len
    output_len = args.output_len or output_len
    limit = args.jump_forward_max_running
    for name, value in (
        ("num-prompts", n),
        ("input-len", input_len),
        ("output-len", output_len),
        ("jump-forward-max-running", 1 if limit is None else limit),
    ):
        if value < 1:
            raise SystemExit(f"pagoda bench offline: --{name} must be >= 1")
    model = args.model or _default_model(args.vocab_size)
    if args.gguf:
        model = _gguf_model(model, args.gguf)
    if args.quantization and model.lower().endswith(".gguf"):
        raise SystemExit("pagoda bench offline: --quantization applies to safetensors models, not GGUF files")
    if args.baseline == "llama.cpp":
        if not model.lower().endswith(".gguf"):
            raise SystemExit(
                "pagoda bench offline: --baseline llama.cpp needs a GGUF model (--model FILE.gguf or --gguf TYPE)"
            )
        if args.workload not in ("batch", "single", "prefill"):
            raise SystemExit(
                "pagoda bench offline: --baseline llama.cpp runs the batch, single and prefill workloads"
            )
    if args.baseline_isa != "native" and args.baseline != "transformers":
        raise SystemExit("pagoda bench offline: --baseline-isa applies to --baseline transformers")
    from pagoda.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    from pagoda.kernels import build as cpu_kernels
    from pagoda.kernels.bandwidth import measure_read_bandwidth

    print(
        f"model: {model}\nworkload: {args.workload}, {n} requests, input {input_len}, output {output_len}, "
        f"dtype {args.dtype}, threads {torch.get_num_threads()}\n"
        f"kernel variant: {cpu_kernels.status().describe()}"
    )
    results: list[RunResult] = []
    # The roofline's bandwidth: the better of a read before the runs and one after them (a busy
    # machine slows a single read far more than the runs).
    bandwidths = [measure_read_bandwidth()] if args.workload == "single" else []
    if args.workload == "structured":
        results = _run_structured(args, model, tokenizer, n, input_len, output_len)
    elif args.workload == "spec":
        results = _run_spec(args, model, tokenizer, n, input_len, output_len)
    elif args.workload == "code-edit":
        results = _run_code_edit(args, model, tokenizer, n, input_len, output_len)
    elif args.workload == "tp":
        from pagoda.bench.tensor_parallel import run_tp

        prompts = _random_prompts(tokenizer, n, input_len, args.seed)
        results = run_tp(args, model, prompts, output_len, lambda **kw: _engine(args, model, **kw))
    elif args.workload in ("shared-prefix", "multi-turn"):
        for caching in (True, False):
            results.append(_run_cache_workload(args, model, tokenizer, n, input_len, output_len, caching))
    else:
        prompts = _random_prompts(tokenizer, n, input_len, args.seed)
        results.append(_run_pagoda(args, model, prompts, output_len))
        if args.baseline == "llama.cpp":
            results.append(_run_llama_cpp(model, prompts, output_len, torch.get_num_threads()))
        elif args.baseline == "transformers" and args.baseline_isa == "avx2":
            results.append(_run_transformers_capped(model, args.dtype, prompts, output_len))
        elif args.baseline == "transformers":
            results.append(_run_transformers(model, args.dtype, prompts, output_len))
    roofline = None
    if args.workload == "single":
        roofline = _roofline(
            model, args.dtype, results, [*bandwidths, measure_read_bandwidth()], args.quantization
        )
    _report(args, results, {"kernel_variant": cpu_kernels.status().variant, "roofline": roofline})
    return 0


def weight_bytes_per_token(model: str, dtype: str, quantization: str | None = None) -> int:
    """Bytes of weights one decode step reads: every linear layer and the LM head (the embedding
    only gives one row), from the checkpoint's config; for a GGUF file, its tensors' bytes as
    stored (the format's roofline); quantized at load, the type's bits per weight."""
    if model.lower().endswith(".gguf"):
        from pagoda.quant.gguf_file import GGUFFile

        f = GGUFFile(model)
        names = [n for n in f.tensor_names() if len(f.tensor_shape(n)) == 2]
        tied = "output.weight" not in names
        return sum(f.tensor_nbytes(n) for n in names if tied or n != "token_embd.weight")
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    heads, hidden = c.num_attention_heads, c.hidden_size
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * c.intermediate_size
    params = c.num_hidden_layers * per_layer + c.vocab_size * hidden
    if quantization is not None:
        from pagoda.quant.formats import LOAD_TIME_TYPES, bits_per_weight

        return int(params * bits_per_weight(LOAD_TIME_TYPES[quantization]) / 8)
    return params * {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def _roofline(
    model: str, dtype: str, results: list[RunResult], bandwidths: list, quantization: str | None = None
) -> dict:
    """Single-stream decode against the memory-read roofline: weight bytes per token over the
    best read bandwidth measured in the same run."""
    per_token = weight_bytes_per_token(model, dtype, quantization)
    bandwidth = max(bandwidths, key=lambda b: b.best_gb_s)
    limit = bandwidth.best_gb_s * 1e9 / per_token
    lines = [
        f"roofline: {per_token / 1e9:.3f} GB of weights per token / read bandwidth "
        f"{bandwidth.describe()} = {limit:.1f} tok/s"
    ]
    reached = {}
    for r in results:
        reached[r.name] = round(r.output_tokens / r.seconds / limit, 4)
        line = f"  {r.name}: {r.output_tokens / r.seconds:.1f} tok/s = {reached[r.name]:.0%} of the roofline"
        if r.ttfts and r.output_tokens > 1 and r.seconds > max(r.ttfts):
            # Decode alone: the tokens after the first over the time after it.
            decode = (r.output_tokens - 1) / (r.seconds - max(r.ttfts))
            reached[f"{r.name} decode"] = round(decode / limit, 4)
            line += f" (decode alone {decode:.1f} tok/s = {decode / limit:.0%})"
        lines.append(line)
    return {
        "weight_bytes_per_token": per_token,
        "bandwidth": bandwidth.to_dict(),
        "tok_per_s": round(limit, 2),
        "fraction_reached": reached,
        "summary": lines,
    }


def _default_model(vocab_size: int) -> str:
    from pagoda.models.synthetic import build_random_model

    root = os.path.join(os.path.expanduser("~"), ".cache", "pagoda", "bench-models")
    path = os.path.join(root, f"qwen2.5-0.5b-shape-v{vocab_size}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"building a random model with Qwen2.5-0.5B's shape in {path} (once)")
        build_random_model(path, "Qwen2ForCausalLM", vocab_size=vocab_size, dtype="bfloat16", **DEFAULT_SHAPE)
    return path


def _gguf_model(model: str, file_type: str) -> str:
    """`model` written as a GGUF file of `file_type` (once; kept beside the folder)."""
    from pagoda.entrypoints.cli import main

    if model.lower().endswith(".gguf"):
        raise SystemExit(
            "pagoda bench offline: --gguf converts a model folder; --model is already a GGUF file"
        )
    path = os.path.join(
        os.path.dirname(os.path.abspath(model)),
        f"{os.path.basename(os.path.abspath(model))}-{file_type}.gguf",
    )
    if not os.path.isfile(path):
        print(f"writing {path} (once)")
        if main(["quantize", model, path, "--type", file_type]) != 0:
            raise SystemExit(f"pagoda bench offline: could not write {path}")
    return path


def _random_prompts(tokenizer, n: int, input_len: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [[rng.choice(vocab) for _ in range(input_len)] for _ in range(n)]


def _engine(args, model: str, caching: bool = True, jump_forward: bool = True, **overrides):
    from pagoda.config import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    values = values_from(
        EngineArgs,
        args,
        model=model,
        enable_prefix_caching=caching,
        enable_jump_forward=jump_forward,
        **overrides,
    )
    return LLMEngine(EngineArgs(**values))


def _warmup(engine) -> None:
    from pagoda.sampling_params import SamplingParams

    engine.add_request(None, [1, 2, 3, 4] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


def _run_pagoda(args, model: str, prompts: list[list[int]], output_len: int) -> RunResult:
    from pagoda.sampling_params import SamplingParams

    engine = _engine(args, model)
    _warmup(engine)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start, mono0 = time.perf_counter(), time.monotonic()
    for p in prompts:
        engine.add_request(None, p, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    elapsed = time.perf_counter() - start
    ttfts = [o.metrics["first_token_time"] - mono0 for o in outputs]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return RunResult("pagoda", elapsed, out_tokens, sum(map(len, prompts)), ttfts)


def _run_llama_cpp(model: str, prompts: list[list[int]], output_len: int, threads: int) -> RunResult:
    """llama-cpp-python on the same GGUF file: greedy, each prompt in its own context (llama.cpp
    decodes one sequence per `Llama`; a batch runs its requests one after another), same threads."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(
            "pagoda bench offline: --baseline llama.cpp needs llama-cpp-python (pip install 'pagoda[llama-cpp]')"
        ) from None
    import numpy as np

    width = max(map(len, prompts)) + output_len
    llm = llama_cpp.Llama(
        model_path=model,
        n_ctx=width,
        n_batch=min(width, 2048),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def generate(prompt: list[int], n: int) -> tuple[int, float]:
        """Greedy: the prompt in one eval (its end is the first token), then one eval per token."""
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        first = time.perf_counter() - start
        for _ in range(n - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return n, first

    generate(prompts[0][:8], 2)  # warm-up
    start = time.perf_counter()
    out_tokens, ttfts = 0, []
    for prompt in prompts:
        begun = time.perf_counter() - start  # requests queue behind each other: TTFT counts the wait
        count, ttft = generate(prompt, output_len)
        out_tokens += count
        ttfts.append(begun + ttft)
    elapsed = time.perf_counter() - start
    llm.close()
    return RunResult("llama.cpp", elapsed, out_tokens, sum(map(len, prompts)), ttfts)


def _run_transformers(model: str, dtype: str, prompts: list[list[int]], output_len: int) -> RunResult:
    import torch
    from transformers import AutoModelForCausalLM

    if model.lower().endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(model))
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    width = max(map(len, prompts))
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        hf.generate(
            input_ids=ids[:, :8],
            attention_mask=mask[:, :8],
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=pad,
        )
        start = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start
    out_tokens = (out.shape[1] - width) * len(prompts)
    return RunResult("transformers", elapsed, out_tokens, sum(map(len, prompts)), [])


# torch's own kernels and oneDNN's (its GEMMs) capped at AVX2: read once, when torch loads.
_AVX2_CAP = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _run_transformers_capped(model: str, dtype: str, prompts: list[list[int]], output_len: int) -> RunResult:
    """`_run_transformers` in a fresh interpreter whose torch is capped at AVX2 (`_AVX2_CAP`),
    with this process's thread count."""
    import subprocess

    import torch

    job = {"model": model, "dtype": dtype, "prompts": prompts, "output_len": output_len}
    job["threads"] = torch.get_num_threads()
    print(
        "baseline: transformers in a subprocess under " + " ".join(f"{k}={v}" for k, v in _AVX2_CAP.items())
    )
    proc = subprocess.run(
        [sys.executable, "-c", "from pagoda.bench.offline import _baseline_child; _baseline_child()"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env={**os.environ, **_AVX2_CAP},
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"pagoda bench offline: the capped transformers baseline failed:\n{proc.stderr[-2000:]}"
        )
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"baseline: torch's CPU capability in the subprocess: {row['cpu_capability']}")
    return RunResult("transformers (avx2)", row["seconds"], row["output_tokens"], row["input_tokens"], [])


def _baseline_child() -> None:
    """The capped baseline's subprocess: a job as JSON on stdin, its RunResult as JSON on stdout."""
    import torch

    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    r = _run_transformers(job["model"], job["dtype"], job["prompts"], job["output_len"])
    capability = torch.backends.cpu.get_cpu_capability()
    print(
        json.dumps(
            {
                "seconds": r.seconds,
                "output_tokens": r.output_tokens,
                "input_tokens": r.input_tokens,
                "cpu_capability": capability,
            }
        )
    )


def _run_cache_workload(args, model, tokenizer, n, input_len, output_len, caching: bool) -> RunResult:
    from pagoda.bench.datasets import DatasetConfig, sample_requests
    from pagoda.sampling_params import SamplingParams

    engine = _engine(args, model, caching)
    _warmup(engine)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    if args.workload == "shared-prefix":
        cfg = DatasetConfig(
            "shared-prefix",
            n,
            input_len=input_len,
            output_len=output_len,
            prefix_len=args.prefix_len,
            num_groups=1,
            seed=args.seed,
        )
    else:
        cfg = DatasetConfig(
            "multi-turn",
            n,
            input_len=input_len,
            output_len=output_len,
            num_turns=args.num_turns,
            seed=args.seed,
        )
    requests = sample_requests(cfg, tokenizer)
    computed0 = engine.stats().num_computed_tokens
    start = time.perf_counter()
    mono0 = time.monotonic()
    ttfts: list[float] = []
    out_tokens = in_tokens = 0
    if args.workload == "shared-prefix":
        for r in requests:
            engine.add_request(None, list(r.prompt_token_ids), params)
            in_tokens += len(r.prompt_token_ids)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    ttfts.append(out.metrics["first_token_time"] - mono0)
                    out_tokens += len(out.outputs[0].token_ids)
    else:
        # Conversations run side by side; each next turn resends the history with the answer.
        turns: dict[int, list] = {}
        for r in requests:
            turns.setdefault(r.conversation_id, []).append(r)
        history: dict[int, list[tuple[str, str]]] = {c: [] for c in turns}
        pending: dict[str, int] = {}

        def submit(conv: int) -> None:
            nonlocal in_tokens
            turn = turns[conv][len(history[conv])]
            ids = tokenizer.encode(turn.completion_prompt(history[conv]), add_special_tokens=False)
            in_tokens += len(ids)
            pending[engine.add_request(None, ids, params)] = conv
            turn_start[conv] = time.monotonic()

        turn_start: dict[int, float] = {}
        for conv in turns:
            submit(conv)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                conv = pending.pop(out.request_id)
                ttfts.append(out.metrics["first_token_time"] - turn_start[conv])
                out_tokens += len(out.outputs[0].token_ids)
                history[conv].append((turns[conv][len(history[conv])].prompt, out.outputs[0].text))
                if len(history[conv]) < len(turns[conv]):
                    submit(conv)
    elapsed = time.perf_counter() - start
    name = f"pagoda cache {'on' if caching else 'off'}"
    return RunResult(
        name, elapsed, out_tokens, in_tokens, ttfts, engine.stats().num_computed_tokens - computed0
    )


def _run_structured(args, model, tokenizer, n, input_len, output_len) -> list[RunResult]:
    """The same prompts constrained by a JSON schema (jump-forward off, then on) and unconstrained
    with each request's output length fixed to what its constrained run produced: the gap in
    output tokens/s is the cost of masking; forward passes vs tokens is what jump-forward saves."""
    import copy
    import json

    from pagoda.sampling_params import SamplingParams, StructuredOutputs

    prompts = _random_prompts(tokenizer, n, input_len, args.seed)
    spec = StructuredOutputs(json=BENCH_SCHEMA)
    results: list[RunResult] = []
    lengths: list[int] = []
    for jump_forward in (False, True):
        engine = _engine(args, model, jump_forward=jump_forward)
        _warmup(engine)
        # Grammar compile: a new spec (cold) against the same spec again (cached).
        cold_spec = StructuredOutputs(json={**copy.deepcopy(BENCH_SCHEMA), "title": f"cold-{jump_forward}"})
        t0 = time.perf_counter()
        engine.compile_grammar(cold_spec).result()
        t1 = time.perf_counter()
        engine.compile_grammar(cold_spec).result()
        t2 = time.perf_counter()
        print(
            f"grammar compile (jump-forward {'on' if jump_forward else 'off'}): first {1e3 * (t1 - t0):.1f} ms, "
            f"cached {1e3 * (t2 - t1):.3f} ms"
        )
        params = SamplingParams(max_tokens=output_len, temperature=0, structured_outputs=spec)
        engine.compile_grammar(spec).result()
        steps0 = engine.stats().num_sequence_steps
        start, mono0 = time.perf_counter(), time.monotonic()
        ids = [engine.add_request(None, p, params) for p in prompts]
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        elapsed = time.perf_counter() - start
        outs = [outputs[i] for i in ids]
        valid = 0
        for o in outs:
            try:
                json.loads(o.outputs[0].text)
                valid += o.outputs[0].finish_reason == "stop"
            except ValueError:
                pass
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        stats = engine.stats()
        steps = stats.num_sequence_steps - steps0  # forward passes each sequence took part in
        name = f"json schema, jf {'on' if jump_forward else 'off'}"
        print(
            f"{name}: {sum(lengths)} tokens in {steps} forward passes summed over sequences "
            f"({1 - steps / sum(lengths):.0%} fewer passes than tokens), "
            f"{valid}/{len(outs)} complete JSON, jump-forward accepted "
            f"{stats.jump_forward_accepted}/{stats.jump_forward_drafts} drafts"
        )
        ttfts = [o.metrics["first_token_time"] - mono0 for o in outs]
        results.append(RunResult(name, elapsed, sum(lengths), sum(map(len, prompts)), ttfts))
    engine = _engine(args, model)
    _warmup(engine)
    start, mono0 = time.perf_counter(), time.monotonic()
    for p, length in zip(prompts, lengths, strict=True):
        engine.add_request(None, p, SamplingParams(max_tokens=length, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    elapsed = time.perf_counter() - start
    ttfts = [o.metrics["first_token_time"] - mono0 for o in outs]
    results.append(RunResult("unconstrained", elapsed, sum(lengths), sum(map(len, prompts)), ttfts))
    return results


SPEC_REPEATS = 3


def _run_spec(args, model, tokenizer, n, input_len, output_len) -> list[RunResult]:
    """The same greedy prompts with speculative decoding on and off, in alternating runs (the
    median of SPEC_REPEATS each); the outputs must be the same. Prints the acceptance rate, the
    mean accepted length (tokens per verified draft span: accepted drafts plus the token sampled
    after them) and the forward passes saved (summed over sequences)."""
    from pagoda.config import SpeculativeConfig
    from pagoda.sampling_params import SamplingParams

    config = args.speculative_config or DEFAULT_SPEC_CONFIG
    if args.draft_model or args.draft_layers:
        if args.speculative_config or (args.draft_model and args.draft_layers):
            raise SystemExit(
                "pagoda bench offline: give one of --draft-model, --draft-layers and --speculative-config"
            )
        draft = args.draft_model
        if args.draft_layers:
            from pagoda.bench.drafts import draft_model

            draft = draft_model(model, args.draft_layers, args.draft_weights)
        config = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": args.num_speculative_tokens,
        }
    spec = SpeculativeConfig.from_dict(config)
    print(f"speculative_config: {json.dumps(config)}")
    prompts = _random_prompts(tokenizer, n, input_len, args.seed)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engines = {
        "spec on": _engine(args, model, speculative_config=config),
        "spec off": _engine(args, model, speculative_config=None),
    }
    for engine in engines.values():
        _warmup(engine)
    times: dict[str, list[float]] = {name: [] for name in engines}
    cpu_times: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    counts: dict[str, tuple[int, int, int, int]] = {}
    for _ in range(SPEC_REPEATS):
        for name, engine in engines.items():
            before = engine.stats()
            start, cpu_start = time.perf_counter(), time.process_time()
            ids = [engine.add_request(None, p, params) for p in prompts]
            done = {}
            while engine.has_unfinished_requests():
                done.update({o.request_id: o for o in engine.step() if o.finished})
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)
            after = engine.stats()
            outputs[name] = [done[i].outputs[0].token_ids for i in ids]
            counts[name] = (
                after.num_sequence_steps - before.num_sequence_steps,
                after.spec_num_drafts - before.spec_num_drafts,
                after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
            )
            engine.reset_prefix_cache()
    same = outputs["spec on"] == outputs["spec off"]
    steps_on, drafts, draft_tokens, accepted = counts["spec on"]
    steps_off = counts["spec off"][0]
    print(
        f"outputs identical: {same}\n"
        f"acceptance rate: {accepted / max(draft_tokens, 1):.1%} ({accepted}/{draft_tokens} draft tokens, "
        f"{drafts} drafts of up to {spec.num_speculative_tokens})\n"
        f"mean accepted length: {1 + accepted / max(drafts, 1):.2f} tokens per verified draft\n"
        f"forward passes (summed over sequences): {steps_on} on, {steps_off} off "
        f"({1 - steps_on / max(steps_off, 1):.1%} saved)"
    )
    cpu_on, cpu_off = (statistics.median(cpu_times[name]) for name in engines)
    # With --threads 1 the process CPU time is the work done, whatever else runs on the machine.
    print(f"process CPU time (median): {cpu_on:.2f} s on, {cpu_off:.2f} s off ({cpu_off / cpu_on:.2f}x)")
    draft = engines["spec on"].core.drafter.draft_model
    if draft is not None:
        print(f"draft model forward passes: {draft.num_forward_passes} (all runs)")
    if not same:
        raise SystemExit("pagoda bench offline: speculative decoding changed the greedy outputs")
    out_tokens = sum(map(len, outputs["spec off"]))
    return [
        RunResult(name, statistics.median(times[name]), out_tokens, sum(map(len, prompts)), [])
        for name in engines
    ]


CODE_EDIT_SPANS = 4  # short spans (1-3 tokens) of the output changed in the prediction


def _edited(tokens: list[int], vocab: list[int], rng) -> list[int]:
    """`tokens` with CODE_EDIT_SPANS short spans replaced by other tokens (as many or one fewer or more)."""
    out = list(tokens)
    for k in range(CODE_EDIT_SPANS):
        # Spread over the text: one edit in each stretch.
        lo, hi = k * len(out) // CODE_EDIT_SPANS, (k + 1) * len(out) // CODE_EDIT_SPANS - 3
        if hi <= lo:
            continue
        i = rng.randrange(lo, hi)
        width = rng.randrange(1, 4)
        out[i : i + width] = [rng.choice(vocab) for _ in range(width + rng.randrange(-1, 2))]
    return out


def _run_code_edit(args, model, tokenizer, n, input_len, output_len) -> list[RunResult]:
    """Greedy prompts with and without a prediction (token ids: the greedy output with
    CODE_EDIT_SPANS spans changed), in alternating runs on one engine (the median of SPEC_REPEATS
    each); the outputs must be the same. Prediction drafts need no speculative_config."""
    import random

    from pagoda.sampling_params import SamplingParams

    prompts = _random_prompts(tokenizer, n, input_len, args.seed)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine = _engine(args, model, speculative_config=args.speculative_config)
    _warmup(engine)

    def run(per_prompt: list[SamplingParams]) -> tuple[float, list, int]:
        before = engine.stats()
        start = time.perf_counter()
        ids = [engine.add_request(None, p, q) for p, q in zip(prompts, per_prompt, strict=True)]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        elapsed = time.perf_counter() - start
        engine.reset_prefix_cache()
        steps = engine.stats().num_sequence_steps - before.num_sequence_steps
        return elapsed, [done[i].outputs[0] for i in ids], steps

    _, reference, _ = run([params] * len(prompts))
    rng = random.Random(args.seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    predicted = [
        SamplingParams(**{**params.__dict__, "prediction": _edited(c.token_ids, vocab, rng)})
        for c in reference
    ]
    times: dict[str, list[float]] = {"prediction on": [], "prediction off": []}
    outputs: dict[str, list] = {}
    steps: dict[str, int] = {}
    for _ in range(SPEC_REPEATS):
        for name, per_prompt in (("prediction on", predicted), ("prediction off", [params] * len(prompts))):
            elapsed, outs, steps[name] = run(per_prompt)
            times[name].append(elapsed)
            outputs[name] = outs
    same = (
        [c.token_ids for c in outputs["prediction on"]]
        == [c.token_ids for c in reference]
        == [c.token_ids for c in outputs["prediction off"]]
    )
    accepted = sum(c.accepted_prediction_tokens for c in outputs["prediction on"])
    rejected = sum(c.rejected_prediction_tokens for c in outputs["prediction on"])
    print(
        f"outputs identical: {same}\n"
        f"prediction tokens: {accepted} accepted, {rejected} rejected "
        f"({CODE_EDIT_SPANS} short spans of each output changed)\n"
        f"forward passes (summed over sequences): {steps['prediction on']} on, {steps['prediction off']} off "
        f"({1 - steps['prediction on'] / max(steps['prediction off'], 1):.1%} saved)"
    )
    if not same:
        raise SystemExit("pagoda bench offline: a prediction changed the greedy outputs")
    out_tokens = sum(len(c.token_ids) for c in reference)
    return [
        RunResult(name, statistics.median(times[name]), out_tokens, sum(map(len, prompts)), [])
        for name in times
    ]


def _report(args, results: list[RunResult], extra: dict) -> None:
    rows = [r.row() for r in results]
    base = results[-1]
    print(
        f"\n{'run':<20}{'seconds':>10}{'out tok/s':>12}{'in tok/s':>12}{'mean TTFT s':>13}{'computed':>10}{'ratio':>8}"
    )
    for r, row in zip(results, rows, strict=True):
        if args.workload == "prefill":
            ratio = base.seconds / r.seconds
        else:
            ratio = (r.output_tokens / r.seconds) / (base.output_tokens / base.seconds)
        row["ratio_vs_last"] = round(ratio, 3)
        ttft = f"{row['mean_ttft_s']:.4f}" if row["mean_ttft_s"] is not None else "-"
        computed = row["computed_tokens"] if row["computed_tokens"] is not None else "-"
        print(
            f"{r.name:<20}{row['seconds']:>10.2f}{row['output_tok_per_s']:>12.1f}{row['input_tok_per_s']:>12.1f}"
            f"{ttft:>13}{computed!s:>10}{ratio:>7.2f}x"
        )
    if len(results) == 2 and results[0].ttfts and results[1].ttfts:
        speedup = statistics.fmean(results[1].ttfts) / statistics.fmean(results[0].ttfts)
        print(f"mean TTFT, {results[1].name} / {results[0].name}: {speedup:.2f}x")
    if extra["roofline"]:
        print("\n" + "\n".join(extra["roofline"]["summary"]))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"workload": args.workload, "results": rows, **extra}, f, indent=2)
