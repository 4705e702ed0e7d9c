"""The engine core: LLMEngine (schedule -> plan -> run -> postprocess), the model runner, sampling, outputs, stats, config."""
