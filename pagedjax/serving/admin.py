"""An instance's admin endpoints, behind `--admin-key` (they do not exist without one):

    GET  /admin/config            the active serving configuration and the versions before it
    POST /admin/config            a new version (JSON, pagedjax.serving.serving_config's format):
                                  its server settings apply to the next requests at once
    POST /admin/config/rollback   back to the previous version

Requests in flight keep the settings they were admitted under: nothing is dropped. A version
that changes the model or an engine setting is refused (409): it needs a new instance. The admin
key alone opens these routes: with an `--api-key` too, they do not take it (nor ask for it).
"""

from __future__ import annotations

import logging

import fastapi

from pagedjax.serving.http_common import error_response, get_route, key_matches, parse_json_object
from pagedjax.serving.server_state import ServerState
from pagedjax.serving.serving_config import NeedsNewInstance, ServingConfig

logger = logging.getLogger("pagedjax.admin")

CONFIG_PATH, ROLLBACK_PATH = "/admin/config", "/admin/config/rollback"
PATHS = (CONFIG_PATH, ROLLBACK_PATH)


def admin_only(server: ServerState, handler):
    """handler behind the admin key (401 without it)."""
    async def guarded(request: fastapi.Request):
        key = server.admin_key
        if key is None or not key_matches(request.headers.get("authorization"), key):
            return error_response(401, "missing or wrong admin key (Authorization: "
                                  "Bearer ...)", None, "authentication_error",
                                  "invalid_api_key")
        return await handler(request)
    return guarded


def admin_routes(server: ServerState, app: fastapi.FastAPI) -> None:
    def admin(handler):
        return admin_only(server, handler)

    def status() -> dict:
        return {"active": server.configs.active.to_dict(),
                "versions": [c.version for c in server.configs.versions],
                "degradation_level": server.degradation.level}

    async def get_config(request):
        return status()

    async def post_config(request):
        try:
            config = ServingConfig.from_dict(parse_json_object(await request.body()))
            server.configs.push(config)
        except ValueError as e:
            return error_response(409 if isinstance(e, NeedsNewInstance) else 400, str(e),
                                  "config")
        server.apply_config(config)
        logger.warning("serving configuration %r applied", config.version)
        return status()

    async def rollback(request):
        try:
            config = server.configs.rollback()
        except ValueError as e:
            return error_response(409, str(e), None)
        server.apply_config(config)
        logger.warning("serving configuration rolled back to %r", config.version)
        return status()

    get_route(app, CONFIG_PATH)(admin(get_config))
    app.post(CONFIG_PATH)(admin(post_config))
    app.post(ROLLBACK_PATH)(admin(rollback))
