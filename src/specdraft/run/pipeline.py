"""The main job, ``specdraft run``: from two checkpoints to a shipped, measured speculator, one declaration per stage.

:data:`PIPELINE` lists the stages in order, each a :class:`~specdraft.run.runner.Stage`: its inputs (the cache key),
the function that writes ``OUT/<stage>/``, its result type and its report.md section. ``check`` (tokenizers) →
``eval_before`` (the target's greedy held-out answers, the draft as given replayed on them) → ``vocab_swap`` (a
draft of another tokenizer re-indexed) → ``headroom`` (the forecast) → ``dump`` (the teacher signal) →
``distill`` → ``eval_after`` (the distilled draft on the same answers: a paired gain) → ``speed`` (interleaved
timings) → ``export`` → the report (:mod:`specdraft.measuring.report`). A stage done with the same inputs is skipped, one
whose inputs changed is refused or redone (:class:`~specdraft.run.runner.Runner`); models enter a key by content
(:func:`model_identity`), prompts by text (:func:`prompt_texts`). Held-out prompts never train (overlap warned or
refused); every check that needs no weights runs first. Design and evidence:
docs/architecture.md#specdraftrunpipeline.
"""

from __future__ import annotations

import gc
import json
import logging
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.core.config import PipelineConfig
from specdraft.core.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdraft.core.io import atomic_write_text, sha256_file, versions
from specdraft.core.progress import progress_lines
from specdraft.data.prompts import PromptSet, select_prompts, teacher_prompts
from specdraft.data.sources import encode_prompts, tokenizer_pad_id
from specdraft.decoding.calibration import gemv_gb_s
from specdraft.decoding.draft_model import (
    HEAD_TOKENS_FORMAT,
    default_head_corpus,
    rank_tokens,
    save_head_tokens,
)
from specdraft.decoding.responses import generate_from_ids
from specdraft.decoding.speed_run import SpeedStage
from specdraft.measuring.evaluate import acceptance_eval, eos_ids, interleaved_speed
from specdraft.measuring.headroom import HeadroomForecast, forecast_headroom
from specdraft.measuring.recommend import distillation_verdict, teaching_road, write_export_manifest
from specdraft.measuring.report import (
    distill_section,
    evaluation_section,
    export_section,
    forecast_section,
    speed_section,
    summary_section,
    swap_section,
    write_pipeline_report,
)
from specdraft.models.check import check_compatible
from specdraft.models.dump_reader import TeacherDataset, answers_written_by
from specdraft.models.loading import (
    ModelRef,
    load_model,
    load_tokenizer,
    model_fingerprint,
    model_revision,
    rendering_identity,
    resolve_ref,
)
from specdraft.models.vocab import build_vocab_mapping, save_vocab_swap, swapped_draft_twins
from specdraft.run.runner import (
    Input,
    PipelineError,
    Runner,
    Stage,
    as_record,
    computed,
    config,
    extends,
    stage_key,
    upstream,
    walk,
)
from specdraft.serving.export import export_draft, export_saved_speculator
from specdraft.serving.gguf_export import export_gguf
from specdraft.serving.llama_cpp import PACKAGED_BENCH, run_plan
from specdraft.training.distill import run_distill
from specdraft.training.dump import run_dump
from specdraft.training.self_teacher import run_self_teacher

_LOG = logging.getLogger("specdraft")

#: Training answers are written by the target, evaluation is greedy, models decode in bf16 (as served).
_DUMP = {"answer_only": True, "dtype": "bfloat16"}

PRESETS: dict[str, dict[str, Any]] = {
    # The whole road, where every stage pays: SmolLM2-135M-Instruct, a draft of another tokenizer (49,152-token
    # BPE), for the Qwen coder. check (mismatch) → the draft as given through a vocabulary mapping → re-indexed into
    # the target's tokenizer → forecast → distilled → evaluated → exported. The vLLM- and llama.cpp-servable
    # speculator must speak the target's tokenizer: the swap makes it one, and distillation wins back what the swap
    # cost. The teacher is the draft as given (the self-teacher: its greedy answers to real code and chat prompts,
    # re-encoded in the target's tokenizer, learnt by the re-indexed copy with the cross-entropy through a restricted
    # head): no target compute, and more answers than the target could write in the same minutes
    # (docs/benchmarks.md, "The self-teacher route" and "Routes on the vocabulary-swap road").
    "default": {
        "draft": "smollm2-135m-instruct",
        "vocab_swap": True,
        "eval_prompts": ["humaneval:100:16:4"],
        # Chat: every sixth question from 0 (14, all 8 categories, inside the held-out split). Decoding their answers
        # with the draft as given is the run's costliest evaluation, and chat is the set that must not get worse.
        "ood_prompts": ["mt-bench:0:14:6"],
        # The self-teacher's prompts: HumanEval's training split, the embedded conversations and ShareGPT's
        # training rows (real user turns: the chat set's gain needs them).
        "train_prompts": ["humaneval:0:100", "conversations", "sharegpt:0:120"],
        "speed_prompts": 3,
        "eval": {"max_new_tokens": 64, "compare_hf": True, "num_speculative_tokens": 5},
        # The target's dump teaches a draft of the target's own tokenizer (the self-teacher does not apply there): the
        # target answers the first 64 training prompts, as many as it writes in the self-teacher's minutes.
        "dump": _DUMP | {"generate": 64, "max_length": 512, "batch_size": 8},
        "target_dump_prompts": 64,
        "self_teacher": {"generate": 192, "max_length": 640, "batch_size": 8, "dtype": "bfloat16"},
        # 24 steps of 8 sequences: the re-indexed copy serves llama.cpp and vLLM's draft_model only, where the draft
        # as given cannot go; its curve is at its knee by ~40 steps (docs/benchmarks.md, "The self-teacher route,
        # run longer"), and the main job's budget goes to measuring what ships.
        "distill": {"loss": "soft_ce", "train": "all", "lr": 3e-4, "row_lr": 1e-3, "untie_head": True,
                    "max_steps": 24, "batch_size": 2, "gradient_accumulation_steps": 4, "held_out_fraction": 0.125,
                    "scheduler": "cosine", "warmup_ratio": 0.1, "save_steps": 8, "precision": "auto",
                    "on_policy_fraction": 0.0, "head_support": 8192},
        # The re-indexed, distilled draft as llama.cpp's -md draft: q8_0, the type its llama-bench timings were taken
        # at (the run's llama.cpp forecast prices it with them).
        "export_gguf": "q8_0",
        "needs": "2 CPU cores, ~11 GB RAM, ~3 GB disk (+11 GB once: the models converted and their bfloat16 copies), ~28 min with the "
                 "models cached",
    },
    # The default with time to spare: the self-teacher's fuller data (452 prompts, answers to 256 tokens) and its
    # 80-step schedule, its curve's end (docs/benchmarks.md, "Routes on the vocabulary-swap road").
    "default-long": {"based_on": "default", "train_prompts": ["humaneval:0:100", "conversations", "sharegpt:0:300"],
                     "self_teacher": {"generate": 256, "max_length": 768},
                     "distill": {"max_steps": 80, "save_steps": 20},
                     "needs": "2 CPU cores, ~12 GB RAM, ~3 GB disk (+11 GB once: the models converted and their "
                              "bfloat16 copies), ~27 min with the models cached on a host twice this class's speed"},
    # The embedded same-family pair. Chat is where this coder pair has headroom (code is near saturation), so the
    # preset trains on target-written answers to MT-Bench questions and measures on *other* MT-Bench questions (every
    # third one: all 8 categories, never trained on), with held-out HumanEval reported beside it. Its distillation
    # gain is a measured null (docs/benchmarks.md, "Headroom forecast against measured gains"). λ = 0: at this budget
    # on-policy data (λ = 0.5) lowered held-out code acceptance and did not raise chat (docs/benchmarks.md,
    # "Distillation gain — dump-only vs on-policy").
    "same-family": {
        "eval_prompts": ["mt-bench:0:27:3"],
        "ood_prompts": ["humaneval:100:16:4"],
        "train_prompts": ["mt-bench:1:20:3", "mt-bench:2:20:3"],
        "speed_prompts": 3,
        # γ 5: the acceptance evaluations count the draft as exported (bf16) at fixed γ 5, replayed on the target's
        # answers (before and after on the same rounds); eval_before writes those answers with the prepared draft
        # (auto: int4 + trimmed head) and adaptive γ ≤ 5, as the speed stage decodes.
        "eval": {"max_new_tokens": 64, "compare_hf": True, "num_speculative_tokens": 5},
        "dump": _DUMP | {"generate": 48, "max_length": 512, "batch_size": 8},
        "distill": {"loss": "tvd", "train": "last_layers", "train_last_layers": 4, "lr": 3e-5, "max_steps": 30,
                    "batch_size": 2, "held_out_fraction": 0.125, "scheduler": "cosine", "warmup_ratio": 0.1,
                    "save_steps": 10, "on_policy_fraction": 0.0, "on_policy_every": 10},
        "needs": "2 CPU cores, ~13 GB RAM, ~2 GB disk, ~30 min with the models cached",
    },
    # The smallest run that exercises every stage on real weights (CI), on-policy data included.
    "ci": {
        "eval_prompts": ["humaneval:100:1"],
        "train_prompts": ["humaneval:0:3"],
        "speed_prompts": 1,
        "eval": {"max_new_tokens": 12, "num_speculative_tokens": 4},
        "dump": _DUMP | {"generate": 12, "max_length": 256, "batch_size": 3},
        "distill": {"loss": "tvd", "train": "last_layers", "train_last_layers": 1, "lr": 3e-5, "max_steps": 2,
                    "batch_size": 1, "held_out_fraction": 0.34, "save_steps": 1, "on_policy_fraction": 0.5},
        "needs": "2 CPU cores, ~10 GB RAM, ~3 GB disk (+14 GB once: the models converted and their bfloat16 copies), "
                 "a few minutes with the models cached",
    },
    # Tiny random models (tests).
    "tiny": {
        "eval_prompts": [],
        "train_prompts": [],
        "eval": {"max_new_tokens": 8, "num_speculative_tokens": 3, "dtype": "float32"},
        "dump": _DUMP | {"generate": 6, "max_length": 64, "batch_size": 4, "dtype": "float32"},
        "distill": {"loss": "tvd", "lr": 1e-3, "max_steps": 3, "batch_size": 2, "held_out_fraction": 0.25,
                    "save_steps": 1, "on_policy_fraction": 0.5, "on_policy_every": 2},
        "needs": "1 CPU core, under 1 GB RAM and 100 MB disk, seconds",
    },
    # A real distillation: one modern GPU (≥ 24 GB), a few hours.
    "large": {
        "eval_prompts": ["mt-bench:0:27:3"],
        "ood_prompts": ["humaneval:100:64"],
        "train_prompts": ["mt-bench:1:27:3", "mt-bench:2:26:3", "humaneval:0:100", "conversations"],
        "speed_prompts": 8,
        "eval": {"max_new_tokens": 256, "compare_hf": True},
        "dump": _DUMP | {"generate": 512, "max_length": 2048, "batch_size": 16},
        "distill": {"loss": "tvd", "train": "all", "lr": 2e-5, "max_steps": 3000, "batch_size": 8,
                    "gradient_accumulation_steps": 4, "held_out_fraction": 0.05, "scheduler": "cosine",
                    "warmup_ratio": 0.03, "eval_steps": 250, "save_steps": 250, "dtype": "bfloat16",
                    "on_policy_fraction": 0.5, "on_policy_every": 50},
        "needs": "1 CUDA GPU with ≥ 24 GB, ~3 hours, ~200 GB disk for the hidden-state dump",
    },
}


def preset_fields(name: str) -> dict[str, Any]:
    """A copy of preset ``name``'s fields; a variant (``based_on``) is its parent's fields with its own replacing them
    (a dict field merged key by key).

    Raises:
        KeyError: an unknown preset.
    """
    fields = json.loads(json.dumps(PRESETS[name]))
    if parent := fields.pop("based_on", None):
        own, fields = fields, preset_fields(parent)
        for key, value in own.items():
            fields[key] = fields[key] | value if isinstance(value, dict) else value
    return fields


#: Where a preset's time was measured: ``{preset: (minutes, bf16 matrix-vector GB/s of that host)}``
#: (:func:`specdraft.decoding.calibration.gemv_gb_s`); the first line scales the minutes by this host's rate.
PRESET_TIMING: dict[str, tuple[float, float]] = {"default": (28.0, 23.0)}


def estimated_minutes(preset: str, host_gb_s: float | None) -> float | None:
    """A preset's minutes on this host: its measured minutes × the measuring host's bf16 matrix-vector rate over this
    host's (:data:`PRESET_TIMING`); ``None`` without a measured time or a rate."""
    if preset not in PRESET_TIMING or not host_gb_s:
        return None
    minutes, ref = PRESET_TIMING[preset]
    return minutes * ref / host_gb_s


def first_line(cfg: PipelineConfig, out: str | Path, host_gb_s: float | None = None) -> str:
    """``run``'s first line: the pair it runs, the preset, and what the preset needs (cores, memory, disk, time),
    said to hold for the preset's own pair when the run names another. With ``host_gb_s`` (this machine's
    :func:`specdraft.decoding.calibration.gemv_gb_s`), the time is the preset's measured minutes scaled to this machine."""
    preset = preset_fields(cfg.preset) if cfg.preset in PRESETS else {}
    own = (preset.get("target", DEFAULT_TARGET), preset.get("draft", DEFAULT_DRAFT))
    needs = cfg.needs
    if (minutes := estimated_minutes(cfg.preset, host_gb_s)) is not None and own == (cfg.target, cfg.draft):
        ref_min, ref = PRESET_TIMING[cfg.preset]
        needs = re.sub(r"~\d+ min", f"~{minutes:.0f} min on this machine (bf16 matrix-vector {host_gb_s:.1f} GB/s; "
                       f"{ref_min:.0f} min measured at {ref:.1f} GB/s)", needs, count=1)
    needs = needs if own == (cfg.target, cfg.draft) else f"{needs}; measured for its own pair {own[0]} ← {own[1]}"
    return f"specdraft run: target {cfg.target} ← draft {cfg.draft}, preset {cfg.preset} (needs {needs}) → {out}"


def make_config(preset: str = "default", **overrides: Any) -> PipelineConfig:
    """A :class:`~specdraft.core.config.PipelineConfig` from a preset plus overrides (top-level fields; ``None`` keeps
    the preset's value). ``eval`` given as a dict overrides single fields of the preset's evaluation settings
    (e.g. ``eval={"draft_quantization": "int8"}``).

    Raises:
        ValueError: an unknown preset.
        pydantic.ValidationError: an override of the wrong type or out of bounds (names the field).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    # A preset may name its own pair (target, draft, vocab_swap); the embedded default pair otherwise.
    base = {"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT} | preset_fields(preset)
    if isinstance(overrides.get("eval"), dict):
        base["eval"] |= {k: v for k, v in overrides.pop("eval").items() if v is not None}
    base.update({k: v for k, v in overrides.items() if v is not None})
    return PipelineConfig(preset=preset, **base)


def run_prompts(cfg: PipelineConfig, sets: tuple[str, ...] = ("train", "eval", "ood")) -> dict[str, PromptSet]:
    """The run's prompt sets named in ``sets``, each as its flag means it (:func:`specdraft.data.prompts.select_prompts`):
    ``train`` (``--train-prompts``, :func:`specdraft.data.prompts.teacher_prompts`: from each source's first example; a
    repeated prompt dropped when the teacher answers greedily, its sequence would repeat: the rows ``dump --prompts``
    reads for that teacher), ``eval`` and ``ood`` (``--eval-prompts`` / ``--ood-prompts``: held out, as ``eval
    --prompts`` reads them). Each set's :meth:`~specdraft.data.prompts.PromptSet.lines` say what will run.

    Raises:
        specdraft.data.sources.DataError: a malformed spec (named with its flag), an unknown source, a bad line.
    """
    # The teacher configured, the draft as given (self_teacher) or the target (dump): its config says the rule.
    distinct = (cfg.self_teacher or cfg.dump).distinct_prompts
    how = {"train": lambda: teacher_prompts(cfg.train_prompts, distinct, "--train-prompts"),
           "eval": lambda: select_prompts(cfg.eval_prompts, "--eval-prompts", held_out=True),
           "ood": lambda: select_prompts(cfg.ood_prompts, "--ood-prompts", held_out=True)}
    return {name: how[name]() for name in sets}


def prompt_overlap(train, evaluation) -> list[str]:
    """Ids of evaluation examples whose prompt messages also occur in the training examples."""
    key = lambda e: json.dumps(e.prompt_messages, sort_keys=True)
    train_keys = {key(e) for e in train}
    return [e.id for e in evaluation if key(e) in train_keys]


def model_identity(role: str, ref: ModelRef) -> dict[str, Any]:
    """A model's part of a stage's inputs: ``{role}_weights`` (:func:`specdraft.models.loading.model_fingerprint` of its
    files), ``{role}_revision`` (:func:`specdraft.models.loading.model_revision`) and ``{role}_chat_template``,
    ``{role}_tokenizer_files``, ``{role}_stop_ids`` (:func:`specdraft.models.loading.rendering_identity`: every prompt is
    rendered by the first two and every answer ends at the last), beside the reference as typed."""

    return {f"{role}_weights": model_fingerprint(ref), f"{role}_revision": model_revision(ref),
            **{f"{role}_{k}": v for k, v in rendering_identity(ref).items()}}


def prompt_texts(examples, whole: bool = False) -> dict[str, str]:
    """``{example id: sha256 (16 hex characters) of its text}``: the prompt messages a model answers, or with
    ``whole`` every message and the reference (what a teacher-forced dump reads). A stage's key holds them beside
    the ids, so a prompt file edited under the same ids is a changed input."""
    text = (lambda e: [e.messages, e.reference]) if whole else (lambda e: e.prompt_messages)
    return {e.id: stage_key(text(e)) for e in examples}


def estimate_dump_bytes(cfg: PipelineConfig, n_prompts: int, avg_prompt_tokens: int, hidden_size: int) -> int:
    """Upper estimate of the dump size in bytes: tokens × :meth:`~specdraft.core.config.DumpConfig.bytes_per_token`
    (hidden states, or the dump's own top-k log-probs)."""
    tokens = n_prompts * min(cfg.dump.max_length, avg_prompt_tokens + (cfg.dump.generate or 0))
    return tokens * cfg.dump.bytes_per_token(hidden_size)


@dataclass
class _Plan:
    """What the pre-flight checks found: the prompts, both references resolved once, the overlap."""

    evals: list
    trains: list
    target: ModelRef
    draft: ModelRef
    overlap: list[str]
    oods: list

    @property
    def sets(self) -> dict[str, list]:
        """The evaluation sets by name: ``held_out`` (the headline) and, when given, ``ood``."""
        return {"held_out": self.evals} | ({"ood": self.oods} if self.oods else {})


def _preflight(cfg: PipelineConfig, out: Path, log, eval_examples, train_examples, ood_examples=None) -> _Plan:
    """Every check that needs no weights: prompts exist and are disjoint, references resolve, disk suffices."""

    given = {"train": train_examples, "eval": eval_examples, "ood": ood_examples}
    for name, chosen in run_prompts(cfg, tuple(k for k, v in given.items() if v is None)).items():
        for line in chosen.lines():
            log(line)
        given[name] = chosen.examples
    trains, evals, oods = given["train"], given["eval"], given["ood"]
    if not evals or not trains:
        raise PipelineError("the pipeline needs evaluation and training prompts (preset prompt lists are empty)")
    overlap = prompt_overlap(trains, evals + oods)
    if overlap:
        msg = f"{len(overlap)} evaluation prompt(s) also occur in the training prompts (e.g. {overlap[:3]})"
        if cfg.refuse_overlap:
            raise PipelineError(msg + "; choose disjoint sources or drop --refuse-overlap")
        log(f"warning: {msg}; their acceptance after distillation is not a held-out figure")
    target, draft = resolve_ref(cfg.target), resolve_ref(cfg.draft)
    tcfg = target.config()
    hidden = getattr(tcfg, "hidden_size", 4096)
    # + the target's logits over the held-out answers, kept from the first replay to the last (2 bytes per entry)
    cache = (len(evals) + len(oods)) * cfg.eval.max_new_tokens * getattr(tcfg, "vocab_size", 0) * 2
    need = estimate_dump_bytes(cfg, len(trains), 200, hidden) + cache
    free = shutil.disk_usage(out).free
    if need > 0.9 * free:
        raise PipelineError(f"the teacher dump and the target's held-out logits need about {need / 1e9:.1f} GB but "
                            f"{out} has {free / 1e9:.1f} GB free; free disk, pick another --out, or use a smaller "
                            "preset / a topk teacher dump")
    return _Plan(evals, trains, target, draft, overlap, oods)



@dataclass
class _Job:
    """The run as its stages see it: the settings (rewritten once ``check`` has spoken), the plan, the directory,
    and every stage's key inputs and result so far (:func:`specdraft.run.runner.walk` fills them)."""

    cfg: PipelineConfig
    plan: _Plan
    out: Path
    command: str
    log: Callable[[str], None]
    keep_checkpoints: bool = False
    results: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    identities: dict[str, dict[str, Any]] = field(default_factory=dict)

    def identity(self, role: str) -> dict[str, Any]:
        """:func:`model_identity` of the ``target`` or ``draft``, hashed once per run."""
        if role not in self.identities:
            self.identities[role] = model_identity(role, getattr(self.plan, role))
        return self.identities[role]

    @property
    def mapped(self) -> bool:
        """The draft speaks another tokenizer (``check``'s verdict)."""
        return self.results["check"]["verdict"] == "mismatch"

    @property
    def self_taught(self) -> bool:
        return self.cfg.self_teacher is not None

    @property
    def trains(self) -> list:
        """The training prompts the teacher answers: all for the self-teacher, the first ``target_dump_prompts``
        for the target."""
        return self.plan.trains if self.self_taught else self.plan.trains[: self.cfg.target_dump_prompts]

    @property
    def train_draft(self) -> str:
        """The draft that is trained: the re-indexed copy when ``vocab_swap`` ran, else the draft as given."""
        swap = self.results.get("vocab_swap")
        return swap["path"] if swap else self.plan.draft.path

    @property
    def target_cache(self) -> Path:
        """The target's teacher-forced logits over its held-out answers: written by the first replay, read by the
        forecast and the last replay."""
        return self.out / "cache" / "target-logits"


def _run_check(job: _Job, d: Path) -> dict[str, Any]:

    rep = check_compatible(job.plan.target.path, job.plan.draft.path)
    atomic_write_text(d / "report.json", json.dumps(rep.to_dict(), indent=2, default=str))
    if rep.verdict == "mismatch" and not job.cfg.vocab_swap:
        hint = (" The overlap is usable: pass --vocab-swap to evaluate it through a vocabulary mapping and "
                "distil it re-indexed into the target's tokenizer." if rep.mapping and rep.mapping["usable"] else "")
        raise ValueError(f"tokenizers differ: {rep.summary()} (see {d / 'report.json'}; specdraft check).{hint}")
    if rep.verdict == "mismatch":
        build_vocab_mapping(job.plan.target.path, job.plan.draft.path)  # no usable overlap → error, before any weights
    return {"verdict": rep.verdict, "real_vocab": rep.real_vocab, "mapping": rep.mapping}


def _after_check(job: _Job, check: dict[str, Any]) -> None:
    """The self-teacher teaches a re-indexed copy what its original knew; a draft of the target's own tokenizer has
    no such copy, so the target's answers teach it (on the full head: a target dump has mass everywhere)."""
    if job.self_taught and not job.mapped:
        job.log(f"[dump] {job.cfg.draft} already speaks the target's tokenizer (check: {check['verdict']}): the "
                "self-teacher does not apply; the target's answers teach it")
        job.cfg = job.cfg.model_copy(update={"self_teacher": None,
                                             "distill": job.cfg.distill.model_copy(update={"head_support": None})})


def _count(job: _Job, d: Path, draft_path: str, map_vocab: bool, stage: str, log: bool = True) -> dict[str, Any]:
    """Greedy acceptance per evaluation set (:func:`specdraft.measuring.evaluate.acceptance_eval`) of ``draft_path``, replayed
    at fixed γ as exported on the target's greedy answers: written here by the target alone, a set's prompts in one
    batch (:func:`specdraft.decoding.responses.generate_from_ids`) before ``eval_before`` has run, else ``eval_before``'s
    (a paired comparison). The replays share the target's logits through :attr:`_Job.target_cache`."""

    cfg, plan, say = job.cfg, job.plan, job.log if log else None
    before = job.results.get("eval_before")
    target, tok = load_model(plan.target, dtype=cfg.eval.dtype)
    draft, _ = load_model(draft_path, dtype=cfg.eval.dtype)
    mapping = build_vocab_mapping(plan.target.path, draft_path) if map_vocab else None
    serving = job.cfg.distill.serving
    sets = {}
    for name, examples in plan.sets.items():
        encoded, written = encode_prompts(tok, examples), None
        if before is not None:
            answers = before["sets"][name]["answers"]
        else:
            if say:
                say(f"[{stage}] {name}: the target writes its {len(examples)} answers (one batch)")
            t0 = time.perf_counter()
            answers = generate_from_ids(target, tok, encoded, cfg.eval.max_new_tokens, real_vocab=len(tok),
                                        eos_token_id=eos_ids(target, tok))
            written = {"decoder_label": f"the target alone, one batch of {len(examples)} rows",
                       "decode_seconds": time.perf_counter() - t0, "decoded_tokens": sum(map(len, answers))}
        sets[name] = acceptance_eval(target, draft, tok, encoded, [e.id for e in examples], cfg.eval, serving,
                                     answers=answers, vocab_mapping=mapping, target_cache=job.target_cache,
                                     progress=progress_lines(say, f"[{stage}] {name}") if say else None).to_dict()
        sets[name] |= written or {}
        sets[name]["sources"] = cfg.eval_prompts if name == "held_out" else cfg.ood_prompts
    atomic_write_text(d / "report.json", json.dumps(sets, indent=1, default=str))
    del target, draft  # free the models before the next stage loads its own
    gc.collect()
    return {"draft": str(draft_path), "sets": sets}


def _run_swap(job: _Job, d: Path) -> dict[str, Any]:
    """The draft re-indexed into the target's tokenizer (:func:`specdraft.models.vocab.save_vocab_swap`), then replayed on
    ``eval_before``'s answers: the distillation gain's baseline is the draft that is trained."""

    report = save_vocab_swap(job.plan.draft.path, job.plan.target.path, d / "model", dtype=job.cfg.distill.dtype,
                             overwrite=True)
    counted = _count(job, d, str(d / "model"), False, "vocab_swap", log=False)
    return report.to_dict() | {"path": str(d / "model"), "sets": counted["sets"]}


def _run_headroom(job: _Job, d: Path) -> dict[str, Any]:
    """The forecast (:func:`specdraft.measuring.headroom.forecast_headroom`) for the draft that is trained, teacher-forced on
    ``eval_before``'s held-out answers with the serving filter; a swapped draft's twins give the swap diagnostic."""

    cfg, plan, draft_path = job.cfg, job.plan, job.train_draft
    twins = swapped_draft_twins(draft_path, plan.target.path)  # None unless the vocab_swap stage wrote it
    target, tok = load_model(plan.target, dtype=cfg.eval.dtype)
    draft, _ = load_model(draft_path, dtype=cfg.eval.dtype)
    prompts = encode_prompts(tok, plan.evals)
    answers = job.results["eval_before"]["sets"]["held_out"]["answers"]
    seqs = [list(p) + list(a) for p, a in zip(prompts, answers, strict=True)]
    # Position j predicts token j + 1: the last prompt position predicts the first answer token.
    masks = [[False] * (len(p) - 1) + [True] * len(a) + [False] for p, a in zip(prompts, answers, strict=True)]
    res = forecast_headroom(target, draft, seqs, masks, cfg.headroom, names=[e.id for e in plan.evals],
                            serving=job.cfg.distill.serving, real_vocab=len(tok), pad_id=tokenizer_pad_id(tok),
                            twins=twins, tokenizer=tok, target_cache=job.target_cache)
    atomic_write_text(d / "report.json", json.dumps(res.to_dict(), indent=1, default=str))
    del target, draft
    gc.collect()
    return res.to_dict(per_sequence=False) | {"draft": str(draft_path)}


def _after_headroom(job: _Job, headroom: dict[str, Any]) -> None:
    forecast = HeadroomForecast.from_dict(headroom)
    job.log(f"[headroom] a forecast against the target's answers: {forecast.verdict} (95% CI "
            f"[{forecast.gain_ci95[0]:+.3f}, {forecast.gain_ci95[1]:+.3f}]); the road this run takes: "
            f"{teaching_road(job.self_taught)}")
    if len(job.trains) < len(job.plan.trains):
        job.log(f"[dump] the target answers the first {len(job.trains)} of the {len(job.plan.trains)} training "
                "prompts (target_dump_prompts)")


def _run_dump(job: _Job, d: Path) -> dict[str, Any]:
    """The teacher dump of :attr:`_Job.trains`: the target's answers (:func:`specdraft.training.dump.run_dump`), or with
    ``cfg.self_teacher`` the draft as given's, re-encoded for its re-indexed copy
    (:func:`specdraft.training.self_teacher.run_self_teacher`)."""
    cfg, plan = job.cfg, job.plan
    progress = progress_lines(job.log, "[dump] teacher", "sequences")
    if job.self_taught:

        man = run_self_teacher(plan.draft.path, plan.target.path, job.trains, d, cfg.self_teacher,
                               progress=progress, command=job.command)
    else:

        man = run_dump(plan.target, job.trains, d, cfg.dump, command=job.command, progress=progress)
    this = man.get("this_run", {})
    return {"sequences": man.get("sequences"), "tokens": man.get("tokens"), "bytes": man.get("bytes"),
            "tokens_per_s": this.get("tokens_per_s"), "generate_tokens_per_s": this.get("generate_tokens_per_s"),
            "teacher": "draft-as-given" if job.self_taught else "target",
            **({"trained_tokens": man.get("trained_tokens"), "signal": man.get("signal")} if job.self_taught else {})}


def _run_distill(job: _Job, d: Path) -> dict[str, Any]:

    cfg = job.cfg
    # The distilled draft is kept in the run's dtype (what the evaluations load it in), unless the export keeps the
    # training dtype; a finished training's checkpoints go unless asked for.
    kept = cfg.eval.dtype if cfg.eval.dtype in ("float32", "bfloat16", "float16") and cfg.export_dtype != "keep" else None
    res = run_distill(cfg.target, job.train_draft, job.out / "dump", d, cfg.distill,
                      num_speculative_tokens=cfg.eval.num_speculative_tokens,
                      keep_checkpoints=job.keep_checkpoints, save_dtype=kept)
    return res.to_dict()


def _run_speed(job: _Job, d: Path) -> SpeedStage:
    """Interleaved timing runs (:func:`specdraft.measuring.evaluate.interleaved_speed`) after a warm-up, on the first
    ``speed_prompts`` prompts of every held-out set: the target alone, the original and the distilled draft, and
    transformers' assisted generation with the original draft; "faster" is claimed per set, never extrapolated."""

    cfg, plan, original = job.cfg, job.plan, job.plan.draft.path
    target, tok = load_model(plan.target, dtype=cfg.eval.dtype)
    drafts = {"original": load_model(original, dtype=cfg.eval.dtype)[0],
              "distilled": load_model(job.results["distill"]["speculator"], dtype=cfg.eval.dtype)[0]}
    mappings = {"original": build_vocab_mapping(plan.target.path, original)} if job.mapped else {}
    by_set = {}
    for name, examples in plan.sets.items():
        examples = examples[: cfg.speed_prompts]
        by_set[name] = interleaved_speed(target, drafts, tok, encode_prompts(tok, examples), [e.id for e in examples],
                                         cfg.eval, hf_draft="original" if cfg.eval.compare_hf else None,
                                         vocab_mappings=mappings)
    res = SpeedStage(by_set["held_out"], {k: v for k, v in by_set.items() if k != "held_out"})
    atomic_write_text(d / "report.json", json.dumps(res.to_dict(), indent=1, default=str))
    del target, drafts
    gc.collect()
    return res


def _after_speed(job: _Job, speed: SpeedStage) -> None:
    if not speed.lossless:
        raise PipelineError(f"greedy speculative decoding diverged from the target alone beyond rounding tolerance "
                            f"(see {job.out / 'speed' / 'report.json'}); this is a bug, please report it")


def _run_export(job: _Job, d: Path) -> dict[str, Any]:
    """The distilled speculator into ``export/speculator`` (:func:`specdraft.serving.export.export_saved_speculator`) with
    its token ranking counted over the teacher dump's answers and the embedded training prompts
    (:func:`specdraft.decoding.draft_model.save_head_tokens`); the draft as given into ``export/speculator-as-given``
    (:func:`specdraft.serving.export.export_draft`); with ``cfg.export_gguf`` the draft of the target's tokenizer that decoded
    faster written as GGUF and priced for llama.cpp (:func:`specdraft.serving.llama_cpp.run_plan`)."""

    cfg, plan, speed = job.cfg, job.plan, job.results.get("speed")
    res = export_saved_speculator(job.results["distill"]["speculator"], d / "speculator", cfg.target, cfg.export_dtype)
    tok = load_tokenizer(plan.target.path)
    dump = TeacherDataset(job.out / "dump")
    answers = []
    for i in range(len(dump)):
        item = dump.tokens(i)
        answers.append(item["input_ids"][1:][item["loss_mask"][:-1].bool()].tolist())
    ranked = rank_tokens(tok, token_lists=answers + default_head_corpus(tok))
    path = save_head_tokens(d / "speculator", ranked, tok, f"teacher dump ({sum(map(len, answers))} answer tokens "
                            f"written by {answers_written_by(dump.manifest)}) + the embedded training prompts")
    res = res | {"head_tokens_file": str(path.resolve())}
    given = export_draft(plan.draft.path, cfg.target, d / "speculator-as-given",
                         num_speculative_tokens=cfg.eval.num_speculative_tokens, overwrite=True)
    res["as_given"] = {"path": str(given.out), "vllm_command": given.vllm_command, "drafting": given.serve.drafting}
    if cfg.export_gguf is not None:  # the same draft for llama.cpp's -md, checked against the target's vocabulary

        which, source = "distilled", d / "speculator"
        if not job.mapped and speed is not None:  # a draft of another tokenizer: only the distilled one pairs
            s = {w: (c.speedup or 0.0) for w in ("original", "distilled")
                 if (c := speed.held_out.contender("speculative", w)) is not None}
            if s.get("original", 0.0) > s.get("distilled", 0.0):
                which, source = "original", d / "speculator-as-given"
        g = export_gguf(source, plan.target.path, d / f"draft-{cfg.export_gguf}.gguf", gguf_type=cfg.export_gguf,
                        num_speculative_tokens=cfg.eval.num_speculative_tokens, overwrite=True)
        side = job.results["eval_after" if which == "distilled" else "eval_before"]
        alpha = ((side or {}).get("sets") or {}).get("held_out", {}).get("alpha")
        res["llama_cpp"] = run_plan(cfg.target, g.out, g.bytes, alpha, which, draft_ref=str(source))
        # The command the plan recommends (the target alone where the draft does not pay) beside the draft's own.
        res["gguf"] = {"path": str(g.out), "gguf_type": g.gguf_type, "bytes": g.bytes, "verdict": g.verdict,
                       "llama_cpp_command": res["llama_cpp"].get("command", g.command),
                       "draft_command": g.command, "draft": which}
    return res


def _file_key(path: Path) -> str:
    """A stage key's part for a data file the stage prices with: its content's hash."""
    return sha256_file(path)[0][:16]


def _model(role: str, when: Callable[[_Job], bool] | None = None) -> Input:
    """A model by content (:func:`model_identity`) in a key: new weights under the same path are a changed input."""
    return computed(None, lambda job: job.identity(role), when)


_PAIR = (config("target"), config("draft"), _model("target"), _model("draft"))
_gguf = lambda job: job.cfg.export_gguf is not None
_self_taught = lambda job: job.self_taught

#: The main job, one declaration per stage, in order (:class:`specdraft.run.runner.Stage`): a stage added here is run,
#: cached by its inputs, resumed, recorded in report.json under its name and rendered in report.md by its section.
PIPELINE: tuple[Stage, ...] = (
    Stage("check", inputs=_PAIR + (config("vocab_swap"),), run=_run_check, after=_after_check),
    Stage("eval_before",
          inputs=_PAIR + (config("eval"), config("serving", "distill.serving"),
                          computed("prompts", lambda job: {k: [e.id for e in v] for k, v in job.plan.sets.items()}),
                          computed("prompt_texts", lambda job: {k: prompt_texts(v) for k, v in job.plan.sets.items()})),
          run=lambda job, d: _count(job, d, job.plan.draft.path, job.mapped, "eval_before"),
          section=evaluation_section),
    Stage("vocab_swap", inputs=(extends("eval_before"), config("dtype", "distill.dtype")), run=_run_swap,
          section=swap_section, when=lambda job: job.mapped),
    Stage("headroom",
          inputs=(extends("eval_before"), computed("trained_draft", lambda job: str(job.train_draft)),
                  config("headroom")),
          run=_run_headroom, section=forecast_section, after=_after_headroom),
    Stage("dump",
          inputs=(config("target"), _model("target"), config("dump", when=lambda job: not job.self_taught),
                  computed("prompts", lambda job: [e.id for e in job.trains]),
                  computed("prompt_texts", lambda job: prompt_texts(job.trains, whole=True)),
                  _model("draft", when=_self_taught), config("self_teacher", when=_self_taught)),
          run=_run_dump),
    Stage("distill",
          inputs=(upstream("dump"), config("draft"), _model("draft"), config("distill"),
                  config("gamma", "eval.num_speculative_tokens"), computed("vocab_swap", lambda job: job.mapped)),
          run=_run_distill, section=distill_section),
    Stage("eval_after", inputs=(extends("eval_before"), upstream("distill")),
          run=lambda job, d: _count(job, d, job.results["distill"]["speculator"], False, "eval_after"),
          section=summary_section, after=lambda job, _: shutil.rmtree(job.target_cache, ignore_errors=True)),
    Stage("speed", inputs=(extends("eval_before"), upstream("distill"), config("speed_prompts")), run=_run_speed,
          result=SpeedStage, section=speed_section, when=lambda job: bool(job.cfg.speed_prompts), after=_after_speed),
    Stage("export",
          inputs=(extends("distill"), config("dtype", "export_dtype"),
                  computed("head_tokens_file", lambda job: HEAD_TOKENS_FORMAT), computed("as_given", lambda job: True),
                  config("gguf", "export_gguf", when=_gguf),
                  computed("llama_cpp_bench", lambda job: _file_key(PACKAGED_BENCH), when=_gguf)),
          run=_run_export, section=export_section),
)

#: The stage names in order, the report last (it is written from every stage's result, never skipped).
STAGES = tuple(s.name for s in PIPELINE) + ("report",)


def report_sections(stages: tuple[Stage, ...] = PIPELINE) -> list[Callable[[dict[str, Any]], list[str]]]:
    """The report.md sections of ``stages``, in their order (:func:`specdraft.measuring.report.render_markdown`)."""
    return [s.section for s in stages if s.section is not None]


def run_pipeline(cfg: PipelineConfig, out: str | Path, command: str | None = None,
                 log: Callable[[str], None] = _LOG.info, eval_examples=None, train_examples=None,
                 ood_examples=None, overwrite: bool = False, keep_checkpoints: bool = False,
                 stages: tuple[Stage, ...] = PIPELINE) -> dict[str, Any]:
    """Run every stage of ``stages`` (skipping those already done with the same inputs) and write the report.

    Args:
        cfg: the pipeline config (:func:`make_config` from :data:`PRESETS`).
        out: the run directory.
        command: how to resume (shown on failure); default ``sys.argv``.
        log: where progress lines go (the CLI prints them; default: the ``specdraft`` logger at INFO).
        eval_examples / train_examples / ood_examples: explicit example lists (override the prompt sources).
        overwrite: redo a stage finished in ``out`` with other inputs (its directory emptied first) instead of
            refusing it.
        keep_checkpoints: keep the distillation's Trainer checkpoints once it has finished (removed by default:
            each is several times the draft's size).
        stages: the stage declarations, in order (default :data:`PIPELINE`).

    Returns:
        The ``report.json`` payload.

    Raises:
        PipelineError: a stage failed (names it and the resume command), a stage finished in ``out`` with other
            inputs (names the stage and what changed; without ``overwrite``), overlap refused, too little disk.
    """

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    command = command or " ".join(["specdraft"] + sys.argv[1:])
    runner = Runner(out, command, log, overwrite)
    t_all = time.time()
    host = {"gemv_bf16_gb_s": gemv_gb_s()}  # the machine's rate before the work: what its minutes scale with
    plan = _preflight(cfg, out, log, eval_examples, train_examples, ood_examples)
    job = _Job(cfg, plan, out, command, log, keep_checkpoints)
    walk(runner, stages, job)
    report = {"config": job.cfg.model_dump(), "command": command,
              **{s.name: as_record(job.results[s.name]) for s in stages},
              "overlap": plan.overlap, "timings": runner.timings, "host": host, "total_seconds": time.time() - t_all,
              "date": time.strftime("%Y-%m-%d %H:%M"), "versions": versions()}
    # What to serve where, from what was measured: the page and report.md open with it; export/ names it too.
    report["recommendation"] = [c.to_dict() for c in write_export_manifest(report, out / "export")]
    verdict = distillation_verdict(report)
    report["distillation_verdict"] = verdict.to_dict() if verdict else None
    write_pipeline_report(report, out, report_sections(stages))
    runner.timings["report"] = {"seconds": 0.0, "skipped": False}
    return report
