"""The dense path on the same models: the embedded model's tasks and trainer (python -m
pagedjax.models.training.train), the dense greedy generation the references use, and the
quality a quantization scheme keeps against the float model (quantization_quality)."""
