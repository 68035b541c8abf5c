"""transformers' own reading of the default GGUF - the suite's oracle - kept on disk per machine.

Reading the GGUF through transformers took 17 s of a bare process on a 2-vCPU AMD EPYC Zen 4 (and
~30 s beside the suite's other worker), nearly all of it in Python: gguf's reader walks the 49k-token
vocabulary twice and transformers rebuilds a tensor-name table per tensor. Each worker process that
ran a test needing the reference paid it again on every run. The dequantized float32 model and the
converted tokenizer depend only on the file and the versions of transformers, gguf and torch, so the
first reading is saved (safetensors and tokenizer.json, as `save_pretrained` writes them) in the
cache folder the kernels and the weight cache use, under ``test-references/``, keyed by all of
those; later runs load the saved copy (~1 s). `tests/model/test_reference_copy.py` checks that the
saved copy equals a fresh reading, parameters and tokenization both.

Two workers starting together take a file lock: one reads and saves, the other waits and loads. A
new copy replaces the older copies of a file of the same name (other bytes or versions), so the
folder holds one ~540 MB copy of the default model, not one per upgrade."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from bench.peers.make_peer_model import save_dequantized
from prefixkv.model.kernels import build


def read_gguf(gguf_path: str) -> tuple[Any, Any]:
    """transformers' model (float32) and tokenizer read from the GGUF itself: the slow, original way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def key(gguf_path: str) -> str:
    """Everything the saved copy depends on: the file's bytes and the readers' versions."""
    h = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    for package in ("transformers", "gguf", "torch"):
        h.update(f"{package}={version(package)};".encode())
    return h.hexdigest()[:20]


def copy_folder(gguf_path: str) -> Path:
    """The saved copy of `gguf_path`'s reading (model/ and tokenizer/), made now if missing."""
    root = build.cache_dir().parent / "test-references"
    root.mkdir(parents=True, exist_ok=True)
    folder = root / f"{Path(gguf_path).stem}-{key(gguf_path)}"
    with open(root / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "complete").exists():
            model, tokenizer = read_gguf(gguf_path)
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=".writing-"))
            try:
                save_dequantized(model, str(tmp / "model"))
                tokenizer.save_pretrained(str(tmp / "tokenizer"))
                check_copy(model, tmp)
                (tmp / "complete").touch()
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
                for older in root.glob(f"{Path(gguf_path).stem}-*"):  # another file or version's: not read again
                    if older.is_dir() and older != folder:
                        shutil.rmtree(older, ignore_errors=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def check_copy(fresh: Any, folder: Path) -> None:
    """The saved model reloads with the fresh reading's parameters, bit for bit (else it is not kept)."""
    saved = load_model_copy(folder).state_dict()
    want = fresh.state_dict()
    if saved.keys() != want.keys() or not all(torch.equal(saved[k], want[k]) for k in want):
        raise RuntimeError(f"the saved copy in {folder} does not reload as transformers read the GGUF")


def load_model_copy(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder / "model"), dtype=torch.float32).eval()


def reference_model(gguf_path: str) -> Any:
    """transformers' float32 model of the GGUF, as read from the file (the saved copy of that reading)."""
    return load_model_copy(copy_folder(gguf_path))


def reference_tokenizer(gguf_path: str) -> Any:
    """transformers' conversion of the GGUF's tokenizer (the saved copy of it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(copy_folder(gguf_path) / "tokenizer"))
