"""The Triton kernels (attention, the fused steps) where a test can run them: compiled on a GPU when one is there, else
on CPU tensors under Triton's interpreter.

The interpreter is chosen when `@triton.jit` decorates a function - Triton's own library functions
(`tl.zeros`, `tl.cdiv`, ...) included, decorated when `triton.language` is first imported. So on a
machine without a GPU, ``TRITON_INTERPRET=1`` is set for the rest of the process (compiled Triton
cannot run there anyway) and, if Triton's Python modules were already imported without it, they
are imported afresh (its compiled extension, `triton._C`, stays: it cannot be loaded twice)."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest
import torch

MODULE = "prefixkv.model.kernels.triton_attention"
FUSED = "prefixkv.model.kernels.triton_fused"
GEMV = "prefixkv.model.kernels.triton_gemv"


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _interpreted() -> bool:
    lang = sys.modules.get("triton.language")
    if lang is None:
        return True  # imported from now on under the variable
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(lang.zeros, InterpretedFunction)


def kernels_module(module: str = MODULE) -> ModuleType:
    """A kernels' module (the attention's by default), runnable on `device()`."""
    pytest.importorskip("triton")
    if device().type == "cuda":
        return importlib.import_module(module)
    os.environ["TRITON_INTERPRET"] = "1"
    if not _interpreted():
        kernels = (MODULE, FUSED, GEMV, "prefixkv.model.kernels.triton_scan")
        stale = [m for m in sys.modules if m in kernels or m == "triton" or m.startswith("triton.")]
        for name in stale:
            if not name.startswith("triton._C"):
                del sys.modules[name]
    _interpreter_without_repeated_work()
    return importlib.import_module(module)


def _interpreter_without_repeated_work() -> None:
    """Two things Triton's interpreter redoes in Python that a compiled kernel never does, skipped
    (each was about a sixth of the time of a test running the attention kernels):

    - it checks every 32-bit integer add, sub and mul for overflow. A GPU build compiles those
      checks only with `debug`, which prefixkv never sets, and the tests' caches are far too small
      to overflow;
    - at every call of a device function (`@triton.jit` called inside a kernel: prefixkv's helpers,
      `tl.cdiv`) it walks `triton.language` with `inspect.getmembers` to swap its builtins for
      interpreted ones, which it never swaps back: after a function's first call the walk finds
      nothing left to swap (the kernel's own launch swaps and restores what it needs)."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    call = interpreter.InterpretedFunction.__call__
    if getattr(call, "patched_once", False):
        return
    patched: set[object] = set()

    def device_call(self, *args, **kwargs):  # InterpretedFunction.__call__, the walk once per function
        if self.fn not in patched:
            interpreter._patch_lang(self.fn)
            patched.add(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    device_call.patched_once = True  # type: ignore[attr-defined]
    interpreter.InterpretedFunction.__call__ = device_call
