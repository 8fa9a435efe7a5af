"""Shared fixtures. Real embedded models are loaded once per test module (``real_model``), not once per test."""

from __future__ import annotations

import gc

import pytest


def release_memory() -> None:
    """Collect garbage, then hand the heap's free pages back to the OS (glibc's ``malloc_trim``).

    A freed model's tensors below glibc's mmap threshold (32 MB at most: a bfloat16 MLP matrix of the 1.5B target is
    27.5 MB) return to the heap, not the OS: the process keeps them resident, and a pytest run is one process, so
    each real model loaded and freed would raise the floor under every later test (3.3 GB after the real dump
    test, before this)."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@pytest.fixture(scope="module")
def real_model():
    """``real_model(name, dtype="float32") -> (model, tokenizer)`` on CPU, shared by the tests of a module.

    The two most recently used models stay loaded (a new one loads beside one other at most), and all are released
    when the module ends, so tests that load models themselves (the pipeline) never run beside a held pair. Tests must
    not modify the returned model (weights or config): later tests share it."""
    from specdraft.models.loading import load_model

    cache: dict = {}

    def get(name: str, dtype: str = "float32"):
        key = (name, dtype)
        if key in cache:
            cache[key] = cache.pop(key)  # most recently used last
        else:
            while len(cache) >= 2:
                cache.pop(next(iter(cache)))
                release_memory()
            cache[key] = load_model(name, dtype=dtype, device="cpu")
        return cache[key]

    yield get
    cache.clear()
    release_memory()


@pytest.fixture(autouse=True)
def _release_after_real_weights(request):
    """After a test on real weights, the memory its models held goes back to the OS (:func:`release_memory`)."""
    yield
    if request.node.get_closest_marker("real"):
        release_memory()


@pytest.fixture(autouse=True, scope="session")
def _speed_cache(tmp_path_factory):
    """Calibrations measured by the tests go to a session directory, never the user's cache
    (:func:`specdraft.decoding.calibration.cached_speed_model`)."""
    import os

    old = os.environ.get("SPECDRAFT_SPEED_CACHE")
    os.environ["SPECDRAFT_SPEED_CACHE"] = str(tmp_path_factory.mktemp("speed-cache"))
    yield
    if old is None:
        os.environ.pop("SPECDRAFT_SPEED_CACHE", None)
    else:
        os.environ["SPECDRAFT_SPEED_CACHE"] = old
