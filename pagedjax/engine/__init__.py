"""The engine: LLMEngine (schedule -> plan -> run -> postprocess), its request checks and intake,
the KV pool and the model runner, sampling, token masks, outputs, stats, config, and speculative
decoding (spec_decode/)."""
