"""Shared fixtures. Real embedded models are loaded once per test module (``real_model``), not once per test."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(scope="module")
def real_model():
    """``real_model(name, dtype="float32") -> (model, tokenizer)`` on CPU, shared by the tests of a module.

    The two most recently used models stay loaded (the default pair in float32 is ~8 GB), and all are released
    when the module ends, so tests that load models themselves (the pipeline) never run beside a held pair. Tests must not modify the returned
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


@pytest.fixture(autouse=True, scope="session")
def _speed_cache(tmp_path_factory):
    """Calibrations measured by the tests go to a session directory, never the user's cache
    (:func:`specdraft.evaluate.cached_speed_model`)."""
    import os

    old = os.environ.get("SPECDRAFT_SPEED_CACHE")
    os.environ["SPECDRAFT_SPEED_CACHE"] = str(tmp_path_factory.mktemp("speed-cache"))
    yield
    if old is None:
        os.environ.pop("SPECDRAFT_SPEED_CACHE", None)
    else:
        os.environ["SPECDRAFT_SPEED_CACHE"] = old
