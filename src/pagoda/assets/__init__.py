"""Files shipped inside the pagoda package, such as the built-in demo model."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEMO_MODEL_DIR = "demo-model"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_path() -> str:
    """Path of the demo model folder that pagoda uses when no model is named.

    The folder is a standard Hugging Face checkpoint (Llama architecture, bfloat16 safetensors,
    byte-level BPE tokenizer with a ChatML chat template) trained by
    ``scripts/train_demo_model.py``; see ``docs/demo-model.md``.

    Raises:
        FileNotFoundError: the package was installed without its data files.
    """
    folder = resources.files(__name__) / DEMO_MODEL_DIR
    # Package data installed from a wheel or sdist sits on disk; a zipped install is not supported.
    path = Path(str(folder))
    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the built-in demo model is incomplete at {path} (missing {', '.join(missing)}); "
            "reinstall pagoda with its package data, or pass a model folder explicitly"
        )
    return str(path)


__all__ = ["DEMO_MODEL_DIR", "default_model_path"]
