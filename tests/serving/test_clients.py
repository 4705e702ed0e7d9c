"""Real clients, unchanged, against a real server (`make test-clients`, which .ci/run calls):
each client in a virtual environment of its own (.venv-clients/NAME, pinned by
requirements/clients/NAME.txt) runs its script in tests/clients/ against `pagedjax serve`'s app on
SmolLM2-135M-Instruct with the tool-aware ChatML template and the hermes tool parser, and
asserts its own success (an agent's final output, a parsed pydantic model, tool calls), not
only status codes."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest
from test_gguf import needs_smollm, smollm_path

from pagedjax import LLM
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer
from pagedjax.text.tokenizer import read_chat_template

pytestmark = [pytest.mark.clients, needs_smollm]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENTS = {"openai-agents": "openai_agents_client.py", "langchain": "langchain_client.py",
           "instructor": "instructor_client.py", "litellm": "litellm_client.py",
           "guidellm": "guidellm_client.py", "aiperf": "aiperf_client.py"}
# Against a pooling server (--runner pooling: SmolLM2 as an embedding model, its last token's
# state normalized), in the same environments.
EMBEDDING_CLIENTS = {"langchain": "embeddings_client.py", "litellm": "litellm_embeddings_client.py"}
# Set by `make test-clients`, which builds the environments first: a missing one then fails.
REQUIRED = os.environ.get("PAGEDJAX_CLIENT_VENVS") == "1"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the server's URL, the model's tokenizer as a directory: the benchmark clients size
    their prompts with it)."""
    llm = LLM(smollm_path(), max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=1024)
    tokenizer = llm.tokenizer.save_pretrained(tmp_path_factory.mktemp("tokenizer"))
    server = OpenAIServer(llm.engine, "smollm2", chat_template=read_chat_template("tool_chatml"),
                          tool_call_parser="hermes", enable_auto_tool_choice=True,
                          enable_prompt_tokens_details=True)
    with BackgroundServer(server.build_app()) as url:
        yield url, tokenizer


@pytest.fixture(scope="module")
def pooled():
    llm = LLM(smollm_path(), runner="pooling", max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=256)
    with BackgroundServer(OpenAIServer(llm.engine, "smollm2").build_app()) as url:
        yield url


def run_client(name: str, script: str, *args: str) -> None:
    """script (tests/clients/) in the environment of client name, asserting its success."""
    python = ROOT / ".venv-clients" / name / "bin" / "python"
    if not python.exists():
        assert not REQUIRED, f"{python} is missing: make test-clients builds it"
        pytest.skip(f"{name}'s environment is not built (make test-clients)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "PYTHON"))}
    result = subprocess.run([str(python), str(ROOT / "tests" / "clients" / script), *args],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), \
        f"{name}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_client_works_unchanged(served, name):
    run_client(name, CLIENTS[name], *served)


@pytest.mark.parametrize("name", sorted(EMBEDDING_CLIENTS))
def test_embedding_client_works_unchanged(pooled, name):
    run_client(name, EMBEDDING_CLIENTS[name], pooled)
