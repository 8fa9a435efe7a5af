"""The distillation's loss step (:class:`DistillModel`) and its Trainer (:class:`DistillTrainer`): one optimizer
step weighs every trained token equally. Derivations: docs/architecture.md#specdrafttrainingdistill_trainer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import ModelOutput

from specdraft.core.config import DistillConfig
from specdraft.core.losses import LOSSES, TOPK_LOSSES, masked_mean, sum_min, tvd_topk
from specdraft.core.sampling import align_logits, filter_logits, filtered_probs
from specdraft.models.dump_reader import teacher_logits_from_hidden, teacher_probs_from_topk
from specdraft.models.loading import load_causal_lm, takes_logits_to_keep
from specdraft.models.restricted_head import (
    NEEDS_NO_TAIL,
    RestrictedHeadError,
    check_draft,
    restricted_logits,
    restricted_soft_ce,
)
from specdraft.training.distill_data import DistillError


@dataclass(frozen=True)
class TeacherHead:
    """The target's output head (``weight [V_t, H_t]``, ``bias``; None for a top-k teacher of ``width`` ids),
    ``real_vocab`` = ``len(tokenizer)`` and the target's final-logit transforms after its head (``logit_ops``)."""

    weight: torch.Tensor | None
    real_vocab: int
    bias: torch.Tensor | None = None
    width: int | None = None
    logit_ops: tuple = ()

    @classmethod
    def of_dump(cls, dataset) -> TeacherHead:
        """The head of a :class:`~specdraft.models.dump_reader.TeacherDataset` (or mix): a hidden dump's stored head."""
        target = dataset.manifest["target"]
        weight = bias = None
        if dataset.manifest["format"] == "hidden":
            head = dataset.head()
            weight, bias = head["lm_head.weight"], head.get("lm_head.bias")
        return cls(weight, int(target["real_vocab"]), bias, int(target["vocab_width"]), tuple(dataset.logit_ops or ()))


@dataclass(frozen=True)
class Metric:
    """A figure: ``name`` its output field and log key, ``held_out`` its key after ``eval_``; ``each_step``: logged
    in training too; ``show``: when the report prints it (``always``, ``nonzero``, ``present``)."""

    name: str
    held_out: str
    each_step: bool = True
    show: str = "always"


#: Every figure :class:`DistillModel` returns (token-weighted means), read by the logs, held-out scores and report.
METRICS = (
    Metric("loss", "loss", each_step=False),  # the Trainer logs its own
    Metric("tvd", "tvd"),  # ½Σ|p − q| at temperature 1, no filter
    Metric("alpha", "alpha"),  # α at the serving settings (alpha_definition)
    Metric("alpha_bound", "alpha_bound", show="nonzero"),  # how far a top-k teacher's unknown tail moves α, tvd
    Metric("train_acc", "acc"),  # top-1 agreement
    Metric("outside_mass", "outside_mass", each_step=False, show="present"),  # restricted head: 1 − q(S)
)
STEP_METRICS = tuple(m.name for m in METRICS if m.each_step)


@dataclass
class DistillOutput(ModelOutput):
    """:data:`METRICS` of one forward (0-dim tensors) and ``tokens``, the positions they average over;
    ``outside_mass`` None but for a restricted head scored with the full head."""

    loss: torch.Tensor | None = None
    train_acc: torch.Tensor | None = None
    tvd: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    alpha_bound: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    outside_mass: torch.Tensor | None = None


def cut_ties(topk_logprobs: torch.Tensor, config: DistillConfig) -> torch.Tensor:
    """``[...] bool``: the positions of a top-k teacher ``topk_logprobs [..., k]`` (any order, nats) where the
    serving filter, applied to the stored values, keeps the smallest of them."""
    if config.serving_is_plain:
        return torch.zeros(topk_logprobs.shape[:-1], dtype=torch.bool, device=topk_logprobs.device)
    lp = topk_logprobs.float()
    # The k stored values alone stand for the full width: a top-k ≤ k and the renormalised top-p read these only.
    kept = torch.isfinite(filter_logits(lp, config.serving.temperature, config.serving.top_k, config.serving.top_p))
    return (kept & (lp == lp.min(dim=-1, keepdim=True).values)).any(dim=-1)


def cut_tie_bound(topk_logprobs: torch.Tensor, leftover_logmass: torch.Tensor, config: DistillConfig) -> torch.Tensor:
    """``[...] float32``: at each cut tie (:func:`cut_ties`) the most the filtered α from the stored ids alone can
    differ from the target's, 0 elsewhere; ``topk_logprobs [..., k]`` and ``leftover_logmass [...]`` in nats."""
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


def stored_logits(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, width: int) -> torch.Tensor:
    """A top-k teacher as logits: its stored log-probs on its stored ids, ``-inf`` elsewhere, ``[..., V] float32``."""
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
    """The draft plus a frozen teacher head; forward computes the chosen loss and :data:`METRICS` over the loss mask.

    Args:
        draft: a transformers causal LM (trained).
        teacher: the :class:`TeacherHead` (frozen: non-persistent buffers, never in the draft's checkpoints).
        config: the :class:`DistillConfig` (loss and serving filter).
        autocast: the draft's forward under ``torch.autocast(dtype=bfloat16)``; the teacher and the loss stay
            float32 outside it.
        trained_columns_only: both heads, the loss and the metrics over the positions some row trains only
            (``logits_to_keep``); exact, since every loss is per position and masked.
        support: ``[U] int64`` ids of a restricted head (:mod:`specdraft.models.restricted_head`), or None.

    Raises:
        DistillError: a width smaller than the real vocabulary (not padding of one tokenizer).
    """

    def __init__(self, draft, teacher: TeacherHead, config: DistillConfig, autocast: bool = False,
                 trained_columns_only: bool = True, support: torch.Tensor | None = None):
        super().__init__()

        self.autocast = autocast
        self.trained_columns_only = trained_columns_only and takes_logits_to_keep(draft)
        self.logit_ops = list(teacher.logit_ops)
        self.draft = draft
        self.config_ = config
        real_vocab, head_weight = teacher.real_vocab, teacher.weight
        d_width = draft.get_output_embeddings().weight.shape[0]
        t_width = head_weight.shape[0] if head_weight is not None else (teacher.width or d_width)
        for name, w in (("draft", d_width), ("teacher", t_width)):
            if w < real_vocab:
                raise DistillError(
                    f"the {name}'s output width {w} is below the tokenizer's {real_vocab} ids: the vocabularies "
                    "differ beyond padding of one tokenizer. Align them first (specdraft.models.vocab.vocab_swap).")
        self.real_vocab = real_vocab
        self.width = t_width
        # Non-persistent buffers: follow .to()/device placement, never saved in checkpoints or state_dict.
        self.register_buffer("head_weight", head_weight.detach() if head_weight is not None else None,
                             persistent=False)
        self.register_buffer("head_bias", teacher.bias.detach() if teacher.bias is not None else None,
                             persistent=False)
        if support is not None:

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
        """The draft of an :class:`~specdraft.decoding.speculator_model.IndependentSpeculator` whose verifier is attached in mode
        ``"train_only"``, with that verifier's output head (and final-logit transforms) as the teacher head.

        Raises:
            DistillError: no verifier head attached (``attach_verifier(ref, mode="train_only")`` first).
        """
        head = speculator.verifier_head
        if head is None:
            raise DistillError("the speculator holds no verifier head: attach_verifier(reference, mode='train_only') "
                               "first")
        w = head.lm_head.weight.detach()
        b = getattr(head.lm_head, "bias", None)
        teacher = TeacherHead(w, real_vocab or w.shape[0], None if b is None else b.detach(),
                              logit_ops=tuple(head.logit_ops or ()))
        return cls(speculator.draft, teacher, config)

    def teacher_probs(self, hidden=None, topk_logprobs=None, topk_ids=None, leftover_logmass=None):
        """Teacher distribution p ``[B, S, V] float32`` (zero on padding rows) and, for a hidden teacher, its
        logits (for tvd_deploy's filter); a top-k teacher's p completes its tail uniformly and has no logits
        (:func:`stored_logits` gives what a filter with top_k ≤ k reads)."""
        if hidden is not None:
            if self.head_weight is None:
                raise DistillError("a hidden-state teacher needs the target's output head")

            # In the head's own dtype, as the target computed its logits (bf16 matmul is also ~2x cheaper on CPU).
            logits = teacher_logits_from_hidden(hidden, self.head_weight, self.head_bias,
                                                logit_ops=self.logit_ops)  # [B, S, V_t] float32
            logits = align_logits(logits, self.width, self.real_vocab)
            return logits.softmax(-1), logits

        p = teacher_probs_from_topk(topk_logprobs, topk_ids, leftover_logmass, self.width, self.real_vocab)
        return p, None

    def forward(self, input_ids, attention_mask=None, loss_mask=None, hidden=None, topk_logprobs=None,
                topk_ids=None, leftover_logmass=None, num_items_in_batch=None, **_: Any) -> DistillOutput:
        """Args: ``input_ids [B, S]``, ``attention_mask [B, S]``, ``loss_mask [B, S]`` (position j trains the
        prediction of token j+1), and the teacher: ``hidden [B, S, H]`` or ``topk_* [B, S, k]`` +
        ``leftover_logmass [B, S]``. Without ``loss_mask`` the attention mask is used."""
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
        # The restricted head trains; held-out scoring (eval mode) takes the full head, over every id.
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
            # |Σ min(p̂, q) − Σ min(p, q)| ≤ TV(p, p̂) ≤ the leftover mass; filtered: cut_tie_bound at a cut tie.
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
        """soft_ce through the head restricted to ``self.support`` (:mod:`specdraft.models.restricted_head`), in training
        only; the metrics (top-1 agreement, TVD, α) over the support's softmax q_S, as the loss (the training log's;
        held-out ones take the full head)."""

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
        (:data:`specdraft.core.losses.TOPK_LOSSES`). soft_ce equals the dense completion's; the tvd loss and the tvd /
        α metrics are :func:`~specdraft.core.losses.tvd_topk`: exact where the teacher's tail is 0, else an upper bound
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


def row_parameter_ids(draft) -> set[int]:
    """``id()`` of the draft's input-embedding and output-head weights (one id when they are tied): the rows that
    ``DistillConfig.row_lr`` trains at their own learning rate."""
    mods = (draft.get_input_embeddings(), draft.get_output_embeddings())
    return {id(m.weight) for m in mods if m is not None and getattr(m, "weight", None) is not None}


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


class _ProgressLines(ProgressCallback):
    """The bar's printer (in a terminal): :func:`log_line` above the bar."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(log_line(logs, state.global_step, state.max_steps))


class _PrinterLines(PrinterCallback):
    """The plain printer's (in a log file): one :func:`log_line` per logging step on stdout."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs:
            print(log_line(logs, state.global_step, state.max_steps), flush=True)


def readable_log_callbacks(trainer) -> None:
    """Swap the Trainer's log printers for ones that write :func:`log_line`."""
    for old, new in ((ProgressCallback, _ProgressLines), (PrinterCallback, _PrinterLines)):
        if trainer.pop_callback(old) is not None:
            trainer.add_callback(new)


class DistillTrainer(Trainer):
    """Trainer that weighs every trained token of a step equally, logs :data:`STEP_METRICS` beside the loss, stops on
    a non-finite loss, scores the held-out set sharded over ranks, and checkpoints the draft alone."""

    _sums: dict[str, float]
    # compute_loss divides by the step's token count already (Trainer.training_step reads this flag).
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
            # Each rank's loss is its share of the global sum / count: undo DDP's average over ranks.
            loss = loss * self.args.world_size
        if not torch.isfinite(loss):
            raise DistillError(
                f"non-finite loss ({loss.item()}) at step {self.state.global_step}; the run stops here. The "
                f"last good checkpoint is kept under {self.args.output_dir}; lower --lr or check the data, "
                "then rerun the same command to resume from it.")
        sums = getattr(self, "_sums", None) or {**dict.fromkeys(STEP_METRICS, 0.0), "n": 0.0}
        tok = float(outputs["tokens"])
        for k in STEP_METRICS:
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
        # Every rank logs at the same steps: the reduction below is entered by all ranks or none.
        if "loss" in logs and sums:
            *vals, n = self._sum_over_ranks([sums[k] for k in STEP_METRICS] + [sums["n"]])
            if n:
                logs.update({k: v / n for k, v in zip(STEP_METRICS, vals)})
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
        scored = [m for m in METRICS if m.name != "outside_mass" or model.support is not None]
        totals = [0.0] * (len(scored) + 1)  # per-key sums weighted by tokens, then tokens
        mine = Subset(ds, range(self.args.process_index, len(ds), self.args.world_size))
        loader = DataLoader(mine, batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator)
        with torch.no_grad():
            for batch in loader:
                out = model(**self._prepare_inputs(batch))
                tok = float(out["tokens"])
                for i, m in enumerate(scored):
                    totals[i] += float(out[m.name]) * tok
                totals[-1] += tok
        *sums, n = self._sum_over_ranks(totals)
        metrics = {f"{metric_key_prefix}_{m.held_out}": v / max(n, 1) for m, v in zip(scored, sums)}
        metrics[f"{metric_key_prefix}_tokens"] = n
        self.log(metrics)
        # As Trainer.evaluate: callbacks see the metrics, and the flag asking for this evaluation is cleared.
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        if was_training:
            model.train()
        return metrics

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        output_dir = output_dir or self.args.output_dir
        draft = self.accelerator.unwrap_model(self.model).draft
        # An overflow in backward can leave NaN weights before any loss shows it: never checkpoint them.
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