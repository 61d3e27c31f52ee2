"""Pytest configuration shared by every test."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked `tf_only` cannot run on another backend: deselect them there
    (the TensorFlow run covers them), rather than skipping inside the test."""
    if keras.backend.backend() == "tensorflow":
        return
    kept, deselected = [], []
    for item in items:
        (deselected if item.get_closest_marker("tf_only") else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture(autouse=True)
def _float32_policy():
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
