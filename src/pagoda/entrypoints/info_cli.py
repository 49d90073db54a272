"""`pagoda info`: what pagoda runs on here (versions, CPU, kernel variant or why none, threads),
and with `--bandwidth` a quick measurement of memory read bandwidth. Paste it into bug reports."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

# CPU flags that decide which kernels can run and how fast.
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
_ENV_VARS = ("PAGODA_CPU_ISA", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "CXX")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "info",
        help="versions, CPU, CPU kernel variant and threads (for bug reports)",
        description=__doc__,
    )
    p.add_argument(
        "--bandwidth", action="store_true", help="also measure memory read bandwidth (about a second)"
    )
    p.add_argument(
        "--bandwidth-mb",
        type=int,
        default=None,
        help="buffer size of the bandwidth probe in MiB (default 512)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "model", nargs="?", default=None, help="also say how this model's weights are stored (a .gguf file)"
    )
    p.set_defaults(func=run)


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or None


def _compiler() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else None


def collect(bandwidth: bool = False, bandwidth_mb: int | None = None) -> dict[str, Any]:
    """The report as a dict; resolves (and if needed compiles) the kernel variant."""
    import torch

    import pagoda
    from pagoda.kernels import build

    flags = build.cpu_flags()
    st = build.status()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    info: dict[str, Any] = {
        "pagoda": pagoda.__version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "os": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS} if flags else None,
        "kernels": {
            "variant": st.variant,
            "status": st.kind,
            "reason": st.reason,
            "forced": st.forced,
            "description": st.describe(),
            "supported_variants": list(st.supported),
            "ready_seconds": None if st.seconds is None else round(st.seconds, 2),
        },
        "compiler": _compiler(),
        "threads": {"torch": torch.get_num_threads(), "cpus": os.cpu_count(), "cpus_usable": affinity},
        "env": {name: os.environ.get(name) for name in _ENV_VARS},
    }
    if st.variant is not None:
        from pagoda.kernels import cpu_quant

        info["kernels"]["quantized_dot"] = cpu_quant.dot_kind()
    if bandwidth:
        from pagoda.kernels.bandwidth import DEFAULT_BUFFER_MB, measure_read_bandwidth

        info["bandwidth"] = measure_read_bandwidth(bandwidth_mb or DEFAULT_BUFFER_MB).to_dict()
    return info


def format_text(info: dict[str, Any]) -> str:
    k, t = info["kernels"], info["threads"]
    flags = info["cpu_flags"]
    lines = [
        f"pagoda          {info['pagoda']}",
        f"python          {info['python']}",
        f"torch           {info['torch']} (CPU capability {info['torch_cpu_capability']})",
        f"os              {info['os']}",
        f"cpu             {info['cpu_model'] or 'unknown'} ({info['machine']})",
        "cpu flags       "
        + (
            " ".join(f for f, present in flags.items() if present)
            + "  (absent: "
            + (" ".join(f for f, present in flags.items() if not present) or "none")
            + ")"
            if flags is not None
            else "unknown (no /proc/cpuinfo)"
        ),
        f"kernel variant  {k['description']}",
        f"quantized dot   {k.get('quantized_dot') or 'none (dequantize + F.linear)'}",
        f"variants here   {', '.join(k['supported_variants']) or 'none'}",
        f"compiler        {info['compiler'] or 'none found'}",
        f"threads         torch {t['torch']}, {t['cpus']} CPUs ({t['cpus_usable']} usable by this process)",
        "env             "
        + (" ".join(f"{n}={v}" for n, v in info["env"].items() if v is not None) or "(none set)"),
    ]
    if "bandwidth" in info:
        from pagoda.kernels.bandwidth import Bandwidth

        lines.append(f"memory read     {Bandwidth(**info['bandwidth']).describe()}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.bandwidth_mb is not None and args.bandwidth_mb < 1:
        print("pagoda info: --bandwidth-mb must be >= 1", file=sys.stderr)
        return 2
    info = collect(args.bandwidth or args.bandwidth_mb is not None, args.bandwidth_mb)
    text = format_text(info)
    if args.model is not None:
        try:
            info["model_format"] = _model_format(args.model)
        except ValueError as exc:
            print(f"pagoda info: error: {exc}", file=sys.stderr)
            return 2
        text += f"\nmodel weights   {info['model_format']}"
    print(json.dumps(info, indent=2) if args.json else text)
    return 0


def _model_format(model: str) -> str:
    """How a model's weights are stored, from its files alone (nothing is loaded)."""
    from pagoda.json_input import read_json_object
    from pagoda.quant.gguf_file import GGUFFile, is_gguf_path

    if is_gguf_path(model):
        return GGUFFile(model).describe()
    config = Path(model) / "config.json"
    if not config.is_file():
        raise ValueError(f"{model!r} is neither a .gguf file nor a model folder with config.json")
    hf = read_json_object(config)
    return f"safetensors {hf.get('torch_dtype') or hf.get('dtype') or 'float32'}"
