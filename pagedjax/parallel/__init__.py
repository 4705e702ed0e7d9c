"""Parallelism: tensor-parallel shardings, data-parallel replicas, multi-host groups, the parallel plan, request placement."""
