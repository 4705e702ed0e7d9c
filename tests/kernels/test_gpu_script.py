"""The GPU device script (benchmarks/gpu_kernels.py) runs, here through the Pallas interpreter.

A device lease is minutes long and starts bare: a script that breaks there costs the lease. These
run slices of it on the CPU (`--smoke`): the decode comparison with its three implementations and
their errors against the reference, and a run whose time budget is spent, which must still write
every results file, say what it skipped, and copy the files to $OUT as the device tool wants.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from pagedjax.pallas_kernels.gpu import mosaic

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_kernels.py"


def run_script(*args, env=None):
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


@pytest.mark.slow  # make test-slow
def test_decode_slice_compares_the_implementations(tmp_path):
    run_script("--sections", "decode", "--batches", "1", "--contexts", "64",
               "--out-dir", str(tmp_path))
    data = json.loads((tmp_path / "gpu_kernels_smoke.json").read_text())
    rows = {row["impl"]: row for row in data["rows"]}
    # The Mosaic GPU kernel where jax has its interpreter (>= 0.11, as on the device).
    assert set(rows) == {"reference (XLA)", "pagedjax gpu kernel",
                         "jax pallas.ops.gpu.paged_attention"} | (
        {"pagedjax mosaic_gpu kernel"} if mosaic.problem() is None else set())
    for row in rows.values():
        assert "error" not in row, row
        assert row["us"] > 0 and row["pct_of_copy_bw"] > 0
        # bf16 K/V and outputs: each side rounds its result to bf16 (2**-8 relative).
        assert row["rel_err_vs_reference"] < 1e-2, row
    assert rows["reference (XLA)"]["rel_err_vs_reference"] == 0.0
    assert rows["jax pallas.ops.gpu.paged_attention"]["speedup_vs_jax_op"] == 1.0
    assert data["params"]["copy_bandwidth_gb_per_s"] > 0
    md = (tmp_path / "gpu_kernels_smoke.md").read_text()
    assert "pagedjax gpu kernel" in md and "bash benchmarks/run_gpu.sh" in md


def test_spent_budget_still_writes_every_file(tmp_path):
    device_out = tmp_path / "OUT"
    device_out.mkdir()
    run_script("--sections", "checks,decode,tuning,engine", "--budget-s", "0",
               "--out-dir", str(tmp_path / "results"), env={"OUT": str(device_out)})
    for name in ("gpu_kernels_smoke", "gpu_kernels_smoke_tuning"):
        for ext in ("json", "md"):
            assert (device_out / f"{name}.{ext}").read_text() == \
                (tmp_path / "results" / f"{name}.{ext}").read_text()
    data = json.loads((tmp_path / "results" / "gpu_kernels_smoke.json").read_text())
    assert data["rows"] and all(row["error"] == "skipped: time budget" for row in data["rows"])
    tuning = json.loads((tmp_path / "results" / "gpu_kernels_smoke_tuning.json").read_text())
    assert tuning["rows"] and all("skipped" in row["error"] for row in tuning["rows"])
    assert data["params"]["checks_passed"] == 0 and data["params"]["checks_total"] > 10
    md = (tmp_path / "results" / "gpu_kernels_smoke.md").read_text()
    assert "FAIL engine greedy tokens skipped: time budget" in md


@pytest.mark.skipif(mosaic.problem() is not None,
                    reason=str(mosaic.problem()))
def test_mosaic_kernel_check_runs(tmp_path):
    """One of the script's Mosaic GPU checks end to end (the cases themselves are
    tests/kernels/test_kernels_mosaic_gpu.py's)."""
    run_script("--sections", "checks", "--checks", "mosaic decode S=16 N=8 K=2",
               "--out-dir", str(tmp_path))
    md = (tmp_path / "gpu_kernels_smoke.md").read_text()
    mosaic = [line for line in md.splitlines() if "mosaic decode" in line]
    assert len(mosaic) == 1 and mosaic[0].startswith("- PASS"), mosaic


@pytest.mark.slow  # tensor parallel over the host devices: make test-slow
def test_engine_section_runs_tensor_parallel_over_the_devices(tmp_path):
    """The engine check runs the gpu backend over every device the model splits over (here 2
    CPU devices, the kernels interpreted under shard_map; one GPU on the lent H200 is TP 1)."""
    run_script("--sections", "engine", "--out-dir", str(tmp_path), env={
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                     f"--xla_force_host_platform_device_count=2"})
    md = (tmp_path / "gpu_kernels_smoke.md").read_text()
    assert "- PASS engine greedy tokens, gpu backend at TP 2 == reference at TP 1" in md, md
