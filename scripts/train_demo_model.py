#!/usr/bin/env python3
"""Train pagoda's built-in demo model from public-domain text, reproducibly, on a CPU.

The corpus comes from three Debian packages of public-domain English works, fetched with
``apt-get download`` and unpacked with ``dpkg-deb`` into a scratch folder:

* ``sword-text-web``     the World English Bible (dedicated to the public domain),
* ``sword-comm-mhcc``    Matthew Henry's Concise Commentary (public domain),
* ``sword-comm-tdavid``  C. H. Spurgeon's Treasury of David (1869-1885, public domain).

They are SWORD modules: zlib-compressed blocks of OSIS markup, read here with the standard
library. The script cleans them into paragraphs, holds out every 50th paragraph for validation,
trains a byte-level BPE tokenizer with ``tokenizers``, trains a small ``LlamaForCausalLM`` with
plain PyTorch (AdamW, cosine schedule, fixed seeds) for a fixed number of steps, reports the
held-out perplexity and writes a standard Hugging Face folder (bfloat16 safetensors).

Usage (the defaults reproduce the shipped model):

    python scripts/train_demo_model.py --output-dir src/pagoda/assets/demo-model
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import html
import json
import math
import os
import platform
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SAMPLE_PROMPTS = (
    "The old man walked slowly",
    "In the morning we",
    "The best way to learn is",
)


@dataclasses.dataclass(frozen=True)
class CorpusPackage:
    """One Debian package holding a public-domain SWORD module."""

    name: str
    version: str
    module_conf: str  # file name under usr/share/sword/mods.d
    title: str
    licence: str


CORPUS_PACKAGES = (
    CorpusPackage(
        "sword-text-web",
        "426.0-1",
        "engWEB2015eb.conf",
        "World English Bible (2015 edition, with Deuterocanon)",
        "Public domain (dedicated to the public domain by its translators)",
    ),
    CorpusPackage(
        "sword-comm-mhcc",
        "2.0-1",
        "mhcc.conf",
        "Matthew Henry's Concise Commentary on the Whole Bible",
        "Public domain",
    ),
    CorpusPackage(
        "sword-comm-tdavid",
        "2.1-1",
        "tdavid.conf",
        "C. H. Spurgeon's Treasury of David (1869-1885)",
        "Public domain (copyright expired)",
    ),
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained weights; recorded in training_report.json."""

    seed: int = 1234
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 5
    num_heads: int = 8
    num_kv_heads: int = 2
    seq_len: int = 512
    batch_size: int = 4
    max_steps: int = 1500
    warmup_steps: int = 50
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    val_every: int = 300  # quick check on the first 32k held-out tokens; the full one runs at the end
    chat_fraction: float = 0.1
    val_stride: int = 50
    max_weight_bytes: int = 10_000_000

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "seq_len",
            "batch_size",
            "max_steps",
            "val_every",
            "val_stride",
            "max_weight_bytes",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size must hold the 256 byte tokens and the specials, got {self.vocab_size}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}"
            )
        if not 0 <= self.warmup_steps < self.max_steps:
            raise ValueError(f"warmup_steps must be in [0, max_steps), got {self.warmup_steps}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"need lr > 0 and 0 <= min_lr_ratio <= 1, got {self.lr}, {self.min_lr_ratio}")
        if not 0 <= self.chat_fraction < 1:
            raise ValueError(f"chat_fraction must be in [0, 1), got {self.chat_fraction}")


# ----------------------------------------------------------------------------- corpus


def fetch_packages(work_dir: Path) -> list[dict[str, str]]:
    """Download and unpack the pinned corpus packages; return their provenance."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: the corpus is fetched from Debian packages")
    debs = work_dir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    provenance = []
    for pkg in CORPUS_PACKAGES:
        found = sorted(debs.glob(f"{pkg.name}_*.deb"))
        if not found:
            spec = f"{pkg.name}={pkg.version}"
            proc = subprocess.run(
                ["apt-get", "download", spec], cwd=debs, capture_output=True, text=True, check=False
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"apt-get download {spec} failed (run 'apt-get update' first?):\n{proc.stderr.strip()}"
                )
            found = sorted(debs.glob(f"{pkg.name}_*.deb"))
        if len(found) != 1:
            raise RuntimeError(f"expected one .deb for {pkg.name} in {debs}, found {found}")
        deb = found[0]
        root = work_dir / "unpacked" / pkg.name
        if not root.exists():
            partial = root.with_name(root.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(partial)], check=True)
            partial.rename(root)
        provenance.append(
            {
                "package": pkg.name,
                "version": pkg.version,
                "deb": deb.name,
                "sha256": hashlib.sha256(deb.read_bytes()).hexdigest(),
                "title": pkg.title,
                "licence": pkg.licence,
            }
        )
    return provenance


def read_sword_conf(path: Path) -> dict[str, str]:
    conf = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#") and key.strip() not in conf:
            conf[key.strip()] = value.strip()
    return conf


def _entry_format(entries: bytes, block_index: bytes, preferred: str) -> str:
    """The verse-index layout that fits the data: some packaged modules name the wrong driver
    in their .conf, so both layouts are tried and the one whose entries all lie inside their
    blocks wins (the .conf's choice first)."""
    n_blocks = len(block_index) // 12
    raw_sizes = [struct.unpack_from("<III", block_index, 12 * i)[2] for i in range(n_blocks)]
    for fmt in dict.fromkeys((preferred, "<IIH", "<III")):
        width = struct.calcsize(fmt)
        if len(entries) % width:
            continue
        fits = True
        for block_no, offset, size in struct.iter_unpack(fmt, entries):
            if size and (block_no >= n_blocks or offset + size > raw_sizes[block_no]):
                fits = False
                break
        if fits:
            return fmt
    raise ValueError("verse index matches neither the 10-byte nor the 12-byte SWORD layout")


def read_sword_module(root: Path, conf_name: str) -> Iterator[str]:
    """Yield the raw OSIS text of every entry of a zText / zCom (or *4) SWORD module, in order.

    A module has, per testament, a block index (``?zs``: offset, compressed and raw size, all
    uint32), a zlib-compressed block store (``?zz``) and an entry index (``?zv``: block number,
    offset in the raw block, size; the size is uint16 for zText/zCom and uint32 for the *4 drivers).
    """
    sword = root / "usr" / "share" / "sword"
    conf = read_sword_conf(sword / "mods.d" / conf_name)
    driver = conf.get("ModDrv", "")
    preferred = {"zText": "<IIH", "zCom": "<IIH", "zText4": "<III", "zCom4": "<III"}.get(driver)
    if preferred is None:
        raise ValueError(f"{conf_name}: unsupported SWORD driver {driver!r}")
    if conf.get("CompressType", "ZIP") != "ZIP":
        raise ValueError(f"{conf_name}: unsupported compression {conf.get('CompressType')!r}")
    letter = {"BOOK": "b", "CHAPTER": "c", "VERSE": "v"}[conf.get("BlockType", "CHAPTER")]
    data_dir = sword / conf["DataPath"].lstrip("./")
    for testament in ("ot", "nt"):
        block_index = (data_dir / f"{testament}.{letter}zs").read_bytes()
        store = (data_dir / f"{testament}.{letter}zz").read_bytes()
        entries = (data_dir / f"{testament}.{letter}zv").read_bytes()
        if not block_index:
            continue
        blocks: dict[int, bytes] = {}
        seen: set[tuple[int, int]] = set()
        for block_no, offset, size in struct.iter_unpack(
            _entry_format(entries, block_index, preferred), entries
        ):
            # Commentaries link every verse of a passage to one shared entry: read it once.
            if size == 0 or (block_no, offset) in seen:
                continue
            seen.add((block_no, offset))
            if block_no not in blocks:
                start, csize, _ = struct.unpack_from("<III", block_index, block_no * 12)
                blocks[block_no] = zlib.decompress(store[start : start + csize])
            yield blocks[block_no][offset : offset + size].decode("utf-8", errors="replace")


_DROP_ELEMENTS = re.compile(r"<(note|title)\b[^>]*?(?<!/)>.*?</\1>", re.DOTALL)
_BREAKS = re.compile(
    r'<(?:div|p|lg|l|lb|br)\b[^>]*type="(?:x-p|paragraph)"[^>]*/?>|</?(?:p|lg|l|lb|br)\b[^>]*>'
)
_TAGS = re.compile(r"<[^>]*>")
_QUOTES = str.maketrans(
    {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u00a0": " ", "\u202f": " ", "\ufeff": ""}
)
_C1_CONTROLS = re.compile(r"[\x80-\x9f]")
_SPACES = re.compile(r"[ \t\r\f\v]+")
_VERSE_LABEL = re.compile(r"^Verses? [\d, -]+\.?\s+")  # "Verse 6." / "Verses 9-13" opening a comment


def osis_to_paragraphs(osis: str, min_words: int = 6) -> list[str]:
    """Plain-text paragraphs from OSIS markup: notes and headings dropped, quotes made ASCII."""
    text = _DROP_ELEMENTS.sub(" ", osis)
    text = _BREAKS.sub("\n", text)
    text = _C1_CONTROLS.sub("", html.unescape(_TAGS.sub("", text)).translate(_QUOTES))
    paragraphs = []
    for raw in text.split("\n"):
        para = _VERSE_LABEL.sub("", _SPACES.sub(" ", raw).strip())
        if len(para.split()) >= min_words:
            paragraphs.append(para)
    return paragraphs


def build_corpus(work_dir: Path) -> tuple[list[list[str]], list[dict[str, str]]]:
    """One list of paragraphs per source work, plus provenance."""
    provenance = fetch_packages(work_dir)
    works = []
    for pkg in CORPUS_PACKAGES:
        root = work_dir / "unpacked" / pkg.name
        # Entries are joined by spaces: a verse rarely ends a paragraph without a break marker.
        osis = " ".join(read_sword_module(root, pkg.module_conf))
        works.append(osis_to_paragraphs(osis))
    return works, provenance


def split_corpus(works: list[list[str]], val_stride: int) -> tuple[list[list[str]], list[list[str]]]:
    """Every val_stride-th paragraph of each work is held out (deterministic, spread evenly)."""
    train = [[p for i, p in enumerate(w) if i % val_stride != val_stride // 2] for w in works]
    val = [[p for i, p in enumerate(w) if i % val_stride == val_stride // 2] for w in works]
    return train, val


_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+")


def as_chat(paragraph: str) -> str | None:
    """A paragraph as a ChatML exchange: its first sentence asks, the rest answers."""
    parts = _SENTENCE_END.split(paragraph, maxsplit=1)
    if len(parts) != 2 or len(parts[1].split()) < 6:
        return None
    return f"{IM_START}user\n{parts[0]}{IM_END}\n{IM_START}assistant\n{parts[1]}{IM_END}\n"


def training_documents(works: list[list[str]], chat_fraction: float, seed: int) -> list[str]:
    """Paragraph runs become plain-text documents; a seeded fraction become chat exchanges so the
    model also learns to answer after the ChatML assistant header and to stop with <|im_end|>."""
    rng = random.Random(seed)
    docs: list[str] = []
    for work in works:
        run: list[str] = []
        for para in work:
            chat = as_chat(para) if rng.random() < chat_fraction else None
            if chat is not None:
                docs.append(chat)
            else:
                run.append(para)
                if len(run) == 8:
                    docs.append("\n\n".join(run))
                    run = []
        if run:
            docs.append("\n\n".join(run))
    return docs


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer, wrapped as a transformers fast tokenizer with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=None,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer, docs: list[str]):
    """All documents as one token stream, each followed by the end-of-text token."""
    import torch

    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    batch = 512
    for start in range(0, len(docs), batch):
        for enc in tokenizer(docs[start : start + batch], add_special_tokens=False)["input_ids"]:
            ids.extend(enc)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# ----------------------------------------------------------------------------- model and training


def build_model(cfg: TrainConfig, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        initializer_range=0.02,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    if 2 * n_params > cfg.max_weight_bytes:
        raise ValueError(
            f"model has {n_params} parameters = {2 * n_params} bytes in bfloat16, over the "
            f"{cfg.max_weight_bytes}-byte budget"
        )
    return model


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model, cfg: TrainConfig):
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def evaluate(model, stream, seq_len: int, batch_size: int, max_tokens: int | None = None) -> float:
    """Mean next-token cross-entropy over non-overlapping windows of the held-out stream."""
    import torch

    n_windows = (len(stream) - 1) // seq_len
    if max_tokens is not None:
        n_windows = min(n_windows, max(1, max_tokens // seq_len))
    if n_windows == 0:
        raise ValueError(f"validation stream of {len(stream)} tokens is shorter than one window")
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, n_windows, batch_size):
            idx = torch.arange(start, min(n_windows, start + batch_size)) * seq_len
            rows = torch.stack([stream[i : i + seq_len + 1] for i in idx.tolist()]).long()
            logits = model(input_ids=rows[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += rows[:, 1:].numel()
    model.train()
    return total / count


def train(model, train_stream, val_stream, cfg: TrainConfig, time_budget_s: float, log) -> dict:
    import torch

    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = make_optimizer(model, cfg)
    n_starts = len(train_stream) - cfg.seq_len - 1
    if n_starts <= 0:
        raise ValueError(f"training stream of {len(train_stream)} tokens is shorter than one window")
    offsets = torch.arange(cfg.seq_len + 1)
    model.train()
    t0 = time.monotonic()
    step, smoothed = 0, None
    history = []
    while step < cfg.max_steps:
        if time.monotonic() - t0 > time_budget_s:
            log(f"time budget of {time_budget_s:.0f}s reached at step {step}; stopping early")
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        starts = torch.randint(0, n_starts, (cfg.batch_size,), generator=generator)
        rows = train_stream[starts[:, None] + offsets].long()
        logits = model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        value = loss.item()
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        if step % 20 == 0 or step == 1:
            elapsed = time.monotonic() - t0
            tok_s = step * cfg.batch_size * cfg.seq_len / elapsed
            log(
                f"step {step}/{cfg.max_steps} loss {value:.3f} (avg {smoothed:.3f}) "
                f"lr {lr_at(step - 1, cfg):.2e} {tok_s:.0f} tok/s {elapsed:.0f}s"
            )
            history.append({"step": step, "loss": round(smoothed, 4), "elapsed_s": round(elapsed, 1)})
        if step % cfg.val_every == 0 and step < cfg.max_steps:
            val = evaluate(model, val_stream, cfg.seq_len, cfg.batch_size, max_tokens=32768)
            log(f"step {step} val loss (first 32k tokens) {val:.3f} ppl {math.exp(val):.1f}")
    return {
        "steps": step,
        "completed": step == cfg.max_steps,
        "train_tokens": step * cfg.batch_size * cfg.seq_len,
        "train_seconds": round(time.monotonic() - t0, 1),
        "loss_history": history,
    }


# ----------------------------------------------------------------------------- saving and samples

SHIPPED_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "training_report.json",
        "README.md",
    }
)


def save_folder(model, tokenizer, out: Path) -> None:
    """Write the standard Hugging Face folder: bf16 safetensors, tokenizer, generation config."""
    import torch
    from transformers import GenerationConfig

    if out.exists() and any(f.name not in SHIPPED_FILES for f in out.iterdir()):
        raise ValueError(f"refusing to write into {out}: it holds files this script did not write")
    out.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, im_end],
        pad_token_id=eos,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _make_tokenizer_config_portable(out / "tokenizer_config.json", model.config.max_position_embeddings)


def _make_tokenizer_config_portable(path: Path, max_length: int) -> None:
    """Spell tokenizer_config.json the way every transformers release reads it: the generic fast
    tokenizer class, a list of additional special tokens and a real maximum length."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config.pop("backend", None)
    extra = config.pop("extra_special_tokens", None)
    if extra is not None:
        config["additional_special_tokens"] = list(extra)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def complete(model, tokenizer, prompt: str, seed: int | None, max_new_tokens: int = 40) -> str:
    """Greedy continuation when seed is None, else one sampled with the shipped generation config."""
    import torch

    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        if seed is None:
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        else:
            torch.manual_seed(seed)
            out = model.generate(ids, max_new_tokens=max_new_tokens)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def write_model_card(out: Path, report: dict) -> None:
    lines = [
        "# pagoda demo model",
        "",
        "A small Llama-architecture model that pagoda ships and uses when no model is named.",
        "It writes English-looking text; it knows little and should not be trusted for facts.",
        "",
        "Trained by `scripts/train_demo_model.py` on these public-domain works (Debian packages):",
        "",
    ]
    lines += [f"- {c['title']} (`{c['package']}` {c['version']}): {c['licence']}" for c in report["corpus"]]
    lines += [
        "",
        f"Parameters: {report['model']['parameters']:,} ({report['model']['weight_bytes']:,} bytes in bfloat16).",
        f"Held-out perplexity: {report['eval']['val_perplexity_bf16']:.1f} "
        f"({report['eval']['val_tokens']:,} held-out tokens).",
        "The training text is in the public domain; the weights ship with pagoda under its licence.",
        "How it was trained and sample outputs: `docs/demo-model.md`.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, TrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("src/pagoda/assets/demo-model"))
    parser.add_argument("--work-dir", type=Path, default=None, help="keep downloads here (default: temp dir)")
    parser.add_argument(
        "--time-budget-min", type=float, default=50.0, help="stop training after this (minutes)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch and tokenizer threads")
    parser.add_argument("--log-file", type=Path, default=None)
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(field.default), default=field.default, dest=field.name)
    args = parser.parse_args(argv)
    if args.threads <= 0 or args.time_budget_min <= 0:
        parser.error("--threads and --time-budget-min must be positive")
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    return args, cfg


def reproduce_command(cfg: TrainConfig, threads: int) -> str:
    """The command line that retrains these weights (local paths left out)."""
    parts = ["python", "scripts/train_demo_model.py", "--threads", str(threads)]
    for field in dataclasses.fields(TrainConfig):
        value = getattr(cfg, field.name)
        if value != field.default:
            parts += ["--" + field.name.replace("_", "-"), str(value)]
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    # Set before tokenizers and torch start their thread pools.
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import tokenizers
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    log_file = args.log_file.open("a", encoding="utf-8") if args.log_file else None

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()

    started = time.monotonic()
    tmp = None
    if args.work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="pagoda-demo-")
        work_dir = Path(tmp.name)
    else:
        work_dir = args.work_dir
        work_dir.mkdir(parents=True, exist_ok=True)
    try:
        works, provenance = build_corpus(work_dir)
        train_works, val_works = split_corpus(works, cfg.val_stride)
        n_chars = sum(len(p) for w in works for p in w)
        log(f"corpus: {sum(map(len, works))} paragraphs, {n_chars:,} characters")

        t = time.monotonic()
        tokenizer = train_tokenizer([p for w in train_works for p in w], cfg.vocab_size)
        log(f"tokenizer: {len(tokenizer)} tokens in {time.monotonic() - t:.0f}s")
        train_docs = training_documents(train_works, cfg.chat_fraction, cfg.seed)
        val_docs = training_documents(val_works, 0.0, cfg.seed)
        train_stream = encode_stream(tokenizer, train_docs)
        val_stream = encode_stream(tokenizer, val_docs)
        log(f"tokens: train {len(train_stream):,}, held-out {len(val_stream):,}")

        torch.manual_seed(cfg.seed)
        model = build_model(cfg, tokenizer)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"model: {n_params:,} parameters ({2 * n_params:,} bytes in bfloat16)")
        run = train(model, train_stream, val_stream, cfg, args.time_budget_min * 60, log)

        t = time.monotonic()
        val_fp32 = evaluate(model, val_stream, cfg.seq_len, cfg.batch_size)
        log(
            f"held-out loss (fp32) {val_fp32:.4f} ppl {math.exp(val_fp32):.2f} in {time.monotonic() - t:.0f}s"
        )
        save_folder(model, tokenizer, args.output_dir)

        # Everything below reads the folder back, as a user of transformers would.
        shipped = AutoModelForCausalLM.from_pretrained(args.output_dir, dtype=torch.bfloat16)
        shipped_tok = AutoTokenizer.from_pretrained(args.output_dir)
        val_bf16 = evaluate(shipped, val_stream, cfg.seq_len, cfg.batch_size)
        log(f"held-out loss (shipped bf16) {val_bf16:.4f} ppl {math.exp(val_bf16):.2f}")
        samples = [
            {
                "prompt": p,
                "greedy": complete(shipped, shipped_tok, p, seed=None),
                "sampled": complete(shipped, shipped_tok, p, seed=cfg.seed),
            }
            for p in SAMPLE_PROMPTS
        ]
        for s in samples:
            log(f"sample: {s['prompt']!r} -> greedy {s['greedy']!r} / sampled {s['sampled']!r}")

        weights = args.output_dir / "model.safetensors"
        report = {
            "corpus": provenance,
            "corpus_characters": n_chars,
            "config": dataclasses.asdict(cfg),
            "model": {
                "parameters": n_params,
                "weight_bytes": 2 * n_params,
                "file_bytes": weights.stat().st_size,
            },
            "tokens": {"train_stream": len(train_stream), "val_stream": len(val_stream)},
            "training": run,
            "eval": {
                "val_tokens": len(val_stream),
                "val_loss_fp32": round(val_fp32, 4),
                "val_perplexity_fp32": round(math.exp(val_fp32), 2),
                "val_loss_bf16": round(val_bf16, 4),
                "val_perplexity_bf16": round(math.exp(val_bf16), 2),
            },
            "samples": samples,
            "sha256": {
                name: hashlib.sha256((args.output_dir / name).read_bytes()).hexdigest()
                for name in ("model.safetensors", "tokenizer.json")
            },
            "wall_seconds": round(time.monotonic() - started, 1),
            "threads": args.threads,
            "seed": cfg.seed,
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
            },
            "command": reproduce_command(cfg, args.threads),
        }
        (args.output_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
        write_model_card(args.output_dir, report)
        log(f"wrote {args.output_dir} in {time.monotonic() - started:.0f}s")
    finally:
        if tmp is not None:
            tmp.cleanup()
        if log_file:
            log_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
