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
    _shapes_built_once()


def _shapes_built_once() -> None:
    """What Triton's front end builds anew at every operation of an interpreted kernel - where a
    compiled kernel builds it once, at compile time - built once per shape (a third of the time of
    a test running the attention kernels went to it):

    - a block type's shape, element count and name (`block_type.__init__`: the shape is made a
      `triton.language.tuple`, which types each of its elements);
    - a tensor's shape as a tuple of `constexpr`s and its element count (`tensor.__init__`);
    - the NumPy type of a Triton type (the interpreter's `_get_np_dtype` builds its whole table).

    The same objects as before, shared between the types and tensors of one shape (the front end
    never changes a shape in place); types whose element type is not hashable (nested pointers)
    are built as before."""
    import builtins
    import math

    from triton.language import core

    if getattr(core.block_type.__init__, "built_once", False):
        return
    block_init = core.block_type.__init__
    blocks: dict[object, tuple[object, int, str]] = {}

    def element_key(ty: object) -> object:
        if isinstance(ty, core.pointer_type):  # equal by value, but not hashable
            return ("ptr", element_key(ty.element_ty), ty.address_space, ty.const)
        hash(ty)
        return ty

    def block_type_init(self, element_ty, shape):  # type: ignore[no-untyped-def]
        try:
            # each dimension with its type: a dimension Triton would refuse is never taken from the cache
            dims = builtins.tuple(
                (type(s), s) for s in (d.value if isinstance(d, core.constexpr) else d for d in shape)
            )
            key = (element_key(element_ty), dims)
        except TypeError:
            block_init(self, element_ty, shape)
            return
        built = blocks.get(key)
        if built is None:
            block_init(self, element_ty, shape)
            blocks[key] = (self.shape, self.numel, self.name)
        else:
            self.element_ty = element_ty
            self.shape, self.numel, self.name = built

    shapes: dict[builtins.tuple[int, ...], tuple[object, object]] = {}

    def tensor_init(self, handle, type):  # type: ignore[no-untyped-def]
        # tensor.__init__ of Triton 3.x with the shape's constexpr tuple and count built once per shape
        self.handle = handle
        dims = builtins.tuple(type.shape) if type.is_block() else ()
        built = shapes.get(dims)
        if built is None:
            built = shapes[dims] = (core.tuple([core.constexpr(s) for s in dims]), core.constexpr(math.prod(dims)))
        self.shape, self.numel = built
        self.type = type
        self.dtype = type.scalar

    from triton.runtime import interpreter

    np_dtype = interpreter._get_np_dtype  # builds its table of types at every call
    np_dtypes: dict[object, object] = {}

    def get_np_dtype(tt_dtype):  # type: ignore[no-untyped-def]
        if isinstance(tt_dtype, core.block_type):  # its elements' type (not hashable itself)
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, core.pointer_type):
            return np_dtype(tt_dtype)
        found = np_dtypes.get(tt_dtype)
        if found is None:
            found = np_dtypes[tt_dtype] = np_dtype(tt_dtype)
        return found

    block_type_init.built_once = True  # type: ignore[attr-defined]
    core.block_type.__init__ = block_type_init
    core.tensor.__init__ = tensor_init
    interpreter._get_np_dtype = get_np_dtype
