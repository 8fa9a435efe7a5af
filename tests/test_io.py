"""Atomic writes (what they leave on disk, and with which modes), file and JSON digests, and the CPU as read."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from specdraft.core.io import (
    atomic_directory,
    atomic_path,
    atomic_write_text,
    cpu_flags,
    cpu_model,
    sha256_file,
    sha256_json,
)


@pytest.fixture
def umask():
    """Set the process umask for one test and restore it after."""
    saved = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(saved)


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_atomic_files_get_the_mode_of_a_plain_write(tmp_path, umask, mask):
    """mkstemp makes 0600: a shipped file must read like its neighbours (0644 under umask 022)."""
    umask(mask)
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_write_text(tmp_path / "a.json", "{}")
    with atomic_path(tmp_path / "b.bin") as tmp:
        tmp.write_bytes(b"\0")
    assert _mode(plain) == 0o666 & ~mask
    assert _mode(tmp_path / "a.json") == _mode(tmp_path / "b.bin") == 0o666 & ~mask


def test_atomic_directory_widens_what_its_writers_made_private(tmp_path, umask):
    """safetensors (through save_pretrained) writes 0600; the finished directory holds plain-mode files."""
    umask(0o022)
    with atomic_directory(tmp_path / "out") as tmp:
        (tmp / "sub").mkdir()
        for f in (tmp / "weights.safetensors", tmp / "sub" / "x.json"):
            f.write_bytes(b"w")
            os.chmod(f, 0o600)
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(tmp / "run.sh", 0o700)
    out = tmp_path / "out"
    assert _mode(out) == _mode(out / "sub") == 0o755
    assert _mode(out / "weights.safetensors") == _mode(out / "sub" / "x.json") == 0o644
    assert _mode(out / "run.sh") == 0o755  # an executable stays executable


def test_a_converted_speculator_is_readable_by_others(tmp_path, umask):
    """The end-to-end case of the issue: model.safetensors after export was -rw-------."""
    from specdraft.serving.export import export_draft
    from specdraft.testing import save_tiny_pair

    umask(0o022)
    target, draft = save_tiny_pair(tmp_path, 64)
    out = tmp_path / "spec"
    export_draft(draft, target, out)
    modes = {p.name: _mode(p) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_cpu_flags_and_model_read_the_first_cpus_lines():
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx2 amx_tile\nbugs\t\t: spectre\n"
            "processor\t: 1\nmodel name\t: other\nflags\t\t: other\n")
    assert cpu_flags(text) == {"fpu", "avx2", "amx_tile"} and cpu_model(text) == "AMD EPYC 9654"
    assert cpu_flags("no flags here") == set() and cpu_model("") == ""


def test_digests_are_of_the_bytes_and_of_canonical_json(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100_000)
    assert sha256_file(path) == (hashlib.sha256(b"x" * 100_000).hexdigest(), 100_000)
    assert sha256_json({"a": 1, "b": [2, 3]}) == sha256_json({"b": [2, 3], "a": 1})
    assert sha256_json({"a": 1}) == hashlib.sha256(b'{"a":1}').hexdigest()
