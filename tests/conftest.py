"""Shared fixtures. Real embedded models are loaded once per test session (``real_model``), not once per test."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(scope="session")
def real_model():
    """``real_model(name, dtype="float32") -> (model, tokenizer)`` on CPU, shared by the tests of a session.

    The two most recently used models stay loaded (the default pair in float32 is ~8 GB; more would break the
    suite's memory bound), so consecutive tests of one pair load it once. Tests must not modify the returned
    model (weights or config): later tests share it."""
    from specdraft.models import load_model

    cache: dict = {}

    def get(name: str, dtype: str = "float32"):
        key = (name, dtype)
        if key in cache:
            cache[key] = cache.pop(key)  # most recently used last
        else:
            while len(cache) >= 2:
                cache.pop(next(iter(cache)))
                gc.collect()
            cache[key] = load_model(name, dtype=dtype, device="cpu")
        return cache[key]

    yield get
    cache.clear()
    gc.collect()
