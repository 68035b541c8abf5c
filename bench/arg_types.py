"""argparse types for the benchmarks' comma-separated flags (`--engines graphs,eager`, `--batches
1,32,256`): a misspelt name or a stray letter fails when the flags are parsed, before any model is
loaded or timed. On a lent GPU a step's flags are found wrong only when it runs, minutes into a
lease of a few (bench/device/gpu_checks.sh, checked on the CPU by tests/test_device_checks.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def names(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """A type for a comma-separated list of names, each one of `choices`."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        items = [item for item in text.split(",") if item]
        unknown = [item for item in items if item not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'none'} not of: {', '.join(allowed)}")
        return items

    return parse


def ints(text: str) -> list[int]:
    """A type for a comma-separated list of whole numbers."""
    try:
        items = [int(item) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not items:
        raise argparse.ArgumentTypeError("an empty list")
    return items
