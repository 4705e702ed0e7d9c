"""guidellm (vLLM's benchmark tool), unchanged, through its own CLI: its default run (a
streamed chat completion with vLLM's continuous usage stats in every chunk), text completions,
the Responses API, and a non-streamed chat run, each a short concurrent benchmark on synthetic
prompts. argv[1]: the server's URL; argv[2]: a tokenizer directory (guidellm sizes its prompts
with it).

Each run must complete every request without an error, every request generating the
max_tokens guidellm asked for (it sends ignore_eos, vLLM's field), with the usage the server
reported and a measured time to first token."""

import json
import os
import subprocess
import sys
import tempfile

URL, TOKENIZER = sys.argv[1], sys.argv[2]
GUIDELLM = os.path.join(os.path.dirname(sys.executable), "guidellm")
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 6, 48, 12


def run(request_format: str, stream: bool) -> dict:
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "benchmarks.json")
        result = subprocess.run([
            GUIDELLM, "run",
            "--backend", f"kind=openai_http,target={URL},model=smollm2,"
                         f"request_format={request_format},stream={str(stream).lower()}",
            "--profile", "kind=concurrent,streams=3",
            "--constraint", f"kind=max_requests,count={REQUESTS}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                      f"output_tokens={OUTPUT_TOKENS}",
            "--tokenizer", f"kind=hf_auto,model={TOKENIZER}",
            "--output", f"kind=json,path={path}", "--disable-console-interactive"],
            capture_output=True, text=True, timeout=300)
        assert result.returncode == 0 and os.path.exists(path), \
            f"{request_format}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        with open(path) as f:
            return json.load(f)["benchmarks"][0]


for request_format, stream in (("/v1/chat/completions", True), ("/v1/completions", True),
                               ("/v1/responses", True), ("/v1/chat/completions", False)):
    benchmark = run(request_format, stream)
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}, \
        (request_format, stream, totals, benchmark["requests"].get("errored"))
    for request in benchmark["requests"]["successful"]:
        assert request["output"] and request["output_tokens"] == OUTPUT_TOKENS, request
        assert request["prompt_tokens"] >= PROMPT_TOKENS, request
        if stream:
            assert request["time_to_first_token_ms"] > 0, request
    print(request_format, "stream" if stream else "whole", "ok", flush=True)
print("OK")
