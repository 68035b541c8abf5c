"""What a first start does once per machine, done ahead: ``python -m prefixkv.model.warmup``
(`make install` runs it).

- builds the native CPU kernels (kernels/, ~10-60 s: the compiler) and the row-split
  operator (row_split.py), each checked against the PyTorch path as at any first use;
- dequantizes the embedded model into the weight cache (weight_cache.py) in float32, the CPU's
  default dtype (``--dtype bfloat16`` adds that one too), so the first `prefixkv generate` or
  `make demo` maps it.

It says what it does and what came of it. The engine calls `prepare_cpu_kernels` itself at the
start (LLMEngine), so nothing depends on having run this: it only moves the wait to the install.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

import torch

from . import row_split
from .kernels import build, ops

logger = logging.getLogger("prefixkv")

KERNELS_BUILD = "preparing the native CPU kernels (built once per machine: ~10-60 s the first time)"


def prepare_cpu_kernels(row_split_too: bool = True) -> dict[str, bool]:
    """Build (once per machine), load and check the native CPU kernels - and the row-split operator
    when `row_split_too` (only the adaptive thread policy uses it). Returns which are usable; both
    False where the kernels are switched off (PREFIXKV_CPU_KERNELS=0) or cannot be built (the
    modules log why)."""
    if row_split_too:  # its compiler beside the kernels': a core is free at the end of theirs
        row_split.start_build()
    ready = {"kernels": ops.available()}
    if row_split_too:
        ready["row_split"] = row_split.available()
    return ready


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prefixkv.model.warmup",
        description="Build the native CPU kernels and dequantize the embedded model into the cache, "
        "so that the first start waits for neither.",
    )
    parser.add_argument(
        "--dtype", action="append", choices=["float32", "bfloat16"], help="weights to cache (default: float32)"
    )
    parser.add_argument("--no-model", action="store_true", help="build the kernels only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="prefixkv: %(message)s", stream=sys.stderr)
    if not ops.enabled():
        logger.info("native CPU kernels switched off (PREFIXKV_CPU_KERNELS=0): nothing to build")
    else:
        logger.info("%s...", KERNELS_BUILD)
        start = time.perf_counter()
        ready = prepare_cpu_kernels()
        logger.info(
            "native CPU kernels %s, row-split products %s (%.1f s; built in %s)",
            "ready" if ready["kernels"] else "not used",
            "ready" if ready["row_split"] else "not used",
            time.perf_counter() - start,
            build.cache_dir(),
        )
    if not args.no_model:
        from . import load_model, weight_cache

        if not weight_cache.enabled():
            logger.info("weight cache switched off (PREFIXKV_WEIGHT_CACHE=0): nothing to dequantize")
            return 0
        for name in args.dtype or ["float32"]:
            start = time.perf_counter()
            load_model(None, dtype=getattr(torch, name))  # writes the entry when there is none
            logger.info("the embedded model's %s weights are in the cache (%.1f s)", name, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
