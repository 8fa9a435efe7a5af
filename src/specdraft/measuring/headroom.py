"""Headroom forecast: before training, how much acceptance distillation can add to a pair.

Over N teacher-forced positions: greedy agreement ``a_j = 1[argmax q_j = argmax p_j]``, sampled acceptance
``α_j = Σ_x min(p_j(x), q_j(x))``, and the target *sure* where ``max_x p_j(x) ≥ τ``. The gap ``1 − ā`` splits
exactly into ``learnable`` (sure positions the draft misses) and ``uncertain``; the forecast gain is the greedy
``learnable`` (probability, as ``acceptance_eval``'s ``alpha``) with a bootstrap interval over sequences.
Derivation and verdict: docs/architecture.md#specdraftmeasuringheadroom.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from specdraft.core.config import HeadroomConfig
from specdraft.core.losses import sum_min
from specdraft.core.sampling import align_logits, check_windows, filtered_probs, output_width
from specdraft.core.stats import ratio_ci
from specdraft.data.sources import (
    DataError,
    build_sequences,
    encode_prompts,
    sequences_from_responses,
    tokenizer_pad_id,
)
from specdraft.decoding.replay import counted_tail, counted_target_logits, tail_logits
from specdraft.decoding.responses import generate_responses
from specdraft.models.check import check_compatible
from specdraft.models.loading import load_model, resolve
from specdraft.models.segmentation import diagnose_masked
from specdraft.models.tokens import left_pad
from specdraft.models.vocab import CompatibilityError, swapped_draft_twins

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from specdraft.core.config import SamplingConfig
    from specdraft.data.sources import Example


@dataclass
class HeadroomCounts:
    """Sums over teacher-forced positions (merge with ``+``): ``positions`` (N), ``sure`` (max p ≥ τ),
    ``agree``/``agree_sure`` (argmax q = argmax p) and ``alpha``/``alpha_sure`` (Σ α_j), all and at sure positions."""

    positions: int = 0
    sure: int = 0
    agree: int = 0
    agree_sure: int = 0
    alpha: float = 0.0
    alpha_sure: float = 0.0

    def __add__(self, other: HeadroomCounts) -> HeadroomCounts:
        return HeadroomCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def _share(self, x: float) -> float:
        return x / self.positions if self.positions else 0.0

    @property
    def greedy(self) -> float:
        """ā: greedy agreement rate (probability)."""
        return self._share(self.agree)

    @property
    def greedy_learnable(self) -> float:
        """Share of positions where the target is sure and the argmaxes differ: the forecast gain."""
        return self._share(self.sure - self.agree_sure)

    @property
    def greedy_uncertain(self) -> float:
        """Share of positions where the target is unsure and the argmaxes differ."""
        return self._share((self.positions - self.sure) - (self.agree - self.agree_sure))

    @property
    def sampled(self) -> float:
        """ᾱ: mean Σ min(p, q)."""
        return min(self._share(self.alpha), 1.0)  # Σ min ≤ 1 per position; float rounding may overshoot ~1e-6

    @property
    def sampled_learnable(self) -> float:
        """(1/N) Σ_{sure} (1 − α_j)."""
        return max(self._share(self.sure - self.alpha_sure), 0.0)

    @property
    def sampled_uncertain(self) -> float:
        """(1/N) Σ_{unsure} (1 − α_j)."""
        return max(self._share((self.positions - self.sure) - (self.alpha - self.alpha_sure)), 0.0)

    def to_dict(self) -> dict[str, Any]:
        """The counts and every derived figure (``*_ceiling`` = the figure plus its learnable part)."""
        return asdict(self) | {
            "sure_share": self._share(self.sure),
            "greedy": self.greedy, "greedy_learnable": self.greedy_learnable,
            "greedy_uncertain": self.greedy_uncertain, "greedy_ceiling": self.greedy + self.greedy_learnable,
            "sampled": self.sampled, "sampled_learnable": self.sampled_learnable,
            "sampled_uncertain": self.sampled_uncertain, "sampled_ceiling": min(self.sampled + self.sampled_learnable, 1.0),
        }


@dataclass
class HeadroomForecast:
    """:func:`forecast_headroom`'s result: the counts, ``gain`` (``counts.greedy_learnable``) with
    ``gain_ci95`` (bootstrap over sequences), the ``verdict`` line, τ, per-sequence counts and the swap diagnostic."""

    counts: HeadroomCounts
    gain: float
    gain_ci95: list[float]
    verdict: str
    sequences: int
    sure_threshold: float
    per_sequence: list[tuple[str, HeadroomCounts]] = field(default_factory=list)
    segmentation: dict[str, Any] | None = None

    def to_dict(self, per_sequence: bool = True) -> dict[str, Any]:
        """The counts' dict plus gain, interval, verdict, τ and (optionally) per-sequence rows."""
        d = self.counts.to_dict() | {"gain": self.gain, "gain_ci95": self.gain_ci95, "verdict": self.verdict,
                                     "sequences": self.sequences, "sure_threshold": self.sure_threshold}
        if per_sequence:
            d["per_sequence"] = [{"id": n} | asdict(c) for n, c in self.per_sequence]
        return d | ({} if self.segmentation is None else {"segmentation": self.segmentation})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadroomForecast:
        """Inverse of :meth:`to_dict` (derived figures ignored)."""
        counts = lambda x: HeadroomCounts(**{f.name: x[f.name] for f in fields(HeadroomCounts)})
        return cls(counts(d), d["gain"], list(d["gain_ci95"]), d["verdict"], d["sequences"], d["sure_threshold"],
                   [(x["id"], counts(x)) for x in d.get("per_sequence") or []], d.get("segmentation"))


@dataclass
class HeadroomRun:
    """:func:`run_headroom`'s result: the forecast and the references, settings and examples behind it."""

    forecast: HeadroomForecast
    target: str
    draft: str
    config: dict[str, Any]  # HeadroomConfig.model_dump
    examples: int  # examples given (sequences scored: ``forecast.sequences``)

    def to_dict(self) -> dict[str, Any]:
        return self.forecast.to_dict() | {"target": self.target, "draft": self.draft, "config": self.config,
                                          "examples": self.examples}


def position_headroom(target_logits: torch.Tensor, draft_logits: torch.Tensor, sure: float = 0.5,
                      serving: SamplingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position ingredients of the forecast: ``(sure [N] bool, agree [N] bool, alpha [N] float64)``.

    ``target_logits``/``draft_logits``: ``[N, V] float`` at the same positions, padding rows at ``-inf``
    (:func:`specdraft.core.sampling.align_logits`). Sureness reads the raw p; α is taken after ``serving``'s filter (None:
    T = 1).
    """

    p = target_logits.float().softmax(-1)  # [N, V]
    is_sure = p.max(-1).values >= sure
    agree = target_logits.argmax(-1) == draft_logits.argmax(-1)
    plain = serving is None or serving.greedy or (serving.temperature == 1.0 and serving.top_k == 0
                                                  and serving.top_p == 1.0)
    if plain:
        alpha = sum_min(p, draft_logits.float().softmax(-1))
    else:
        alpha = sum_min(filtered_probs(target_logits.float(), serving.temperature, serving.top_k, serving.top_p),
                        filtered_probs(draft_logits.float(), serving.temperature, serving.top_k, serving.top_p))
    return is_sure, agree, alpha.double()


def counts_from_positions(is_sure: torch.Tensor, agree: torch.Tensor, alpha: torch.Tensor) -> HeadroomCounts:
    """:class:`HeadroomCounts` of the ``[N]`` outputs of :func:`position_headroom`."""
    return HeadroomCounts(positions=int(is_sure.numel()), sure=int(is_sure.sum()), agree=int(agree.sum()),
                          agree_sure=int((agree & is_sure).sum()), alpha=float(alpha.sum()),
                          alpha_sure=float(alpha[is_sure].sum()))


def verdict(counts: HeadroomCounts, min_gain: float = 0.02) -> str:
    """The one-line reading of a forecast (see the module docstring)."""
    gain = counts.greedy_learnable
    if gain >= min_gain:
        return (f"distillation can add about +{gain:.2f} greedy acceptance (sampled α +{counts.sampled_learnable:.2f}): "
                f"the draft disagrees at {counts.sure - counts.agree_sure:,} of the {counts.sure:,} positions where "
                f"the target is sure")
    return (f"little to learn: the draft already agrees where the target is sure (at most +{gain:.2f}; "
            f"{counts.greedy_uncertain:.2f} of the gap is where the target itself is uncertain)")


def forecast_headroom(
    target,
    draft,
    sequences: Sequence[Sequence[int]],
    masks: Sequence[Sequence[bool | int]],
    config: HeadroomConfig | None = None,
    *,
    names: Sequence[str] | None = None,
    serving: SamplingConfig | None = None,
    real_vocab: int | None = None,
    pad_id: int = 0,
    progress: Callable[[int, int], None] | None = None,
    twins: Sequence[bool] | None = None,
    tokenizer=None,
    target_cache=None,
) -> HeadroomForecast:
    """The forecast over the masked positions of ``sequences`` (teacher-forced, one pass per batch).

    ``masks`` follow the dump's ``loss_mask`` convention; ``real_vocab`` ids and above are padding. ``twins`` (``[V]``
    bool, a swapped draft's) with ``tokenizer`` add the segmentation diagnostic
    (:func:`specdraft.models.segmentation.diagnose_masked`); ``target_cache`` shares target logits with replays.

    Raises ValueError (a mask of the wrong length, no masked position, ``twins`` without ``tokenizer``) and
    :class:`specdraft.core.sampling.ContextWindowError` (a sequence longer than either context window, before any pass).
    """
    import torch


    config = config or HeadroomConfig()
    if twins is not None and tokenizer is None:
        raise ValueError("the swap diagnostic (twins) needs the target's tokenizer")
    check_windows(sequences, [("target", target), ("draft", draft)],
                  "lower --max-length (or --generate) to fit it.", names=names)
    width = output_width(target)
    draft_top1: list[list[int]] = []  # per sequence the draft's argmax at each masked position (swap diagnostic)
    device = next(target.parameters()).device
    per_sequence: list[HeadroomCounts] = []
    bs = config.batch_size
    for start in range(0, len(sequences), bs):
        chunk = [list(s) for s in sequences[start:start + bs]]
        ids, attn = left_pad(chunk, pad_id, device)
        sel = torch.zeros_like(attn, dtype=torch.bool)
        for i, s in enumerate(chunk):
            m = [bool(x) for x in masks[start + i]]
            if len(m) != len(s):
                raise ValueError(f"mask {start + i} has length {len(m)}, its sequence {len(s)}")
            sel[i, ids.shape[1] - len(s):] = torch.tensor(m, device=device)
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        keep, sel = counted_tail(sel)  # the heads run over the tail holding the masked positions
        with torch.no_grad():
            p_all = counted_target_logits(target, chunk, ids, attn, pos, sel, width, real_vocab, pad_id,
                                          target_cache)
            q_all = align_logits(tail_logits(draft, ids, attn, pos, keep), width, real_vocab)[sel]
        per_row = sel.sum(1).tolist()
        for p_l, q_l in zip(p_all.split(per_row), q_all.split(per_row), strict=True):
            per_sequence.append(counts_from_positions(*position_headroom(p_l, q_l, config.sure, serving)))
            if twins is not None:
                draft_top1.append(q_l.argmax(-1).tolist())
        del p_all, q_all
        if progress:
            progress(min(start + bs, len(sequences)), len(sequences))
    total = sum(per_sequence, HeadroomCounts())
    if total.positions == 0:
        raise ValueError("no masked position to forecast over (every mask is empty)")
    ci = ratio_ci([c.sure - c.agree_sure for c in per_sequence], [c.positions for c in per_sequence])
    names = list(names) if names is not None else [str(i) for i in range(len(per_sequence))]
    line, seg = verdict(total, config.min_gain), None
    if twins is not None:

        seg = diagnose_masked(tokenizer, twins, sequences, masks, draft_top1).to_dict()
        line = f"{line}; vocabulary swap: {seg['verdict']}"
    return HeadroomForecast(total, total.greedy_learnable, [ci.low, ci.high], line, len(per_sequence), config.sure,
                            list(zip(names, per_sequence, strict=True)), seg)


def headroom_sequences(target, tokenizer, examples: list[Example], config: HeadroomConfig,
                       ) -> tuple[list[str], list[list[int]], list[list[bool]]]:
    """The sequences a forecast runs on: ``(ids, sequences, masks)``, cut to ``config.max_length``.

    Existing replies are teacher-forced (reply tokens count), or with ``config.generate`` the target's greedy answers.
    Raises :class:`specdraft.data.sources.DataError` for an example without a reply while ``generate`` is off.
    """

    if config.generate is None:
        missing = [e.id for e in examples if e.messages[-1]["role"] != "assistant" and not e.reference]
        if missing:
            raise DataError(f"{len(missing)} example(s) have no reply to teacher-force (e.g. {missing[:3]}): pass "
                            "--generate N to let the target answer them, or use data with replies (sharegpt, "
                            "humaneval).")
        seqs = build_sequences(tokenizer, examples, answer_only=True, max_length=config.max_length)
    else:

        prompts, responses = generate_responses(target, tokenizer, examples, config.generate,
                                                real_vocab=len(tokenizer))
        seqs = [s for s in sequences_from_responses([e.id for e in examples], prompts, responses, answer_only=True,
                                                    max_length=config.max_length) if s is not None]
    return [s.id for s in seqs], [s.ids for s in seqs], [s.loss_mask for s in seqs]


def run_headroom(target_ref: str, draft_ref: str, examples: list[Example], config: HeadroomConfig | None = None,
                 progress: Callable[[int, int], None] | None = None) -> HeadroomRun:
    """Load the pair, check that it shares one tokenizer, build the sequences and forecast.

    A draft written by ``specdraft vocab-swap`` also gets the swap diagnostic
    (:func:`specdraft.models.vocab.swapped_draft_twins`).
    Raises :class:`specdraft.models.vocab.CompatibilityError` when the tokenizers differ (before weights load), else as
    :func:`headroom_sequences` and :func:`forecast_headroom`.
    """

    config = config or HeadroomConfig()
    rep = check_compatible(target_ref, draft_ref)
    if rep.verdict == "mismatch":
        raise CompatibilityError(f"the forecast compares p and q id by id, but the tokenizers differ ({rep.summary()}): "
                                 "re-index the draft into the target's tokenizer first (specdraft vocab-swap) and "
                                 "forecast the swapped draft.")
    twins = swapped_draft_twins(resolve(draft_ref), resolve(target_ref))
    target, tok = load_model(target_ref, dtype=config.dtype)
    if config.generate is not None:  # before the target writes the answers: the longest sequence they can make
        from transformers import AutoConfig


        bound = [min(len(p) + config.generate, config.max_length) for p in encode_prompts(tok, examples)]
        check_windows(bound, [("target", target), ("draft", AutoConfig.from_pretrained(resolve(draft_ref)))],
                      "lower --generate or --max-length to fit it.", names=[e.id for e in examples])
    names, seqs, masks = headroom_sequences(target, tok, examples, config)
    draft, _ = load_model(draft_ref, dtype=config.dtype)
    pad = tokenizer_pad_id(tok)
    res = forecast_headroom(target, draft, seqs, masks, config, names=names, real_vocab=len(tok), pad_id=pad,
                            progress=progress, twins=twins, tokenizer=tok if twins is not None else None)
    return HeadroomRun(res, str(target_ref), str(draft_ref), config.model_dump(), len(examples))
