"""The installed project in a fresh virtual environment (issue 51): one top-level import name,
`pagedjax`; a working directory with its own `models`, `scheduler` and `pallas_kernels` (each
raising on import) neither shadows the engine's nor is shadowed, for `LLM().generate` and for
`pagedjax serve`.

The wheel is built from this checkout without build isolation (setuptools from the test
environment) and installed with --no-deps into a new venv; the dependencies come from the test
environment's site-packages through a .pth line (a path line: that directory's own .pth files,
the editable install's finder among them, are not run)."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import sysconfig
import venv

import pytest
from helpers import complete, start_serve, wait_healthy

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHADOWS = ("models", "scheduler", "pallas_kernels")


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{args}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the fresh venv's python, its site-packages, a working directory full of shadows)."""
    tmp = tmp_path_factory.mktemp("install")
    source, wheels = tmp / "source", tmp / "wheels"
    # A copy of the checkout's files (tracked, and untracked but not ignored): setuptools builds
    # in the source tree, and a checkout's stale build/ must not reach the wheel.
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT)
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_symlink():  # pagedjax/models -> ../models, ...
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).symlink_to(os.readlink(ROOT / name))
        elif (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--wheel-dir", str(wheels), str(source), cwd=tmp)
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = pathlib.Path(run(str(python), "-c", "import sysconfig; "
                            "print(sysconfig.get_path('purelib'))").stdout.strip())
    (site / "test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
        "--no-deps", "--no-index", *map(str, wheels.glob("pagedjax-*.whl")))
    work = tmp / "work"
    (work / "models").mkdir(parents=True)
    for shadow in [f"{name}.py" for name in SHADOWS] + ["models/__init__.py"]:
        (work / shadow).write_text(f"raise ImportError('the user\\'s own {shadow} was "
                                   f"imported')\n")
    return python, site, work


def test_one_top_level_import_name(installed):
    _, site, _ = installed
    top = {p.name for p in site.iterdir()}
    assert "pagedjax" in top
    assert not top & {*SHADOWS, *(f"{name}.py" for name in SHADOWS)}, sorted(top)
    package = site / "pagedjax"
    for folder in SHADOWS:  # mapped under the pagedjax name, package data with them
        assert (package / folder / "__init__.py").is_file()
    assert (package / "models" / "checkpoints" / "pagedjax-tiny").is_dir()


def test_generate_beside_a_users_own_models_and_scheduler(installed):
    python, site, work = installed
    script = ("import sys\n"
              "from pagedjax import LLM, SamplingParams\n"
              "out = LLM().generate(['rev:paged='], SamplingParams(max_tokens=8, "
              "temperature=0), use_tqdm=False)\n"
              "print(out[0].outputs[0].text)\n"
              "import pagedjax.models, pagedjax.scheduler\n"
              "print(pagedjax.models.__file__)\n"
              "print(pagedjax.scheduler.__file__)\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in "
              "('models', 'scheduler', 'pallas_kernels')))\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ""}
    lines = run(str(python), "-c", script, cwd=work, env=env).stdout.splitlines()
    assert lines[0] == "degap"  # the embedded model reverses strings
    assert all(pathlib.Path(p).is_relative_to(site) for p in lines[1:3]), lines
    assert lines[3] == "[]"


def test_pagedjax_serve_beside_a_users_own_models_and_scheduler(installed):
    python, _, work = installed
    proc, url = start_serve("--max-model-len", "128", "--max-num-batched-tokens", "128",
                            "--served-model-name", "tiny",
                            command=[str(python.parent / "pagedjax")], cwd=work,
                            env={"PYTHONPATH": ""})
    try:
        wait_healthy(url, [proc])
        data = complete(url, {"model": "tiny", "prompt": "rev:paged=", "max_tokens": 8,
                              "temperature": 0}, timeout_s=60)
        assert data["choices"][0]["text"] == "degap"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), out
