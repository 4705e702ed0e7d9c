"""The disk tier of the prefix cache: blocks the host tier evicts, one file a block under a
directory, found again by their chained hash (LMCache's local disk backend, SGLang HiCache's
storage tier).

A file is `<hash hex>.kvblock`: a magic line, the header's length, a JSON header (what the
content depends on: the model key, the layout, dtypes, block size; the block's hash; each
leaf's shape and dtype; a checksum of the payload) and the payload (the block's leaves, raw).
A read opens the file without following a link and without waiting on it (a FIFO, a device),
reads a regular file of at most a block file's size, and checks every field, every leaf's shape
and dtype against the layout, and the checksum; a file that fails (a link, not a regular file,
too large, corrupt, truncated, another model's or layout's) is counted, deleted and never
loaded: its blocks are recomputed.

Writes never block a step: `write` queues the block for a writer thread (a bounded queue; a
block that finds it full is dropped and counted). A write that fails (a full disk, a directory
made unwritable) turns the tier off with a logged warning: the engine goes on with the host
tier alone. The directory's size is kept under its capacity, least recently used files
deleted first; a restarted engine indexes the files already there (by modification time).
Files removed or truncated from outside leave no stale entry for long: a block is written again
when its file is gone or changed size, and a read that finds a file gone has the writer thread
drop every entry whose file is.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import queue
import stat
import threading
import time

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"PAGEDJAX-KV-BLOCK 1\n"
SUFFIX = ".kvblock"
MAX_HEADER_BYTES = 1 << 16  # a header is a few hundred bytes: key, layout, hash, checksum


def _dtype(name: str) -> np.dtype:
    import ml_dtypes  # noqa: F401 - registers bfloat16 and the fp8 types with numpy
    return np.dtype(getattr(ml_dtypes, name, name))


_RECHECK = ("recheck",)  # the writer's job of dropping entries whose files are gone


class DiskTier:
    def __init__(self, directory: str, capacity_bytes: int, key: str, layout: dict,
                 queue_size: int = 256):
        """key: names the model and its weights (the content's origin); layout: the block's
        shape facts (block size, layers, heads, dtype, backend): both must match a file's."""
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.key = key
        self.layout = layout
        # Each leaf's [shape, dtype] when the layout names them (an engine's always does).
        self.leaves = layout.get("leaves")
        payload = None if self.leaves is None else sum(
            int(np.prod(shape)) * _dtype(dtype).itemsize for shape, dtype in self.leaves)
        self.max_file_bytes = None if payload is None else \
            len(MAGIC) + 4 + MAX_HEADER_BYTES + payload
        self.enabled = True
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.bytes_used = 0
        # counters (blocks unless bytes or seconds)
        self.num_hits = self.num_misses = self.num_writes = self.num_evictions = 0
        self.num_dropped_writes = self.num_corrupt = self.num_write_errors = 0
        self.bytes_read = self.bytes_written = 0
        self.read_s = self.write_s = 0.0
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".probe-{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.remove(probe)
        except OSError as error:
            self._disable(f"cannot write to {directory!r} ({error})")
            return
        self._scan()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._recheck_queued = False
        self._thread = threading.Thread(target=self._writer, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def _disable(self, why: str) -> None:
        self.enabled = False
        logger.warning("KV disk tier off, the host tier goes on alone: %s", why)

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(SUFFIX):
                try:  # a link or anything but a regular file is never a block
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    block_hash = bytes.fromhex(entry.name[:-len(SUFFIX)])
                    info = entry.stat(follow_symlinks=False)
                except (ValueError, OSError):
                    continue
                found.append((info.st_mtime, block_hash, info.st_size))
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self.bytes_used += size

    # ---- the engine thread ------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: bytes) -> bool:
        return self.enabled and block_hash in self._index

    def write(self, block_hash: bytes, leaves: list[np.ndarray], wait: bool = False) -> None:
        """Queues a block (a copy of its leaves) for the writer; never waits for room unless
        told to (a shutdown writing the cache down). A block already indexed is written again
        only when its file is gone or changed size (removed or truncated from outside: the
        stale entry is dropped, else it would suppress every rewrite until a read failed)."""
        if not self.enabled or (block_hash in self._index and self._on_disk(block_hash)):
            return
        try:
            self._queue.put((block_hash, leaves), block=wait, timeout=30.0 if wait else None)
        except queue.Full:
            self.num_dropped_writes += 1

    def read(self, block_hash: bytes) -> list[np.ndarray] | None:
        """The block's leaves, or None: not on disk, or a file that fails a check (counted,
        deleted)."""
        if block_hash not in self:
            self.num_misses += 1
            return None
        start = time.perf_counter()
        path = self._path(block_hash)
        try:
            data = self._read_file(path)
            leaves = self._decode(data, block_hash)
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("KV disk tier: refused %s (%s)", path, error)
            self.num_corrupt += 1
            self._forget(block_hash, delete=True)
            if isinstance(error, FileNotFoundError):  # removed from outside: others too?
                self._recheck()
            return None
        finally:
            self.read_s += time.perf_counter() - start
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        self.num_hits += 1
        self.bytes_read += len(data)
        return leaves

    def _recheck(self) -> None:
        """Has the writer thread drop every entry whose file is gone or changed size (once
        queued at a time; skipped when the queue is full)."""
        if not self._recheck_queued:
            try:
                self._queue.put_nowait(_RECHECK)
                self._recheck_queued = True
            except queue.Full:
                pass

    def _on_disk(self, block_hash: bytes) -> bool:
        """Whether an indexed block's file is still a regular file of its indexed size (one
        lstat); if not, its entry is dropped."""
        size = self._index.get(block_hash)
        try:
            info = os.lstat(self._path(block_hash))
            if stat.S_ISREG(info.st_mode) and info.st_size == size:
                return True
        except OSError:
            pass
        self._forget(block_hash, delete=False)
        return False

    def close(self, timeout: float = 30.0) -> None:
        """Writes what is queued and stops the writer."""
        thread = getattr(self, "_thread", None)
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(timeout)

    def drain(self, timeout: float = 30.0) -> None:
        """Waits until every queued block is written (tests, a clean shutdown)."""
        if getattr(self, "_thread", None) is None:
            return
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    # ---- files ------------------------------------------------------------------------------

    def _read_file(self, path: str) -> bytes:
        """A regular file's bytes, opened without following a link or waiting on a FIFO, and
        no more than a block file's size read."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("not a regular file")
            limit = self.max_file_bytes
            if limit is not None and info.st_size > limit:
                raise ValueError(f"{info.st_size} bytes, more than a block file's {limit}")
            data = f.read() if limit is None else f.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise ValueError("it grew past a block file's size while read")
        return data

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + SUFFIX)

    def _encode(self, block_hash: bytes, leaves: list[np.ndarray]) -> bytes:
        payload = b"".join(np.ascontiguousarray(leaf).tobytes() for leaf in leaves)
        header = json.dumps({
            "key": self.key, "layout": self.layout, "hash": block_hash.hex(),
            "leaves": [[list(leaf.shape), leaf.dtype.name] for leaf in leaves],
            "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
        return MAGIC + len(header).to_bytes(4, "little") + header + payload

    def _decode(self, data: bytes, block_hash: bytes) -> list[np.ndarray]:
        if not data.startswith(MAGIC):
            raise ValueError("not a KV block file")
        start = len(MAGIC) + 4
        length = int.from_bytes(data[len(MAGIC):start], "little")
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {length} bytes")
        header = json.loads(data[start:start + length])
        for field, want in (("key", self.key), ("layout", self.layout),
                            ("hash", block_hash.hex())):
            if header[field] != want:
                raise ValueError(f"its {field} is another engine's")
        payload = data[start + length:]
        if self.leaves is not None and header["leaves"] != self.leaves:
            raise ValueError("its leaves' shapes or dtypes are not the layout's")
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["checksum"]:
            raise ValueError("checksum mismatch")
        leaves, offset = [], 0
        for shape, dtype in header["leaves"]:
            dtype = _dtype(dtype)
            size = int(np.prod(shape)) * dtype.itemsize
            if offset + size > len(payload):
                raise ValueError("truncated")
            leaves.append(np.frombuffer(payload, dtype, int(np.prod(shape)), offset)
                          .reshape(shape))
            offset += size
        if offset != len(payload):
            raise ValueError(f"{len(payload) - offset} bytes past its leaves")
        return leaves

    def _forget(self, block_hash: bytes, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.bytes_used -= size
        if delete:
            try:
                os.remove(self._path(block_hash))
            except OSError:
                pass

    # ---- the writer thread ------------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if item is _RECHECK:
                    self._recheck_queued = False
                    with self._lock:
                        indexed = list(self._index)
                    for block_hash in indexed:
                        if block_hash in self._index:
                            self._on_disk(block_hash)
                elif self.enabled:
                    self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, leaves: list[np.ndarray]) -> None:
        start = time.perf_counter()
        data = self._encode(block_hash, leaves)
        if len(data) > self.capacity_bytes:
            self.num_dropped_writes += 1
            return
        path = self._path(block_hash)
        temporary = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
        try:
            self._make_room(len(data))
            with open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, path)  # a reader sees a whole file or none
        except OSError as error:
            self.num_write_errors += 1
            try:
                os.remove(temporary)
            except OSError:
                pass
            self._disable(f"writing {path!r} failed ({error})")
            return
        with self._lock:
            self.bytes_used += len(data) - self._index.pop(block_hash, 0)  # written twice
            self._index[block_hash] = len(data)
        self.num_writes += 1
        self.bytes_written += len(data)
        self.write_s += time.perf_counter() - start

    def _make_room(self, size: int) -> None:
        while True:
            with self._lock:
                if not self._index or self.bytes_used + size <= self.capacity_bytes:
                    return
                oldest = next(iter(self._index))
            self._forget(oldest, delete=True)
            self.num_evictions += 1
