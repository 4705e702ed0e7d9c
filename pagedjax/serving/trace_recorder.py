"""What a server records of its traffic for `pagedjax simulate` (--trace-out): no text, no
tokens, and hashes nobody without the file's key can test a guessed prompt against."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading

from pagedjax.engine.outputs import RequestOutput
from pagedjax.scheduler.trace import prefix_hashes


class TraceRecorder:
    """Appends each finished request to a JSON-lines trace: arrival (seconds since the server
    started), prompt and output lengths, samples, the chained hashes of the prompt's 16-token
    pieces (which requests share a prefix), and what the endpoint noted of it (annotate: its
    session, hashed like the pieces, earlier turns, stream flag, workload tag).

    The hashes are keyed by a random secret drawn for this recorder and never written, with the
    request's cache_salt mixed in: within one file equal prefixes (under equal salts) hash alike,
    as the simulator needs, but nobody can confirm a guessed prompt piece. The file is created
    readable by its owner only (0600)."""

    def __init__(self, path: str, start: float):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # an existing file too
        self.file = os.fdopen(fd, "a", buffering=1)
        self.start = start
        self._key = secrets.token_bytes(32)
        self._notes: dict[str, dict] = {}  # request id -> its markers, until it finishes
        self._lock = threading.Lock()  # annotate: the event loop; record: the engine thread

    def annotate(self, request_id: str, *, stream: bool, session: str | None = None,
                 turns: int | None = None, workload: str | None = None) -> None:
        """What the endpoint knows of a request the trace cannot see in its output (before it
        is queued)."""
        note: dict[str, object] = {"stream": stream}
        if session is not None:
            note["session"] = hashlib.blake2b(session.encode("utf-8", "replace"),
                                              digest_size=8, key=self._key).hexdigest()
        if turns is not None:
            note["turns"] = turns
        if workload is not None:
            note["workload"] = workload
        with self._lock:
            self._notes[request_id] = note

    def forget(self, request_id: str) -> None:
        """A request that ends unrecorded (refused, or aborted by its client)."""
        with self._lock:
            self._notes.pop(request_id, None)

    def _key_for(self, cache_salt: str | None) -> bytes:
        if cache_salt is None:
            return self._key
        return hashlib.blake2b(self._key + b"salt:" + cache_salt.encode("utf-8", "replace"),
                               digest_size=32).digest()

    def record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if not out.finished:
                continue
            record: dict[str, object] = {"arrival_s": round(out.metrics.arrival_time - self.start, 6),
                      "prompt_len": len(out.prompt_token_ids),
                      "output_len": max(1, max(c.num_tokens for c in out.outputs))}
            if len(out.outputs) > 1:
                record["n"] = len(out.outputs)
            if hashes := prefix_hashes(out.prompt_token_ids, self._key_for(out.cache_salt)):
                record["prefix_hashes"] = list(hashes)
            with self._lock:
                record.update(self._notes.pop(out.request_id, {}))
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()
