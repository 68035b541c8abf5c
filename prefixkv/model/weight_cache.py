"""A GGUF model's dequantized weights kept on disk, so that only the first start dequantizes.

Dequantizing the default model's Q4_1 GGUF with gguf's numpy code and copying the result into the
model took 4-5 s of every start on a 2-vCPU AMD EPYC Zen 4 (~12 s on a Zen 3). The result depends
only on the file and the dtype, so the first load writes the model's parameters - exactly as
`LlamaModel.load_hf_weights` left them, q/k/v and gate/up fused, in the model's dtype - into one
file in the cache folder the kernels use (``$PREFIXKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/prefixkv``
or ``~/.cache/prefixkv``, under ``weights/``), and later loads map that file (copy-on-write: the
file is never written through) and hand its tensors to the model as they are: no copy, no
dequantization. The warm load's parameters are the fresh load's bit for bit
(tests/model/test_model_weight_cache.py).

The file's name is a key of everything its contents depend on: the GGUF's size, modification time
and a hash of its first and last bytes (its header - metadata, tokenizer, tensor table - and the
tail of its data; hashing all of a multi-GiB file would cost seconds of every start), the dtype,
the versions of torch, numpy and gguf (the dequantization), and the source of the code that turns
the file into parameters (loader.py, gguf_file.py, llama.py). A changed file or code writes a new
entry and removes the older ones of the same model and dtype, so the folder holds one per pair.

The folder is bounded. An entry names the GGUF it was made from; writing one removes every entry
whose GGUF is gone (a deleted venv, clone or temporary folder: each new location of a model is a
model of its own, so without this a machine that makes fresh clones - CI - gained ~540 MB a clone),
entries of another format version, and then the least recently used entries (a load marks its
entry used) until the folder holds at most ``PREFIXKV_WEIGHT_CACHE_MAX_GB`` GiB (20 by default;
the entry just written always stays).

The file: a header (magic, version, JSON length), a JSON table (per tensor its name, dtype, shape,
offset and CRC-32) and the data, every tensor 64-byte aligned. It is written to a temporary file
and renamed into place (a concurrent process sees all of it or none). Before use its size is
checked against the table and every tensor against its CRC-32 (both cores: ~0.1 s for the default
model's 540 MB in float32): a truncated or corrupted file is removed and the weights dequantized
again, never used. ``PREFIXKV_WEIGHT_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .kernels import build

logger = logging.getLogger(__name__)

ENV_SWITCH = "PREFIXKV_WEIGHT_CACHE"
ENV_MAX_GB = "PREFIXKV_WEIGHT_CACHE_MAX_GB"
DEFAULT_MAX_GB = 20.0
MAGIC = b"PKVW"
FORMAT_VERSION = 2  # 2: the table names the GGUF the entry was made from ("source")
ALIGN = 64
# the file's head and tail that go into its key: the default model's header (metadata with its
# 49k-token vocabulary, the tensor table) is ~2 MiB; 5 ms of hashing
HEAD_BYTES = 8 << 20
TAIL_BYTES = 1 << 20
_PREFIX = struct.Struct("<4sIQ")  # magic, format version, JSON length
_CODE = ("loader.py", "gguf_file.py", "llama.py")  # the code from file to parameters
STALE_TEMP_S = 3600.0  # a temporary file this old is no concurrent writer's
CHUNK = 16 << 20  # the data is checked in pieces of this size, each with its CRC-32, on every core


def enabled() -> bool:
    """Whether loads use and write the cache (``PREFIXKV_WEIGHT_CACHE=0``: never)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def max_bytes() -> int:
    """The bound on the folder's size (``PREFIXKV_WEIGHT_CACHE_MAX_GB``, in GiB; 20 by default)."""
    text = os.environ.get(ENV_MAX_GB, "")
    try:
        gib = float(text) if text else DEFAULT_MAX_GB
    except ValueError:
        gib = -1.0
    if not gib >= 0:
        raise ValueError(f"{ENV_MAX_GB} must be a number of GiB >= 0, got {text!r}")
    return int(gib * (1 << 30))


def folder() -> Path:
    """Where the entries are kept: beside the native kernels' builds."""
    return build.cache_dir().parent / "weights"


def entry_path(gguf_path: str, dtype: torch.dtype) -> Path:
    """The file that holds (or would hold) `gguf_path`'s parameters in `dtype`: ``<model>-<key>.pkvw``,
    <model> naming the file and dtype (older entries of the pair share it), <key> everything the
    contents depend on."""
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    key = hashlib.sha256()
    with open(real, "rb") as f:
        key.update(f.read(HEAD_BYTES))
        if st.st_size > HEAD_BYTES:
            f.seek(max(HEAD_BYTES, st.st_size - TAIL_BYTES))
            key.update(f.read(TAIL_BYTES))
    import gguf  # the dequantization's own version

    parts = [str(st.st_size), str(st.st_mtime_ns), str(dtype), str(FORMAT_VERSION), torch.__version__]
    parts += [np.__version__, getattr(gguf, "__version__", "") or dist_version("gguf")]
    for part in parts:
        key.update(part.encode() + b"\0")
    here = Path(__file__).parent
    for name in _CODE:
        key.update((here / name).read_bytes())
    max_bytes()  # a bad bound is refused at the load, not at some later write
    model = hashlib.sha256(f"{real}\0{dtype}".encode()).hexdigest()[:12]
    return folder() / f"{model}-{key.hexdigest()[:20]}.pkvw"


def dist_version(name: str) -> str:
    """An installed distribution's version ("" where it is not installed): part of the keys of
    what is kept on disk for a set of versions."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return ""


def _crc32s(buffer: memoryview, start: int, end: int) -> list[int]:
    """The CRC-32 of each CHUNK-byte piece of buffer[start:end], computed on every core (zlib
    releases the GIL)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    offsets = range(start, end, CHUNK)
    with ThreadPoolExecutor(max(1, min(cpus, 8))) as pool:
        return list(pool.map(lambda o: zlib.crc32(buffer[o : min(o + CHUNK, end)]), offsets))


def load(path: Path, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor] | None:
    """The entry's tensors, mapped from the file, when it holds exactly `params`' names, dtypes and
    shapes and passes its checks; else None (a damaged entry is removed)."""
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writes never reach the file
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: an empty file
        _discard(path, str(e) or "empty")
        return None
    try:
        magic, version, n = _PREFIX.unpack_from(mapped, 0)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise ValueError("not a weight-cache file of this version")
        table = json.loads(bytes(mapped[_PREFIX.size : _PREFIX.size + n]))
        entries, data, size = table["tensors"], table["data"], table["size"]
        if size != len(mapped):
            raise ValueError(f"{len(mapped)} bytes where the table says {size}")
        if any(e["offset"] < data or e["offset"] + e["nbytes"] > size for e in entries):
            raise ValueError("a tensor lies outside the data")
        if _crc32s(memoryview(mapped), data, size) != table["crc32"]:
            raise ValueError("the data's CRC-32 does not match")
        tensors: dict[str, torch.Tensor] = {}
        for entry in entries:
            dtype = getattr(torch, entry["dtype"])
            count = entry["nbytes"] // dtype.itemsize
            if count:
                t = torch.frombuffer(mapped, dtype=dtype, count=count, offset=entry["offset"])
            else:  # frombuffer refuses a count of 0
                t = torch.empty(0, dtype=dtype)
            tensors[entry["name"]] = t.view(entry["shape"])
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, struct.error) as e:
        _discard(path, str(e))
        return None
    want = {name: (p.dtype, tuple(p.shape)) for name, p in params.items()}
    if {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()} != want:
        return None  # another model layout (the key should have told them apart): dequantized again
    try:
        os.utime(path)  # used now: the size bound removes the least recently used entries first
    except OSError:
        pass
    return tensors


def _discard(path: Path, why: str) -> None:
    logger.warning("weight cache %s is damaged (%s): removed, the weights are dequantized again", path, why)
    try:
        path.unlink()
    except OSError:
        pass


def store(path: Path, params: dict[str, torch.Tensor], source: str | None = None) -> None:
    """Write `params` (CPU tensors) as the entry `path` of the GGUF `source`, atomically, then tidy
    the folder (`tidy`). A cache that cannot be written (read-only, full) only logs."""
    arrays: list[np.ndarray] = []
    entries: list[dict[str, Any]] = []
    offset = 0  # from the data's start
    for name, t in params.items():
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, dtype=np.uint8)
        offset = -(-offset // ALIGN) * ALIGN
        dtype = str(t.dtype).removeprefix("torch.")
        entries.append({"name": name, "dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": raw.nbytes})
        arrays.append(raw)
        offset += raw.nbytes
    # the header's length is fixed before the CRCs are known: room for the widest ones
    chunks = -(-offset // CHUNK)
    widest = {"tensors": entries, "data": 10**12, "size": 10**12, "crc32": [2**32 - 1] * chunks, "source": source}
    data = -(-(_PREFIX.size + len(json.dumps(widest)) + 64 * len(entries)) // ALIGN) * ALIGN
    for e in entries:
        e["offset"] += data
    size = data + offset
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".weights-", dir=path.parent)
        try:
            with os.fdopen(fd, "w+b") as f:
                f.truncate(size)
                for e, raw in zip(entries, arrays):
                    f.seek(e["offset"])
                    f.write(raw.data)
                f.flush()
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as written:
                    crcs = _crc32s(memoryview(written), data, size)  # of what the file holds
                table = {"tensors": entries, "data": data, "size": size, "crc32": crcs, "source": source}
                body = json.dumps(table).encode()
                if _PREFIX.size + len(body) > data:
                    raise AssertionError("weight-cache header overflow")
                f.seek(0)
                f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)) + body)
            os.replace(tmp, path)  # atomic: a concurrent load sees the whole file or none
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        logger.info("weight cache not written (%s); the next start dequantizes again", e)
        return
    tidy(path)


def tidy(keep: Path) -> None:
    """Remove what no load will use again, beside the entry `keep` just written: older entries of its
    model and dtype, entries whose GGUF is gone, entries of another format version, a killed
    writer's temporary file; then the least recently used entries while the folder is over its bound."""
    family = keep.name.split("-", 1)[0]
    stale = time.time() - STALE_TEMP_S  # a writer killed mid-write leaves its temporary file
    kept: list[tuple[float, int, Path]] = []
    for old in keep.parent.iterdir():
        try:
            if old.name.startswith(".weights-"):
                if old.stat().st_mtime < stale:
                    old.unlink()
            elif old.suffix == ".pkvw" and old != keep:
                if old.name.split("-", 1)[0] == family or not _source_exists(old):
                    old.unlink()
                else:
                    st = old.stat()
                    kept.append((st.st_mtime, st.st_size, old))
        except OSError:
            pass
    try:
        total = keep.stat().st_size + sum(size for _, size, _ in kept)
    except OSError:
        return
    bound = max_bytes()
    for _, size, old in sorted(kept):  # the least recently used first
        if total <= bound:
            break
        try:
            old.unlink()
            total -= size
        except OSError:
            pass


def _source_exists(path: Path) -> bool:
    """Whether the GGUF the entry was made from is still there (False for another format version)."""
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            return False
        magic, version, n = _PREFIX.unpack(prefix)
        if magic != MAGIC or version != FORMAT_VERSION:
            return False
        try:
            source = json.loads(f.read(n)).get("source")
        except (ValueError, AttributeError):
            return False
    return isinstance(source, str) and os.path.exists(source)
