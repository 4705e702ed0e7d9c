"""LoRA adapters over HTTP (issue 53), as vLLM serves them:

- `--lora-modules name=path` (or JSON `{"name", "path", "base_model_name"}`): adapters a
  request picks by the OpenAI `model` field; `/v1/models` lists each after the base model, its
  `root` the adapter's path and its `parent` the model it adapts.
- `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}` and `POST
  /v1/unload_lora_adapter {"lora_name"}` when runtime updates are allowed
  (`--allow-runtime-lora-updating`, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true), answered
  with vLLM's plain-text success lines. Loading reads and checks the adapter on the engine's side
  (400 naming what does not fit); `load_inplace` gives a loaded adapter new weights in place
  (LLMEngine.update_lora); an unknown adapter is a 404 naming it.

Loads and unloads run one at a time (a lock around each, its id taken before the engine is
asked), so concurrent loads of different adapters each get their own id and concurrent loads of
one name answer "already loaded". Unloading is vLLM's rule: the name is gone at once (new
requests naming it get 404, a request resolved just before is refused by the engine), requests
already running under it finish under it, and a reload of the name is a new adapter (a new id).

`--allowed-lora-paths DIR ...` (the operator's allowlist): a runtime load's lora_path must lie
under one of them (after links), else a 400 that says only that, so a client learns nothing of
the server's files; without it any path the server can read is loaded (vLLM's behaviour).
"""

from __future__ import annotations

import asyncio
import json
import os

import fastapi
from fastapi import responses
from pydantic import BaseModel, ConfigDict, Field

from pagedjax.lora.peft_adapter import read_config
from pagedjax.lora.request import MAX_LORA_NAME_CHARS, LoRARequest
from pagedjax.models.loading.user_files import is_within
from pagedjax.serving.http_common import APIError, parse_body

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_from_env() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").lower() in ("1", "true")


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(..., min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(..., min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(..., min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_int_id: int | None = Field(None, ge=1)


def parse_lora_module(entry) -> dict:
    """One --lora-modules entry: `name=path`, or a JSON object (or dict) with name, path and
    optionally base_model_name (ValueError naming what is wrong)."""
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            entry = json.loads(entry)
        except ValueError as error:
            raise ValueError(f"--lora-modules: {entry!r} is not JSON ({error})") from None
    if isinstance(entry, str):
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path (or JSON with name and path), "
                             f"got {entry!r}")
        entry = {"name": name, "path": path}
    if not isinstance(entry, dict) or not {"name", "path"} <= set(entry) \
            or not set(entry) <= {"name", "path", "base_model_name"}:
        raise ValueError(f"--lora-modules JSON holds name, path and optionally "
                         f"base_model_name, got {entry!r}")
    return entry


class ServedLoRAs:
    """The adapters the server answers to, by name (ids given in order, from 1)."""

    def __init__(self, base_name: str, modules=(), runtime_updates: bool = False,
                 allowed_paths=()):
        self.base_name = base_name
        self.runtime_updates = runtime_updates
        if isinstance(allowed_paths, (str, os.PathLike)):
            allowed_paths = [allowed_paths]
        for path in allowed_paths:
            if not os.path.isdir(path):
                raise ValueError(f"--allowed-lora-paths: {path} is not a directory")
        self.allowed_roots = [os.path.realpath(p) for p in allowed_paths]
        self.by_name: dict[str, LoRARequest] = {}
        self.next_id = 1
        for entry in modules:
            module = parse_lora_module(entry)
            read_config(module["path"])  # a bad directory stops the start, named
            self.add(module["name"], module["path"], module.get("base_model_name"))

    def add(self, name: str, path: str, base_model_name: str | None = None,
            lora_id: int | None = None) -> LoRARequest:
        """Serves the adapter under name (lora_id: one new_id gave; None: the next)."""
        if name == self.base_name or name in self.by_name:
            raise ValueError(f"--lora-modules: the name {name!r} is taken")
        lora = LoRARequest(name, self.new_id() if lora_id is None else lora_id, path,
                           base_model_name)
        self.by_name[name] = lora
        return lora

    def new_id(self) -> int:
        """An id no adapter of this server had before (ids are never reused)."""
        lora_id, self.next_id = self.next_id, self.next_id + 1
        return lora_id

    def check_path(self, path: str) -> None:
        """APIError 400 unless path lies under an allowed root (when the operator set any)."""
        if not self.allowed_roots:
            return
        real = os.path.realpath(path)
        if not any(is_within(real, root) for root in self.allowed_roots):
            raise APIError(400, "lora_path is not under a directory this server allows "
                           "adapters from (--allowed-lora-paths)", "lora_path")

    def resolve(self, model: str | None, param: str | None = "model") -> LoRARequest | None:
        """The adapter `model` names; None for the base model (or no name); 404 otherwise."""
        if model is None or model == self.base_name:
            return None
        lora = self.by_name.get(model)
        if lora is None:
            served = [self.base_name, *self.by_name]
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{served[:20]}", param, code="model_not_found")
        return lora

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        return [{"id": lora.lora_name, "object": "model", "created": created,
                 "owned_by": "pagedjax", "root": lora.lora_path,
                 "parent": lora.base_model_name or self.base_name,
                 "max_model_len": max_model_len} for lora in self.by_name.values()]


def lora_routes(server, app: fastapi.FastAPI) -> None:
    """The runtime load / unload routes (only when server.loras allows runtime updates)."""
    loras = server.loras

    async def control(control_name: str, **kwargs):
        try:
            return await server.async_engine.control(control_name, **kwargs)
        except ValueError as error:  # the adapter named by the engine
            raise APIError(400, str(error)[:2000], "lora_path") from None

    lock = asyncio.Lock()  # one load or unload at a time: the tables move together

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: fastapi.Request):
        body = parse_body(await request.body(), LoadLoRARequest)
        loras.check_path(body.lora_path)
        async with lock:
            known = loras.by_name.get(body.lora_name)
            if known is not None and not body.load_inplace:
                raise APIError(400, f"The lora adapter '{body.lora_name}' has already been "
                               f"loaded.", "lora_name")
            if known is not None:
                await control("update_lora", lora_name=body.lora_name, path=body.lora_path)
            else:
                if body.lora_name == loras.base_name:
                    raise APIError(400, f"the name {body.lora_name!r} is the base model's",
                                   "lora_name")
                lora_id = loras.new_id()
                await control("add_lora", lora_name=body.lora_name, lora_id=lora_id,
                              path=body.lora_path)
                loras.add(body.lora_name, body.lora_path, lora_id=lora_id)
        return responses.PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: fastapi.Request):
        body = parse_body(await request.body(), UnloadLoRARequest)
        async with lock:
            lora = loras.by_name.get(body.lora_name)
            if lora is None or body.lora_int_id not in (None, lora.lora_int_id):
                raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                               "lora_name", code="model_not_found")
            del loras.by_name[body.lora_name]  # first: no request resolves it from here on
            await control("remove_lora", lora_id=lora.lora_int_id)
        return responses.PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
