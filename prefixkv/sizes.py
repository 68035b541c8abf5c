"""Byte sizes as people write them on a command line ('512M', '2GiB'): the engine's budgets and the
tiers' bounds share one parser, below both."""

from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '2GiB', '1.5G' -> bytes (binary units: K = 1024). Raises argparse's
    ArgumentTypeError, so that a flag given this as its type reports it as argparse does."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 536870912, 512M, 2GiB)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    value = int(float(m.group(1)) * scale)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value
