"""Distil the draft toward the target's distribution (DistillSpec, Zhou et al. 2023), then export it.

The trainable module is :class:`DistillModel`: the draft plus a frozen copy of the target's output head (kept
as non-persistent buffers, so it never enters the draft's state_dict or checkpoints, and follows ``.to()``).
Its ``forward`` returns a ``ModelOutput`` whose ``loss`` is passed to the constructor — transformers' Trainer
reads ``outputs["loss"]`` by key — plus ``train_acc`` (top-1 agreement) and ``tvd`` as metrics.

**One optimizer step weighs every trained token equally**, however it is split into micro-batches (gradient
accumulation) and ranks (data parallelism): the loss is a token-weighted mean over the loss mask, so the
Trainer counts the trained positions of the whole step first (all micro-batches, all ranks), and each
micro-batch contributes its *sum* divided by that count. Averaging micro-batch means instead — the Trainer's
default when a batch has no ``labels`` — would let a micro-batch of one trained token weigh as much as one of
a thousand. Logged losses stay per-token means of the step.

What it trains and validates on — the held-out split by prompt and, for ``on_policy_fraction`` λ > 0, the
stream that mixes the draft's own answers (scored by the target) into every step — comes from
:mod:`specdraft.distill_data`.

**Precision** (``precision``, :func:`resolve_precision`): ``float32`` computes everything in float32;
``bf16-autocast`` runs the draft's forward pass under ``torch.autocast(dtype=bfloat16)`` — its matmuls (the output
head over the whole vocabulary first) in bfloat16, native on CPUs with AMX-bf16 or avx512_bf16
(:data:`BF16_CPU_FLAGS`) — while the weights, their gradients and AdamW's state stay float32 (master weights:
autocast casts a weight per op, the gradient lands on the float32 parameter). The teacher and the loss are outside
autocast: p is computed as the target computed it, and the softmax over the vocabulary stays float32. ``auto``
chooses by hardware. A draft of bfloat16 weights (``dtype`` bfloat16) trains the same way: its trained parameters
get float32 master weights (:func:`master_weights`; AdamW stepping bfloat16 itself rounds small updates away) and its
forward runs under that autocast, while frozen weights stay bfloat16. ``training.json`` records ``moved_fraction``,
the share of trainable weights whose value changed (:func:`moved_fraction`).

**Learning curve**: with ``eval_steps`` the held-out set is scored every N steps (teacher-forced, no decoding;
α = Σ min(p̃, q̃) under the serving filter); :func:`learning_curve` reads the points from the training log.

Teacher signal per position (from :mod:`specdraft.dump`):

* ``hidden`` dump: teacher logits = ``lm_head(h)`` with h the target's post-norm final hidden state;
* ``topk`` dump: a sparse teacher. Under plain serving ``soft_ce`` and ``tvd`` read it as stored
  (:data:`specdraft.losses.TOPK_LOSSES`, no full-width p: soft_ce exact against the uniform tail completion, tvd
  exact where the tail is 0 and an upper bound by at most the tail elsewhere); the other losses densify it (see
  :func:`specdraft.dump_reader.teacher_probs_from_topk` for the leftover rule). It says what it cannot compute:
  serving settings that re-temper or filter wider than the stored k are refused before training
  (:meth:`~specdraft.config.DistillConfig.sparse_teacher_problem`); a filter with top_k ≤ k is exact
  (:func:`stored_logits`) but at cut ties (:func:`cut_ties`, counted in ``training.json``'s ``metrics.cut_ties``);
  ``alpha_bound`` says how far α can be off: the leftover mass under plain serving, :func:`cut_tie_bound` at a cut
  tie under a filter.

Padded vocabularies: both widths may exceed ``len(tokenizer)`` (151936 vs 152064 in Qwen2.5); logits are
compared over the real shared vocabulary (:func:`specdraft.sampling.align_logits`), padding rows carry zero
teacher mass. Widths below the real vocabulary are refused at construction.

**Size.** Past the house's ~800 lines on purpose: the model, the Trainer subclass whose token-weighted step reads
its outputs, and :func:`train`, which wires the two to the data and the resume checks, are one training step's
parts; apart, each would import the others' private rules.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from specdraft.config import NUM_SPECULATIVE_TOKENS, DistillConfig
from specdraft.distill_data import (
    DistillError,
    OnPolicyStream,
    collate,
    dataset_prompts,
    load_draft_writer,
    prompt_keyed_split,
    stream_start_callback,
)
from specdraft.export import export_speculator, write_training_json
from specdraft.io import atomic_write_text
from specdraft.losses import LOSSES, TOPK_LOSSES, masked_mean, sum_min, tvd_topk
from specdraft.sampling import (
    align_logits,
    check_context,
    check_token_ids,
    filter_logits,
    filtered_probs,
    input_width,
    output_width,
)

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
    """What ``DistillConfig.precision`` means on this device: ``("float32" | "bf16-autocast", reason)``.

    ``auto`` is bf16-autocast on a CPU with :data:`BF16_CPU_FLAGS` or on a CUDA device that supports bfloat16
    (``torch.cuda.is_bf16_supported``), float32 elsewhere; an explicit choice is kept as asked.
    """
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


@dataclass
class DistillOutput(ModelOutput):
    """Forward output, each a token-weighted mean over the loss mask: ``loss`` (0-dim), ``train_acc`` (top-1
    agreement), ``tvd`` (½Σ|p − q| at temperature 1, no filter), ``alpha`` (the α at the serving settings:
    Σ min(p̃, q̃) with p̃, q̃ both after the serving filter and renormalised; Σ min(p, q) when serving is plain; see
    :func:`alpha_definition`) and ``alpha_bound``, the most ``alpha`` and ``tvd`` can differ from their values under
    the true p because a top-k teacher's tail is unknown (its leftover mass, with plain serving; 0 for a hidden
    teacher; under a serving filter, α's bound: 0 where the filter keeps stored ids only, :func:`cut_tie_bound` at
    a cut tie, and ``tvd``, unfiltered against the uniformly completed tail, is within the leftover mass).
    ``outside_mass``: under a restricted head, scored with the full head (held-out), the draft's mass outside the
    support, ``1 − q(S)``; else None."""

    loss: torch.Tensor | None = None
    train_acc: torch.Tensor | None = None
    tvd: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    alpha_bound: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    outside_mass: torch.Tensor | None = None


#: The per-token metrics the trainer logs beside the loss (``eval_`` + each for the held-out set; ``acc`` for
#: ``train_acc``).
METRICS = ("train_acc", "tvd", "alpha", "alpha_bound")


#: How the figures of a run through a restricted head read (appended to :func:`alpha_definition`).
RESTRICTED_HEAD_METRICS = (
    "; q over the full head for the held-out eval_ figures (one full pass per held-out batch), eval_outside_mass "
    "the draft's mass outside the restricted head's support, 1 − q(S); the training log's alpha, tvd and train_acc "
    "are over the support's softmax q_S, which the outside mass inflates")


def alpha_definition(config: DistillConfig, teacher_format: str = "hidden",
                     cut: dict[str, Any] | None = None) -> str:
    """What the logged ``alpha`` / ``eval_alpha`` is under ``config``'s serving settings, in words (recorded in
    ``training.json`` as ``metrics["alpha_definition"]``).

    ``cut``: :func:`count_cut_ties`'s record for a top-k teacher under a serving top-k; α is called exact only
    when it counted no cut tie (``None``: not counted, so never called exact)."""
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


def cut_ties(topk_logprobs: torch.Tensor, config: DistillConfig) -> torch.Tensor:
    """``[...] bool``: the positions of a top-k teacher ``topk_logprobs [..., k]`` (any order, nats) where the
    serving filter, applied to the stored values, keeps the smallest of them.

    There the filter's tie group at its cut reaches the end of what was stored: the target's own filter keeps every
    id tied with the cut (:func:`specdraft.sampling.filter_logits`), and unstored ids of the same value would be
    kept too, which the dump cannot show; elsewhere the filtered teacher is exact. Always true at a serving top-k
    ≥ k. The dump's cut rule: :mod:`specdraft.dump`. Plain serving has no cut: all False.
    """
    if config.serving_is_plain:
        return torch.zeros(topk_logprobs.shape[:-1], dtype=torch.bool, device=topk_logprobs.device)
    lp = topk_logprobs.float()
    # The k stored values alone stand for the full width: a top-k ≤ k and the renormalised top-p read these only.
    kept = torch.isfinite(filter_logits(lp, config.serving.temperature, config.serving.top_k, config.serving.top_p))
    return (kept & (lp == lp.min(dim=-1, keepdim=True).values)).any(dim=-1)


def cut_tie_bound(topk_logprobs: torch.Tensor, leftover_logmass: torch.Tensor, config: DistillConfig) -> torch.Tensor:
    """``[...] float32``: at each cut tie (:func:`cut_ties`) the most the filtered α from the stored ids alone can
    differ from the target's, 0 elsewhere; ``topk_logprobs [..., k]`` and ``leftover_logmass [...]`` in nats.

    The target's filter keeps the stored kept ids S plus m unstored ids tied with the last stored value (its top-p
    threshold is taken over the top-k values, which the dump holds, so ties move no other cut). Each of those holds
    p_min of the full p, so m ≤ leftover / p_min; each weighs r = p̃(last stored id) against the stored p̃, and the
    filtered teacher moves by TV = m·r / (1 + m·r), increasing in m: the bound takes m's largest value (unrounded,
    so float16 rounding of p_min cannot make it too small), and |Σ min(p̃, q̃) − Σ min(p̃*, q̃)| ≤ TV(p̃, p̃*).
    At temperature 1 without top-p it is the leftover mass itself.
    """
    lp = topk_logprobs.float()
    ties = cut_ties(lp, config)
    if not ties.any():
        return torch.zeros(lp.shape[:-1], device=lp.device)
    last = lp.argmin(dim=-1, keepdim=True)
    s = config.serving
    share = filtered_probs(lp, s.temperature, s.top_k, s.top_p).gather(-1, last).squeeze(-1)  # r
    m = (leftover_logmass.float() - lp.gather(-1, last).squeeze(-1)).exp()  # leftover / p_min
    bound = (m * share / (1 + m * share)).nan_to_num(0.0)
    return torch.where(ties, bound, torch.zeros_like(bound))


def count_cut_ties(dataset, config: DistillConfig) -> dict[str, Any] | None:
    """:func:`cut_ties` counted over every trained position (``loss_mask``) of a top-k ``dataset``
    (:class:`~specdraft.dump_reader.TeacherDataset` or ``TeacherMix``), for ``training.json``'s
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


def stored_logits(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, width: int) -> torch.Tensor:
    """A top-k teacher as logits: its stored log-probs on its stored ids, ``-inf`` elsewhere, ``[..., V] float32``.

    Any serving filter with 0 < top_k ≤ k keeps stored ids only, and its temperature and top-p act on their values
    alone (the renormalisation cancels the shared log-normaliser), so ``filtered_probs`` of these logits is exactly
    the filtered p but at a cut tie (:func:`cut_ties`: the filter keeps the last stored value, and the target's
    would keep unstored ids tied with it); without such a top-k it is not
    (:meth:`DistillConfig.sparse_teacher_problem`).
    """
    shape = (*topk_ids.shape[:-1], width)
    return torch.full(shape, float("-inf"), device=topk_logprobs.device).scatter_(
        -1, topk_ids.long(), topk_logprobs.float())


def trained_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, S] bool``: the positions a loss trains — ``loss_mask`` (else the attention mask, else every
    position), never padding. The one rule used by the forward pass and by the step's token count."""
    mask = loss_mask if loss_mask is not None else attention_mask
    if mask is None:
        mask = torch.ones_like(input_ids)
    mask = mask.bool()
    if attention_mask is not None:
        mask = mask & attention_mask.bool()
    return mask


class DistillModel(nn.Module):
    """The draft plus a frozen teacher head; forward computes the chosen loss over the loss mask.

    Args:
        draft: a transformers causal LM (trained).
        head_weight: ``[V_t, H_t]`` the target's output-head weight (frozen; ``None`` for a topk teacher).
        head_bias: ``[V_t]`` or None.
        real_vocab: ``len(tokenizer)``; ids at or past it are padding (zero teacher mass, masked draft logits).
        config: the :class:`DistillConfig` (loss and serving filter).
        logit_ops: the target's final-logit transforms after its head (soft-capping, scaling): the dump's
            ``TeacherDataset.logit_ops``; without them a soft-capped target's teacher would be wrong.
        autocast: run the draft's forward under ``torch.autocast(dtype=bfloat16)`` (weights stay as they are;
            the teacher and the loss stay outside it): ``precision`` bf16-autocast, resolved by :func:`train`.
        trained_columns_only: both heads, the loss and the metrics run only over the sequence positions some row of
            the batch trains (transformers' ``logits_to_keep`` with a 1-D tensor of positions). Exact: every loss
            is per position and masked, so untrained positions add nothing to it or to its gradient. What it saves
            is the vocabulary-wide work at prompt positions, which an answer-only dump never trains
            (docs/benchmarks.md, "Where a distillation step's time goes"). A draft whose ``forward`` lacks
            ``logits_to_keep`` scores every position.

    Raises:
        DistillError: a width smaller than the real vocabulary (not padding of one tokenizer).
    """

    def __init__(self, draft, head_weight: torch.Tensor | None, head_bias: torch.Tensor | None, real_vocab: int,
                 config: DistillConfig, teacher_width: int | None = None, logit_ops=None, autocast: bool = False,
                 trained_columns_only: bool = True, support: torch.Tensor | None = None):
        super().__init__()
        from specdraft.models import takes_logits_to_keep

        self.autocast = autocast
        self.trained_columns_only = trained_columns_only and takes_logits_to_keep(draft)
        self.logit_ops = list(logit_ops or [])
        self.draft = draft
        self.config_ = config
        d_width = draft.get_output_embeddings().weight.shape[0]
        t_width = head_weight.shape[0] if head_weight is not None else (teacher_width or d_width)
        for name, w in (("draft", d_width), ("teacher", t_width)):
            if w < real_vocab:
                raise DistillError(
                    f"the {name}'s output width {w} is below the tokenizer's {real_vocab} ids: the vocabularies "
                    "differ beyond padding of one tokenizer. Align them first (specdraft.vocab.vocab_swap).")
        self.real_vocab = real_vocab
        self.width = t_width
        # Non-persistent buffers: follow .to()/device placement, never saved in checkpoints or state_dict.
        self.register_buffer("head_weight", head_weight.detach() if head_weight is not None else None,
                             persistent=False)
        self.register_buffer("head_bias", head_bias.detach() if head_bias is not None else None, persistent=False)
        if support is not None:
            from specdraft.restricted_head import check_draft

            check_draft(draft)
        self.register_buffer("support", support, persistent=False)

    # Trainer looks these up on the model.
    @property
    def device(self) -> torch.device:
        return next(self.draft.parameters()).device

    def gradient_checkpointing_enable(self, **kw):  # pragma: no cover - passthrough
        return self.draft.gradient_checkpointing_enable(**kw)

    @classmethod
    def from_speculator(cls, speculator, config: DistillConfig, real_vocab: int | None = None) -> DistillModel:
        """The draft of an :class:`~specdraft.speculator_model.IndependentSpeculator` whose verifier is attached in mode
        ``"train_only"``, with that verifier's output head (and final-logit transforms) as the teacher head.

        A hidden-state dump stores the verifier's states *after* its final norm, so only the head applies here.

        Raises:
            DistillError: no verifier head attached (``attach_verifier(ref, mode="train_only")`` first).
        """
        head = speculator.verifier_head
        if head is None:
            raise DistillError("the speculator holds no verifier head: attach_verifier(reference, mode='train_only') "
                               "first")
        w = head.lm_head.weight.detach()
        b = getattr(head.lm_head, "bias", None)
        return cls(speculator.draft, w, None if b is None else b.detach(), real_vocab or w.shape[0], config,
                   logit_ops=head.logit_ops)

    def teacher_probs(self, hidden=None, topk_logprobs=None, topk_ids=None, leftover_logmass=None):
        """Teacher distribution p ``[B, S, V] float32`` (zero on padding rows) and, for a hidden teacher, its
        logits (for tvd_deploy's filter); a top-k teacher's p completes its tail uniformly and has no logits
        (:func:`stored_logits` gives what a filter with top_k ≤ k reads)."""
        if hidden is not None:
            if self.head_weight is None:
                raise DistillError("a hidden-state teacher needs the target's output head")
            from specdraft.dump_reader import teacher_logits_from_hidden

            # In the head's own dtype, as the target computed its logits (bf16 matmul is also ~2x cheaper on CPU).
            logits = teacher_logits_from_hidden(hidden, self.head_weight, self.head_bias,
                                                logit_ops=self.logit_ops)  # [B, S, V_t] float32
            logits = align_logits(logits, self.width, self.real_vocab)
            return logits.softmax(-1), logits
        from specdraft.dump_reader import teacher_probs_from_topk

        p = teacher_probs_from_topk(topk_logprobs, topk_ids, leftover_logmass, self.width, self.real_vocab)
        return p, None

    def forward(self, input_ids, attention_mask=None, loss_mask=None, hidden=None, topk_logprobs=None,
                topk_ids=None, leftover_logmass=None, num_items_in_batch=None, **_: Any) -> DistillOutput:
        """Args: ``input_ids [B, S]``, ``attention_mask [B, S]``, ``loss_mask [B, S]`` (position j trains the
        prediction of token j+1), and the teacher: ``hidden [B, S, H]`` or ``topk_* [B, S, k]`` +
        ``leftover_logmass [B, S]``. Without ``loss_mask`` the attention mask is used.

        ``num_items_in_batch``: trained positions of the whole optimizer step (all micro-batches and ranks);
        given, ``loss`` is this batch's sum divided by it (its share of the step's per-token mean), else the
        per-token mean of this batch. The metrics are always per-token means of this batch."""
        cfg = self.config_
        sparse = hidden is None
        if sparse and (problem := cfg.sparse_teacher_problem(int(topk_ids.shape[-1]))):
            raise DistillError(problem)  # run_distill refuses it before loading the draft
        mask = trained_mask(input_ids, attention_mask, loss_mask)  # [B, S] bool
        keep = {}
        if self.trained_columns_only:
            cols = mask.any(0).nonzero().squeeze(-1)  # [K] positions some row trains
            if 0 < cols.numel() < mask.shape[1]:
                keep = {"logits_to_keep": cols}
                mask = mask[:, cols]
                hidden, topk_logprobs, topk_ids, leftover_logmass = (
                    None if t is None else t[:, cols] for t in (hidden, topk_logprobs, topk_ids, leftover_logmass))
        # The restricted head trains; held-out scoring (eval mode) takes the full head, so the logged α, TVD and
        # agreement are the draft's own over every id, and the mass the restricted loss cannot see is measured.
        if self.support is not None and self.training:
            return self._forward_restricted(input_ids, attention_mask, mask, keep.get("logits_to_keep"),
                                            topk_logprobs, topk_ids, leftover_logmass, num_items_in_batch)
        with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.draft(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **keep)
        d_logits = align_logits(out.logits, self.width, self.real_vocab).float()  # [B, S or K, V]
        if sparse and cfg.serving_is_plain and cfg.loss in TOPK_LOSSES:
            res = self._forward_topk(d_logits, mask, topk_logprobs, topk_ids, leftover_logmass, num_items_in_batch)
            if self.support is not None:  # the config allows a restricted head on this path only
                with torch.no_grad():
                    inside = d_logits.softmax(-1).index_select(-1, self.support).sum(-1)  # [B, S or K], q(S)
                    res["outside_mass"] = masked_mean(1 - inside, mask)
            return res
        with torch.no_grad():
            p, t_logits = self.teacher_probs(hidden, topk_logprobs, topk_ids, leftover_logmass)
            if sparse and not cfg.serving_is_plain:
                # 0 < top_k ≤ k (checked above): the filter reads the stored values alone, never the completed tail.
                t_logits = stored_logits(topk_logprobs, topk_ids, self.width)
        # A sparse teacher under plain serving has no logits: tvd_deploy then takes p as it is (= tvd).
        per_pos = LOSSES[cfg.loss](d_logits, p, teacher_logits=t_logits, temperature=cfg.serving.temperature,
                                   top_k=cfg.serving.top_k, top_p=cfg.serving.top_p)
        loss = masked_mean(per_pos, mask, num_items_in_batch)
        with torch.no_grad():
            # Metrics reuse the loss where it already is the metric (no second vocabulary-wide pass).
            acc = (d_logits.argmax(-1) == p.argmax(-1)).float()
            tvd_full = per_pos.detach() if cfg.loss == "tvd" else 0.5 * (p - d_logits.softmax(-1)).abs().sum(-1)
            if cfg.loss == "tvd_deploy":
                alpha = 1 - per_pos.detach()
            elif cfg.serving_is_plain:
                alpha = 1 - tvd_full
            else:  # the α at the serving settings: both distributions filtered, never the unfiltered one
                pf = filtered_probs(t_logits, cfg.serving.temperature, cfg.serving.top_k, cfg.serving.top_p)
                qf = filtered_probs(d_logits, cfg.serving.temperature, cfg.serving.top_k, cfg.serving.top_p)
                alpha = sum_min(pf, qf)
            # |Σ min(p̂, q) − Σ min(p, q)| ≤ TV(p, p̂) ≤ the leftover mass that p̂ spreads uniformly (dump.py);
            # under a serving filter the stored ids are exact but at a cut tie, whose bound cut_tie_bound gives.
            if sparse and cfg.serving_is_plain:
                bound = leftover_logmass.float().exp()
            elif sparse:
                bound = cut_tie_bound(topk_logprobs, leftover_logmass, cfg)
            else:
                bound = torch.zeros_like(alpha)
        return DistillOutput(loss=loss, train_acc=masked_mean(acc, mask), tvd=masked_mean(tvd_full, mask),
                             alpha=masked_mean(alpha, mask), alpha_bound=masked_mean(bound, mask), tokens=mask.sum())

    def _forward_restricted(self, input_ids, attention_mask, mask, columns, topk_logprobs, topk_ids,
                            leftover_logmass, num_items_in_batch):
        """soft_ce through the head restricted to ``self.support`` (:mod:`specdraft.restricted_head`), in training
        only; the metrics (top-1 agreement, TVD, α) over the support's softmax q_S, as the loss (the training log's;
        held-out ones take the full head)."""
        from specdraft.restricted_head import (
            NEEDS_NO_TAIL,
            RestrictedHeadError,
            restricted_logits,
            restricted_soft_ce,
        )

        if topk_ids is None or bool((leftover_logmass.float().exp() * mask).gt(0).any()):
            raise DistillError(f"{NEEDS_NO_TAIL}; this one spreads mass past its stored ids")
        logits_s = restricted_logits(self.draft, self.support, input_ids, attention_mask, columns, self.autocast)
        probs = topk_logprobs.float().exp()  # [B, S, k]
        try:
            per_pos, tvd_s = restricted_soft_ce(logits_s, topk_ids, probs, self.support, self.width, mask)
        except RestrictedHeadError as e:
            raise DistillError(str(e)) from e
        loss = masked_mean(per_pos, mask, num_items_in_batch)
        with torch.no_grad():
            top1 = topk_ids.gather(-1, probs.argmax(-1, keepdim=True)).squeeze(-1)
            acc = (self.support[logits_s.argmax(-1)] == top1).float()
            tvd_s = tvd_s.detach()
        return DistillOutput(loss=loss, train_acc=masked_mean(acc, mask), tvd=masked_mean(tvd_s, mask),
                             alpha=masked_mean(1 - tvd_s, mask), alpha_bound=masked_mean(torch.zeros_like(tvd_s), mask),
                             tokens=mask.sum())

    def _forward_topk(self, d_logits, mask, topk_logprobs, topk_ids, leftover_logmass, num_items_in_batch):
        """The loss and metrics against a top-k teacher, never building its full-width p
        (:data:`specdraft.losses.TOPK_LOSSES`). soft_ce equals the dense completion's; the tvd loss and the tvd /
        α metrics are :func:`~specdraft.losses.tvd_topk`: exact where the teacher's tail is 0, else an upper bound
        of the TVD by at most the tail (α a lower bound). The teacher's argmax is its top-1 stored id."""
        cfg = self.config_
        with torch.no_grad():
            probs = topk_logprobs.float().exp()  # [B, S, k]
            tail = leftover_logmass.float().exp()  # [B, S]; exp(−inf) = 0 where nothing is left
            teacher_top1 = topk_ids.gather(-1, probs.argmax(-1, keepdim=True)).squeeze(-1)  # [B, S]
        per_pos = TOPK_LOSSES[cfg.loss](d_logits, topk_ids, probs, tail=tail, real_vocab=self.real_vocab)
        loss = masked_mean(per_pos, mask, num_items_in_batch)
        with torch.no_grad():
            acc = (d_logits.argmax(-1) == teacher_top1).float()
            tvd_k = per_pos.detach() if cfg.loss == "tvd" else tvd_topk(d_logits, topk_ids, probs, tail=tail,
                                                                         real_vocab=self.real_vocab)
        # α = 1 − TVD under plain serving (the only serving this path takes), a lower bound by at most the tail.
        return DistillOutput(loss=loss, train_acc=masked_mean(acc, mask), tvd=masked_mean(tvd_k, mask),
                             alpha=masked_mean(1 - tvd_k, mask), alpha_bound=masked_mean(tail, mask),
                             tokens=mask.sum())


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
    its forward then needs bfloat16 autocast to mix them with float32 ones.

    AdamW's step on a bfloat16 parameter is rounded to its 8 significand bits: an update below half a unit in the
    last place (~0.002 at 1.0) is lost, so norm weights near 1 never move and a small learning rate barely moves
    anything. Held in float32, updates accumulate; the forward still computes in bfloat16 (:class:`DistillModel`'s
    autocast, which :func:`train` turns on), and frozen parameters stay in bfloat16, as loaded.
    """
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


def row_parameter_ids(draft) -> set[int]:
    """``id()`` of the draft's input-embedding and output-head weights (one id when they are tied): the rows that
    ``DistillConfig.row_lr`` trains at their own learning rate."""
    mods = (draft.get_input_embeddings(), draft.get_output_embeddings())
    return {id(m.weight) for m in mods if m is not None and getattr(m, "weight", None) is not None}


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


def log_line(logs: dict[str, Any], step: int, max_steps: int) -> str:
    """One Trainer log as a line a person reads: ``step 10/20  loss 0.5123  tvd 0.31  lr 3e-04`` (floats to four
    significant digits, the learning rate in scientific notation; ``total_flos`` and ``epoch`` left out), instead of
    the raw dict transformers' ProgressCallback / PrinterCallback write (``{'loss': '0.5123', ...}``)."""
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"]
    for k, v in logs.items():
        if k in ("total_flos", "epoch"):
            continue
        name = "lr" if k == "learning_rate" else k
        parts.append(f"{name} {v:.1e}" if k == "learning_rate" and isinstance(v, float) else
                     f"{name} {v:.4g}" if isinstance(v, float) else f"{name} {v}")
    return "  ".join(parts)


def _readable_log_callbacks(trainer) -> None:
    """Swap the Trainer's log printers for ones that write :func:`log_line`: the bar's (in a terminal) above the
    bar, the plain printer's (in a log file) one line per logging step on stdout."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class ProgressLines(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and self.training_bar is not None and logs:
                self.training_bar.write(log_line(logs, state.global_step, state.max_steps))

    class PrinterLines(PrinterCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_local_process_zero and logs:
                print(log_line(logs, state.global_step, state.max_steps), flush=True)

    for old, new in ((ProgressCallback, ProgressLines), (PrinterCallback, PrinterLines)):
        if trainer.pop_callback(old) is not None:
            trainer.add_callback(new)


def _make_trainer_class():
    from transformers import Trainer

    class DistillTrainer(Trainer):
        """Trainer that weighs every trained token of a step equally (see the module docstring), logs
        :data:`METRICS` (train_acc, tvd, α, α's bound) beside the loss, stops on a non-finite loss, evaluates
        held-out α (sharded over ranks), and checkpoints the draft alone with ``save_pretrained`` (tied weights
        handled; teacher head out)."""

        _sums: dict[str, float]
        # compute_loss already divides by the step's token count: the Trainer must not divide again by the
        # number of accumulation steps (transformers' Trainer.training_step reads this flag).
        loss_is_scaled_for_ga = True

        def create_optimizer(self, model=None):
            """The Trainer's AdamW, its groups split so the embedding and head rows run at ``row_lr``."""
            opt = super().create_optimizer(model)
            row_lr = self.model.config_.row_lr
            if row_lr is None or getattr(opt, "_rows_split", False):
                return opt
            rows = row_parameter_ids(self.model.draft)
            groups = []
            for g in opt.param_groups:
                rest = {k: v for k, v in g.items() if k != "params"}
                for part, lr in (([p for p in g["params"] if id(p) not in rows], rest["lr"]),
                                 ([p for p in g["params"] if id(p) in rows], row_lr)):
                    if part:
                        groups.append(rest | {"params": part, "lr": lr})
            opt.param_groups.clear()  # no step taken yet: no state to carry over
            for g in groups:
                opt.add_param_group(g)
            opt._rows_split = True
            return opt

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            """The step's micro-batches and its trained positions, summed over micro-batches and ranks.

            transformers counts ``labels`` only; our batches carry ``loss_mask``, so count it here."""
            batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
            n = sum(int(trained_mask(b["input_ids"], b.get("attention_mask"), b.get("loss_mask")).sum())
                    for b in batch_samples)
            n = torch.tensor(n, dtype=torch.long, device=device)
            if self.args.world_size > 1:
                n = self.accelerator.reduce(n, reduction="sum")
            return batch_samples, n

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
            loss = outputs["loss"]  # by key, as Trainer itself does
            if num_items_in_batch is not None and self.args.world_size > 1:
                # DDP averages gradients over ranks, but each rank's loss is already its share of the global
                # sum / global count: undo the average (as Trainer.compute_loss does for its own losses).
                loss = loss * self.args.world_size
            if not torch.isfinite(loss):
                raise DistillError(
                    f"non-finite loss ({loss.item()}) at step {self.state.global_step}; the run stops here. The "
                    f"last good checkpoint is kept under {self.args.output_dir}; lower --lr or check the data, "
                    "then rerun the same command to resume from it.")
            sums = getattr(self, "_sums", None) or {**dict.fromkeys(METRICS, 0.0), "n": 0.0}
            tok = float(outputs["tokens"])
            for k in METRICS:
                sums[k] += float(outputs[k]) * tok
            sums["n"] += tok
            self._sums = sums
            return (loss, outputs) if return_outputs else loss

        def _sum_over_ranks(self, values: list[float]) -> list[float]:
            t = torch.tensor(values, dtype=torch.float64, device=self.args.device)
            if self.args.world_size > 1:
                t = self.accelerator.reduce(t, reduction="sum")
            return t.tolist()

        def log(self, logs: dict[str, float], *args, **kwargs) -> None:
            sums = getattr(self, "_sums", None)
            # Every rank logs at the same steps with sums gathered since the last log, so the reduction below
            # is entered by all of them or by none.
            if "loss" in logs and sums:
                *vals, n = self._sum_over_ranks([sums[k] for k in METRICS] + [sums["n"]])
                if n:
                    logs.update({k: v / n for k, v in zip(METRICS, vals)})
                self._sums = {}
            super().log(logs, *args, **kwargs)

        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
            """Token-weighted held-out loss and :data:`METRICS`; rank r scores sequences r, r+W, …
            and the sums are added over ranks (no sequence scored twice, unlike a padded distributed loader)."""
            from torch.utils.data import DataLoader, Subset

            ds = eval_dataset if eval_dataset is not None else self.eval_dataset
            if ds is None or len(ds) == 0:
                return {}
            model = self.model
            was_training = model.training
            model.eval()
            # A restricted head is scored with the full head here (DistillModel.forward): its outside mass too.
            keys = ("loss", *METRICS, *(("outside_mass",) if model.support is not None else ()))
            totals = [0.0] * (len(keys) + 1)  # per-key sums weighted by tokens, then tokens
            mine = Subset(ds, range(self.args.process_index, len(ds), self.args.world_size))
            loader = DataLoader(mine, batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator)
            with torch.no_grad():
                for batch in loader:
                    out = model(**self._prepare_inputs(batch))
                    tok = float(out["tokens"])
                    for i, k in enumerate(keys):
                        totals[i] += float(out[k]) * tok
                    totals[-1] += tok
            *sums, n = self._sum_over_ranks(totals)
            metrics = {f"{metric_key_prefix}_{k if k != 'train_acc' else 'acc'}": v / max(n, 1)
                       for k, v in zip(keys, sums)}
            metrics[f"{metric_key_prefix}_tokens"] = n
            self.log(metrics)
            # As Trainer.evaluate does: callbacks see the metrics, and the flag that asked for this evaluation is
            # cleared (left set, the epoch-end check would score the same step a second time).
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            if was_training:
                model.train()
            return metrics

        def _save(self, output_dir: str | None = None, state_dict=None) -> None:
            output_dir = output_dir or self.args.output_dir
            draft = self.accelerator.unwrap_model(self.model).draft
            # A finite loss can still give non-finite gradients (an overflow in backward) and so NaN weights after
            # the optimizer step, saved before the next loss would show it: never write such a checkpoint.
            if bad := [n for n, p in draft.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]:
                raise DistillError(
                    f"the draft's weights are not finite after step {self.state.global_step} ({', '.join(bad[:4])}"
                    f"{' …' if len(bad) > 4 else ''}): an update overflowed. No checkpoint is written; the last good "
                    f"one stays under {self.args.output_dir}. Lower --lr or --max-grad-norm (or train in float32), "
                    "then rerun the same command to resume from it.")
            os.makedirs(output_dir, exist_ok=True)
            draft.save_pretrained(output_dir, is_main_process=self.args.should_save)

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            """Load what :meth:`_save` wrote: a LoRA draft's adapters (``adapter_model.safetensors``), else the
            whole draft. A checkpoint missing a weight stops the resume rather than restart that weight at random."""
            from specdraft.models import load_causal_lm

            draft = self.accelerator.unwrap_model(model or self.model).draft
            if hasattr(draft, "peft_config"):  # a peft model saves its adapters alone
                _load_adapters(draft, Path(resume_from_checkpoint))
                return
            # Float32 when the draft holds any (master weights beside bfloat16 ones): each copies back losslessly.
            dtypes = {p.dtype for p in draft.parameters()}
            dtype = torch.float32 if torch.float32 in dtypes else next(iter(dtypes))
            loaded, _ = load_causal_lm(resume_from_checkpoint, dtype=dtype, cls=type(draft))
            draft.load_state_dict(loaded.state_dict(), strict=False)
            del loaded

    return DistillTrainer


def _load_adapters(draft, checkpoint: Path) -> None:
    """Load the LoRA adapters a checkpoint of ``draft`` (a peft model) holds into it.

    Raises:
        DistillError: the checkpoint holds no adapters (a whole-model checkpoint: another --train), or lacks some
            of the draft's (another --lora-r or set of target modules), named with how to start over.
    """
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    path = checkpoint / "adapter_model.safetensors"
    if not path.is_file():
        raise DistillError(f"{checkpoint} holds no LoRA adapters ({path.name}) to resume train=lora from; pass "
                           "--no-resume to start over, or choose a new --out")
    saved = load_file(str(path))
    missing = sorted(set(get_peft_model_state_dict(draft)) - set(saved))
    if missing:
        raise DistillError(f"{path} lacks {len(missing)} of the draft's adapter weights ({', '.join(missing[:3])}"
                           f"{' …' if len(missing) > 3 else ''}); pass --no-resume to start over")
    set_peft_model_state_dict(draft, saved)


def learning_curve(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``[{"step", "eval_alpha", "eval_loss"}]`` by step from a Trainer log history: one point per step (the
    last evaluation logged at it), step 0 being the draft before training."""
    points = {h["step"]: {"step": h["step"], "eval_alpha": h["eval_alpha"], "eval_loss": h["eval_loss"]}
              for h in history if "eval_alpha" in h}
    return [points[s] for s in sorted(points)]


def distill_origin(parts, draft_ref, dump_weights: list[int] | None) -> dict[str, Any]:
    """The data and draft of a distillation (for :func:`resume_origin`): each dump's plan (what it was made from:
    target, prompts, settings) by sha256, their weights, each dump's teacher by content (the whole target's
    :func:`specdraft.models.model_fingerprint` its manifest records, ``None`` for a dump made before one was), and
    the draft by reference and content: checkpoints trained against another teacher, or from a draft whose weights
    changed under the same path, are never resumed."""
    from specdraft.models import model_fingerprint

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


def train(
    draft,
    head_weight: torch.Tensor | None,
    head_bias: torch.Tensor | None,
    real_vocab: int,
    train_dataset,
    eval_dataset,
    config: DistillConfig,
    output_dir: str | Path,
    resume: bool = True,
    teacher_width: int | None = None,
    report_to: str = "none",
    logit_ops=None,
    callbacks: list | None = None,
    writer=None,
    origin: dict[str, Any] | None = None,
    support: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Train ``draft`` with transformers' Trainer (runs unchanged under ``accelerate launch`` / ``torchrun``).

    Checkpoints go to ``output_dir/checkpoints``; with ``resume`` the newest complete checkpoint is resumed.
    ``logit_ops``: the target's final-logit transforms, applied after ``head_weight`` (see :class:`DistillModel`).
    ``callbacks``: extra ``transformers.TrainerCallback`` objects (e.g. to watch gradients in a test).
    ``writer``: a :class:`~specdraft.distill_data.DraftWriter` (needed when ``config.on_policy_fraction`` > 0):
    the draft writes that share of the training sequences (:class:`~specdraft.distill_data.OnPolicyStream`);
    λ = 0 trains on ``train_dataset`` alone.
    ``origin``: what the training data and draft are (:func:`run_distill` passes the dumps' fingerprints and the
    draft reference); with the loss, the batch geometry and the draft's parameter shapes it is the run's identity
    (:func:`check_resume_origin`): checkpoints of another identity are refused, never resumed; ``resume=False``
    deletes them and starts over.
    ``support``: ``[U] int64`` ids of a restricted head (``config.head_support``; :mod:`specdraft.restricted_head`).

    Returns:
        ``{"trainable_parameters", "moved_fraction", "steps", "history": [log dicts], "eval_before", "eval_after",
        "curve", "processes", "precision", "precision_reason", "seconds", "resumed_from", "draft", "on_policy"}``;
        ``moved_fraction`` is :func:`moved_fraction` against the draft passed in, ``curve`` :func:`learning_curve` of
        the history, ``processes`` the data-parallel ranks, ``precision`` what ``config.precision`` resolved to here
        (:func:`resolve_precision`; ``bf16-autocast`` for a draft of bfloat16 weights, see :func:`master_weights`),
        ``on_policy`` the writer's counts and seconds plus the steps it wrote at (``None`` for λ = 0). A LoRA
        draft comes back merged (its adapters folded into the weights). ``start``: the trained parameters before
        training (:func:`trainable_snapshot`, in their loaded dtype), to measure what a save kept; None for LoRA,
        whose trained parameters (the adapters) are gone once merged.

    Raises:
        DistillError: non-finite loss (the last good checkpoint stays), widths that cannot be aligned.
    """
    from transformers import TrainingArguments
    from transformers.trainer_utils import set_seed

    set_seed(config.seed)
    if config.untie_head:
        from specdraft.head_warmup import untie_head

        untie_head(draft)  # before freezing: the new head parameter follows config.train like the rest
    draft, n_trainable = select_trainable(draft, config)
    use_cpu = not torch.cuda.is_available()
    precision, precision_reason = resolve_precision(config.precision, "cpu" if use_cpu else "cuda")
    start = trainable_snapshot(draft)
    if master_weights(draft):
        precision, precision_reason = "bf16-autocast", (
            "dtype bfloat16: the trained parameters keep float32 master weights under a bfloat16 forward")
    model = DistillModel(draft, head_weight, head_bias, real_vocab, config, teacher_width=teacher_width,
                         logit_ops=logit_ops, autocast=precision == "bf16-autocast", support=support)
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
    Trainer = _make_trainer_class()
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      data_collator=collate, callbacks=callbacks)
    _readable_log_callbacks(trainer)
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
    return {"trainable_parameters": n_trainable, "moved_fraction": moved, "steps": trainer.state.global_step,
            "history": history,
            "eval_before": eval_before, "eval_after": eval_after, "curve": learning_curve(history),
            "processes": args.world_size, "precision": precision, "precision_reason": precision_reason,
            "seconds": time.time() - t0,
            "resumed_from": ckpt, "draft": draft, "start": None if config.train == "lora" else start,
            "on_policy": None if stream is None else {**getattr(stream.writer, "stats", {}),
                                                      "refresh_steps": stream.refresh_steps}}


def head_support(dataset, tokenizer, config: DistillConfig, widths: tuple[int, int]) -> torch.Tensor:
    """The restricted head's support (:func:`specdraft.restricted_head.support_ids`): every token id of the dump's
    sequences (the labels among them) plus the ``config.head_support`` most frequent ids of the embedded training
    prompts (:func:`specdraft.draft_model.rank_tokens`).

    Raises:
        DistillError: the dump is not a top-k dump (a hidden-state teacher has mass on every id), or one of its
            trained positions holds leftover mass (a token-level self-teacher, a target's top-k): before training.
    """
    from specdraft.draft_model import default_head_corpus, rank_tokens
    from specdraft.restricted_head import NEEDS_NO_TAIL, support_ids

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


def run_distill(target_ref: str, draft_ref: str, dump_dir: str | Path | list[str | Path], out: str | Path,
                config: DistillConfig | None = None, resume: bool = True, report_to: str = "none",
                device: str | None = None, num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
                callbacks: list | None = None, dump_weights: list[int] | None = None,
                keep_checkpoints: bool = False, save_dtype: str | None = None) -> dict[str, Any]:
    """Distil ``draft_ref`` against the teacher dump in ``dump_dir`` and export it as a speculator.

    ``dump_dir`` may be a list of dumps of the same teacher (:class:`specdraft.dump_reader.TeacherMix`: e.g. teacher-forced
    ShareGPT replies and target-written answers); ``dump_weights`` repeats each dump's training sequences that
    many times per epoch (:func:`specdraft.distill_data.mixed_split`; default 1 each).

    Everything that can be wrong is checked before training starts: the dump is finished and its shards
    intact; the draft's tokenizer fingerprint equals the dump's; the widths align (padding only).

    Writes ``out/checkpoints/`` (resumable while training; removed once the speculator is written unless
    ``keep_checkpoints``: a finished training's Trainer states are the size of several drafts and nothing reads them),
    ``out/speculator/`` (the export, with ``training.json``; weights in ``save_dtype``, ``"float32"`` /
    ``"bfloat16"`` / ``"float16"``, default the dtype the draft was loaded in) and ``out/training.json``. ``num_speculative_tokens`` (γ) is recorded in the exported speculator
    (:func:`specdraft.export.export_speculator`). ``callbacks``: extra ``transformers.TrainerCallback`` objects
    (e.g. a learning curve measured by decoding, ``bench/bench_distill_gain.py --curve-every``). Under ``accelerate launch`` / ``torchrun`` the ranks train
    data-parallel (``batch_size`` is per rank) and rank 0 alone writes the export.

    Returns:
        ``{"speculator": path, "metrics": {...}, "training": training.json payload}``; ``metrics["curve"]`` is
        the learning curve (held-out teacher-forced α and loss by step, :func:`learning_curve`).

    Raises:
        DistillError / specdraft.dump_reader.DumpError: a dump of another tokenizer, a corrupt dump, bad widths,
            a top-k dump with serving settings it cannot compute (:meth:`DistillConfig.sparse_teacher_problem`,
            before the draft loads), a dump sequence longer than the draft's context window (both lengths named),
            a non-finite loss.
        specdraft.sampling.TokenWidthError: the dump holds token ids past the draft's embedding or head (named).
    """
    from torch.utils.data import Subset

    from specdraft.dump_reader import TeacherDataset, TeacherMix, load_manifest
    from specdraft.models import load_model, load_tokenizer

    config = config or DistillConfig()
    out = Path(out)
    draft_tok = load_tokenizer(draft_ref)
    dirs = list(dump_dir) if isinstance(dump_dir, (list, tuple)) else [dump_dir]
    for d in dirs:  # from the manifests alone: before any shard is hashed or weight loaded
        m = load_manifest(d)
        if m["format"] == "topk" and (problem := config.sparse_teacher_problem(int(m["top_k"]))):
            raise DistillError(f"{d}: {problem}")
    parts = [TeacherDataset(d, draft_tokenizer=draft_tok, verify=True, prompt_positions=config.prompt_positions)
             for d in dirs]  # refuses a mismatch
    dataset = parts[0] if len(parts) == 1 else TeacherMix(parts)  # refuses dumps of different teachers
    manifest = dataset.manifest
    if len(dataset) == 0:
        raise DistillError(f"the dump in {dump_dir} holds no sequences")
    real_vocab = int(manifest["target"]["real_vocab"])
    head_w = head_b = None
    if manifest["format"] == "hidden":
        head = dataset.head()
        head_w, head_b = head["lm_head.weight"], head.get("lm_head.bias")
    teacher_width = int(manifest["target"]["vocab_width"])
    draft, _ = load_model(draft_ref, dtype=config.dtype, device=device or "cpu")
    loaded_dtype = next(draft.parameters()).dtype
    widths = (input_width(draft), output_width(draft))
    if beyond := dataset.token_ids_from(min(widths)):  # an IndexError inside the draft at its first batch otherwise
        check_token_ids(torch.tensor(beyond), [("draft", widths)], what=f"the dump's sequences ({dump_dir})")
    longest_id, longest = dataset.longest()  # past the draft's window: an IndexError at step N, or silent training
    check_context(longest, [("draft", draft)], f"the dump's longest sequence {longest_id!r} ({longest} tokens)",
                  "dump with a --max-length the draft's window holds, or distil a draft with a longer window.",
                  error=DistillError)
    cut = count_cut_ties(dataset, config)  # before training: where the logged α is not the deployed one
    support = head_support(dataset, draft_tok, config, widths) if config.head_support is not None else None
    train_idx, held_idx, split_counts = prompt_keyed_split(parts, dump_weights, config.held_out_fraction, config.seed)
    train_ds = Subset(dataset, train_idx)
    eval_ds = Subset(dataset, held_idx) if held_idx else None
    writer = (load_draft_writer(target_ref, manifest, draft_tok, config, device) if config.on_policy_fraction > 0
              else None)
    result = train(draft, head_w, head_b, real_vocab, train_ds, eval_ds, config, out, resume=resume,
                   teacher_width=teacher_width, report_to=report_to, logit_ops=dataset.logit_ops, writer=writer,
                   callbacks=callbacks, origin=distill_origin(parts, draft_ref, dump_weights), support=support)
    del writer  # frees the target
    # Float32 master weights (master_weights) served their purpose: the export is in the dtype the draft was loaded
    # in, one dtype for every tensor, as a speculator's config.json records it.
    saved_dtype = save_dtype or str(loaded_dtype).removeprefix("torch.")
    trained = result.pop("draft").to(getattr(torch, saved_dtype))
    # What the save kept of the update: a bfloat16 export rounds a small-lr update of float32 masters away.
    start = result.pop("start")
    moved_saved = moved_fraction(trained, start) if start is not None else None
    if lost := rounded_away(result["moved_fraction"], moved_saved, saved_dtype):
        warnings.warn(lost, stacklevel=2)
    metrics = {"eval_before": result["eval_before"], "eval_after": result["eval_after"],
               "steps": result["steps"], "trainable_parameters": result["trainable_parameters"],
               "moved_fraction": result["moved_fraction"], "moved_fraction_saved": moved_saved,
               "saved_dtype": saved_dtype, "saved_update_lost": lost,
               "seconds": result["seconds"], "resumed_from": result["resumed_from"], "curve": result["curve"],
               "train_sequences": len(train_idx), "held_out_sequences": len(held_idx), "held_out_split": split_counts,
               "processes": result["processes"],
               "precision": result["precision"], "precision_reason": result["precision_reason"],
               "global_batch_sequences": config.batch_size * config.gradient_accumulation_steps * result["processes"],
               "on_policy": result["on_policy"], "cut_ties": cut,
               "alpha_definition": alpha_definition(config, manifest["format"], cut),
               "head_support": None if support is None else int(support.numel())}
    training = {"config": config.model_dump(), "target": target_ref, "draft": str(draft_ref),
                "dump": {"dir": str(dirs[0]) if len(dirs) == 1 else [str(d) for d in dirs],
                         "weights": dump_weights, "sequences_per_dump": [len(p) for p in parts],
                         "tokenizer_fingerprint": manifest["tokenizer_fingerprint"],
                         "head_fingerprint": manifest.get("head_fingerprint"), "format": manifest["format"],
                         "logit_transform": dataset.logit_ops,
                         "sequences": len(dataset)},
                "metrics": metrics, "history": result["history"]}
    if config.prompt_positions:  # where each dump's trained prompt positions start
        training["dump"]["shared_prefix_tokens"] = [p.shared_tokens for p in parts]
    # Under accelerate launch / torchrun every rank holds the same trained weights: one writes, all wait for it
    # (the state is the Trainer's process group; a plain run is rank 0 alone).
    from accelerate import PartialState

    state = PartialState()
    spec_dir = out / "speculator"
    if state.is_main_process:
        export_speculator(trained, draft_tok, target_ref, spec_dir, num_speculative_tokens, training)
        write_training_json(out / "training.json", training)
        if not keep_checkpoints:  # the training is finished and exported: nothing resumes from them
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
    state.wait_for_everyone()
    return {"speculator": spec_dir, "metrics": metrics, "training": training, "model": trained}
