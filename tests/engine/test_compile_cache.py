"""JAX's persistent compilation cache, on by default: a second process with the same model and
config compiles no program; "off" and a user's own JAX cache directory are respected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from pagedjax.engine.compile_cache import enable_compilation_cache, resolve_cache_dir

CHILD = textwrap.dedent('''
    import json, sys
    import jax
    from jax import monitoring
    counts = {}
    monitoring.register_event_listener(
        lambda event, **kw: counts.__setitem__(event, counts.get(event, 0) + 1))
    from pagedjax import LLM, SamplingParams
    llm = LLM(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
    out = llm.generate(["copy:ab=", "rev:cd="], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)
    requests = counts.get("/jax/compilation_cache/compile_requests_use_cache", 0)
    hits = counts.get("/jax/compilation_cache/cache_hits", 0)
    print(json.dumps({"compiled": requests - hits, "hits": hits, "texts": [o.text for o in out],
                      "dir": llm.engine.compilation_cache_dir}))
''')


def _run(cache: str) -> dict:
    env = {**os.environ, "PAGEDJAX_COMPILATION_CACHE": cache, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a second process compiling everything: make test-slow
def test_second_process_compiles_nothing(tmp_path):
    cache = str(tmp_path / "jax_cache")
    first = _run(cache)
    second = _run(cache)
    assert first["dir"] == second["dir"] == cache
    assert first["compiled"] > 0 and os.listdir(cache)
    assert second["compiled"] == 0 and second["hits"] >= first["compiled"]
    assert second["texts"] == first["texts"] == ["ab", "dc"]
    off = _run("off")
    assert off["dir"] is None and off["hits"] == 0 and off["compiled"] > 0  # compiles again


def test_settings_resolve_and_a_users_own_directory_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDJAX_COMPILATION_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir("auto") == str(tmp_path / "env")
    assert resolve_cache_dir(str(tmp_path / "x")) == str(tmp_path / "x")
    assert resolve_cache_dir("off") is None
    monkeypatch.delenv("PAGEDJAX_COMPILATION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir("auto") == str(tmp_path / "xdg" / "pagedjax" / "jax_cache")
    current = jax.config.jax_compilation_cache_dir
    own = current or str(tmp_path / "users_own")
    jax.config.update("jax_compilation_cache_dir", own)
    try:
        assert enable_compilation_cache(str(tmp_path / "other")) == own
        assert enable_compilation_cache("off") == own  # off leaves the user's setting alone
        assert jax.config.jax_compilation_cache_dir == own
    finally:
        jax.config.update("jax_compilation_cache_dir", current)
