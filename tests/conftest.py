import atexit
import glob
import os
import shutil
import sys
import tempfile

# Tests are grouped by room (tests/engine, tests/serving, ...); a test module imports the shared
# helpers (tests/helpers.py) and other rooms' test modules by their names, so every room is on
# the path, as pytest puts a test file's own folder (the names are unique across rooms).
TESTS = os.path.dirname(os.path.abspath(__file__))
for _room in sorted(glob.glob(os.path.join(TESTS, "*", "test_*.py"))):
    if os.path.dirname(_room) not in sys.path:
        sys.path.append(os.path.dirname(_room))

# Before anything starts a JAX backend: the tests' programs are small and mostly compiled once,
# so LLVM's optimisation passes cost the CPU more than they save (the suite: ~30% less time on
# 2 cores). Float semantics do not change (XLA's CPU backend uses no fast-math). TPU compiles in
# child processes (benchmarks.aot.xla_tpu) drop the flag; benchmarks never see it.
TEST_XLA_FLAG = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAG}".strip()

# One persistent compilation cache for the run, fresh and removed after it (never the user's):
# the suite builds hundreds of engines over the same small configurations, and each engine
# compiles its programs ahead of time (nothing shared in memory between engines), so the same
# programs compiled again in every test file and every server process. The controller makes it;
# xdist's workers and the tests' child processes inherit it. The tests of the cache
# (test_compile_cache.py) name their own directories; PAGEDJAX_COMPILATION_CACHE=off as the
# environment turns it off.
if "PYTEST_XDIST_WORKER" not in os.environ and "PAGEDJAX_COMPILATION_CACHE" not in os.environ:
    os.environ["PAGEDJAX_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="pagedjax-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["PAGEDJAX_COMPILATION_CACHE"], True)

import pytest  # noqa: E402

from pagedjax.models import get_config, init_model  # noqa: E402

MAX_MAPS = 20_000  # of the kernel's default vm.max_map_count, 65,530


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(items):
    """A parametrized test marked quick_variant("id", ...) runs those variants in make test and
    its other variants in make test-slow (each compiles programs of its own configuration):
    make test keeps one path through every test, .ci/run runs them all."""
    for item in items:
        quick = item.get_closest_marker("quick_variant")
        callspec = getattr(item, "callspec", None)
        if quick is not None and callspec is not None and callspec.id not in quick.args:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After a test module, when the process holds more than MAX_MAPS memory maps, the programs
    compiled so far are let go (JAX's caches, the process-wide sampler programs; later modules
    compile what they need again). Each XLA CPU executable maps its code into the process (~6
    maps); a worker compiling thousands over the suite reached the kernel's vm.max_map_count
    (65,530) and its next compile crashed (an abort or a segfault inside backend_compile, near
    the end of the suite)."""
    yield
    try:
        with open("/proc/self/maps") as maps:  # Linux; elsewhere no such limit
            if sum(1 for _ in maps) < MAX_MAPS:
                return
    except OSError:
        return
    import gc

    import jax

    from pagedjax.engine import sampling_step

    sampling_step.clear_programs()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_model():
    """debug-tiny with seeded random weights (initializer_range 0.1 gives peaked logits, so
    greedy ties between two correct implementations are practically impossible)."""
    return init_model(get_config("debug-tiny"), seed=0)
