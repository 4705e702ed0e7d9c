"""JAX's persistent compilation cache, on by default: a second start of the same model and
config loads its step programs from disk instead of compiling them (minutes to seconds).

EngineConfig.compilation_cache (and `--compilation-cache` on the command line) says where:
"auto" (the default) is $PAGEDJAX_COMPILATION_CACHE when set, else
$XDG_CACHE_HOME/pagedjax/jax_cache (~/.cache/pagedjax/jax_cache); "off" leaves JAX as it is;
anything else is a directory. A cache directory the user configured in JAX itself
(jax_compilation_cache_dir) is never replaced. Entries are keyed by JAX on the program, the
compile options, the XLA flags, the backend and the JAX version, so a stale one is never used.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

OFF = "off"
AUTO = "auto"
ENV = "PAGEDJAX_COMPILATION_CACHE"


def resolve_cache_dir(setting: str) -> str | None:
    """The directory a compilation_cache setting names, or None for "off"."""
    if setting == AUTO:
        setting = os.environ.get(ENV) or AUTO
    if setting == OFF:
        return None
    if setting == AUTO:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".cache")
        return os.path.join(base, "pagedjax", "jax_cache")
    return os.path.abspath(os.path.expanduser(setting))


def enable_compilation_cache(setting: str = AUTO) -> str | None:
    """Points JAX's persistent cache at setting's directory (unless the user already chose one,
    or setting is "off") and caches every program, however quick to compile; returns the
    directory in use, or None."""
    current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # a jax.config flag (untyped)
    if current:
        return current
    path = resolve_cache_dir(setting)
    if path is None:
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # A step program of a small model compiles in under JAX's default 1 s threshold.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX decides once per process whether the cache is used, at the first compile (loading a
    # model may have compiled already): decide again with the directory set.
    compilation_cache.reset_cache()
    return path
