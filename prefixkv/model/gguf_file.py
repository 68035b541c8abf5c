"""A fast reader of GGUF files: metadata and tensor views, nothing else.

`gguf.GGUFReader` builds a numpy memmap view for every part of every field - about 250,000 views for a
49k-token vocabulary - which costs ~2 s of a ~7 s engine start. The format is small (header, key/values,
tensor infos, aligned data: see llama.cpp's docs/gguf.md), so this module parses the header with
`struct` over one bytes read and hands out the tensors as views into one memmap. The values it returns
are the ones `GGUFReader(...).fields[k].contents()` returns (tests/model/test_model_gguf_reader.py compares both on
the default model); a file it cannot read (big-endian, an unknown version or value type) raises ValueError.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value types (gguf_type in ggml/include/gguf.h)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR: dict[int, tuple[str, int]] = {
    _UINT8: ("<B", 1),
    _INT8: ("<b", 1),
    _UINT16: ("<H", 2),
    _INT16: ("<h", 2),
    _UINT32: ("<I", 4),
    _INT32: ("<i", 4),
    _FLOAT32: ("<f", 4),
    _BOOL: ("<?", 1),
    _UINT64: ("<Q", 8),
    _INT64: ("<q", 8),
    _FLOAT64: ("<d", 8),
}
_NUMPY: dict[int, str] = {
    _UINT8: "<u1",
    _INT8: "<i1",
    _UINT16: "<u2",
    _INT16: "<i2",
    _UINT32: "<u4",
    _INT32: "<i4",
    _FLOAT32: "<f4",
    _UINT64: "<u8",
    _INT64: "<i8",
    _FLOAT64: "<f8",
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF order (innermost dimension first, as `GGUFReader`), `data` a view
    into the file: float32/float16 elements, or for every other type the raw bytes, one row per
    innermost row (what `gguf.quants.dequantize` takes)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """`GGUFFile(path)`: `.metadata` (key -> python value) and `.tensors` (GGUFTensor, file order)."""

    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[:4] != GGUF_MAGIC:
                raise ValueError(f"{path!r} is not a GGUF file (bad magic)")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
            if version not in (2, 3):
                raise ValueError(f"{path!r}: GGUF version {version} is not supported (2 and 3 are)")
            f.seek(0)
            # key/values and tensor infos sit at the start; read generously, then grow if short
            buf = f.read(1 << 22)
        self._buf = buf
        self._path = path
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,), pos = self._unpack("<I", pos)
            metadata[key], pos = self._value(vtype, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,), pos = self._unpack("<I", pos)
            dims, pos = self._unpack(f"<{n_dims}Q", pos)
            (ttype, offset), pos = self._unpack("<IQ", pos)
            infos.append((name, dims, ttype, offset))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (pos + alignment - 1) // alignment * alignment
        self.metadata = metadata
        self._buf = b""  # the header bytes are parsed: do not keep them

        mm = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = []
        for name, dims, ttype, offset in infos:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims)) if dims else 1
            n_bytes = n_elems // block * type_size
            start = data_start + offset
            raw = mm[start : start + n_bytes]
            if len(raw) != n_bytes:
                raise ValueError(f"{path!r}: tensor {name!r} runs past the end of the file")
            np_shape = tuple(reversed(dims))
            if qtype == GGMLQuantizationType.F32:
                data = raw.view(np.float32).reshape(np_shape)
            elif qtype == GGMLQuantizationType.F16:
                data = raw.view(np.float16).reshape(np_shape)
            else:  # quantized (and bf16): raw bytes, one row per innermost row
                data = raw.reshape(*np_shape[:-1], dims[0] // block * type_size)
            tensors.append(GGUFTensor(name, qtype, tuple(int(d) for d in dims), data))
        self.tensors = tensors

    # -- parsing --------------------------------------------------------------------------------
    def _ensure(self, end: int) -> None:
        if end > len(self._buf):
            with open(self._path, "rb") as f:
                self._buf = f.read(max(end, 2 * len(self._buf)))
            if end > len(self._buf):
                raise ValueError(f"{self._path!r}: GGUF header truncated")

    def _unpack(self, fmt: str, pos: int) -> tuple[tuple[Any, ...], int]:
        size = struct.calcsize(fmt)
        self._ensure(pos + size)
        return struct.unpack_from(fmt, self._buf, pos), pos + size

    def _string(self, pos: int) -> tuple[str, int]:
        (n,), pos = self._unpack("<Q", pos)
        self._ensure(pos + n)
        return self._buf[pos : pos + n].decode("utf-8"), pos + n

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype in _SCALAR:
            fmt, _ = _SCALAR[vtype]
            (v,), pos = self._unpack(fmt, pos)
            return v, pos
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            (etype, count), pos = self._unpack("<IQ", pos)
            if etype in _NUMPY:
                size = _SCALAR[etype][1] * count
                self._ensure(pos + size)
                arr = np.frombuffer(self._buf, dtype=_NUMPY[etype], count=count, offset=pos)
                return arr.tolist(), pos + size
            if etype == _BOOL:
                self._ensure(pos + count)
                return [b != 0 for b in self._buf[pos : pos + count]], pos + count
            if etype == _STRING:
                out = []
                buf_len = len(self._buf)
                for _ in range(count):
                    if pos + 8 > buf_len:
                        self._ensure(pos + 8)
                        buf_len = len(self._buf)
                    (n,) = struct.unpack_from("<Q", self._buf, pos)
                    pos += 8
                    if pos + n > buf_len:
                        self._ensure(pos + n)
                        buf_len = len(self._buf)
                    out.append(self._buf[pos : pos + n].decode("utf-8"))
                    pos += n
                return out, pos
            items = []
            for _ in range(count):  # arrays of arrays: rare, element by element
                v, pos = self._value(etype, pos)
                items.append(v)
            return items, pos
        raise ValueError(f"{self._path!r}: unknown GGUF value type {vtype}")
