"""Pytest configuration shared by every test."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked `tf_only` / `jax_only` cannot run on the other backend:
    deselect them there (the other run covers them), rather than skipping
    inside the test."""
    backend = keras.backend.backend()
    wrong = {"tf_only": backend != "tensorflow", "jax_only": backend != "jax"}
    kept, deselected = [], []
    for item in items:
        other_backend = any(
            item.get_closest_marker(marker) and is_wrong
            for marker, is_wrong in wrong.items()
        )
        (deselected if other_backend else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture(autouse=True)
def _float32_policy():
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
