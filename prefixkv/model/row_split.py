"""Row-split products beside a neighbour: a long step's linear layers with their rows handed out to
torch's threads as they come free (csrc/row_split_linear.cpp).

oneDNN splits each product's rows statically between the threads of a call, so when another
process takes part of one of our cores, every product runs at the pace of the thread on that core.
Handed out in blocks of `BLOCK_ROWS` instead, the thread on the shared core takes fewer blocks. A
761-token prefill of the default model beside a neighbour keeping 70% of one of two cores busy
(bench/prefill_threads.py, medians of 6, one process alternating): bfloat16 0.79 s split vs 0.90 s
whole, float32 1.35 vs 1.58 s. On a quiet machine the split costs 2-6% (more, smaller calls), so it
is off unless the CPU thread policy (engine/cpu_threads.py) turns it on for a long step while other
processes keep one of our cores busy (`set_active`). Like torch's thread count this is
process-wide state, set by the thread that runs the model.

Each row comes out the same bits as in the whole product (oneDNN's sums over the inner dimension do
not depend on the number of rows multiplied): checked before first use on a toy shape and on the
default model's fused q/k/v shape (`_CHECKS`), and across the model's shapes by
tests/model/test_model_row_split.py, so outputs never depend on whether a step split its products.

The operator calls a torch operator, so unlike cpu_kernels' plain-C kernels it is built against
torch's headers (~7 s once per machine on the 2-vCPU Zen 4, mostly the headers) into the same
cache folder (build.build), beside the kernels' own sources at a first start (`start_build`).
Where anything is missing - no compiler or headers, no oneDNN, a failed build
or check, kernels switched off (PREFIXKV_CPU_KERNELS=0, `ops.disabled()`) - products stay
whole, with one log line saying why (none of its own where the kernels' line gave the same cause:
no compiler, or one that fails, says so once).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from .kernels import build, ops

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "row_split_linear.cpp"
# Rows per block. 32, 64 and 128 gained alike beside a 70% neighbour (8-11% of a bfloat16
# prefill, within the run-to-run drift); fewer rows cost more calls on a quiet machine.
BLOCK_ROWS = 64
MIN_ROWS = 2 * BLOCK_ROWS  # fewer rows than two blocks: nothing to hand out

_active = False
_lock = threading.Lock()
_loaded = False
_op: Any = None  # torch.ops.prefixkv.row_split_linear once built and checked
_built: Future[Path] | None = None  # its build, where start_build began it


def set_active(on: bool) -> None:
    """Split the products of the steps that follow (engine/cpu_threads.py: a long step beside a
    neighbour), or stop."""
    global _active
    _active = on


def active() -> bool:
    return _active


def _build_flags() -> tuple[list[str], tuple[str, ...]]:
    root = Path(torch.__file__).parent
    include, lib = root / "include", root / "lib"
    if not (include / "torch" / "library.h").exists():
        raise RuntimeError(f"torch's C++ headers are missing ({include})")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-Wno-c++20-extensions"]
    flags += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}"]
    return flags, (f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu")


def _build() -> Path:
    if not sys.platform.startswith("linux"):
        raise RuntimeError("only built on Linux")
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("this torch has no oneDNN")
    if not torch.backends.openmp.is_available():
        raise RuntimeError("this torch has no OpenMP runtime to share")
    flags, link = _build_flags()
    return build.build(build.compiler(), [SOURCE], [], flags, link, name="prefixkv-row-split")


def start_build() -> None:
    """Start compiling the operator in a thread, beside other work (the kernels' compiler): the first
    `available()` then loads and checks what it built, or reports what it raised. Nothing where it
    was loaded, or its build started, before."""
    global _built
    with _lock:
        if _built is not None or _loaded or not ops.enabled():
            return
        future: Future[Path] = Future()
        _built = future

    def run() -> None:
        try:
            future.set_result(_build())
        except BaseException as e:  # handed to available(), which says why the products stay whole
            future.set_exception(e)

    threading.Thread(target=run, name="prefixkv-row-split-build", daemon=True).start()


def _load() -> Any:
    path = _built.result() if _built is not None else _build()
    torch.ops.load_library(str(path))
    return torch.ops.prefixkv.row_split_linear


# (rows, in, out, bias) of the check: a short tail joined to the last block; and a model's shape
# (SmolLM2's fused q/k/v) whose last block is half a block - oneDNN picks its kernels by shape, so
# the check covers a realistic one, not only a toy
_CHECKS = ((200, 48, 37, True), (224, 576, 960, False))


def _agrees(op: Any) -> bool:
    """The freshly loaded operator against the whole product, bit for bit, in both dtypes."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, fan_in, fan_out, with_bias in _CHECKS:
            weight = torch.randn(fan_out, fan_in, generator=g).to(dtype)
            bias = torch.randn(fan_out, generator=g).to(dtype) if with_bias else None
            x = torch.randn(rows, fan_in, generator=g).to(dtype)
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
            except RuntimeError:  # no packed kernel for this dtype here: nothing will call us with it
                break
            with torch.inference_mode():
                want = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
                got = op(x, packed, bias, fan_out, BLOCK_ROWS)
            if not torch.equal(got, want):
                return False
    return True


def _checked_op() -> Any:
    """The operator, built, loaded and checked - or None, with a log line saying why."""
    try:
        op = _load()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        # the same cause as the kernels' own (no compiler, say): their line said it, one line is enough
        said = str(e) == ops.load_failure()
        logger.log(logging.DEBUG if said else logging.INFO, "row-split products not used (%s)", e)
        return None
    if not _agrees(op):
        logger.warning("row-split products disagreed with whole ones; not used")
        return None
    return op


def _op_or_none() -> Any:
    global _loaded, _op
    with _lock:  # once per process: loading the library a second time would register its namespace twice
        if not _loaded:
            _op, _loaded = _checked_op(), True
    return _op


def available() -> bool:
    """Whether products can be split here (builds the operator on the first call)."""
    return ops.enabled() and _op_or_none() is not None


def linear(
    flat: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor | None:
    """flat [rows, in] times a weight packed by mkldnn::_reorder_linear_weight (+ bias), its rows
    handed out in blocks - or None where that does not apply (not active, fewer than `MIN_ROWS`
    rows, one thread, not built here): then the caller multiplies whole."""
    if not _active or flat.shape[0] < MIN_ROWS or not ops.enabled():
        return None
    if _op is None or torch.get_num_threads() < 2 or not flat.is_contiguous() or flat.device.type != "cpu":
        return None
    y: torch.Tensor = _op(flat, packed, bias, out_features, BLOCK_ROWS)
    return y
