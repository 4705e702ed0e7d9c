"""SamplingParams' list fields as the tuples it keeps (RequestError naming the field otherwise)."""

from __future__ import annotations

from pagedjax.scheduler.errors import RequestError, check_int

INT32_MAX = 2**31 - 1  # integer fields are packed into i32 plan arrays


def bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (id, bias) pairs, from a mapping or a sequence of pairs."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = value.items()
    elif isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise RequestError("logit_bias", f"logit_bias must map token ids to biases, got "
                           f"{type(value).__name__}")
    pairs = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise RequestError("logit_bias", "logit_bias must map token ids to biases")
        pairs.append(tuple(pair))
    if len({token_id for token_id, _ in pairs}) != len(pairs):
        raise RequestError("logit_bias", "logit_bias names a token id twice")
    try:
        return tuple(sorted(pairs))
    except TypeError:
        raise RequestError("logit_bias", "logit_bias's token ids must be integers") from None


def str_tuple(field: str, values) -> tuple[str, ...]:
    """A list-of-strings field (or one string) as a tuple."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = (values,)
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
        raise RequestError(field, f"{field} must be a list of strings")
    return tuple(values)


def int_tuple(field: str, values) -> tuple[int, ...]:
    """A list-of-token-ids field as a tuple of non-negative i32s."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise RequestError(field, f"{field} must be a list of integers, got "
                           f"{type(values).__name__}")
    return tuple(check_int(f"{field}", v, 0, INT32_MAX) for v in values)
