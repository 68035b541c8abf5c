"""Answers measured once per machine and kept on disk: which CPU kernels run (choice.py), which mixed
steps replay a CUDA graph (engine/mixed_graph_choice.py). Each answer is a JSON file in
`cache_dir()/../<kind>/`, named by a hash of everything the measurement depends on, so a change of
any of it (the machine, the versions, the model's shapes) measures again instead of reading a stale
answer. Written atomically; a read-only or missing folder costs a measurement, never a failure."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from . import build

logger = logging.getLogger(__name__)


def answer_path(kind: str, parts: list[str]) -> Path:
    """The file of the answer of `kind` (a folder name) that `parts` determine."""
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return build.cache_dir().parent / kind / f"{key}.json"


def read_answer(path: Path) -> dict[str, Any] | None:
    """The answer kept at `path`; None where there is none or it cannot be read (measure then)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def keep_answer(path: Path, data: dict[str, Any]) -> None:
    """Write `data` at `path` in one step (a reader never sees half a file); where the folder cannot
    be written, say so once in the log: the next start measures again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".answer-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        logger.info("%s not kept on disk (%s): measured again at the next start", path.parent.name, e)
