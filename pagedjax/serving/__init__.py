"""The online stack: the OpenAI-compatible app, its protocol, the async engine loop, metrics, traces, the KV-aware router."""
