"""The dense training path on the same models: the embedded model's tasks and trainer (python -m
pagedjax.models.training.train), and the dense greedy generation the references use."""
