"""Files written atomically and hashed, and this machine as an artifact records it (architecture, CPU, versions).

Atomic writes go to a temporary file in the same directory, fsync, then rename into place: ``os.replace`` is atomic
on POSIX within one filesystem, so a reader sees the old file or the new one, never a half-written one, and a killed
writer leaves only a ``.tmp-*`` file that nothing reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path`` with the mode a plain write
    would give it (0666 less the umask), on error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        chmod_like_umask(tmp_path)  # mkstemp makes 0600: the written file gets a plain open()'s mode
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``, so a power loss after the rename exposes no empty file."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    umask = os.umask(0)  # the only way to read it: set, then restore at once
    os.umask(umask)
    return umask


def chmod_like_mkdir(path: Path) -> None:
    """Give ``path`` the mode a plain mkdir would (0777 less umask); mkdtemp creates 0700."""
    os.chmod(path, 0o777 & ~_umask())


def chmod_like_umask(path: str | os.PathLike) -> None:
    """Give ``path`` the mode a plain write would (0666, or 0777 if executable, less the umask):
    mkstemp and safetensors write 0600, which a server running as another user cannot read."""
    exe = os.stat(path).st_mode & 0o111
    os.chmod(path, (0o777 if exe else 0o666) & ~_umask())


def chmod_tree_like_umask(root: str | os.PathLike) -> None:
    """:func:`chmod_like_umask` on every file and :func:`chmod_like_mkdir` on every directory."""
    for dirpath, _, files in os.walk(root):
        chmod_like_mkdir(Path(dirpath))
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                chmod_like_umask(p)


def swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the complete ``tmp`` onto ``out``; a non-empty ``out`` is renamed aside first, then removed."""
    if not out.exists():
        os.rename(tmp, out)
        return
    if not any(out.iterdir()):
        os.replace(tmp, out)  # rename(2) replaces an empty directory atomically
        return
    old = Path(tempfile.mkdtemp(prefix=f".old-{out.name}-", dir=out.parent))
    os.replace(out, old)  # onto the fresh empty directory
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; on success it is chmodded, fsynced and renamed onto
    ``out``, on error removed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        chmod_like_mkdir(tmp)
        yield tmp
        chmod_tree_like_umask(tmp)
        fsync_tree(tmp)
        swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """``(sha256 hex digest, size in bytes)`` of the file at ``path`` (streamed: ``hashlib.file_digest``)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest(), os.fstat(f.fileno()).st_size


def sha256_json(obj: Any) -> str:
    """sha256 hex digest of ``obj`` as canonical JSON (sorted keys, no spaces): equal values, equal digests."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _cpuinfo(cpuinfo: str | None) -> str:
    """``cpuinfo`` as given, else the text of ``/proc/cpuinfo`` ("" where it cannot be read: not Linux)."""
    if cpuinfo is not None:
        return cpuinfo
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpuinfo_field(key: str, cpuinfo: str | None) -> str | None:
    """The value of the first ``key`` line of ``/proc/cpuinfo`` (or the text given), ``None`` where there is none."""
    for line in _cpuinfo(cpuinfo).splitlines():
        if line.startswith(key) and ":" in line:
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The ``flags`` of the first CPU in ``/proc/cpuinfo`` (or the text given); empty where there is none."""
    return set((_cpuinfo_field("flags", cpuinfo) or "").split())


def cpu_model(cpuinfo: str | None = None) -> str:
    """The ``model name`` of the first CPU in ``/proc/cpuinfo`` (or the text given); "" where there is none."""
    return _cpuinfo_field("model name", cpuinfo) or ""


def machine_name() -> str:
    """This machine as an artifact records it: ``"x86_64 (2 cpus)"`` (architecture and CPU count)."""
    import platform

    return f"{platform.machine()} ({os.cpu_count()} cpus)"


def versions() -> dict[str, str]:
    """What made an artifact: python, specdraft, torch (the running build, e.g. ``+cpu``), transformers,
    safetensors, accelerate, CUDA, and the machine (architecture and CPU count)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("specdraft", "torch", "transformers", "safetensors", "accelerate"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    import torch

    out["torch"] = torch.__version__  # the build actually running (e.g. "+cu130"), not just the wheel's number
    out["cuda"] = torch.version.cuda
    out["machine"] = machine_name()
    return out
