"""Draft models for `pagoda bench offline --workload spec --draft-layers N`, written once next to
the target folder: a truncated copy of the target (its embedding, first N layers, final norm and
LM head: the same weights, so its guesses follow the target's), or a random model of the target's
family and shape with N layers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def draft_model(target: str, layers: int, weights: str, seed: int = 1) -> str:
    """The folder of the draft (built on first use)."""
    if weights not in ("truncated", "random"):
        raise ValueError(f"draft weights must be 'truncated' or 'random', got {weights!r}")
    src = Path(target)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(
            f"--draft-layers must be in 1..{config['num_hidden_layers']} (the target's layers), got {layers}"
        )
    out = src.parent / f"{src.name}-draft{layers}-{weights}"
    if (out / "config.json").is_file():
        return str(out)
    print(f"building a {layers}-layer {weights} draft of {target} in {out} (once)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if weights == "truncated":
        _truncate(src, tmp, config, layers)
    else:
        _random(src, tmp, layers, seed)
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, tmp / name)
    os.replace(tmp, out)
    return str(out)


def _truncate(src: Path, out: Path, config: dict, layers: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                parts = name.split(".")
                if "layers" in parts:
                    index = int(parts[parts.index("layers") + 1])
                    if index >= layers:
                        continue
                tensors[name] = f.get_tensor(name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {**config, "num_hidden_layers": layers}
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _random(src: Path, out: Path, layers: int, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(src))
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype or torch.float32)
    model.save_pretrained(str(out))
