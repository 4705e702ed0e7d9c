"""How many times step programs were traced and compiled, over every runner of the process (a
test holds a step's compiles to its shape buckets with them)."""

_counts = {"traces": 0, "compiles": 0}


def num_step_traces() -> int:
    """How many times any step program has been traced."""
    return _counts["traces"]


def num_step_compiles() -> int:
    """How many step programs any runner has compiled (ModelRunner.program)."""
    return _counts["compiles"]


def count(kind: str) -> None:
    _counts[kind] += 1
