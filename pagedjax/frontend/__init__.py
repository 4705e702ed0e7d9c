"""The engine's front-ends, one room: what stands in front of an LLMEngine and drives its steps.
make_engine (data_parallel: one engine, or replicas behind one), AsyncLLMEngine (async_engine:
the engine on a thread of the server's process), the engine core (engine_core: the engine in a
process of its own) and its client (core_client, with output_deltas, the channel's encoding),
EngineDriver (engine_driver: what serving adds around a step wherever the engine runs) and the
token-budget admission control it applies (admission_control: HTTP 429s by reason)."""
