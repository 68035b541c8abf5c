"""Runs a peer driver (bench/peers/*.py) in the peer's own Python and returns its JSON line.

The peers' venvs and model live in `peers/` at the repo root (git-ignored; bench/peers/README.md
says how to build them), or wherever $PREFIXKV_PEERS points; $VLLM_PYTHON, $LLAMACPP_PYTHON and
$VLLM_MODEL override single paths. A peer that is not installed is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PEERS = Path(__file__).resolve().parent / "peers"
PEERS_DIR = Path(os.environ.get("PREFIXKV_PEERS", Path(__file__).resolve().parent.parent / "peers"))
DEFAULT_VLLM_PYTHON = os.environ.get("VLLM_PYTHON", str(PEERS_DIR / "vllm" / "bin" / "python"))
DEFAULT_LLAMACPP_PYTHON = os.environ.get("LLAMACPP_PYTHON", str(PEERS_DIR / "llama" / "bin" / "python"))
DEFAULT_VLLM_MODEL = os.environ.get("VLLM_MODEL", str(PEERS_DIR / "smollm2-135m-hf"))


def available(python: str | None) -> bool:
    return bool(python) and os.path.exists(python)


def run_peer(python: str, script: str, args: list[str], timeout: float = 3600) -> dict | None:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    proc = subprocess.run(
        [python, str(PEERS / script), *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    if proc.returncode != 0:
        print(f"  {script} failed (exit {proc.returncode}):\n{proc.stderr[-1500:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])
