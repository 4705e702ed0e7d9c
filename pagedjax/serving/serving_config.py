"""Versioned serving configurations: what an instance serves with, as a file, so that a change
is a new version and a rollback returns to the previous one.

    # serving/v7.yaml (or .json)
    version: "v7"
    model: /models/llama-3.2-1b        # engine-level: a new version here needs a new instance
    engine: {max_model_len: 4096, max_num_seqs: 64, gpu_memory_utilization: 0.9}
    server:                            # live: the next requests get it, in-flight ones keep theirs
      max_outstanding_tokens: 200000
      kv_overcommit: 1.5
      long_context_threshold: 2048
      max_long_context_requests: 4
      max_non_streamed_requests: 32
      max_concurrent_requests: 128
      max_tokens_cap: 2048
      default_max_tokens: 512
      degradation: {ttft_p99_s: 2.0, itl_p99_s: 0.2, oom_burst: 2, window_s: 60, hold_s: 30}

`pagedjax serve --config FILE` starts with one; the active version is in `/v1/models`
(`config_version`) and on `/metrics` (`pagedjax:serving_config_info{version}`). Behind
`--admin-key`, `POST /admin/config` (a configuration as JSON) applies a new version's server
settings live, and `POST /admin/config/rollback` returns to the previous version; a version
whose model or engine settings differ is refused (409: it needs a new instance, rolled out by
the router's canary). Unknown keys are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os

from pagedjax.frontend.admission_control import AdmissionLimits
from pagedjax.scheduler.errors import check_int
from pagedjax.scheduler.request import INT32_MAX
from pagedjax.serving.degradation import DegradationPolicy

SERVER_KEYS = ({f.name for f in dataclasses.fields(AdmissionLimits)}
               | {"max_tokens_cap", "default_max_tokens", "degradation"})
TOP_KEYS = {"version", "model", "engine", "server"}
MAX_VERSION_CHARS = 128


class NeedsNewInstance(ValueError):
    """A version that changes the model or an engine setting: a running instance cannot apply
    it (HTTP 409); it is rolled out as a new instance."""


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    version: str
    model: str | None = None
    engine: dict = dataclasses.field(default_factory=dict)  # EngineConfig fields
    admission: AdmissionLimits = AdmissionLimits()
    max_tokens_cap: int | None = None
    default_max_tokens: int | None = 512
    degradation: DegradationPolicy = DegradationPolicy()

    def __post_init__(self):
        if not isinstance(self.version, str) or not self.version.strip() or \
                len(self.version) > MAX_VERSION_CHARS:
            raise ValueError(f"version must be a non-empty string of at most "
                             f"{MAX_VERSION_CHARS} characters, got {self.version!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a string, got {type(self.model).__name__}")
        if not isinstance(self.engine, dict):
            raise ValueError(f"engine must be a mapping, got {type(self.engine).__name__}")
        from pagedjax.engine.config import EngineConfig
        try:
            EngineConfig.from_kwargs(**self.engine)
        except (TypeError, ValueError) as e:
            raise ValueError(f"engine: {e}") from None
        for name in ("max_tokens_cap", "default_max_tokens"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1, INT32_MAX)

    @classmethod
    def from_dict(cls, data) -> "ServingConfig":
        """A configuration from its mapping; ValueError names the key at fault."""
        if not isinstance(data, dict):
            raise ValueError("a serving configuration must be a mapping")
        unknown = sorted(set(data) - TOP_KEYS)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; known: {sorted(TOP_KEYS)}")
        if "version" not in data:
            raise ValueError("version is required (the name a rollback returns to)")
        server = data.get("server") or {}
        if not isinstance(server, dict):
            raise ValueError("server must be a mapping")
        unknown = sorted(set(server) - SERVER_KEYS)
        if unknown:
            raise ValueError(f"unknown server key(s) {unknown}; known: {sorted(SERVER_KEYS)}")
        degradation = server.get("degradation") or {}
        if not isinstance(degradation, dict):
            raise ValueError("server.degradation must be a mapping")
        known = {f.name for f in dataclasses.fields(DegradationPolicy)}
        unknown = sorted(set(degradation) - known)
        if unknown:
            raise ValueError(f"unknown server.degradation key(s) {unknown}; known: "
                             f"{sorted(known)}")
        try:
            admission = AdmissionLimits(**{k: v for k, v in server.items()
                                           if k in {f.name for f in dataclasses.fields(
                                               AdmissionLimits)}})
            policy = DegradationPolicy(**degradation)
        except ValueError as e:
            raise ValueError(f"server: {e}") from None
        return cls(version=data["version"], model=data.get("model"),
                   engine=dict(data.get("engine") or {}), admission=admission,
                   max_tokens_cap=server.get("max_tokens_cap"),
                   default_max_tokens=server.get("default_max_tokens", 512),
                   degradation=policy)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ServingConfig":
        """From a .json or .yaml / .yml file; errors name the file."""
        from pagedjax.models.loading.user_files import read_user_text

        text = read_user_text(path, "serving config")
        try:
            if str(path).endswith((".yaml", ".yml")):
                import yaml
                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        except Exception as e:  # noqa: BLE001 - a syntax error of the file's format
            raise ValueError(f"{path}: not a valid configuration file: {e}") from None

    def to_dict(self) -> dict:
        server = {k: v for k, v in dataclasses.asdict(self.admission).items() if v is not None}
        server.update(max_tokens_cap=self.max_tokens_cap,
                      default_max_tokens=self.default_max_tokens,
                      degradation=dataclasses.asdict(self.degradation))
        return {"version": self.version, "model": self.model, "engine": dict(self.engine),
                "server": server}



def engine_fields(config) -> dict:
    """An EngineConfig as a configuration's engine mapping (every field)."""
    return dataclasses.asdict(config)


class ConfigHistory:
    """The versions an instance has served with, the active one last."""

    def __init__(self, first: ServingConfig):
        self.versions = [first]

    @property
    def active(self) -> ServingConfig:
        return self.versions[-1]

    def check(self, config: ServingConfig) -> None:
        """NeedsNewInstance naming what cannot change on a running instance."""
        from pagedjax.engine.config import EngineConfig

        active = self.active
        fields = ["model"] if config.model is not None and config.model != active.model else []
        mine, theirs = (dataclasses.asdict(EngineConfig.from_kwargs(**c.engine))
                        for c in (active, config))
        fields += [f"engine.{k}" for k in sorted(mine) if mine[k] != theirs[k]]
        if fields:
            raise NeedsNewInstance(
                f"version {config.version!r} changes {', '.join(fields)}: that needs a new "
                "instance (roll it out as a canary through the router)")

    def push(self, config: ServingConfig) -> None:
        self.check(config)
        self.versions.append(config)

    def rollback(self) -> ServingConfig:
        """Drops the active version; returns the previous one (now active)."""
        if len(self.versions) < 2:
            raise ValueError(f"version {self.active.version!r} is the first: nothing to roll "
                             "back to")
        self.versions.pop()
        return self.active
