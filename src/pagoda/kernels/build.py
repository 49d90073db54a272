"""Builds pagoda's CPU kernels (`csrc/`) once per instruction-set variant and picks the one this
process uses.

Variants, fastest first (every one needs Linux on x86-64):

- `avx512_bf16`: AVX-512 F/BW/VL/DQ plus AVX512-BF16 (the native fp32 -> bf16 rounding);
- `avx512`: AVX-512 F/BW/VL/DQ, rounding to bf16 with integer ops;
- `avx2`: AVX2 + FMA, the same kernels on two 256-bit halves.

All come from one source over the vector layer in `csrc/vec.h`; each is its own extension whose
ops live in the torch library `pagoda_<variant>`, so several load side by side (the tests run
every kernel on every variant the CPU can execute) while the engine uses exactly one: the
fastest the CPU supports, or the one `PAGODA_CPU_ISA=avx2|avx512|avx512_bf16` forces
(`PAGODA_CPU_ISA=none` turns the kernels off). A forced variant the CPU cannot run, or an unknown
value, is a clear error; anything else that stops the kernels (another platform, an old CPU, no
compiler, a failed compile) leaves pagoda on plain PyTorch with one WARNING naming the reason.

Compiling is lazy (the first `status()` / `available()` call in a process) and cached in torch's
extension directory under a name that carries the variant and a hash of the sources, flags and
torch version, so a shared build cache never hands out another variant's or a stale binary:
only the first run on a machine pays the compile.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ISA_ENV = "PAGODA_CPU_ISA"
DISABLED = "none"
_CSRC = Path(__file__).parent / "csrc"
_COMMON_CFLAGS = ("-O3", "-fopenmp")


@dataclass(frozen=True)
class Variant:
    name: str
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the variant's code needs
    cflags: tuple[str, ...]
    summary: str

    @property
    def namespace(self) -> str:
        """The torch library its ops are registered in (`torch.ops.<namespace>.<op>`)."""
        return f"pagoda_{self.name}"


_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma")
# Fastest first: the engine takes the first one the CPU supports.
VARIANTS: tuple[Variant, ...] = (
    Variant(
        "avx512_bf16",
        ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
        ("-DPAGODA_ISA_AVX512_BF16", *_AVX512, "-mavx512bf16"),
        "AVX-512 with native bf16 conversion",
    ),
    Variant(
        "avx512",
        ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
        ("-DPAGODA_ISA_AVX512", *_AVX512),
        "AVX-512 F/BW/VL/DQ, bf16 rounding in integer ops",
    ),
    Variant("avx2", ("avx2", "fma"), ("-DPAGODA_ISA_AVX2", "-mavx2", "-mfma"), "AVX2 + FMA"),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)
_BY_NAME = {v.name: v for v in VARIANTS}

# Every csrc/*.cpp goes into every variant; `register_sources` adds files kept elsewhere.
_extra_sources: list[Path] = []


class BuildError(RuntimeError):
    """A variant could not be compiled or loaded; `kind` is "no-compiler" or "compile-error"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class KernelStatus:
    """Which kernel variant this process uses, or exactly why none.

    `kind`: "ok", "disabled" (PAGODA_CPU_ISA=none), "invalid-setting" (an unknown or unsupported
    PAGODA_CPU_ISA), "unsupported-platform", "unsupported-cpu", "no-compiler", "compile-error".
    """

    kind: str
    variant: str | None = None
    reason: str | None = None  # why no variant is in use
    forced: bool = False  # chosen by PAGODA_CPU_ISA
    supported: tuple[str, ...] = ()  # variants this CPU can execute, fastest first
    seconds: float | None = None  # to compile (or load from the cache) the variant in use

    def describe(self) -> str:
        if self.variant is None:
            return f"none ({self.reason})"
        how = f"forced by {ISA_ENV}" if self.forced else "the fastest this CPU supports"
        return f"{self.variant} ({_BY_NAME[self.variant].summary}; {how})"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def platform_reason() -> str | None:
    """Why no variant can run on this OS / architecture, or None."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in {"x86_64", "amd64"}:
        return f"the kernels need Linux on x86-64, this is {sys.platform} on {platform.machine()}"
    return None


def supported_variants(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The variants this machine can execute (fastest first); empty off Linux x86-64."""
    if platform_reason() is not None:
        return ()
    flags = cpu_flags() if flags is None else flags
    return tuple(v.name for v in VARIANTS if all(f in flags for f in v.cpu_flags))


def register_sources(*paths: str | os.PathLike) -> None:
    """Compile these .cpp files into every variant too (files in csrc/ need no registration).
    They include "vec.h" for the vector layer and register ops with `PAGODA_LIBRARY_FRAGMENT`.
    Must run before the first variant is built."""
    if _loaded:
        raise RuntimeError("register_sources must run before any kernel variant is built")
    for path in map(Path, paths):
        if path.suffix != ".cpp" or not path.is_file():
            raise ValueError(f"not a .cpp file: {path}")
        if path not in _extra_sources:
            _extra_sources.append(path)


def sources() -> list[Path]:
    return sorted(_CSRC.glob("*.cpp")) + list(_extra_sources)


def extension_name(variant: str) -> str:
    """`pagoda_cpu_<variant>_<hash>`: the hash covers every source and header, the flags and
    torch's version, so a build cache shared by checkouts or torch installs never mixes them."""
    v = _BY_NAME[variant]
    digest = hashlib.sha256()
    for part in (torch.__version__, *v.cflags, *_COMMON_CFLAGS):
        digest.update(part.encode() + b"\0")
    headers = {h for src in sources() for h in src.parent.glob("*.h")}
    for path in [*sources(), *sorted(headers)]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"pagoda_cpu_{variant}_{digest.hexdigest()[:12]}"


def _compiler_missing() -> str | None:
    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found; set CXX or install g++)"
    if not is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None


_loaded: dict[str, object] = {}  # variant -> its torch.ops namespace, once built and loaded
_load_lock = threading.Lock()


def load_variant(variant: str):
    """Build (or take from the cache) and load one variant; returns its `torch.ops` namespace.
    Raises ValueError for a variant this CPU cannot execute, BuildError if compiling fails."""
    if variant not in _BY_NAME:
        raise ValueError(f"unknown kernel variant {variant!r}; known: {', '.join(VARIANT_NAMES)}")
    reason = platform_reason()
    if reason is None and variant not in supported_variants():
        missing = [f for f in _BY_NAME[variant].cpu_flags if f not in cpu_flags()]
        reason = f"this CPU lacks {', '.join(missing)}"
    if reason is not None:
        raise ValueError(f"kernel variant {variant} cannot run here: {reason}")
    with _load_lock:
        if variant in _loaded:
            return _loaded[variant]
        missing_tool = _compiler_missing()
        if missing_tool is not None:
            raise BuildError("no-compiler", missing_tool)
        from torch.utils.cpp_extension import load

        v = _BY_NAME[variant]
        try:
            load(
                name=extension_name(variant),
                sources=[str(p) for p in sources()],
                extra_cflags=[*_COMMON_CFLAGS, *v.cflags],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:
            raise BuildError("compile-error", f"compiling the {variant} kernels failed: {exc}") from exc
        _loaded[variant] = getattr(torch.ops, v.namespace)
        return _loaded[variant]


# ---- the variant this process uses --------------------------------------------------------------

_status: KernelStatus | None = None
_active = None  # torch.ops namespace of the variant in use (or of `use_variant`'s)
_status_lock = threading.Lock()


def _select() -> tuple[KernelStatus, object]:
    supported = supported_variants()
    requested = os.environ.get(ISA_ENV, "").strip().lower()
    if requested == DISABLED:
        return KernelStatus("disabled", reason=f"disabled by {ISA_ENV}={DISABLED}", supported=supported), None
    if requested and requested not in _BY_NAME:
        choices = ", ".join((*VARIANT_NAMES, DISABLED))
        return KernelStatus(
            "invalid-setting", reason=f"{ISA_ENV}={requested!r} is not one of {choices}", supported=supported
        ), None
    if requested and requested not in supported:
        why = platform_reason() or (
            "this CPU lacks " + ", ".join(f for f in _BY_NAME[requested].cpu_flags if f not in cpu_flags())
        )
        can = ", ".join(supported) or "none"
        return KernelStatus(
            "invalid-setting",
            reason=f"{ISA_ENV}={requested} cannot run here: {why} (this machine can run: {can})",
            supported=supported,
        ), None
    if not requested:
        if platform_reason() is not None:
            return KernelStatus("unsupported-platform", reason=platform_reason()), None
        if not supported:
            return KernelStatus("unsupported-cpu", reason="the CPU lacks AVX2 + FMA"), None
    variant = requested or supported[0]
    start = time.perf_counter()
    try:
        namespace = load_variant(variant)
    except BuildError as exc:
        return KernelStatus(exc.kind, reason=str(exc), forced=bool(requested), supported=supported), None
    seconds = time.perf_counter() - start
    return KernelStatus("ok", variant, None, bool(requested), supported, seconds), namespace


def status() -> KernelStatus:
    """The variant in use (chosen, built and loaded on the first call in a process, then logged:
    INFO for a variant or PAGODA_CPU_ISA=none, WARNING for any other fallback to PyTorch)."""
    global _status, _active
    if _status is None:
        with _status_lock:
            if _status is None:
                st, namespace = _select()
                if st.variant is not None:
                    logger.info("CPU kernels: %s, ready in %.1f s", st.describe(), st.seconds)
                elif st.kind == "disabled":
                    logger.info("CPU kernels %s: using the plain PyTorch path", st.reason)
                elif st.kind != "invalid-setting":  # that one raises where it is used
                    logger.warning(
                        "CPU kernels unavailable, using the plain PyTorch path: %.2000s", st.reason
                    )
                _active = namespace
                _status = st
    return _status


def available() -> bool:
    """True if kernels run in this process (builds them on the first call). Raises ValueError
    when PAGODA_CPU_ISA names an unknown variant or one this CPU cannot run."""
    st = status()
    if st.kind == "invalid-setting":
        raise ValueError(st.reason)
    return _active is not None


def ops():
    """`torch.ops.pagoda_<variant>` of the variant in use; RuntimeError if there is none."""
    namespace = _active
    if namespace is None:
        if not available():
            raise RuntimeError(f"CPU kernels unavailable: {status().reason}")
        namespace = _active
    return namespace


def active():
    """The `torch.ops` namespace of the variant in use (after choosing it), or None on plain
    PyTorch: a cheap key for callers that bind ops once per variant."""
    status()
    return _active


_op_cache: dict[tuple[object, str], object] = {}  # (loaded namespace, op name) -> OpOverload


def op(name: str):
    """Op `name` of the variant in use, as its OpOverload (looked up once per variant: the decode
    path calls a few hundred ops per step). RuntimeError if no variant is in use."""
    key = (_active or ops(), name)  # loaded namespaces live as long as the process (`_loaded`)
    overload = _op_cache.get(key)
    if overload is None:
        overload = _op_cache[key] = getattr(key[0], name).default
    return overload


@contextlib.contextmanager
def use_variant(variant: str | None) -> Iterator[None]:
    """Run every kernel call inside the block on `variant` (built if needed), or with None on
    plain PyTorch: for tests, which compare variants in one process. Not thread-safe; the
    engine never calls it."""
    global _active
    status()  # resolve the process's own choice first, so that it cannot override this one
    namespace = None if variant is None else load_variant(variant)
    previous, _active = _active, namespace
    try:
        yield
    finally:
        _active = previous
