"""What each of a request's outputs holds (vLLM's RequestOutputKind)."""

from __future__ import annotations

import enum

from pagedjax.scheduler.errors import RequestError


class RequestOutputKind(enum.IntEnum):
    """CUMULATIVE: every output holds everything so far (its tokens, logprobs and text);
    DELTA: only what is new since the request's last output (what a streaming server reads:
    O(1) host work a token, not O(tokens so far)); FINAL_ONLY: one output, once it finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def output_kind(value) -> RequestOutputKind:
    """value (a RequestOutputKind, its int, or its name) as a RequestOutputKind; RequestError
    naming output_kind otherwise."""
    if isinstance(value, str) and value.upper() in RequestOutputKind.__members__:
        return RequestOutputKind[value.upper()]
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return RequestOutputKind(value)
        except ValueError:
            pass
    raise RequestError("output_kind", f"output_kind must be one of "
                       f"{[kind.name for kind in RequestOutputKind]}, got {value!r}")
