"""Disk tier: one file per value in a directory, bounded in bytes, written atomically.

A value is written to a temporary file in the same directory and renamed over its final name
(`os.replace`), so a reader - this process, a restarted one, another engine sharing the folder -
sees a whole value or none. The bound is kept from an index of (size, last use) built by
scanning the folder at start (so it holds across restarts, oldest modification first); beyond it
the least recently used files are deleted. Engines sharing a folder each keep their own index,
so the bound is per engine, not global. A full disk makes `put` raise (ENOSPC): the tier
manager counts it, warns and backs off.

A file in the folder may not be what this code wrote (the folder is shared, or tampered with): a
read opens it non-blocking (a FIFO in a value's place would block open() forever), refuses
anything but a regular file of the size the value must have (a huge sparse file would be read
whole), and reads at most that many bytes. A refused file is returned as b"", a value the checks
refuse (counted as rejected). A read that hangs all the same (a hung network mount) holds only
a daemon loader thread: the manager gives up on it at its load deadline and exits without it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from urllib.parse import parse_qs

from ..sizes import parse_bytes
from .registry import TierBackend, register_backend
from .spec import TierSpec, parse_load_mode
from .store import KVStore, UnusableStore

logger = logging.getLogger("prefixkv")

SUFFIX = ".kv"
DEFAULT_DISK_BYTES = 16 << 30


class DiskStore:
    name = "disk"
    fast = False

    def __init__(self, path: str, capacity_bytes: int = DEFAULT_DISK_BYTES, sync_load: bool = False) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the disk tier needs a positive size, got {capacity_bytes} bytes")
        self.path = os.path.abspath(path)
        self.spec = f"disk:{path}"
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()  # the writer thread and the engine thread share the index
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> size, least recently used first
        self.used_bytes = 0
        self.num_evicted = 0
        self.sync_load = sync_load  # `?load=sync`: looked up on the engine thread (docs/tiers.md)
        # the tier manager's: a KV event per file this index drops (deleted, or gone under it)
        self.on_evict: Callable[[bytes], None] | None = None
        os.makedirs(self.path, exist_ok=True)  # raises when the path cannot be a folder
        self._scan()

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.path):
            if entry.name.endswith(SUFFIX) and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime, entry.name, st.st_size))
            elif entry.name.endswith(".tmp"):  # a write cut short by a crash
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
        for _, name, size in sorted(found):
            self._index[name] = size
            self.used_bytes += size

    @staticmethod
    def _name(key: bytes) -> str:
        return key.hex() + SUFFIX

    def get(self, key: bytes, size: int | None = None) -> bytes | None:
        """The value under `key`, None if there is none; b"" for a file that cannot be a value
        (not a regular file, or not `size` bytes when given)."""
        name = self._name(key)
        try:
            value = _read_regular(os.path.join(self.path, name), size)
        except FileNotFoundError:
            with self._lock:
                self._forget(name)
            return None
        if value is None:
            return b""
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
            else:  # written by another engine sharing the folder
                self._index[name] = len(value)
                self.used_bytes += len(value)
        return value

    def get_many(self, keys: Sequence[bytes], sizes: Sequence[int] | None = None) -> list[bytes | None]:
        if sizes is None:
            return [self.get(k) for k in keys]
        return [self.get(k, n) for k, n in zip(keys, sizes, strict=True)]

    def contains(self, key: bytes) -> bool:
        return os.path.exists(os.path.join(self.path, self._name(key)))

    def put(self, key: bytes, value: bytes) -> None:
        name = self._name(key)
        final = os.path.join(self.path, name)
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        with self._lock:
            self.used_bytes -= self._index.pop(name, 0)  # rewritten in place: not an eviction
            self._index[name] = len(value)
            self.used_bytes += len(value)
            victims = []
            while self.used_bytes > self.capacity_bytes and len(self._index) > 1:
                old, size = self._index.popitem(last=False)
                self.used_bytes -= size
                victims.append(old)
        for old in victims:
            try:
                os.unlink(os.path.join(self.path, old))
                self.num_evicted += 1
            except FileNotFoundError:
                pass
            self._evicted(old)

    def _forget(self, name: str) -> None:
        size = self._index.pop(name, None)
        if size is not None:
            self.used_bytes -= size
            self._evicted(name)

    def _evicted(self, name: str) -> None:
        if self.on_evict is not None:
            try:
                key = bytes.fromhex(name[: -len(SUFFIX)])
            except ValueError:  # not a name this store writes
                return
            self.on_evict(key)

    def close(self) -> None:
        pass


def _read_regular(path: str, size: int | None) -> bytes | None:
    """The bytes of `path` if it is a regular file (of `size` bytes when given), else None, read
    with at most one byte past its size asked for. O_NONBLOCK: opening a FIFO returns at once
    (rather than wait for a writer) and fstat refuses it; O_NOCTTY: a terminal there is not taken
    as ours. FileNotFoundError when there is no file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ENXIO:  # a Unix socket (or a FIFO's like) in a value's place: not a value
            return None
        raise  # gone (FileNotFoundError), unreadable: the caller's business
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
            return None
        want = st.st_size if size is None else size
        chunks = []
        left = want + 1  # one more: a file that grew since fstat is refused, not cut
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) != want:  # changed under us (truncated or grown): not a whole value
            return None
        return data
    finally:
        os.close(fd)


def parse_disk_spec(text: str) -> TierSpec:
    """`disk:PATH[?size=SIZE][&load=sync]`."""
    path, _, query = text[len("disk:") :].partition("?")
    if not path:
        raise ValueError(f"the disk tier {text!r} names no folder (disk:/path/to/folder)")
    opts = parse_qs(query, keep_blank_values=True)
    size = DEFAULT_DISK_BYTES
    if "size" in opts:
        try:
            size = parse_bytes(opts.pop("size")[0])
        except Exception as e:  # noqa: BLE001 (argparse's error type: said as a ValueError)
            raise ValueError(f"bad size in the disk tier {text!r}: {e}") from None
    sync_load = parse_load_mode(opts.pop("load", ["async"])[0], text)
    if opts:
        raise ValueError(f"unknown option(s) {', '.join(opts)} in the disk tier {text!r} (known: size, load)")
    return TierSpec("disk", path, size, sync_load)


def build_disk_store(spec: TierSpec) -> KVStore:
    try:
        return DiskStore(spec.target, spec.size_bytes or DEFAULT_DISK_BYTES, spec.sync_load)
    except OSError as e:
        logger.warning("KV tier disk:%s cannot be used (%s); serving without it", spec.target, e)
        return UnusableStore("disk", f"disk:{spec.target}", e)


register_backend(
    TierBackend(
        name="disk",
        medium="DISK",
        prefixes=("disk:",),
        parse=parse_disk_spec,
        build=build_disk_store,
        usage="disk:/path/to/folder[?size=16GiB][&load=sync]",
    )
)
