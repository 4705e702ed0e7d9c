"""Tools over the engine: the `pagedjax` CLI, the demos, workload profiling, plotting."""
