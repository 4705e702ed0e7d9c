"""aiperf (NVIDIA's benchmark tool), unchanged, through its own CLI: streamed chat completions
with --per-chunk-usage (vLLM's continuous usage stats) and streamed text completions, the
server's token counts used (--use-server-token-count). argv[1]: the server's URL; argv[2]: a
tokenizer directory.

Each run must finish every request without an error, each generating the output length asked
for (as the server's usage reports it), with times to first token measured."""

import json
import os
import subprocess
import sys
import tempfile

URL, TOKENIZER = sys.argv[1], sys.argv[2]
AIPERF = os.path.join(os.path.dirname(sys.executable), "aiperf")
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 6, 32, 10


def run(endpoint: str, *extra: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run([
            AIPERF, "profile", "--model", "smollm2", "--url", URL, "--endpoint-type", endpoint,
            "--streaming", "--tokenizer", TOKENIZER, "--concurrency", "2",
            "--request-count", str(REQUESTS), "--isl", str(PROMPT_TOKENS),
            "--osl", str(OUTPUT_TOKENS), "--extra-inputs", "ignore_eos:true",
            "--use-server-token-count",
            "--artifact-dir", out, "--ui", "none", *extra],
            capture_output=True, text=True, timeout=300)
        path = os.path.join(out, "profile_export_aiperf.json")
        assert result.returncode == 0 and os.path.exists(path), \
            f"{endpoint}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        with open(path) as f:
            return json.load(f)


for endpoint, extra in (("chat", ("--per-chunk-usage",)), ("completions", ())):
    report = run(endpoint, *extra)
    assert report["error_summary"] == [] and report["is_complete"], report["error_summary"]
    assert report["request_count"]["avg"] == REQUESTS, report["request_count"]
    lengths = report["output_sequence_length"]
    assert lengths["min"] == lengths["max"] == OUTPUT_TOKENS, lengths
    assert report["time_to_first_token"]["count"] == REQUESTS, report["time_to_first_token"]
    print(endpoint, "ok", flush=True)
print("OK")
