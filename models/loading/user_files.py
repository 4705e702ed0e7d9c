"""The one checked way to open a file a user names (a checkpoint, a LoRA adapter, a tokenizer or
chat template, a config): every caller goes through `checked_path` (for files a library maps
itself: safetensors, GGUF) or `read_user_bytes` / `read_user_json` (for files read here).

What it refuses, each as a ValueError naming the file and the rule (never a hang, never a
traceback):

- anything but a regular file: a FIFO (opening one for reading waits for a writer: the engine and
  every request behind it would wait), a device, a socket, a directory;
- a link out of the folder the user named (`root`): a file of an adapter or checkpoint directory
  resolves inside that directory, or, for a Hugging Face cache snapshot
  (`.../snapshots/<revision>/file -> ../../blobs/<hash>`), inside the cached repository;
- a file over `max_bytes` (before reading it: a sparse 1 GiB file costs nothing to refuse);
- a read slower than `timeout_s` (a file on a stalled network mount), checked between chunks;
- JSON nested past Python's recursion limit, or not an object where an object is expected.

Files are opened non-blocking and checked on the open descriptor (fstat), so a FIFO swapped in
between the check and the open is still refused. (An orbax checkpoint's array files are opened by
orbax itself; only its record, config.json, is read through here.)
"""

from __future__ import annotations

import json
import os
import stat
import time

MiB = 1 << 20
MAX_JSON_BYTES = 64 * MiB  # a config, a tokenizer.json (the largest known are ~30 MB)
READ_TIMEOUT_S = 30.0
_CHUNK = 4 * MiB


def is_within(path: str, folder: str) -> bool:
    """Whether path (resolved) is folder or lies under it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _allowed_roots(root: str) -> list[str]:
    """Where a file under root may resolve: root itself, and the cached repository when root is
    a Hugging Face cache snapshot (its files link to ../../blobs)."""
    real = os.path.realpath(root)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.dirname(parent))
    return roots


def checked_path(path, what: str = "file", max_bytes: int | None = None,
                 root: str | None = None) -> str:
    """path, once it is known to be a regular file (after links, none leading out of root when
    root is given) of at most max_bytes; ValueError naming what is wrong otherwise."""
    path = os.fspath(path)
    if root is not None:
        real = os.path.realpath(path)
        if not any(is_within(real, allowed) for allowed in _allowed_roots(root)):
            raise ValueError(f"{what} {path}: a link out of {root} (to {real}) is not followed")
    try:
        info = os.stat(path)
    except OSError as error:
        raise ValueError(f"{what} {path} could not be read ({error.strerror or error})") from None
    _check_info(path, info, what, max_bytes)
    return path


def _check_info(path: str, info: os.stat_result, what: str, max_bytes: int | None) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(info.st_mode) else "a directory"
                if stat.S_ISDIR(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode)
                else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
                else "not a regular file")
        raise ValueError(f"{what} {path} is {kind}; only a regular file is read")
    if max_bytes is not None and info.st_size > max_bytes:
        raise ValueError(f"{what} {path} is {info.st_size} bytes, over the {max_bytes}-byte "
                         f"limit for it")


def read_user_bytes(path, what: str = "file", max_bytes: int = MAX_JSON_BYTES,
                    root: str | None = None, timeout_s: float = READ_TIMEOUT_S) -> bytes:
    """The bytes of a regular file of at most max_bytes (checked_path's rules, checked again on
    the open descriptor), read within timeout_s; ValueError otherwise."""
    path = checked_path(path, what, max_bytes, root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise ValueError(f"{what} {path} could not be read ({error.strerror or error})") from None
    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    with os.fdopen(fd, "rb", buffering=0) as f:
        _check_info(path, os.fstat(fd), what, max_bytes)
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise ValueError(f"{what} {path} grew past the {max_bytes}-byte limit while "
                                 f"read")
            if time.monotonic() > deadline:
                raise ValueError(f"{what} {path}: reading took over {timeout_s} s")
            chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(text: str, what: str, kind: type = dict):
    """A JSON object (or, kind=list, an array) from text; ValueError naming what for anything
    else (malformed, nested past Python's recursion limit, another kind of value)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply to be a config") from None
    except ValueError as error:
        raise ValueError(f"{what} is not valid JSON ({str(error)[:200]})") from None
    if not isinstance(data, kind):
        name = "a JSON object" if kind is dict else "a JSON array"
        raise ValueError(f"{what} must hold {name}, not a {type(data).__name__}")
    return data


def read_user_text(path, what: str | None = None, max_bytes: int = MAX_JSON_BYTES,
                   root: str | None = None) -> str:
    """A user-named UTF-8 text file (read_user_bytes' rules; ValueError if not UTF-8)."""
    what = what or os.path.basename(os.fspath(path))
    data = read_user_bytes(path, what, max_bytes, root)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} {path} is not UTF-8 ({error})") from None


def read_user_json(path, what: str | None = None, max_bytes: int = MAX_JSON_BYTES,
                   root: str | None = None, kind: type = dict):
    """A JSON object (kind=list: an array) from a user-named file (read_user_text's rules, then
    parse_json_object's)."""
    what = what or os.path.basename(os.fspath(path))
    return parse_json_object(read_user_text(path, what, max_bytes, root), f"{what} {path}", kind)
