"""How torch's OpenMP worker threads wait, set before torch loads its OpenMP runtime.

With OpenMP's default (spin, then sleep), a worker thread that finishes its share of a parallel
region spins until the next one. On a machine where another process wants the core - a
tokenizer, the HTTP server, a neighbour - the spinning threads and the neighbour take turns, and
every parallel region (several per layer) waits for the slowest thread: measured on this 2-core
machine with other processes running (`bench/contention.py`), one decode step took 3.9 s per token
with the default against 0.2 s with passive waiting. prefixkv therefore asks for passive waiting
(`OMP_WAIT_POLICY=PASSIVE`) unless the user chose a policy (`OMP_WAIT_POLICY`, `GOMP_SPINCOUNT`
or `KMP_BLOCKTIME` set) or set `PREFIXKV_OMP_POLICY=keep`. It must run before `import torch`:
`prefixkv/__init__.py` calls it first; when torch was imported before prefixkv it changes nothing.
"""

from __future__ import annotations

import os
import sys

USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def configure_openmp(environ: dict[str, str] | None = None) -> str | None:
    """Set passive waiting where nobody chose; returns the value set, or None if it left things
    as they were (a user setting, PREFIXKV_OMP_POLICY=keep, or torch already loaded)."""
    env = os.environ if environ is None else environ
    if env.get("PREFIXKV_OMP_POLICY", "").lower() == "keep":
        return None
    if any(name in env for name in USER_SETTINGS):
        return None
    if environ is None and "torch" in sys.modules:
        return None  # its OpenMP runtime has read the environment already
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE"
