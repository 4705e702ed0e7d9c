"""The server's OpenAPI document is real (every POST route's request body and every answer
documented, /metrics as text/plain, HEAD answered), and schemathesis, driven by it against a
real server with bounded examples per operation, finds no 5xx and no answer outside the
document (status code, content type, body schema)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from test_server import ENGINE

from pagedjax import LLM
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer
from pagedjax.serving.response_store import ResponseStore

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import content_type_conformance  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

# Clients driving a real server: run by make test-clients (and CI), beside the client suite,
# to keep make test within its time.
pytestmark = pytest.mark.clients

EXAMPLES = 8  # per operation: a few seconds each on the tiny model


@pytest.fixture(scope="module", params=["generate", "pooling"])
def url(request):
    """A generating server with its admin routes, and a pooling one (the embedded model
    served as an embedding model: its last token's state, normalized)."""
    llm = LLM(**ENGINE, runner=request.param)
    server = OpenAIServer(llm.engine, "tiny", admin_key="ops")
    server.responses = ResponseStore(64)
    with BackgroundServer(server.build_app()) as url:
        yield url


def test_the_document_declares_bodies_answers_and_errors(url):
    doc = httpx.get(f"{url}/openapi.json").json()
    posts = {p: ops["post"] for p, ops in doc["paths"].items() if "post" in ops}
    pooling = "/v1/embeddings" in posts
    served = (("/v1/embeddings", "/pooling", "/classify", "/score", "/rerank", "/v1/rerank")
              if pooling else ("/v1/completions", "/v1/chat/completions", "/v1/responses"))
    for path in served + ("/tokenize", "/detokenize"):
        assert "requestBody" in posts[path], path
        assert set(posts[path]["responses"]) >= {"200", "400", "429", "500"}
    assert pooling != ("/v1/completions" in posts)  # one runner's routes, never both
    if not pooling:
        chat = posts["/v1/chat/completions"]["responses"]["200"]["content"]
        assert set(chat) == {"application/json", "text/event-stream"}
        assert chat["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["responses"]["200"].get("content") or path == "/metrics", (method, path)
    for path in ("/metrics", "/health", "/v1/models"):
        assert httpx.head(f"{url}{path}").status_code == 200, path


def test_schemathesis_finds_no_5xx_and_no_undocumented_answer(url):
    """Each operation of the document, EXAMPLES generated cases (hypothesis, derandomized)."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14
    for operation in operations:
        @given(operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            case.call_and_validate(base_url=url, timeout=60, checks=[
                not_a_server_error, status_code_conformance, content_type_conformance,
                response_schema_conformance])

        run()
