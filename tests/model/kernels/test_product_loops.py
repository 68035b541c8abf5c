"""The matrix products' inner loops keep their accumulators in registers, for each x86 target they
build for. Where the compiler keeps them in memory instead, it stores every accumulator each step,
and those stores, not the multiply-adds, set the speed: the AVX2 many-row product ran at half of
oneDNN's (45 against 80 GFLOP/s on one thread of an AMD Zen 2) until every loop over its tile's
rows was unrolled (csrc/blocked_linear.cpp). Read from the compiler's assembly at -O3, as
test_cross_build.py reads an ARM build's: what is checked is the loop the compiler made, which no
timing here could pin down."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from prefixkv.model.kernels import build

COMPILER = "g++"

pytestmark = pytest.mark.skipif(shutil.which(COMPILER) is None, reason=f"no {COMPILER}")

# AVX2 + FMA (Haswell's set: Zen 2 and Zen 3 have it, and no more), AVX-512 with AVX512-BF16
TARGETS = ("haswell", "sapphirerapids")
PRODUCTS = ("blocked_linear.cpp", "small_linear.cpp")

_LABEL = re.compile(r"^(\.L\d+):$")
_BACK_JUMP = re.compile(r"^\s+j\w+\s+(\.L\d+)$")
_MULTIPLY_ADD = re.compile(r"\b(vfmadd\w+|vdpbf16ps)\b")
# a vector register stored to the stack frame
_SPILL = re.compile(r"\bvmov\w*\s+%[xyz]mm\d+, -?\d*\(%r[sb]p\)")


def innermost_loops(asm: str) -> list[list[str]]:
    """The bodies of the loops that hold no other label: from a label to the jump back to it."""
    lines = asm.splitlines()
    where = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    loops = []
    for i, line in enumerate(lines):
        jump = _BACK_JUMP.match(line)
        if jump and where.get(jump.group(1), i) < i:
            body = lines[where[jump.group(1)] + 1 : i]
            if not any(_LABEL.match(b) for b in body):
                loops.append(body)
    return loops


def assembly(source: Path, target: str, folder: Path) -> str:
    out = folder / f"{source.stem}-{target}.s"
    flags = [f for f in build.BASE_FLAGS if f != "-shared"] + [f"-march={target}", "-S", "-o", str(out)]
    done = subprocess.run([COMPILER, *flags, str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out.read_text()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("product", PRODUCTS)
def test_the_products_accumulate_in_registers(product, target, tmp_path):
    source = next(s for s in build.SOURCES if s.name == product)
    loops = [
        body
        for body in innermost_loops(assembly(source, target, tmp_path))
        if len(_MULTIPLY_ADD.findall("\n".join(body))) >= 4
    ]
    assert loops, "no multiply-add loop found: the check reads nothing"
    spilling = [body for body in loops if any(_SPILL.search(line) for line in body)]
    assert not spilling, "\n\n".join("\n".join(body) for body in spilling[:2])
