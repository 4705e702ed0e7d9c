"""The one error a rejected request raises: a ValueError that names the field at fault."""

from __future__ import annotations

import math
import numbers


class RequestError(ValueError):
    """A request (or one of its fields) breaks a limit; nothing was built or queued.

    field names the offending field as the caller spelled it in the Python API
    (`prompt_token_ids`, `max_tokens`, `n`, ...); the message starts with it and names the limit.
    """

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickled whole (the engine core's process boundary)
        return type(self), (self.field, str(self))


def check_int(field: str, value, low: int, high: int, *, allow: tuple = ()) -> int:
    """value as an int in [low, high] (or one of allow); booleans and floats are refused."""
    if value in allow and not isinstance(value, bool) and isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestError(field, f"{field} must be an integer, got {_short(value)}")
    number = int(value)  # numbers.Integral: exact
    if not low <= number <= high:
        extra = f" (or {', '.join(map(str, allow))})" if allow else ""
        raise RequestError(field, f"{field} must be in [{low}, {high}]{extra}, got "
                           f"{_short(value)}")
    return number


def check_float(field: str, value, low: float, high: float, *, low_open: bool = False) -> float:
    """value as a finite float in [low, high] ((low, high] with low_open); booleans refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestError(field, f"{field} must be a number, got {_short(value)}")
    value = float(value)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(field, f"{field} must be a finite number in {bracket}{low}, {high}], "
                           f"got {_short(value)}")
    return value


def check_bool(field: str, value) -> bool:
    if not isinstance(value, bool):
        raise RequestError(field, f"{field} must be a boolean, got {type(value).__name__}")
    return value


def _short(value) -> str:
    """A value for an error message, never long: errors must not echo a client's input."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return type(value).__name__
    if isinstance(value, numbers.Integral) and int(value).bit_length() > 64:
        return f"an integer of {int(value).bit_length()} bits"
    return repr(value)
