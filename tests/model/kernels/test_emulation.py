"""PREFIXKV_EMULATE_CPU=avx2, the benchmarks' AVX2-only machine on a CPU with AVX-512: what prefixkv
reads of the CPU loses AVX-512 and bfloat16 arithmetic, "native" builds for x86-64-v3, and the switch
refuses to run unless PyTorch's own kernels are capped alike (bench/machine.py sets both)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from bench import machine
from prefixkv.model.kernels import build

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not build.arch_runs_here("x86-64-v3"), reason="no AVX2 CPU to emulate it on"
)


def test_the_benchmarks_set_the_variables_prefixkv_checks():
    assert machine.EMULATE_ENV == build.EMULATE_ENV
    assert machine.EMULATIONS == build.EMULATIONS
    env = machine.emulation_env("avx2")
    assert env[build.EMULATE_ENV] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert machine.emulation_env(None) == {}


def test_the_switch_alone_is_refused(monkeypatch):
    """Our AVX2 kernels timed against oneDNN's AVX-512 ones would decide for a CPU that does not
    exist: without the caps (set before torch is imported) the switch is an error, not a warning."""
    monkeypatch.setenv(build.EMULATE_ENV, "avx2")
    for name in build.EMULATIONS["avx2"]:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="ONEDNN_MAX_CPU_ISA=AVX2"):
        build.cpu_flags()
    monkeypatch.setenv(build.EMULATE_ENV, "zen3")
    with pytest.raises(ValueError, match="expected one of avx2"):
        build.emulated()


def test_an_emulated_avx2_cpu_is_what_prefixkv_sees():
    """In a process started as the benchmarks start it: no AVX-512 or bfloat16 flags, the native
    build is x86-64-v3 (and x86-64-v4 does not run), ATen runs its AVX2 kernels, bfloat16 is warned
    about, and the model name says it is emulated (so do the build's and the choice's keys)."""
    code = """
import json, logging
import torch
from prefixkv.model.kernels import build, choice
flags = build.cpu_flags().split()
print(json.dumps({
    "avx512": [f for f in flags if f.startswith(("avx512", "amx"))],
    "avx2": "avx2" in flags and "fma" in flags,
    "arch": build.arch(),
    "v4": build.arch_runs_here("x86-64-v4"),
    "aten": torch.backends.cpu.get_cpu_capability(),
    "model": build.cpu_model(),
    "warned": choice.warn_if_bfloat16_is_emulated(torch.bfloat16),
}))
"""
    env = {**os.environ, **machine.emulation_env("avx2"), "PYTHONPATH": str(ROOT)}
    env.pop(build.ARCH_ENV, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["avx512"] == [] and seen["avx2"]
    assert seen["arch"] == "x86-64-v3" and not seen["v4"]
    assert seen["aten"] == "AVX2"
    assert "emulating avx2" in seen["model"]
    assert seen["warned"]
    assert seen["model"] != build.cpu_model()  # keyed apart from the CPU as it is
