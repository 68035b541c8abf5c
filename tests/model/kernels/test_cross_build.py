"""The native kernels' sources build for a 64-bit ARM CPU (aarch64) too: they are written with the
compiler's vector extensions rather than x86 intrinsics (those sit behind their instruction sets'
macros), so an ARM machine compiles them for its own vectors. Checked here with Debian's aarch64
cross compiler (`g++-aarch64-linux-gnu`, which `.ci/run` installs), since no ARM machine is at hand;
that an ARM machine without a working build falls back to PyTorch with one log line is
test_ops.py's."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from prefixkv.model import row_split
from prefixkv.model.kernels import build

CROSS = "aarch64-linux-gnu-g++"

pytestmark = pytest.mark.skipif(
    shutil.which(CROSS) is None, reason=f"no aarch64 cross compiler ({CROSS}: apt-get install g++-aarch64-linux-gnu)"
)

# the flags of a real build (build.BASE_FLAGS) for a generic ARMv8 CPU, compiled to objects: the
# check is that the sources build for the architecture, not the optimizer's output (nothing here
# runs it), and -O0 takes seconds where -O3 takes a minute
FLAGS = [f for f in build.BASE_FLAGS if f not in ("-O3", "-shared")] + ["-O0", "-march=armv8-a", "-c"]


def test_the_kernels_compile_for_aarch64(tmp_path):
    done = subprocess.run(
        [CROSS, *FLAGS, *map(str, build.SOURCES)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("*.o")) == sorted(f"{s.stem}.o" for s in build.SOURCES)


def test_the_row_split_products_compile_for_aarch64(tmp_path):
    """The row-split source includes torch's headers (those of this machine's torch: they are the
    same C++ for every architecture), so only its syntax and types are checked."""
    flags, _ = row_split._build_flags()
    flags = [f for f in flags if f != "-shared"] + ["-march=armv8-a", "-fsyntax-only"]
    done = subprocess.run(
        [CROSS, *flags, str(row_split.SOURCE)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_kernel_source_includes_target_h_first():
    for source in build.SOURCES:
        includes = [line for line in source.read_text().splitlines() if line.startswith("#include")]
        assert includes[0].startswith('#include "target.h"'), source.name


def test_an_sve_cpus_build_keeps_neon_vectors(tmp_path):
    """-march=native on an SVE CPU (here a Neoverse V1's, AWS Graviton 3) turns SVE on with no fixed
    vector length, where GCC 12 lowers the 16-float vectors to scalar code (csrc/target.h): built
    with SVE off, they are NEON's. SiLU x up at -O3 (half a second): NEON multiply-adds, no SVE."""
    source = build.SOURCES[[s.name for s in build.SOURCES].index("silu_and_mul.cpp")]
    flags = [f for f in build.BASE_FLAGS if f != "-shared"] + ["-mcpu=neoverse-v1", "-S", "-o", "out.s"]
    done = subprocess.run([CROSS, *flags, str(source)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    asm = (tmp_path / "out.s").read_text()
    neon_fmla = re.findall(r"\bfmla\s+v\d+\.4s", asm)
    sve = re.findall(r"\bz\d+\.[bhsd]\b", asm)
    assert neon_fmla and not sve, (len(neon_fmla), len(sve))
