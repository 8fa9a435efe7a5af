"""Ship a draft: write it as an *independent speculator* and say how vLLM serves it.

* :func:`convert` — a plain draft checkpoint (as it is, untrained) → a speculator directory: weights re-saved
  byte-identical, ``config.json`` = the draft's plus the three ``speculators_*`` keys
  (:mod:`specdraft.speculator` holds that format), the draft's tokenizer files copied byte for byte.
* :func:`export_speculator` — a draft in memory (e.g. just distilled) → a speculator directory, with its
  tokenizer and ``training.json``.
* :func:`vllm_serve_command` — the shell command that serves the verifier with the speculator as its draft
  (vLLM's ``draft_model`` speculative method).

Every directory is written into a temporary sibling and renamed into place (:func:`specdraft.io.atomic_directory`):
a killed export leaves the destination as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from specdraft.config import NUM_SPECULATIVE_TOKENS, ExportConfig
from specdraft.io import atomic_directory, atomic_write_text
from specdraft.speculator import (
    IndependentSpeculator,
    SpeculatorError,
    check_causal_lm_config,
    config_diff,
    read_config_json,
    strip_speculator_keys,
    verifier_config,
)

# Files a tokenizer's save_pretrained may write; `convert` copies the ones the draft has, byte for byte.
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


@dataclass
class ConvertResult:
    """What :func:`convert` wrote.

    Attributes:
        out: the speculator directory (absolute).
        config: its config.json.
        added: ``config_diff(plain, config)``: the keys added relative to the draft's own save (3 keys).
        resaved: ``config_diff(source config.json, plain)``: keys transformers itself rewrote on re-saving
            the draft (empty when the source was written by this transformers version); ``corrected`` keys left out.
        corrected: ``{key: (draft's value, written value)}`` for config values specdraft set to match the tensors:
            a draft whose config.json claims ``tie_word_embeddings: true`` while its ``lm_head.weight`` differs
            from its embeddings is written with ``false`` (warned). The speculator's config.json then differs from
            the draft's in that key, on purpose: with ``true``, loaders that drop ``lm_head.weight`` for tied models
            (vLLM) would serve the embeddings as the head, a model other than the one evaluated.
        tokenizer_files: names copied from the draft directory.
        vllm_command: serves the verifier with this speculator as its draft.
        compat_verdict: the tokenizer check's verdict, or ``None`` when a tokenizer was unknown (warned).
        seconds: wall time of the whole conversion, seconds.
    """

    out: Path
    config: dict[str, Any]
    added: dict[str, tuple[Any, Any]]
    resaved: dict[str, tuple[Any, Any]]
    tokenizer_files: list[str]
    vllm_command: str
    compat_verdict: str | None = None
    corrected: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


def convert(
    draft: str | os.PathLike,
    verifier: str | os.PathLike,
    out: str | os.PathLike,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    overwrite: bool = False,
) -> ConvertResult:
    """Write ``draft`` as an independent speculator for ``verifier`` into ``out``: weights, config.json
    (draft's + three keys), generation config and the draft's tokenizer files (copied byte for byte).

    Order: validate options → refuse a non-empty ``out`` (unless ``overwrite``) → read the verifier's config
    → load the draft (checkpoint dtype) → tokenizer check → write everything into a temporary directory
    beside ``out`` → rename it into place (with ``overwrite``: the old directory is renamed aside first,
    then removed). A killed or failed run leaves ``out`` as it was, plus at most a ``.tmp-*`` sibling that
    nothing reads.

    A config that contradicts the tensors is corrected, never exported as is: see ``ConvertResult.corrected``.

    Raises:
        SpeculatorError: invalid option (the message names the flag, e.g. ``--num-speculative-tokens``);
            ``out`` exists and is not empty (without ``overwrite``) or is a file; unreadable verifier; a
            draft that is not a causal LM (names its architecture); tokenizer mismatch.
        specdraft.models.ModelResolutionError: a reference cannot be resolved (before anything is written).
        specdraft.models.CheckpointWeightsError: the draft's checkpoint lacks weights its model needs (e.g. an
            untied ``lm_head.weight``) or holds ones it does not use; named, nothing written.
    """
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    try:
        opts = ExportConfig(
            draft=str(draft), verifier=str(verifier), out=Path(out),
            num_speculative_tokens=num_speculative_tokens, overwrite=overwrite,
        )
    except ValidationError as exc:
        raise SpeculatorError(flag_errors(exc)) from exc
    out_dir = opts.out.expanduser().absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise SpeculatorError(f"--out {out_dir} is a file, not a directory.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not opts.overwrite:
        raise SpeculatorError(f"--out {out_dir} exists and is not empty; pass --overwrite to replace it.")

    from specdraft.models import resolve

    verifier_config(opts.verifier)  # unreadable verifier → error before loading or writing anything
    draft_dir = resolve(opts.draft)
    source_cfg = read_config_json(draft_dir, role="draft")
    check_causal_lm_config(source_cfg, what=f"draft {opts.draft}")
    timings["resolve_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    spec = IndependentSpeculator.from_pretrained(draft_dir, num_speculative_tokens=opts.num_speculative_tokens)
    timings["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    verdict = spec.attach_verifier(opts.verifier, "detached").compat_verdict
    timings["check_s"] = time.perf_counter() - t

    t = time.perf_counter()
    with atomic_directory(out_dir) as tmp:
        spec.save_pretrained(tmp)
        copied = _copy_tokenizer_files(Path(draft_dir), tmp)
    timings["write_s"] = time.perf_counter() - t

    config = spec.speculator_config.to_dict()
    plain = spec.speculator_config.draft_config
    corrected = {k: (source_cfg.get(k, before), after) for k, (before, after) in spec.corrections.items()}
    resaved = {k: v for k, v in config_diff(strip_speculator_keys(source_cfg), plain).items() if k not in corrected}
    return ConvertResult(
        out=out_dir,
        config=config,
        added=config_diff(plain, config),
        resaved=resaved,
        tokenizer_files=copied,
        vllm_command=vllm_serve_command(opts.verifier, out_dir, spec.num_speculative_tokens),
        compat_verdict=verdict,
        corrected=corrected,
        seconds=time.perf_counter() - t0,
        timings=timings,
    )


def flag_errors(exc: ValidationError) -> str:
    """One line per pydantic error, naming the CLI flag (``num_speculative_tokens`` → ``--num-speculative-tokens``)."""
    lines = []
    for err in exc.errors():
        loc = err["loc"][0] if err["loc"] else ""
        lines.append(f"--{str(loc).replace('_', '-')}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)


def write_training_json(path: Path, payload: dict[str, Any]) -> None:
    """``training.json`` beside the exported speculator (atomic)."""
    atomic_write_text(path, json.dumps(payload, indent=2, default=str))


def export_speculator(draft, tokenizer, verifier_ref: str, out: str | Path, num_speculative_tokens: int,
                      training: dict[str, Any] | None = None, overwrite: bool = True) -> Path:
    """Save a (trained) draft as an independent speculator: plain HF directory (safetensors, ``architectures``
    = the draft's class), ``config.json`` plus the ``speculators_*`` keys naming the verifier and γ, the
    tokenizer, and ``training.json``. Written into a temporary directory beside ``out`` and renamed into place.

    Raises:
        SpeculatorError: the verifier reference cannot be read, or ``out`` exists without ``overwrite``
            (nothing is written).
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise SpeculatorError(f"{out} exists; pass overwrite=True to replace it")
    spec = IndependentSpeculator(draft, num_speculative_tokens=num_speculative_tokens)
    spec.attach_verifier(verifier_ref, mode="detached", check_tokenizer=False)
    with atomic_directory(out) as tmp:
        spec.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if training is not None:
            write_training_json(tmp / "training.json", training)
    return out


def vllm_serve_command(verifier: str, speculator_dir: str | os.PathLike, num_speculative_tokens: int) -> str:
    """The shell command that serves ``verifier`` with the speculator at ``speculator_dir`` as its draft.

    An embedded name (vLLM does not know them) becomes its specdraft cache directory.
    """
    import shlex

    from specdraft.models import EMBEDDED, cache_dir

    target = str(cache_dir(verifier)) if verifier in EMBEDDED else str(verifier)
    spec = json.dumps(
        {"method": "draft_model", "model": str(speculator_dir), "num_speculative_tokens": num_speculative_tokens}
    )
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"


def copy_speculator(src: str | os.PathLike, dest: str | os.PathLike) -> dict[str, Any]:
    """Copy an exported speculator directory to ``dest`` (atomically) and return what serving it needs:
    ``{"path", "vllm_command", "num_speculative_tokens"}`` (the pipeline's ``export`` stage)."""
    from specdraft.speculator import load_speculator_config

    dest = Path(dest)
    with atomic_directory(dest) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
    conf = load_speculator_config(str(dest))
    verifier = str(conf.speculators_config.verifier.name_or_path)
    return {"path": str(dest.resolve()), "num_speculative_tokens": conf.num_speculative_tokens,
            "vllm_command": vllm_serve_command(verifier, dest.resolve(), conf.num_speculative_tokens)}


def _copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        s = src / name
        if s.is_dir():
            shutil.copytree(s, dst / name)
        elif s.is_file():
            shutil.copyfile(s, dst / name)  # follows hub-cache symlinks: copies the content
        else:
            continue
        copied.append(name)
    return copied
