"""The HTTP API: the OpenAI-compatible app (app over server_state), one module an endpoint
family, its protocol, metrics, degradation, serving configurations, traces, the KV-aware router
(the engine's front-ends it drives are pagedjax.frontend)."""
