"""Host time per pooled pair as the queue grows (issue 71): /score requests of 1,024 pairs each
(the route's cap) sent together, so 2,048 to 16,384 pairs wait at once, on a small random Qwen3
embedding model (the device work per pair is small: what grows is the host's).

The baseline, measured in the same run, is the engine driver as it was: outstanding tokens
summed over every live request at each step's report (O(queue) a step, O(queue^2) a queue).
The table gives ms per pair at each queue size for both, and their ratio.

    .venv/bin/python benchmarks/pooling_queue.py [--sizes 2048,8192,16384]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), *sorted({str(p.parent) for p in (ROOT / "tests").glob("*/test_*.py")})]
RESULTS = ROOT / "benchmarks" / "results"


def brute_outstanding(driver) -> int:
    """The driver's outstanding tokens as they were computed before issue 71."""
    from pagedjax.frontend.engine_driver import remaining_tokens
    return sum(remaining_tokens(samples) for samples in driver.live.values())


def timed(client, pairs: int) -> float:
    """Seconds to score `pairs` pairs sent as requests of 1,024 at once."""
    bodies = [{"text_1": "w1 w2", "text_2": [f"w{(i + j) % 100} w{(7 * i) % 100} w3"
                                            for i in range(min(1024, pairs - j))]}
              for j in range(0, pairs, 1024)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: client.post("/score", json=body), bodies))
    assert all(a.status_code == 200 for a in answers), answers[0].text
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2048,8192,16384")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    from fastapi.testclient import TestClient
    from pooling_checkpoints import save_random, word_tokenizer, write_st_pipeline

    from pagedjax import LLM
    from pagedjax.frontend.engine_driver import EngineDriver
    from pagedjax.serving.app import OpenAIServer

    directory = pathlib.Path(tempfile.mkdtemp())
    save_random(directory, "Qwen3Config", "Qwen3ForCausalLM", head_dim=32,
                tie_word_embeddings=True)
    write_st_pipeline(directory, "lasttoken", normalize=True)
    word_tokenizer(directory)
    llm = LLM(str(directory), runner="pooling", block_size=16, max_model_len=128,
              max_num_seqs=64, max_num_batched_tokens=512)
    kept = EngineDriver.outstanding_tokens
    rows = []
    with TestClient(OpenAIServer(llm.engine, "emb").build_app()) as client:
        timed(client, 1024)  # compiles
        for size in sizes:
            row = {"pairs": size}
            for name, method in (("baseline", brute_outstanding), ("running_totals", kept)):
                EngineDriver.outstanding_tokens = method
                row[f"{name}_ms_per_pair"] = 1000 * timed(client, size) / size
            EngineDriver.outstanding_tokens = kept
            row["speedup"] = row["baseline_ms_per_pair"] / row["running_totals_ms_per_pair"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| pairs queued | baseline ms/pair | running totals ms/pair | speedup |",
             "|---|---|---|---|"]
    lines += [f"| {r['pairs']} | {r['baseline_ms_per_pair']:.2f} | "
              f"{r['running_totals_ms_per_pair']:.2f} | {r['speedup']:.2f}x |" for r in rows]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pooling_queue.json").write_text(json.dumps(rows, indent=2) + "\n")
    (RESULTS / "pooling_queue.md").write_text(
        "# Host time per pooled pair as the queue grows\n\n"
        "`.venv/bin/python benchmarks/pooling_queue.py`; /score requests of 1,024 pairs sent "
        "together; the baseline is the driver summing outstanding tokens over every live "
        "request each step, in the same run.\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
