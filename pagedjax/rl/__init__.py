"""Reinforcement-learning integrations: pagedjax as the rollout engine of a JAX post-training
library (tunix_rollout: Tunix's BaseRollout; tunix_mapping: its models' weights in pagedjax's terms)."""
