"""Every route behind a key answers 401 without it and with a wrong one, on the server (the API
key on /v1 and the rest, the admin key on /admin) and on the router (its admin key on
/router); the routes are read from the apps themselves, so a route added later is checked too.
Every key check is a constant-time comparison (secrets.compare_digest)."""

from __future__ import annotations

import secrets

import pytest
from fastapi.testclient import TestClient
from test_server import ENGINE

from pagedjax import LLM
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.router import Router

API, ADMIN = "secret", "ops"
PATH_VALUES = {"{model:path}": "tiny", "{response_id}": "resp_none"}


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, HEAD aside (GET's twin)."""
    out = []
    for route in app.routes:
        path = route.path
        for pattern, value in PATH_VALUES.items():
            path = path.replace(pattern, value)
        assert "{" not in path, f"give {route.path} a value in PATH_VALUES"
        out += [(m, path) for m in sorted(getattr(route, "methods", None) or ()) if m != "HEAD"]
    return out


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def comparisons(monkeypatch):
    """What secrets.compare_digest compared, as (given, expected) pairs."""
    seen, real = [], secrets.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(secrets, "compare_digest", spy)
    return seen


def _check(client, routes, open_paths, key_of, other_keys):
    """Each route: 401 without a header, with a wrong key and with each of other_keys(path);
    not 401 with its own key_of(path)."""
    for method, path in routes:
        if path in open_paths:
            assert client.request(method, path).status_code == 200, path
            continue
        for headers in [{}, _bearer("wrong"), {"Authorization": key_of(path)},
                        *(_bearer(k) for k in other_keys(path))]:
            response = client.request(method, path, headers=headers)
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert client.request(method, path, headers=_bearer(key_of(path))).status_code != 401, \
            (method, path)


def test_every_server_route_needs_its_key(comparisons):
    server = OpenAIServer(LLM(**ENGINE).engine, "tiny", api_key=API, admin_key=ADMIN)
    app = server.build_app()
    routes = _routes(app)
    paths = {p for _, p in routes}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/tiny",
            "/metrics", "/tokenize", "/detokenize", "/openapi.json", "/docs", "/admin/config",
            "/admin/config/rollback"} <= paths
    weights = {"/update_weights", "/pause", "/resume", "/reset_prefix_cache", "/weight_info",
               "/is_paused", "/sleep", "/wake_up", "/is_sleeping"}  # the admin key's
    assert weights <= paths
    admin = lambda path: path.startswith("/admin/") or path in weights  # noqa: E731
    with TestClient(app) as client:
        _check(client, routes, {"/health"}, lambda p: ADMIN if admin(p) else API,
               lambda p: [API] if admin(p) else [ADMIN])
    # A wrong key was compared in constant time, against each key.
    assert (b"Bearer wrong", f"Bearer {API}".encode()) in comparisons
    assert (b"Bearer wrong", f"Bearer {ADMIN}".encode()) in comparisons


def test_every_router_admin_route_needs_the_admin_key(comparisons):
    router = Router(["http://127.0.0.1:9"], admin_key=ADMIN)
    app = router.build_app()
    routes = [(m, p) for m, p in _routes(app) if p.startswith("/router/")]
    assert {p for _, p in routes} == {"/router/status", "/router/canary", "/router/rollback",
                                      "/router/promote"}
    with TestClient(app) as client:
        _check(client, routes, set(), lambda p: ADMIN, lambda p: [])
    assert (b"Bearer wrong", f"Bearer {ADMIN}".encode()) in comparisons
