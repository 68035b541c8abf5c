"""A package's public names imported on first use (PEP 562 module `__getattr__`).

`import prefixkv` and the CLI's flag parsing stay free of torch, whose import alone costs 2-4 s of
CPU a process: `prefixkv --help` answers at once, and a refused flag costs no start-up."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, modules: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` giving each name of `modules` (name -> relative module)
    from its module, imported when the name is first asked for."""

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
