"""Session-wide models of the checkpoint tests (building them is the slow part)."""

import pytest
from h3_checkpoints import FULL_NAMES_CONFIG

from flowlock.models.minimax_h3.tiny import make_h3, tiny_h3


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_h3()


@pytest.fixture(scope="session")
def full_names_model():
    return make_h3(FULL_NAMES_CONFIG, seed=3)


@pytest.fixture
def unpoisoned(monkeypatch):
    """Undo the session's NaN-poisoned ``torch.empty`` (its wrapper makes a ``torch.device("meta")`` build
    allocate on the CPU): for building full-size models on the meta device, which have no memory to poison."""
    monkeypatch.undo()
