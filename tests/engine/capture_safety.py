"""What a CUDA graph cannot record, found on a CPU: a step's forward over the graphs' buffers must
neither read a device value back to the host (`.item()`, `bool(t)`, `.tolist()`, `.cpu()`: a
capture raises, or the host decides on the capture's values for every replay) nor build a tensor
from host data (`torch.tensor(list)`: its values are the capture's forever), nor run an operator
whose output's shape follows the values (`nonzero`, `masked_select`: the capture's shape for every
replay). `HostReads` records each such operation made inside it, outside Triton's kernels (whose
interpreter reads values on the host to run them), with the Python line that made it."""

from __future__ import annotations

import collections
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operators that read values on the host, or whose output's shape depends on them
VALUE_DEPENDENT = frozenset(
    {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "nonzero_static", "masked_select", "unique"}
    | {"_unique", "_unique2", "unique_consecutive", "unique_dim", "lift_fresh", "lift_fresh_copy"}
)
# the Tensor methods that read values without an aten operator on a CPU tensor
HOST_METHODS = ("tolist", "numpy", "__array__")


class HostReads(TorchDispatchMode):
    """Within it, `found` counts each value-dependent operation by (name, the line that made it);
    `triton_depth[0]` > 0 while a Triton kernel runs (the interpreter's own reads, not the
    forward's)."""

    def __init__(self, triton_depth: list[int]) -> None:
        super().__init__()
        self.triton_depth = triton_depth
        self.found: collections.Counter[tuple[str, str]] = collections.Counter()
        self._patched: list[tuple[str, Callable[..., Any]]] = []

    def _where(self) -> str:
        for frame in reversed(traceback.extract_stack()[:-3]):
            if "/prefixkv/" in frame.filename:
                return f"{frame.filename.split('/prefixkv/')[-1]}:{frame.lineno} {frame.line}"
        return "?"

    def _record(self, name: str) -> None:
        if not self.triton_depth[0]:
            self.found[name, self._where()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in VALUE_DEPENDENT:
            self._record(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostReads:
        for method in HOST_METHODS:
            real = getattr(torch.Tensor, method)

            def probe(t, *args, _real=real, _name=method, **kwargs):  # type: ignore[no-untyped-def]
                self._record(_name)
                return _real(t, *args, **kwargs)

            self._patched.append((method, real))
            setattr(torch.Tensor, method, probe)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for method, real in self._patched:
            setattr(torch.Tensor, method, real)
        self._patched.clear()
