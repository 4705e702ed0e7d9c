import pytest

from models import get_config, init_model


@pytest.fixture(scope="session")
def tiny_model():
    """debug-tiny with seeded random weights (initializer_range 0.1 gives peaked logits, so
    greedy ties between two correct implementations are practically impossible)."""
    return init_model(get_config("debug-tiny"), seed=0)
