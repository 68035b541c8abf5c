"""One line naming the machine a benchmark ran on, printed first by every `make bench` script: a
figure means little without the CPU it was measured on (its model, core count and the vector
extensions the kernels can use).

It reads /proc/cpuinfo itself rather than through prefixkv.model.kernels.build: step_times.py also
runs under the peers' Pythons (peers/vllm), where prefixkv's own dependencies are not installed."""

from __future__ import annotations

import os
import platform
import sys

# `--emulate avx2` of the benchmarks: an AVX2-only CPU (AMD Zen 3) on a CPU with AVX-512 - our kernels
# built for x86-64-v3 and PyTorch's oneDNN, MKL and ATen kernels capped at AVX2. The same variables
# as prefixkv/model/kernels/build.py's EMULATIONS (this file runs under the peers' Pythons too, where
# prefixkv cannot be imported; tests/model/kernels/test_emulation.py checks they agree).
EMULATE_ENV = "PREFIXKV_EMULATE_CPU"
EMULATIONS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")  # x86 flags the kernels use
ARM_FLAGS = ("asimd", "sve", "bf16")


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def describe() -> str:
    """e.g. 'CPU: AMD EPYC (family 25 model 17), 2 CPUs, x86_64; avx2 fma avx512f avx512_bf16;
    no amx_bf16 amx_tile'."""
    info = cpuinfo()
    name = info.get("model name") or info.get("Hardware") or platform.processor() or "unknown CPU"
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']} model {info['model']})"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    known = FLAGS if platform.machine() in ("x86_64", "AMD64") else ARM_FLAGS
    has = [f for f in known if f in flags]
    lacks = [f for f in known if f not in flags]
    text = f"CPU: {name}, {cpus} CPUs, {platform.machine()}"
    if has:
        text += "; " + " ".join(has)
    if lacks:
        text += "; no " + " ".join(lacks)
    line = emulation_line()
    return text + ("\n" + line if line else "")


def emulation_env(name: str | None) -> dict[str, str]:
    """The environment a benchmark's processes run with to emulate `name` (None: this CPU as it is)."""
    if name is None:
        return {}
    return {EMULATE_ENV: name, **EMULATIONS[name]}


def emulate(name: str | None) -> None:
    """Run this script again under `name`'s emulation where it is not in force yet (the caps must be
    set before torch is imported: oneDNN and ATen read them once)."""
    env = emulation_env(name)
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})


def emulation_line() -> str:
    """What this process emulates (the variables in force), or '' for the CPU as it is."""
    name = os.environ.get(EMULATE_ENV)
    if not name:
        return ""
    caps = " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in EMULATIONS.get(name, {}))
    return f"EMULATED {name}-only CPU on the CPU above ({EMULATE_ENV}={name} {caps}): not a real {name} CPU's speed"


if __name__ == "__main__":
    print(describe())
