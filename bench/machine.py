"""One line naming the machine a benchmark ran on, printed first by every `make bench` script: a
figure means little without the CPU it was measured on (its model, core count and the vector
extensions the kernels can use).

It reads /proc/cpuinfo itself rather than through prefixkv.model.kernels.build: step_times.py also
runs under the peers' Pythons (peers/vllm), where prefixkv's own dependencies are not installed."""

from __future__ import annotations

import os
import platform

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
    return text


if __name__ == "__main__":
    print(describe())
