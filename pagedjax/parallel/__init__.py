"""Where an engine runs: tensor-parallel shardings, placement (devices and backend), multi-host
groups, the parallel plan, request placement (routing_policy). Data-parallel replicas are a
front-end (pagedjax.frontend.data_parallel)."""
