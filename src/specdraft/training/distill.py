"""The distillation recipe: train the draft toward the target's distribution (DistillSpec, Zhou et al. 2023), export it.

:func:`run_distill` runs :func:`setup`, :func:`data`, the loss step
(:class:`specdraft.training.distill_trainer.DistillModel`), :func:`train` and :func:`save`, in that order. Evidence and
derivations: docs/architecture.md#specdrafttrainingdistill.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdraft.core.config import NUM_SPECULATIVE_TOKENS, DistillConfig
from specdraft.core.io import atomic_write_text
from specdraft.core.sampling import check_context, check_token_ids, input_width, output_width
from specdraft.decoding.draft_model import default_head_corpus, rank_tokens
from specdraft.models.dump_reader import TeacherDataset, TeacherMix, load_manifest
from specdraft.models.loading import load_model, load_tokenizer, model_fingerprint
from specdraft.models.restricted_head import NEEDS_NO_TAIL, support_ids
from specdraft.serving.export import export_speculator, write_training_json
from specdraft.training.distill_data import (
    DistillError,
    OnPolicyStream,
    collate,
    dataset_prompts,
    load_draft_writer,
    prompt_keyed_split,
    stream_start_callback,
)
from specdraft.training.distill_trainer import (
    METRICS,
    DistillModel,
    DistillTrainer,
    TeacherHead,
    cut_ties,
    readable_log_callbacks,
)
from specdraft.training.head_warmup import untie_head

#: CPU flags (``/proc/cpuinfo``) of native bfloat16 matmuls: AMX tiles, or AVX-512 BF16 dot products (oneDNN
#: uses either); without them a bfloat16 matmul is emulated and no faster than float32.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The :data:`BF16_CPU_FLAGS` this CPU advertises (``cpuinfo``: the text of ``/proc/cpuinfo``, read when
    None; an unreadable file — not Linux — gives none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return [f for f in BF16_CPU_FLAGS if f in flags]


def resolve_precision(precision: str, device_type: str, cpuinfo: str | None = None) -> tuple[str, str]:
    """What ``DistillConfig.precision`` means on this device: ``("float32" | "bf16-autocast", reason)``."""
    if precision != "auto":
        return precision, "asked for"
    if device_type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ("bf16-autocast", "auto: CUDA with bfloat16") if ok else ("float32", "auto: CUDA without bfloat16")
    if device_type == "cpu":
        found = cpu_bf16_flags(cpuinfo)
        if found:
            return "bf16-autocast", f"auto: CPU with {', '.join(found)}"
        return "float32", f"auto: CPU without {' or '.join(BF16_CPU_FLAGS)} (bfloat16 would be emulated)"
    return "float32", f"auto: {device_type} (bf16 autocast only chosen on CPU and CUDA)"


#: How the figures of a run through a restricted head read (appended to :func:`alpha_definition`).
RESTRICTED_HEAD_METRICS = (
    "; q over the full head for the held-out eval_ figures (one full pass per held-out batch), eval_outside_mass "
    "the draft's mass outside the restricted head's support, 1 − q(S); the training log's alpha, tvd and train_acc "
    "are over the support's softmax q_S, which the outside mass inflates")


def alpha_definition(config: DistillConfig, teacher_format: str = "hidden",
                     cut: dict[str, Any] | None = None) -> str:
    """What the logged ``alpha`` / ``eval_alpha`` is under ``config``'s serving settings, in words (recorded in
    ``training.json`` as ``metrics["alpha_definition"]``)."""
    if config.serving_is_plain:
        text = "Σ min(p, q) at temperature 1, no filter"
        if teacher_format == "topk":
            text += (" (p: the dump's top-k, its leftover mass spread uniformly over the other ids; within "
                     "±alpha_bound, the mean leftover mass, of the value under the full p)")
        if config.head_support is not None:  # the only serving a restricted head takes
            text += RESTRICTED_HEAD_METRICS
        return text
    text = (f"Σ min(p̃, q̃), p̃ and q̃ after the serving filter (temperature {config.serving.temperature}, top-k "
            f"{config.serving.top_k}, top-p {config.serving.top_p}), renormalised")
    if teacher_format != "topk":
        return text
    where = ("where the serving cut keeps the last stored value, the target's filter may also keep unstored ids "
             "tied with it, and α is within ±alpha_bound there (cut_tie_bound: the ids the leftover mass could hold "
             "at that value)")
    if cut is None:
        text += (f" (from the dump's top-k, stored ids only; not exact {where} — every position at a serving top-k "
                 "equal to the stored k; those positions were not counted)")
    elif cut["positions"]:
        text += (f" (from the dump's top-k, stored ids only; not exact at {cut['positions']} of {cut['of']} "
                 f"trained positions ({cut['share']:.1%}, metrics.cut_ties): there {where})")
    else:
        text += (f" (exact from the dump's top-k: the filter keeps stored ids only, and at none of {cut['of']} "
                 "trained positions does it keep the last stored value)")
    if cut is not None and cut.get("stored_dtype") == "float16":
        text += "; the dump stores float16 log-probs, whose rounding can make or break ties at the cut"
    return text


def count_cut_ties(dataset, config: DistillConfig) -> dict[str, Any] | None:
    """:func:`cut_ties` counted over every trained position (``loss_mask``) of a top-k ``dataset``
    (:class:`~specdraft.models.dump_reader.TeacherDataset` or ``TeacherMix``), for ``training.json``'s
    ``metrics.cut_ties``.

    Returns:
        ``{"positions", "of", "share", "stored_k", "serving_top_k", "stored_dtype"}`` (``positions`` of ``of``
        trained positions are cut ties), or ``None`` for a hidden teacher or plain serving (no cut to tie).
    """
    manifest = dataset.manifest
    if manifest["format"] != "topk" or config.serving_is_plain:
        return None
    positions = total = 0
    for i in range(len(dataset)):
        item = dataset[i]
        mask = item["loss_mask"].bool()
        positions += int(cut_ties(item["topk_logprobs"], config)[mask].sum())
        total += int(mask.sum())
    return {"positions": positions, "of": total, "share": positions / total if total else 0.0,
            "stored_k": manifest["top_k"], "serving_top_k": config.serving.top_k,
            "stored_dtype": manifest["dtype"]["topk_logprobs"]}


def select_trainable(draft, config: DistillConfig):
    """Freeze what ``config.train`` says stays fixed; returns the (possibly peft-wrapped) draft and the number
    of trainable parameters."""
    if config.train == "lora":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:  # pragma: no cover - peft is optional
            raise DistillError("train=lora needs peft: pip install peft") from exc
        draft = get_peft_model(draft, LoraConfig(r=config.lora_r, lora_alpha=2 * config.lora_r,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    elif config.train == "last_layers":
        stack, layers = _decoder_layers(draft)
        norm = _final_norm(stack, draft)
        for p in draft.parameters():
            p.requires_grad_(False)
        for module in (*layers[-config.train_last_layers:], norm):
            for p in module.parameters():
                p.requires_grad_(True)
    return draft, sum(p.numel() for p in draft.parameters() if p.requires_grad)


def master_weights(draft) -> bool:
    """Give the draft's trained parameters of a reduced-precision dtype float32 master weights, in place; True when
    the draft holds weights of such a dtype (a draft loaded in bfloat16: ``DistillConfig.dtype``), trained or not:
    its forward then needs bfloat16 autocast to mix them with float32 ones."""
    low = [p for p in draft.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    for p in low:
        if p.requires_grad:
            p.data = p.data.float()
    return bool(low)


def trainable_snapshot(draft) -> dict[str, torch.Tensor]:
    """The trainable parameters' values by name, copied to the CPU in their own dtype (for :func:`moved_fraction`)."""
    return {n: p.detach().to("cpu", copy=True) for n, p in draft.named_parameters() if p.requires_grad}


def moved_fraction(draft, start: dict[str, torch.Tensor]) -> float:
    """Share of the trainable parameter elements (those of ``start``, a :func:`trainable_snapshot`) whose value in
    ``draft`` differs from ``start``: 0 when training changed nothing (an update rounded away, a frozen module),
    near 1 when every trained weight moved. Elements whose gradient was always 0 (embedding rows of tokens never
    seen) stay put and count as unmoved. 0.0 with nothing trainable."""
    params = dict(draft.named_parameters())
    moved = sum(int((params[n].detach().float().cpu() != v.float()).sum()) for n, v in start.items())
    total = sum(v.numel() for v in start.values())
    return moved / total if total else 0.0


#: Below this share of the training's moved weights surviving the save, the export is said to have lost the update.
KEPT_UPDATE_MIN = 0.5


def rounded_away(moved: float, moved_saved: float | None, saved_dtype: str) -> str | None:
    """The warning for an export that keeps less than :data:`KEPT_UPDATE_MIN` of what training moved (float32
    master weights rounded back to a bfloat16 export: an update below half a unit in the last place is lost), or
    None. ``moved`` / ``moved_saved``: :func:`moved_fraction` of the trained weights, in training and as saved."""
    if moved_saved is None or moved <= 0 or moved_saved >= KEPT_UPDATE_MIN * moved:
        return None
    return (f"specdraft distill: {moved:.1%} of the trained weights moved in training, {moved_saved:.1%} as saved in "
            f"{saved_dtype}: most of the update rounds away in {saved_dtype}. Keep float32 weights with "
            "--dtype float32 (a run config: distill.dtype float32 and export_dtype keep), or raise --lr")


#: Where a causal LM keeps its decoder stack (the module holding the layer list, then the list's name): Llama,
#: Qwen2, Mistral and Gemma ``model.layers``; GPT-2 ``transformer.h``; OPT ``model.decoder.layers``.
DECODER_STACKS = (("model", "layers"), ("transformer", "h"), ("model.decoder", "layers"))
#: The final norm's name in that stack module (Llama-style ``norm``, GPT-2 ``ln_f``, OPT ``final_layer_norm``): it
#: normalises the last layer's output for the head, so training the last layers without it leaves the head reading
#: states scaled as before.
FINAL_NORMS = ("norm", "ln_f", "final_layer_norm")


def _decoder_layers(model) -> tuple[nn.Module, list[nn.Module]]:
    """The module holding ``model``'s decoder layers (one of :data:`DECODER_STACKS`) and the layers in order.

    Raises:
        DistillError: none of the known paths holds them (named, with what to train instead).
    """
    for path, name in DECODER_STACKS:
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj, list(getattr(obj, name))
        except AttributeError:
            continue
    raise DistillError(f"cannot find the decoder layers of {type(model).__name__} for train=last_layers (looked "
                       f"for {', '.join(f'{p}.{n}' for p, n in DECODER_STACKS)}); train it with --train all or lora")


def _final_norm(stack: nn.Module, model) -> nn.Module:
    """The final norm of a decoder ``stack`` (one of :data:`FINAL_NORMS`), which train=last_layers trains too.

    Raises:
        DistillError: the stack holds none (named): training the last layers alone would leave it silently frozen.
    """
    for name in FINAL_NORMS:
        norm = getattr(stack, name, None)
        if isinstance(norm, nn.Module):
            return norm
    raise DistillError(f"cannot find the final norm of {type(model).__name__} for train=last_layers (looked for "
                       f"{', '.join(FINAL_NORMS)} beside its decoder layers); train it with --train all or lora")


def learning_curve(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``[{"step", "eval_alpha", "eval_loss"}]`` by step from a Trainer log history: one point per step (the
    last evaluation logged at it), step 0 being the draft before training."""
    points = {h["step"]: {"step": h["step"], "eval_alpha": h["eval_alpha"], "eval_loss": h["eval_loss"]}
              for h in history if "eval_alpha" in h}
    return [points[s] for s in sorted(points)]


def distill_origin(parts, draft_ref, dump_weights: list[int] | None) -> dict[str, Any]:
    """The data and draft of a distillation (for :func:`resume_origin`): each dump's plan (what it was made from:
    target, prompts, settings) by sha256, their weights, each dump's teacher by content (the whole target's
    :func:`specdraft.models.loading.model_fingerprint` its manifest records, ``None`` for a dump made before one was), and
    the draft by reference and content: checkpoints trained against another teacher, or from a draft whose weights
    changed under the same path, are never resumed."""

    plans = [hashlib.sha256(json.dumps(p.manifest.get("plan"), sort_keys=True, default=str).encode()).hexdigest()[:16]
             for p in parts]
    return {"dump": plans, "dump_weights": dump_weights,
            "teacher_weights": [p.manifest.get("identity", {}).get("target_weights") for p in parts],
            "draft": str(draft_ref), "draft_weights": model_fingerprint(draft_ref)}


def resume_origin(draft, config: DistillConfig, processes: int, origin: dict[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint belongs to: the data and draft (``origin``), the loss and its settings, the batch
    geometry (per-rank batch × accumulation × ranks: a resumed sampler and schedule count steps of it) and the
    draft's parameter names and shapes. ``max_steps`` and the learning rate are left out: a longer run resumes."""
    shapes = hashlib.sha256(json.dumps(sorted((n, list(p.shape)) for n, p in draft.state_dict().items())).encode())
    return {**(origin or {}), "loss": config.loss, **config.serving.model_dump(), "train": config.train,
            "batch_size": config.batch_size, "gradient_accumulation_steps": config.gradient_accumulation_steps, "processes": processes,
            "draft_parameters": shapes.hexdigest()[:16]}


def check_resume_origin(checkpoint_dir: Path, origin: dict[str, Any], resume: bool, write: bool = True) -> None:
    """Refuse to resume checkpoints made for another run (naming each field that changed), before any training;
    without ``resume`` delete them (start over). Then record ``origin`` beside the checkpoints.

    Raises:
        DistillError: ``checkpoint_dir`` holds a checkpoint and an ``origin.json`` that differs from ``origin`` (or
            none: checkpoints of unknown origin).
    """
    path = checkpoint_dir / "origin.json"
    origin = json.loads(json.dumps(origin, default=str))
    if last_checkpoint(checkpoint_dir) is not None:
        if not resume:
            if write:
                shutil.rmtree(checkpoint_dir)
        else:
            saved = json.loads(path.read_text()) if path.is_file() else None
            if saved != origin:
                changed = ["no origin.json (checkpoints of unknown origin)"] if saved is None else [
                    f"{k}: {saved.get(k)!r} → {origin.get(k)!r}" for k in sorted(set(saved) | set(origin))
                    if saved.get(k) != origin.get(k)]
                raise DistillError(f"{checkpoint_dir} holds checkpoints of another training run ({'; '.join(changed)}); "
                                   "resuming them would continue that run into this one. Pass --no-resume to delete "
                                   "them and start over, or choose a new --out.")
    if write:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(origin, indent=1, default=str))


def last_checkpoint(checkpoint_dir: Path) -> str | None:
    """The newest complete ``checkpoint-N`` directory (one with trainer_state.json), or None."""
    if not checkpoint_dir.is_dir():
        return None
    done = [p for p in checkpoint_dir.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    if not done:
        return None
    return str(max(done, key=lambda p: int(p.name.split("-")[-1])))


def train(draft, teacher: TeacherHead, train_dataset, eval_dataset, config: DistillConfig, output_dir: str | Path,
          resume: bool = True, report_to: str = "none", callbacks: list | None = None, writer=None,
          origin: dict[str, Any] | None = None, support: torch.Tensor | None = None) -> TrainResult:
    """Step 3, train: ``draft`` against ``teacher`` with :class:`DistillTrainer` (runs unchanged under
    ``accelerate launch`` / ``torchrun``; ``batch_size`` per rank).

    Raises:
        DistillError: non-finite loss (the last good checkpoint stays), widths that cannot be aligned, checkpoints
            of another run.
    """
    from transformers import TrainingArguments
    from transformers.trainer_utils import set_seed

    set_seed(config.seed)
    if config.untie_head:

        untie_head(draft)  # before freezing: the new head parameter follows config.train like the rest
    draft, n_trainable = select_trainable(draft, config)
    use_cpu = not torch.cuda.is_available()
    precision, precision_reason = resolve_precision(config.precision, "cpu" if use_cpu else "cuda")
    start = trainable_snapshot(draft)
    if master_weights(draft):
        precision, precision_reason = "bf16-autocast", (
            "dtype bfloat16: the trained parameters keep float32 master weights under a bfloat16 forward")
    model = DistillModel(draft, teacher, config, autocast=precision == "bf16-autocast", support=support)
    ckpt_dir = Path(output_dir) / "checkpoints"
    args = TrainingArguments(
        output_dir=str(ckpt_dir),
        max_steps=config.max_steps,
        per_device_train_batch_size=config.batch_size,
        per_device_eval_batch_size=config.batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        learning_rate=config.lr,
        weight_decay=config.weight_decay,
        warmup_steps=math.ceil(config.warmup_ratio * config.max_steps),
        lr_scheduler_type=config.scheduler,
        max_grad_norm=config.max_grad_norm,
        logging_steps=config.logging_steps,
        save_steps=config.save_steps,
        save_total_limit=2,
        eval_strategy="steps" if config.eval_steps and eval_dataset is not None else "no",
        eval_steps=config.eval_steps or None,
        seed=config.seed,
        data_seed=config.seed,
        remove_unused_columns=False,
        report_to=report_to,
        use_cpu=use_cpu,
        # The Trainer's own bf16 would autocast the teacher too (and step bfloat16 parameters in bfloat16):
        # bfloat16 runs through DistillModel's autocast, which wraps the draft alone, over float32 master weights.
        bf16=False,
        dataloader_num_workers=0,
        # The teacher head is a (non-persistent) buffer, identical on every rank: DDP's default would
        # broadcast all V×H of it from rank 0 before every forward.
        ddp_broadcast_buffers=False,
        # A bar where a terminal draws it; in a log file or CI the Trainer prints one line per logging step instead
        # (its PrinterCallback), never a carriage-return bar no one redraws.
        disable_tqdm=not sys.stderr.isatty(),
        save_only_model=False,
    )
    check_resume_origin(ckpt_dir, resume_origin(draft, config, args.world_size, origin), resume,
                        write=args.process_index == 0)
    stream = None
    if config.on_policy_fraction > 0:
        if writer is None:
            raise DistillError("on_policy_fraction > 0 needs a DraftWriter (the target scores the draft's answers)")
        stream = OnPolicyStream(train_dataset, dataset_prompts(train_dataset), writer, draft,
                                config.on_policy_fraction, config.on_policy_every,
                                config.batch_size * config.gradient_accumulation_steps * args.world_size, config.seed,
                                config.max_steps)
        # The Trainer iterates an IterableDataset in order (no sampler, no data skipping on resume: the stream
        # itself restarts at the resumed step, told by stream_start_callback).
        train_dataset = stream
        args.ignore_data_skip = True
        callbacks = [*(callbacks or []), stream_start_callback(stream)]
    trainer = DistillTrainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                             data_collator=collate, callbacks=callbacks)
    readable_log_callbacks(trainer)
    t0 = time.time()
    eval_before = trainer.evaluate() if eval_dataset is not None and len(eval_dataset) else {}
    ckpt = last_checkpoint(ckpt_dir) if resume else None
    trainer.train(resume_from_checkpoint=ckpt)
    last = next((h for h in reversed(trainer.state.log_history) if "eval_alpha" in h), None)
    if last is not None and last["step"] == trainer.state.global_step:
        eval_after = {k: v for k, v in last.items() if k.startswith("eval_")}  # eval_steps already scored it
    else:
        eval_after = trainer.evaluate() if eval_dataset is not None and len(eval_dataset) else {}
    # train() starts a fresh TrainerState (or the checkpoint's), dropping the log of the evaluation before it.
    history = ([eval_before | {"step": 0}] if eval_before else []) + list(trainer.state.log_history)
    moved = moved_fraction(draft, start)
    if config.train == "lora":
        draft = draft.merge_and_unload()
    return TrainResult(
        trainable_parameters=n_trainable, moved_fraction=moved, steps=trainer.state.global_step, history=history,
        eval_before=eval_before, eval_after=eval_after, curve=learning_curve(history), processes=args.world_size,
        precision=precision, precision_reason=precision_reason, seconds=time.time() - t0, resumed_from=ckpt,
        draft=draft, start=None if config.train == "lora" else start,
        on_policy=None if stream is None else {**getattr(stream.writer, "stats", {}),
                                               "refresh_steps": stream.refresh_steps})


def head_support(dataset, tokenizer, config: DistillConfig, widths: tuple[int, int]) -> torch.Tensor:
    """The restricted head's support (:func:`specdraft.models.restricted_head.support_ids`): every token id of the dump's
    sequences (the labels among them) plus the ``config.head_support`` most frequent ids of the embedded training
    prompts (:func:`specdraft.decoding.draft_model.rank_tokens`).

    Raises:
        DistillError: the dump is not a top-k dump (a hidden-state teacher has mass on every id), or one of its
            trained positions holds leftover mass (a token-level self-teacher, a target's top-k): before training.
    """

    if dataset.manifest["format"] != "topk":
        raise DistillError("--head-support needs a top-k dump with no leftover mass (hard labels: a self-teacher "
                           "dump); a hidden-state teacher gives mass to every id")
    data = set()
    for i in range(len(dataset)):
        item = dataset[i]
        if bool((item["leftover_logmass"].float().exp().gt(0) & item["loss_mask"].bool()).any()):
            raise DistillError(f"{NEEDS_NO_TAIL}; sequence {item['id']!r} spreads mass past its stored ids")
        data.update(item["input_ids"].tolist())
    ranked = rank_tokens(tokenizer, token_lists=default_head_corpus(tokenizer)) if config.head_support else []
    return support_ids(data, ranked, config.head_support or 0, width=min(widths))


@dataclass
class Setup:
    """What :func:`setup` checked and loaded: the dump (``parts``, one per directory, and ``dataset``, their mix),
    the draft and its tokenizer, the teacher's head, and the restricted head's support (or None)."""

    dirs: list[Path]
    parts: list
    dataset: Any
    tokenizer: Any
    draft: Any
    loaded_dtype: torch.dtype
    teacher: TeacherHead
    cut: dict[str, Any] | None
    support: torch.Tensor | None


def setup(draft_ref: str, dump_dirs: list[str | Path], config: DistillConfig, device: str | None = None) -> Setup:
    """Step 1, setup: every check that can fail before training — the manifests against the serving filter (before
    any shard is hashed or weight loaded), the shards, the tokenizer fingerprint, the widths, the draft's window.

    Raises:
        DistillError / specdraft.models.dump_reader.DumpError: a dump of another tokenizer, a corrupt or empty dump, bad
            widths, serving settings a top-k dump cannot compute, a sequence past the draft's window.
        specdraft.core.sampling.TokenWidthError: dump token ids past the draft's embedding or head.
    """

    tokenizer = load_tokenizer(draft_ref)
    dirs = [Path(d) for d in dump_dirs]
    for d in dirs:
        m = load_manifest(d)
        if m["format"] == "topk" and (problem := config.sparse_teacher_problem(int(m["top_k"]))):
            raise DistillError(f"{d}: {problem}")
    parts = [TeacherDataset(d, draft_tokenizer=tokenizer, verify=True, prompt_positions=config.prompt_positions)
             for d in dirs]  # refuses a mismatch
    dataset = parts[0] if len(parts) == 1 else TeacherMix(parts)  # refuses dumps of different teachers
    if len(dataset) == 0:
        raise DistillError(f"the dump in {', '.join(map(str, dirs))} holds no sequences")
    draft, _ = load_model(draft_ref, dtype=config.dtype, device=device or "cpu")
    widths = (input_width(draft), output_width(draft))
    if beyond := dataset.token_ids_from(min(widths)):  # an IndexError inside the draft at its first batch otherwise
        check_token_ids(torch.tensor(beyond), [("draft", widths)], what=f"the dump's sequences ({dump_dirs})")
    longest_id, longest = dataset.longest()  # past the draft's window: an IndexError at step N, or silent training
    check_context(longest, [("draft", draft)], f"the dump's longest sequence {longest_id!r} ({longest} tokens)",
                  "dump with a --max-length the draft's window holds, or distil a draft with a longer window.",
                  error=DistillError)
    support = head_support(dataset, tokenizer, config, widths) if config.head_support is not None else None
    return Setup(dirs, parts, dataset, tokenizer, draft, next(draft.parameters()).dtype, TeacherHead.of_dump(dataset),
                 count_cut_ties(dataset, config), support)


@dataclass
class Data:
    """What :func:`data` split: the training and held-out sets (held-out None when empty), the split's counts by
    dump, and the on-policy writer (None for λ = 0)."""

    train: Any
    held_out: Any
    split: Any
    writer: Any


def data(s: Setup, config: DistillConfig, target_ref: str, dump_weights: list[int] | None = None,
         device: str | None = None) -> Data:
    """Step 2, data: the held-out split by prompt (:func:`specdraft.training.distill_data.prompt_keyed_split`, each dump's
    sequences repeated ``dump_weights`` times) and, for ``on_policy_fraction`` > 0, the target as the writer's scorer."""
    from torch.utils.data import Subset

    train_idx, held_idx, counts = prompt_keyed_split(s.parts, dump_weights, config.held_out_fraction, config.seed)
    writer = (load_draft_writer(target_ref, s.dataset.manifest, s.tokenizer, config, device)
              if config.on_policy_fraction > 0 else None)
    return Data(Subset(s.dataset, train_idx), Subset(s.dataset, held_idx) if held_idx else None, counts, writer)


@dataclass
class TrainResult:
    """What :func:`train` returns: ``draft`` trained (a LoRA draft merged), ``start`` its trained parameters before
    (:func:`trainable_snapshot`; None for LoRA), ``history`` the Trainer's logs (step 0: the held-out scores
    before), ``curve`` :func:`learning_curve`, the held-out scores (``eval_`` + each :data:`METRICS`' ``held_out``)
    before and after, ``precision`` as resolved, ``processes`` the data-parallel ranks, ``on_policy`` the writer's
    counts (None for λ = 0)."""

    trainable_parameters: int
    moved_fraction: float
    steps: int
    history: list[dict[str, Any]]
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    curve: list[dict[str, Any]]
    processes: int
    precision: str
    precision_reason: str
    seconds: float
    resumed_from: str | None
    draft: Any
    start: dict[str, torch.Tensor] | None
    on_policy: dict[str, Any] | None


@dataclass
class DistillMetrics:
    """``training.json``'s ``metrics`` (and the pipeline's distill stage), one field per key."""

    eval_before: dict[str, float]
    eval_after: dict[str, float]
    steps: int
    trainable_parameters: int
    moved_fraction: float
    moved_fraction_saved: float | None
    saved_dtype: str
    saved_update_lost: str | None
    seconds: float
    resumed_from: str | None
    curve: list[dict[str, Any]]
    train_sequences: int
    held_out_sequences: int
    held_out_split: Any
    processes: int
    precision: str
    precision_reason: str
    global_batch_sequences: int
    on_policy: dict[str, Any] | None
    cut_ties: dict[str, Any] | None
    alpha_definition: str
    head_support: int | None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def held_out_rows(self) -> list[tuple[str, float | None, float | None]]:
        """``[(eval_ key, before, after)]`` of the :data:`METRICS` the report shows (each :class:`Metric`'s
        ``show``)."""
        rows = []
        for m in METRICS:
            key = f"eval_{m.held_out}"
            b, a = self.eval_before.get(key), self.eval_after.get(key)
            if (m.show == "nonzero" and not (b or a)) or (m.show == "present" and key not in self.eval_after):
                continue
            rows.append((key, b, a))
        return rows


@dataclass
class DistillResult:
    """What :func:`run_distill` returns: the exported ``speculator`` directory, its ``metrics``, the ``training``
    record (``training.json``) and the trained ``model`` (in the saved dtype)."""

    speculator: Path
    metrics: DistillMetrics
    training: dict[str, Any]
    model: Any

    def to_dict(self) -> dict[str, Any]:
        """The pipeline's distill stage record: the speculator's path and the metrics."""
        return {"speculator": str(self.speculator), **self.metrics.to_dict()}


def save(s: Setup, d: Data, result: TrainResult, config: DistillConfig, target_ref: str, draft_ref: str, out: Path,
         num_speculative_tokens: int, dump_weights: list[int] | None, keep_checkpoints: bool,
         save_dtype: str | None) -> DistillResult:
    """Step 4, save: the trained draft in ``save_dtype`` (default the dtype it was loaded in) as a speculator with
    ``training.json``, beside ``out/training.json``; rank 0 alone writes, the others wait. A finished training's
    checkpoints are removed unless ``keep_checkpoints``."""
    from accelerate import PartialState

    saved_dtype = save_dtype or str(s.loaded_dtype).removeprefix("torch.")
    trained = result.draft.to(getattr(torch, saved_dtype))
    # What the save kept of the update: a bfloat16 export rounds a small-lr update of float32 masters away.
    moved_saved = moved_fraction(trained, result.start) if result.start is not None else None
    if lost := rounded_away(result.moved_fraction, moved_saved, saved_dtype):
        warnings.warn(lost, stacklevel=3)
    manifest = s.dataset.manifest
    metrics = DistillMetrics(
        eval_before=result.eval_before, eval_after=result.eval_after, steps=result.steps,
        trainable_parameters=result.trainable_parameters, moved_fraction=result.moved_fraction,
        moved_fraction_saved=moved_saved, saved_dtype=saved_dtype, saved_update_lost=lost, seconds=result.seconds,
        resumed_from=result.resumed_from, curve=result.curve, train_sequences=len(d.train),
        held_out_sequences=len(d.held_out) if d.held_out is not None else 0, held_out_split=d.split,
        processes=result.processes, precision=result.precision, precision_reason=result.precision_reason,
        global_batch_sequences=config.batch_size * config.gradient_accumulation_steps * result.processes,
        on_policy=result.on_policy, cut_ties=s.cut,
        alpha_definition=alpha_definition(config, manifest["format"], s.cut),
        head_support=None if s.support is None else int(s.support.numel()))
    dirs = s.dirs
    training = {"config": config.model_dump(), "target": target_ref, "draft": str(draft_ref),
                "dump": {"dir": str(dirs[0]) if len(dirs) == 1 else [str(x) for x in dirs],
                         "weights": dump_weights, "sequences_per_dump": [len(p) for p in s.parts],
                         "tokenizer_fingerprint": manifest["tokenizer_fingerprint"],
                         "head_fingerprint": manifest.get("head_fingerprint"), "format": manifest["format"],
                         "logit_transform": s.dataset.logit_ops, "sequences": len(s.dataset)},
                "metrics": metrics.to_dict(), "history": result.history}
    if config.prompt_positions:  # where each dump's trained prompt positions start
        training["dump"]["shared_prefix_tokens"] = [p.shared_tokens for p in s.parts]
    state = PartialState()  # the Trainer's process group; a plain run is rank 0 alone
    spec_dir = out / "speculator"
    if state.is_main_process:
        export_speculator(trained, s.tokenizer, target_ref, spec_dir, num_speculative_tokens, training)
        write_training_json(out / "training.json", training)
        if not keep_checkpoints:  # the training is finished and exported: nothing resumes from them
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
    state.wait_for_everyone()
    return DistillResult(spec_dir, metrics, training, trained)


def run_distill(target_ref: str, draft_ref: str, dump_dir: str | Path | list[str | Path], out: str | Path,
                config: DistillConfig | None = None, resume: bool = True, report_to: str = "none",
                device: str | None = None, num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
                callbacks: list | None = None, dump_weights: list[int] | None = None,
                keep_checkpoints: bool = False, save_dtype: str | None = None) -> DistillResult:
    """Distil ``draft_ref`` against the teacher dump(s) in ``dump_dir`` and export it: :func:`setup`, :func:`data`,
    :func:`train`, :func:`save`.

    Raises:
        DistillError / specdraft.models.dump_reader.DumpError: what :func:`setup` and :func:`train` refuse.
        specdraft.core.sampling.TokenWidthError: the dump holds token ids past the draft's embedding or head.
    """
    config = config or DistillConfig()
    out = Path(out)
    s = setup(draft_ref, list(dump_dir) if isinstance(dump_dir, (list, tuple)) else [dump_dir], config, device)
    d = data(s, config, target_ref, dump_weights, device)
    result = train(s.draft, s.teacher, d.train, d.held_out, config, out, resume=resume, report_to=report_to,
                   writer=d.writer, callbacks=callbacks, origin=distill_origin(s.parts, draft_ref, dump_weights),
                   support=s.support)
    d.writer = None  # frees the target
    return save(s, d, result, config, target_ref, draft_ref, out, num_speculative_tokens, dump_weights,
                keep_checkpoints, save_dtype)
