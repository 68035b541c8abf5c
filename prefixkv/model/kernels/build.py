"""Builds the native CPU kernels' library with the system C++ compiler, once per machine.

The library lands in a cache folder (``$PREFIXKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/prefixkv`` or
``~/.cache/prefixkv``), keyed by the source, the flags, the compiler, torch's version and the CPU's
flags; concurrent processes write it atomically.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent.parent / "csrc"
SOURCES = [
    _CSRC / name
    for name in (
        "decode_attention.cpp",
        "prefill_attention.cpp",
        "add_rms_norm.cpp",
        "silu_and_mul.cpp",
        "rotary.cpp",
        "small_linear.cpp",
        "blocked_linear.cpp",
        "decode_layers.cpp",
        "write_kv.cpp",
    )
]
# part of the cache key, not compiled alone
HEADERS = [_CSRC / name for name in ("bf16.h", "exp.h", "kernels.h", "linear_step.h", "target.h", "vec16.h")]
BASE_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# What the kernels are compiled for: "native" (every instruction this CPU has), or an x86-64 level
# ("x86-64-v3": AVX2 + FMA, the CPU of most cloud VMs; "x86-64-v4": AVX-512), so that a machine with
# AVX-512 builds and tests the AVX2 variant too. PREFIXKV_CPU_ARCH picks the one a process loads.
ARCH_ENV = "PREFIXKV_CPU_ARCH"
ARCHES = ("native", "x86-64-v3", "x86-64-v4")
# the CPU flags each x86-64 level needs (a build for a level this CPU lacks would die of SIGILL)
_ARCH_CPU_FLAGS = {
    "x86-64-v3": ("avx2", "fma", "bmi2", "f16c", "movbe"),
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}


# A benchmark- and test-only switch: PREFIXKV_EMULATE_CPU=avx2 makes a CPU with AVX-512 act as an
# AVX2-only one (an AMD Zen 3, the CPU of most cloud VMs) for this process. The flags read from
# /proc/cpuinfo lose AVX-512, AMX and the AVX-VNNI family (so bfloat16 counts as without arithmetic,
# and the build and kernel-choice caches are keyed apart from the native ones), "native" builds for
# x86-64-v3, and the model name says "emulated". PyTorch must be capped alike before it is imported
# (the variables below; bench/machine.py's `emulation_env` sets them for a benchmark's processes):
# on its own, the switch would time our AVX2 kernels against oneDNN's AVX-512 ones. It emulates the
# instructions, not a Zen 3's speed (caches, clocks and memory stay this machine's).
EMULATE_ENV = "PREFIXKV_EMULATE_CPU"
EMULATIONS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
_EMULATED_ARCH = {"avx2": "x86-64-v3"}
# flags an AVX2-only CPU lacks (prefixes of /proc/cpuinfo's names)
_DROPPED_FLAGS = {"avx2": ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert")}


def emulated() -> str | None:
    """The CPU this process emulates ($PREFIXKV_EMULATE_CPU, e.g. "avx2"), or None; ValueError where
    the name is unknown or PyTorch was not capped alike (see EMULATIONS)."""
    chosen = os.environ.get(EMULATE_ENV, "")
    if not chosen:
        return None
    if chosen not in EMULATIONS:
        raise ValueError(f"{EMULATE_ENV}={chosen!r}: expected one of {', '.join(EMULATIONS)}")
    missing = [f"{k}={v}" for k, v in EMULATIONS[chosen].items() if os.environ.get(k) != v]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.lower() != chosen:
        missing.append(f"(ATen runs {capability}: set before torch is imported)")
    if missing:
        raise ValueError(f"{EMULATE_ENV}={chosen} needs PyTorch capped alike: {' '.join(missing)}")
    return chosen


def arch() -> str:
    """The target this process builds the kernels for ($PREFIXKV_CPU_ARCH, else "native"; under
    $PREFIXKV_EMULATE_CPU, "native" is the emulated CPU's level)."""
    chosen = os.environ.get(ARCH_ENV, "native") or "native"
    if chosen not in ARCHES:
        raise ValueError(f"{ARCH_ENV}={chosen!r}: expected one of {', '.join(ARCHES)}")
    emulation = emulated()
    if emulation is not None and chosen == "native":
        return _EMULATED_ARCH[emulation]
    return chosen


def arch_runs_here(target: str) -> bool:
    """Whether this CPU executes code built for `target` (native always does)."""
    if target == "native":
        return True
    have = set(cpu_flags().split())
    return all(flag in have for flag in _ARCH_CPU_FLAGS[target])


def flags_for(target: str) -> list[str]:
    """The compiler flags of a build for `target` (see ARCHES)."""
    return [*BASE_FLAGS, f"-march={target}"]


FLAGS = flags_for("native")


def cache_dir() -> Path:
    if os.environ.get("PREFIXKV_CACHE_DIR"):
        return Path(os.environ["PREFIXKV_CACHE_DIR"]) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefixkv" / "kernels"


CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_line(prefix: str) -> str:
    """The first line of /proc/cpuinfo starting with `prefix` (empty where there is none)."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith(prefix):
                return line
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    """The flags line of /proc/cpuinfo (an ARM CPU's "Features" line; empty where there is none),
    less what an emulated CPU lacks (emulated())."""
    line = _cpuinfo_line("flags") or _cpuinfo_line("Features")
    emulation = emulated()
    if emulation is None or not line:
        return line
    name, _, flags = line.partition(":")
    kept = [f for f in flags.split() if not f.startswith(_DROPPED_FLAGS[emulation])]
    return f"{name}: {' '.join(kept)}"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (empty where there is none), naming an emulation."""
    name = _cpuinfo_line("model name").partition(":")[2].strip()
    if not name:  # an ARM CPU's names it by implementer and part numbers (0x41 0xd40: Arm Neoverse V1)
        implementer = _cpuinfo_line("CPU implementer").partition(":")[2].strip()
        part = _cpuinfo_line("CPU part").partition(":")[2].strip()
        name = f"CPU implementer {implementer}, part {part}" if implementer or part else ""
    emulation = emulated()
    return name if emulation is None else f"{name} (emulating {emulation} only: {EMULATE_ENV})"


def build(
    compiler: str,
    sources: list[Path] = SOURCES,
    headers: list[Path] = HEADERS,
    flags: list[str] = FLAGS,
    link: tuple[str, ...] = (),
    name: str = "prefixkv-cpu",
) -> Path:
    """Compile `sources` into the cache folder once per machine (see the module's docstring) and
    return the library's path; `link` comes after the sources (libraries to link against)."""
    source = b"\0".join(path.read_bytes() for path in sources + headers)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        b"\0".join(
            x.encode() if isinstance(x, str) else x
            for x in (source, " ".join([*flags, *link]), version, torch.__version__, cpu_flags())
        )
    ).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"{name}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    logger.info("building native CPU kernels %s (once per machine, ~10-60 s) ...", target.name)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix=".objects-", dir=folder) as objects:
            _compile_and_link(compiler, sources, flags, link, tmp, Path(objects))
        os.replace(tmp, target)  # atomic: a concurrent process sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compile_and_link(
    compiler: str, sources: list[Path], flags: list[str], link: tuple[str, ...], out: str, objects: Path
) -> None:
    """Each source into an object file, as many at once as this process has cores, then one link.
    One compiler call for every source compiles them one after another: the kernels took 11.5-11.9 s
    that way on the 2-vCPU Zen 4, 5.9 s side by side (the largest source alone, prefill attention,
    is over a third of the whole)."""
    if len(sources) == 1:
        _run([compiler, *flags, str(sources[0]), "-o", out, *link], compiler)
        return
    compile_flags = [f for f in flags if f != "-shared"]
    paths = [objects / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]

    def compile_one(i: int) -> None:
        _run([compiler, *compile_flags, "-c", str(sources[i]), "-o", str(paths[i])], compiler)

    # the largest (the longest to compile) first: no core is left alone with a long one started last
    order = sorted(range(len(sources)), key=lambda i: -sources[i].stat().st_size)
    with ThreadPoolExecutor(min(len(sources), _cores())) as pool:
        list(pool.map(compile_one, order))  # list(): each one's error raised here
    _run([compiler, *flags, *map(str, paths), "-o", out, *link], compiler)


def _run(command: list[str], compiler: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        said = done.stderr.strip()[-500:]
        raise RuntimeError(f"{compiler} failed with exit status {done.returncode}" + (f": {said}" if said else ""))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compiler() -> str:
    """The C++ compiler the kernels are built with ($CXX, else c++ or g++); RuntimeError if none."""
    found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if found is None:
        raise RuntimeError("no C++ compiler (c++ / g++ / $CXX) found")
    return found
