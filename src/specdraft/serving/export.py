"""Ship a draft: export it as an *independent speculator* and say how vLLM serves it.

* :func:`export_draft` — a draft checkpoint on disk → a speculator directory, or with ``format="gguf"`` one GGUF for
  llama.cpp's ``-md`` (:mod:`specdraft.serving.gguf_export`);
* :func:`export_speculator` — a draft in memory (just distilled) → a speculator directory with ``training.json``;
* :func:`export_saved_speculator` — a saved speculator directory → another, whole (the pipeline's ``export``);
* :func:`vllm_serve` — the commands vLLM serves it with, built by :func:`vllm_speculative_config` alone.

Dtype ``"keep"`` writes the draft's tensors byte-identical; any other casts them. Every directory is written
atomically (:func:`specdraft.core.io.atomic_directory`). Notes: docs/architecture.md#specdraftservingexport.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from specdraft.core.config import NUM_SPECULATIVE_TOKENS, ExportConfig, ExportDtype, ExportFormat, GgufType
from specdraft.core.embedded import EMBEDDED, ModelResolutionError
from specdraft.core.io import atomic_directory, atomic_write_text
from specdraft.decoding.speculator_model import IndependentSpeculator
from specdraft.models.check import check_compatible, compare_chat_templates, template_difference
from specdraft.models.loading import (
    TOKENIZER_FILES,  # `export_draft` copies the ones the draft has, byte for byte
    embedded_for_hub_id,
    load_tokenizer,
    resolve,
    serving_path,
)
from specdraft.models.speculator import (
    IndependentSpeculatorConfig,
    SpeculatorError,
    check_causal_lm_config,
    config_diff,
    load_speculator_config,
    read_config_json,
    strip_speculator_keys,
    tokenizer_dir,
    verifier_config,
)
from specdraft.models.tokenizer_view import tokenizer_fingerprint
from specdraft.models.vocab import CompatibilityError, build_vocab_mapping
from specdraft.models.weights import check_checkpoint_weights
from specdraft.serving.gguf_export import export_gguf
from specdraft.serving.vllm_proposer import PROPOSER_CLASS, SPECULATOR_KEY

if TYPE_CHECKING:  # pragma: no cover
    from specdraft.serving.gguf_export import GgufResult

_LOG = logging.getLogger("specdraft")

#: The vLLM release the printed commands and the plugin were tested with (``make test-vllm``, docs/serving.md).
VLLM_TESTED_VERSION = "0.32.0"

# Weight files a save_pretrained writes; a cast rewrites them all.
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "*.bin", "pytorch_model.bin.index.json")

@dataclass
class ExportResult:
    """What :func:`export_draft` wrote.

    Attributes:
        out: the speculator directory (absolute); ``config``: its config.json.
        added: the keys added to the draft's own save (3); ``resaved``: keys transformers rewrote on re-saving.
        corrected: ``{key: (draft's value, written value)}`` set to match the tensors (a false tie flag).
        tokenizer_files: names copied from the draft directory; ``serve``: the :class:`VllmServe`.
        dtype: ``"keep"`` or the dtype cast to; ``compat_verdict``: the tokenizer check's, or ``None`` (unknown).
        seconds: wall time of the export, seconds.
    """

    out: Path
    config: dict[str, Any]
    added: dict[str, tuple[Any, Any]]
    resaved: dict[str, tuple[Any, Any]]
    tokenizer_files: list[str]
    vllm_command: str
    serve: VllmServe | None = None
    dtype: str = "keep"
    compat_verdict: str | None = None
    corrected: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    source_config: dict[str, Any] = field(default_factory=dict)  # the draft's config.json as read
    chat_template: dict[str, Any] = field(default_factory=dict)  # carry_chat_template's result


def export_draft(
    draft: str | os.PathLike,
    verifier: str | os.PathLike,
    out: str | os.PathLike,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    overwrite: bool = False,
    dtype: ExportDtype = "keep",
    format: ExportFormat = "speculator",
    gguf_type: GgufType | None = None,
    llama_cpp: str | os.PathLike | None = None,
    llama_quantize: str | os.PathLike | None = None,
    progress=None,
) -> ExportResult | GgufResult:
    """Write ``draft`` as an independent speculator for ``verifier`` into ``out``: weights, config.json (draft's +
    three keys), generation config and tokenizer files (the verifier's chat template where needed,
    :func:`carry_chat_template`). ``format="gguf"`` writes one GGUF instead
    (:func:`specdraft.serving.gguf_export.export_gguf`; ``dtype`` must stay ``"keep"``). Every check runs before anything is
    written.

    Args:
        dtype: ``"keep"``, ``"bfloat16"``, ``"float16"`` or ``"float32"``.

    Raises:
        SpeculatorError: invalid option (names the flag); ``out`` non-empty without ``overwrite`` or a file;
            unreadable verifier; not a causal LM; tokenizer mismatch.
        specdraft.core.embedded.ModelResolutionError: a reference cannot be resolved.
        specdraft.models.weights.CheckpointWeightsError: weights missing from or left over in the draft's checkpoint.
    """
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    # Only what was given reaches the config, which refuses a GGUF option given to the speculator format.
    gguf_opts = {k: v for k, v in (("gguf_type", gguf_type), ("llama_cpp", llama_cpp),
                                   ("llama_quantize", llama_quantize)) if v is not None}
    try:
        opts = ExportConfig(
            draft=str(draft), verifier=str(verifier), out=Path(out),
            num_speculative_tokens=num_speculative_tokens, overwrite=overwrite, dtype=dtype, format=format,
            **{k: str(v) if k != "gguf_type" else v for k, v in gguf_opts.items()},
        )
    except ValidationError as exc:
        raise SpeculatorError(flag_errors(exc)) from exc
    if opts.format == "gguf":

        return export_gguf(opts.draft, opts.verifier, opts.out, gguf_type=opts.gguf_type,
                           num_speculative_tokens=opts.num_speculative_tokens, overwrite=opts.overwrite,
                           llama_cpp=opts.llama_cpp, llama_quantize=opts.llama_quantize, progress=progress)
    out_dir = opts.out.expanduser().absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise SpeculatorError(f"--out {out_dir} is a file, not a directory.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not opts.overwrite:
        raise SpeculatorError(f"--out {out_dir} exists and is not empty; pass --overwrite to replace it.")


    verifier_config(opts.verifier)  # unreadable verifier → error before loading or writing anything
    draft_dir = resolve(opts.draft)
    source_cfg = read_config_json(draft_dir, role="draft")
    check_causal_lm_config(source_cfg, what=f"draft {opts.draft}")
    timings["resolve_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    spec = IndependentSpeculator.from_pretrained(draft_dir, num_speculative_tokens=opts.num_speculative_tokens,
                                                 dtype="auto" if opts.dtype == "keep" else opts.dtype)
    timings["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if _tokenizer_verdict(opts.verifier, draft_dir) == "mismatch":
        # Another tokenizer: exported as it is, drafting through text (vLLM: specdraft's custom_class proposer).
        _check_text_pair(opts.verifier, draft_dir)
        spec.attach_verifier(opts.verifier, "detached", check_tokenizer=False)
        spec.speculator_config = spec.speculator_config.with_text_proposals()
        verdict = "mismatch"
    else:
        verdict = spec.attach_verifier(opts.verifier, "detached").compat_verdict
    timings["check_s"] = time.perf_counter() - t

    t = time.perf_counter()
    with atomic_directory(out_dir) as tmp:
        spec.save_pretrained(tmp)
        copied = _copy_tokenizer_files(Path(draft_dir), tmp)
        template = carry_chat_template(tmp, opts.verifier)
    timings["write_s"] = time.perf_counter() - t

    config = spec.speculator_config.to_dict()
    plain = spec.speculator_config.draft_config
    corrected = {k: (source_cfg.get(k, before), after) for k, (before, after) in spec.corrections.items()}
    resaved = {k: v for k, v in config_diff(strip_speculator_keys(source_cfg), plain).items() if k not in corrected}
    serve = vllm_serve(out_dir, verifier=opts.verifier)
    return ExportResult(
        out=out_dir,
        config=config,
        added=config_diff(plain, config),
        resaved=resaved,
        tokenizer_files=copied,
        vllm_command=serve.command,
        serve=serve,
        dtype=opts.dtype,
        compat_verdict=verdict,
        corrected=corrected,
        seconds=time.perf_counter() - t0,
        timings=timings,
        source_config=source_cfg,
        chat_template=template,
    )


def _tokenizer_verdict(verifier: str, draft_dir) -> str | None:
    """:func:`specdraft.models.check.check_compatible`'s verdict on the two tokenizers, ``None`` when one is unknown
    (the verifier attachment then warns, as before)."""

    t, d = tokenizer_dir(resolve(verifier)), tokenizer_dir(draft_dir)
    return None if t is None or d is None else check_compatible(t, d).verdict


def _check_text_pair(verifier: str, draft_dir) -> None:
    """Refuse a text-drafting pair whose tokenizers share (almost) nothing.

    Raises:
        SpeculatorError: :func:`specdraft.models.vocab.build_vocab_mapping` refuses the pair (its reason, and the way out).
    """

    try:
        build_vocab_mapping(resolve(verifier), draft_dir)
    except CompatibilityError as exc:
        raise SpeculatorError(f"{exc} A draft of another tokenizer is exported to draft through text, which needs "
                              "tokenizers that share tokens; see specdraft check.") from exc


def carry_chat_template(speculator_dir: str | os.PathLike, verifier) -> dict[str, Any]:
    """Make ``speculator_dir`` carry the verifier's chat template where the draft's files render differently
    (:func:`specdraft.models.check.compare_chat_templates`), in transformers' template files, a ``tokenizer_config.json``
    key removed. ``verifier``: a tokenizer or reference (unloadable: noted, not raised).

    Returns:
        ``{"carried": "target" | "draft" | None, "changed": bool, "comparison": dict | None, "note": str}``.

    Raises:
        SpeculatorError: the written template does not reload as the target's.
    """
    from transformers import AutoTokenizer


    directory = Path(speculator_dir)
    target_tok = verifier
    if isinstance(verifier, (str, os.PathLike)):

        try:
            target_tok = load_tokenizer(verifier)
        except ModelResolutionError:
            return {"carried": None, "changed": False, "comparison": None,
                    "note": f"the verifier's tokenizer ({verifier}) is not readable here: the chat template is the "
                            "draft's, not compared with the target's"}
    try:
        draft_tok = AutoTokenizer.from_pretrained(directory)
    except Exception:  # noqa: BLE001 - no tokenizer files: there is no template to correct
        return {"carried": None, "changed": False, "comparison": None,
                "note": "the speculator holds no tokenizer files: vLLM serves the target's tokenizer and template"}
    chat = compare_chat_templates(target_tok, draft_tok)
    if not chat["target_has_template"]:
        return {"carried": "draft" if chat["draft_has_template"] else None, "changed": False, "comparison": chat,
                "note": "the target has no chat template; the draft's tokenizer files are kept as they are"}
    if chat["equal"]:
        return {"carried": "draft", "changed": False, "comparison": chat,
                "note": f"the draft's chat template renders as the target's ({len(chat['conversations'])} probe "
                        "conversations): kept"}
    for name in ("chat_template.jinja", "chat_template.json"):
        (directory / name).unlink(missing_ok=True)
    shutil.rmtree(directory / "additional_chat_templates", ignore_errors=True)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config, _ = target_tok.save_chat_templates(directory, config, None, save_jinja_files=True)
    if config_file.is_file():
        atomic_write_text(config_file, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if not compare_chat_templates(target_tok, AutoTokenizer.from_pretrained(directory))["equal"]:
        raise SpeculatorError(f"the target's chat template written into {directory} does not reload as the target's; "
                              "this is a bug, please report it")
    return {"carried": "target", "changed": True, "comparison": chat,
            "note": f"{template_difference(chat)}: the speculator carries the target's chat template (the one it "
                    "serves with), not the draft's"}


def flag_errors(exc: ValidationError) -> str:
    """One line per pydantic error, naming the CLI flag (``num_speculative_tokens`` → ``--num-speculative-tokens``)."""
    lines = []
    for err in exc.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not err["loc"]:  # a cross-field check: its message names the flags itself
            lines.append(msg)
            continue
        lines.append(f"--{str(err['loc'][0]).replace('_', '-')}: {msg} (got {err.get('input')!r})")
    return "; ".join(lines)


def write_training_json(path: Path, payload: dict[str, Any]) -> None:
    """``training.json`` beside the exported speculator (atomic)."""
    atomic_write_text(path, json.dumps(payload, indent=2, default=str))


def export_speculator(draft, tokenizer, verifier_ref: str, out: str | Path, num_speculative_tokens: int,
                      training: dict[str, Any] | None = None, overwrite: bool = True,
                      dtype: ExportDtype = "keep", verifier_tokenizer=None) -> Path:
    """Save a (trained) draft as an independent speculator: safetensors, ``config.json`` with the ``speculators_*``
    keys, the tokenizer (:func:`carry_chat_template`) and ``training.json``; a prepared draft is written dense
    (:func:`specdraft.decoding.draft_model.dense_draft`). ``dtype`` as :func:`export_draft`.

    Raises:
        SpeculatorError: unreadable verifier reference, or ``out`` exists without ``overwrite``.
        specdraft.models.weights.CheckpointWeightsError: tensors its class would not reload (named; nothing written).
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise SpeculatorError(f"{out} exists; pass overwrite=True to replace it")
    spec = IndependentSpeculator(draft, num_speculative_tokens=num_speculative_tokens)
    spec.attach_verifier(verifier_ref, mode="detached", check_tokenizer=False)
    as_given = tokenizer is not None and _other_tokenizer(tokenizer, verifier_tokenizer, verifier_ref)
    if as_given:  # a draft of another tokenizer (trained as given) drafts through text, as export_draft writes it
        spec.speculator_config = spec.speculator_config.with_text_proposals()
    with atomic_directory(out) as tmp:
        spec.save_pretrained(tmp)
        if as_given:
            tokenizer.save_pretrained(tmp)  # its own tokenizer and template: it reads the verifier's text
        elif tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            template = carry_chat_template(tmp, verifier_tokenizer if verifier_tokenizer is not None else verifier_ref)
            _LOG.info("export %s: %s", out, template["note"])
            training = None if training is None else training | {"chat_template": _template_record(template)}
        if training is not None:
            write_training_json(tmp / "training.json", training)
        cast_weights(tmp, dtype)
    return out


def _other_tokenizer(tokenizer, verifier_tokenizer, verifier_ref: str) -> bool:
    """Whether ``tokenizer`` is not the verifier's (:func:`specdraft.models.tokenizer_view.tokenizer_fingerprint`); False where the
    verifier's tokenizer cannot be read (the attachment has warned)."""

    try:
        vt = verifier_tokenizer if verifier_tokenizer is not None else load_tokenizer(verifier_ref)
    except Exception:  # noqa: BLE001 - an unreadable verifier keeps the token proposer, as before
        return False
    return tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(vt)


def _template_record(template: dict[str, Any]) -> dict[str, Any]:
    """carry_chat_template's result for a JSON file: whose template, whether it was rewritten, the sentence."""
    return {k: template[k] for k in ("carried", "changed", "note")}


def cast_weights(speculator_dir: str | os.PathLike, dtype: ExportDtype) -> bool:
    """Rewrite a speculator directory's weights in ``dtype``, in place (config.json's ``dtype`` updated).
    Returns ``True`` when rewritten; ``False`` for ``"keep"`` or weights already in ``dtype``."""
    if dtype == "keep":
        return False
    path = Path(speculator_dir)
    d = read_config_json(path, role="speculator")
    if d.get("dtype", d.get("torch_dtype")) == dtype:
        return False
    spec = IndependentSpeculator.from_pretrained(path, dtype=dtype)
    for pattern in WEIGHT_FILES:
        for f in path.glob(pattern):
            f.unlink()
    spec.save_pretrained(path)
    return True


# Serving with vLLM


def vocab_width(config: dict[str, Any]) -> int | None:
    """A config.json's output width: ``vocab_size``, or its ``text_config``'s (what vLLM's ``get_vocab_size``
    reads for a multimodal config); ``None`` when it names none."""
    width = config.get("vocab_size")
    if width is None and isinstance(config.get("text_config"), dict):
        width = config["text_config"].get("vocab_size")
    return None if width is None else int(width)


def vllm_speculative_config(speculator: dict[str, Any], model: str,
                            verifier_vocab_size: int | None = None) -> dict[str, Any]:
    """vLLM's speculative config for an independent speculator's config.json dict (pure JSON; no vLLM needed).

    Returns:
        A text-drafting pair: ``{"method": "custom_class", "model": "specdraft.vllm_proposer.TextProposer",
        "num_speculative_tokens": γ}``; otherwise ``{"method": "draft_model", "model": model,
        "num_speculative_tokens": γ}``, plus ``"use_heterogeneous_vocab": true`` where the output widths differ
        (vLLM refuses unequal vocabulary sizes otherwise).

    Raises:
        NotASpeculatorError / SpeculatorError: not a valid independent speculator config.
    """
    conf = IndependentSpeculatorConfig.from_speculator_dict(speculator)
    if conf.drafts_through_text:

        return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": conf.num_speculative_tokens}
    spec: dict[str, Any] = {"method": "draft_model", "model": str(model),
                            "num_speculative_tokens": conf.num_speculative_tokens}
    width = vocab_width(speculator)
    if verifier_vocab_size is not None and width is not None and width != verifier_vocab_size:
        spec["use_heterogeneous_vocab"] = True
    return spec


def vllm_additional_config(speculator: dict[str, Any], model: str) -> dict[str, Any]:
    """vLLM's ``--additional-config`` for a speculator: ``{"specdraft_speculator": model}`` for one that drafts
    through text (where :class:`specdraft.vllm_proposer.TextProposer` finds it), else ``{}``."""

    conf = IndependentSpeculatorConfig.from_speculator_dict(speculator)
    return {SPECULATOR_KEY: str(model)} if conf.drafts_through_text else {}


#: How printed commands start vLLM's OpenAI server (as ``make test-vllm`` does).
VLLM_SERVER = "python -m vllm.entrypoints.openai.api_server"


def vllm_command(target: str, speculative_config: dict[str, Any], engine: str = f"vLLM {VLLM_TESTED_VERSION}",
                 additional_config: dict[str, Any] | None = None) -> str:
    """The vLLM OpenAI server command (:data:`VLLM_SERVER`) with every drafting parameter of ``speculative_config``
    pinned and a comment naming the build (``engine``); ``target`` is shell-quoted by the caller."""
    import shlex

    extra = f" --additional-config {shlex.quote(json.dumps(additional_config))}" if additional_config else ""
    return (f"{VLLM_SERVER} --model {target} --speculative-config {shlex.quote(json.dumps(speculative_config))}{extra}"
            f" # for {engine}")


@dataclass
class VllmServe:
    """How vLLM serves a speculator on this machine (:func:`vllm_serve`).

    Attributes:
        command: the server command, both paths absolute, γ pinned (:func:`vllm_command`).
        one_path: ``--model SPECULATOR_DIR`` alone (needs specdraft's plugin beside vLLM).
        target: what ``command`` serves; ``speculative_config`` / ``additional_config``: the JSON passed.
        notes: what the reader should know; ``drafting``: ``"token ids"`` or ``"text"``.
    """

    command: str
    one_path: str
    target: str
    speculative_config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    drafting: str = "token ids"
    additional_config: dict[str, Any] = field(default_factory=dict)

    @property
    def header(self) -> str:
        how = " (a draft of another tokenizer, as given: it drafts through text)" if self.drafting == "text" else ""
        return f"Serve it with vLLM{how} (tested with vLLM {VLLM_TESTED_VERSION}):"


def vllm_serve(speculator_dir: str | os.PathLike, verifier: str | None = None) -> VllmServe:
    """The commands that serve the speculator at ``speculator_dir`` with vLLM, here (``verifier`` default: the
    recorded one; an embedded model is served from specdraft's cache).

    Raises:
        NotASpeculatorError / SpeculatorError: ``speculator_dir`` holds no valid independent speculator.
    """
    import shlex


    spec_dir = os.path.abspath(speculator_dir)
    d = read_config_json(spec_dir, role="speculator")
    recorded = IndependentSpeculatorConfig.from_speculator_dict(d).speculators_config.verifier.name_or_path
    ref = str(verifier) if verifier is not None else str(recorded)
    target = serving_path(ref)
    notes = []
    emb = EMBEDDED.get(ref) or (embedded_for_hub_id(ref) if target != ref else None)
    if emb is not None:
        notes.append(f"The verifier {emb.name} is {emb.provenance}; it is served from specdraft's cache ({target}).")
    try:
        verifier_width = vocab_width(read_config_json(target, role="verifier"))
    except (SpeculatorError, ModelResolutionError):  # e.g. a hub id not cached here: say so, do not guess
        verifier_width = None
        notes.append(f"The verifier's config is not readable here, so its vocabulary width was not compared with "
                     f"the draft's ({vocab_width(d)}): add \"use_heterogeneous_vocab\": true to the speculative "
                     "config if they differ.")
    spec = vllm_speculative_config(d, spec_dir, verifier_width)
    extra = vllm_additional_config(d, spec_dir)
    # Commands name the verifier as this machine resolves it offline: the embedded name over its hub id.
    local = shlex.quote(emb.name if emb is not None else ref)
    if extra:
        notes = [n for n in notes if "vocabulary width" not in n]  # the widths differ by design: no draft_model
        notes.append(f"The draft speaks another tokenizer and is served as given: specdraft's proposer "
                     f"(pip install --no-deps specdraft next to vLLM) drafts γ = {spec['num_speculative_tokens']} "
                     "tokens in the draft's tokenizer and proposes their text re-encoded in the verifier's; vLLM "
                     "verifies them (lossless, greedy or sampled). The re-indexed draft is served with vLLM's own "
                     f"draft_model method: `specdraft vocab-swap --target {local} --draft {shlex.quote(spec_dir)} "
                     f"--out SWAPPED`, then `specdraft export --draft SWAPPED --target {local} --out SPECULATOR` (or "
                     "`specdraft run`, which distils it).")
    return VllmServe(
        command=vllm_command(shlex.quote(target), spec, additional_config=extra),
        one_path=f"{VLLM_SERVER} --model {shlex.quote(spec_dir)}",
        target=target, speculative_config=spec, notes=notes,
        drafting="text" if extra else "token ids", additional_config=extra,
    )


def export_saved_speculator(src: str | os.PathLike, dest: str | os.PathLike, verifier: str | None = None,
                            dtype: ExportDtype = "keep") -> dict[str, Any]:
    """Export a saved speculator directory to ``dest`` whole (cast to ``dtype``, :func:`carry_chat_template`).

    Returns:
        ``{"path", "num_speculative_tokens", "dtype", "vllm_command", "vllm_one_path", "vllm_notes",
        "vllm_drafting", "vllm_tested_version", "chat_template"}``.

    Raises:
        specdraft.models.weights.CheckpointWeightsError: ``src``'s tensors do not fit its config's model (nothing written).
    """

    check_checkpoint_weights(src)  # refuse before writing: the copy must reload as the source was evaluated
    dest = Path(dest)
    with atomic_directory(dest) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        cast_weights(tmp, dtype)
        conf = load_speculator_config(str(tmp))
        template = carry_chat_template(tmp, verifier if verifier is not None else
                                       str(conf.speculators_config.verifier.name_or_path))
    serve = vllm_serve(dest, verifier)
    return {"path": str(dest.resolve()), "num_speculative_tokens": conf.num_speculative_tokens, "dtype": dtype,
            "vllm_command": serve.command, "vllm_one_path": serve.one_path, "vllm_notes": serve.notes,
            "vllm_drafting": serve.drafting,
            "vllm_tested_version": VLLM_TESTED_VERSION, "chat_template": _template_record(template)}


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
