"""A workload trace: what the simulator replays and `pagedjax serve --trace-out` records.

A trace is JSON lines, one request each: {"arrival_s", "prompt_len", "output_len"} and
optionally "n" (parallel samples), and either "prefix_group" and "prefix_len" (requests of one
group share their first prefix_len prompt tokens) or "prefix_hashes" (chained hashes of the
prompt's 16-token pieces, as `pagedjax serve --trace-out` records them), so that the prefix
cache sees the requests as it would.

What a served trace also records of each request, for the workload profile
(scheduler.workload; the simulator ignores them): "session" (a keyed hash of the conversation id
the client sent: the X-Session-ID header, metadata.session_id, or the `user` field), "turns"
(chat: the assistant messages before the reply, i.e. earlier turns of its conversation in the
prompt), "stream" (whether it was streamed) and "workload" (the client's metadata.workload tag,
e.g. "rag"; a chat request carrying vLLM's `documents` is "rag" too).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Iterable, Sequence

import numpy as np

from pagedjax.scheduler.block_hash import chained_hashes

CHUNK = 16  # tokens a prefix hash covers


def prefix_hashes(prompt_token_ids: Sequence[int], key: bytes = b"") -> tuple[str, ...]:
    """Chained hashes of a prompt's whole CHUNK-token pieces, for a trace: equal lists mean
    equal prefixes, and the tokens cannot be read back from them. With a secret key (at most 64
    bytes; a served trace's is random per file) nobody can confirm a guessed piece either."""
    def combine(parent: bytes, piece) -> bytes:
        data = parent + np.asarray(piece, np.int64).tobytes()
        return hashlib.blake2b(data, digest_size=8, key=key).digest()

    return tuple(h.hex() for h in chained_hashes(prompt_token_ids, CHUNK, combine, b""))


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    n: int = 1
    prefix_group: int | None = None
    prefix_len: int = 0
    # Chained hashes of the prompt's leading CHUNK-token pieces (hex; what a served trace
    # records): prompts whose lists start alike share those tokens.
    prefix_hashes: tuple[str, ...] = ()
    # The workload profile's markers (None: not recorded); see the module's docstring.
    session: str | None = None
    turns: int | None = None
    stream: bool | None = None
    workload: str | None = None

    def __post_init__(self):
        for name in ("prompt_len", "output_len", "n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.arrival_s, (int, float)) or not np.isfinite(self.arrival_s) \
                or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        if not isinstance(self.prefix_len, int) or not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"prefix_len must be an integer in [0, prompt_len="
                             f"{self.prompt_len}], got {self.prefix_len!r}")
        if self.prefix_len and self.prefix_group is None:
            raise ValueError("prefix_len needs a prefix_group")
        object.__setattr__(self, "prefix_hashes", tuple(self.prefix_hashes))
        if self.prefix_hashes and self.prefix_len:
            raise ValueError("give prefix_hashes or prefix_group/prefix_len, not both")
        for name, kind in (("session", str), ("workload", str), ("stream", bool)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"{name} must be a {kind.__name__} or absent, got {value!r}")
        if self.turns is not None and (not isinstance(self.turns, int)
                                       or isinstance(self.turns, bool) or self.turns < 0):
            raise ValueError(f"turns must be an integer >= 0 or absent, got {self.turns!r}")
        if len(self.prefix_hashes) * CHUNK > self.prompt_len:
            raise ValueError(f"prefix_hashes cover {len(self.prefix_hashes)} x {CHUNK} tokens, "
                             f"more than prompt_len={self.prompt_len}")

    def prompt_token_ids(self, index: int, vocab_size: int) -> list[int]:
        """Synthetic ids: the group's shared prefix (the same for every member), then tokens
        of this request's own."""
        shared = []
        if self.prefix_len:
            rng = np.random.default_rng([1, self.prefix_group or 0])
            shared = rng.integers(0, vocab_size, self.prefix_len).tolist()
        for h in self.prefix_hashes:
            shared += np.random.default_rng([3, int(h, 16)]).integers(0, vocab_size,
                                                                      CHUNK).tolist()
        own = np.random.default_rng([2, index]).integers(0, vocab_size,
                                                         self.prompt_len - len(shared))
        return shared + own.tolist()


def load_trace(path: str | os.PathLike) -> list[TraceRequest]:
    """Reads a JSON-lines trace; errors name the line and the field."""
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("a line must be a JSON object")
                requests.append(TraceRequest(**record))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    return requests


def save_trace(path: str | os.PathLike, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            record = {k: list(v) if isinstance(v, tuple) else v
                      for k, v in dataclasses.asdict(r).items()
                      if v != TraceRequest.__dataclass_fields__[k].default}
            f.write(json.dumps({"arrival_s": r.arrival_s, **record}) + "\n")
