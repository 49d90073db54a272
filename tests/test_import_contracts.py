"""Imports point down only: the import-linter contracts in pyproject.toml hold, and they catch a violation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"

pytestmark = pytest.mark.timeout(180)


def lint_imports(src: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter on the `pagoda` package found in `src`, with the project's contracts."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(sys.argv[1], no_cache=True))"
    return subprocess.run(
        [sys.executable, "-c", code, str(CONFIG)], capture_output=True, text=True, env=env, timeout=150
    )


def test_the_import_contracts_hold() -> None:
    result = lint_imports(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


# New modules in a copy of the package, each breaking one contract.
VIOLATIONS = {
    "cache/_upward.py": "import pagoda.engine.core\n",  # a lower layer importing a higher one
    "attention/_sideways.py": "import pagoda.sample.sampler\n",  # two independent siblings
    "sample/_grammar.py": "import xgrammar\n",  # the grammar library outside structured/
    "scheduler/_tokenizer.py": "import transformers\n",  # the scheduler loading a model library
}


def test_a_violated_contract_fails(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(
        ROOT / "src" / "pagoda",
        src / "pagoda",
        ignore=shutil.ignore_patterns("__pycache__", "assets", "csrc", "*.so"),
    )
    (src / "pagoda" / "assets").mkdir()
    (src / "pagoda" / "assets" / "__init__.py").write_text("")
    for path, text in VIOLATIONS.items():
        (src / "pagoda" / path).write_text(text)
    with open(src / "pagoda" / "config.py", "a") as f:
        f.write("\nimport torch  # noqa\n")  # the declared configuration must stay light

    result = lint_imports(src)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "pagoda.cache is not allowed to import pagoda.engine" in out
    assert "pagoda.attention is not allowed to import pagoda.sample" in out
    assert "pagoda.sample is not allowed to import xgrammar" in out
    assert "pagoda.scheduler is not allowed to import transformers" in out
    assert "pagoda.config is not allowed to import torch" in out
    assert "0 kept, 4 broken" in out


def test_the_scheduler_and_the_cache_load_no_model_library() -> None:
    """At run time too (the contracts check the static imports)."""
    code = (
        "import sys, pagoda.cache, pagoda.scheduler, pagoda.step; "
        "print([m for m in ('xgrammar', 'transformers', 'pagoda.structured') if m in sys.modules])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
