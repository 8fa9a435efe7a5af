"""Headroom forecast: before training, how much acceptance distillation can add to a pair.

Over N teacher-forced positions both models score once; per position j: greedy agreement
``a_j = 1[argmax q_j = argmax p_j]``, sampled acceptance ``α_j = Σ_x min(p_j(x), q_j(x))``, and the target is
*sure* when ``max_x p_j(x) ≥ τ`` (``HeadroomConfig.sure``). The gap ``1 − ā`` splits exactly into ``learnable``
(sure positions the draft misses) and ``uncertain`` (the target itself spreads its mass); the forecast gain is the
greedy ``learnable`` with a bootstrap interval over sequences, the ceiling ``ā + learnable``. Units: per-position
probability, as ``acceptance_eval``'s ``alpha``. Counts first (:class:`HeadroomCounts`, per sequence), so forecasts
merge across batches. The derivation and the verdict's wording: docs/architecture.md, "headroom".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from specdraft.config import HeadroomConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from specdraft.config import SamplingConfig
    from specdraft.data import Example


@dataclass
class HeadroomCounts:
    """Sums over teacher-forced positions (merge with ``+``); every figure of the forecast derives from them.

    Attributes:
        positions: N, positions scored.
        sure: positions where max p ≥ τ.
        agree / agree_sure: greedy agreements (argmax q = argmax p), all and at sure positions.
        alpha / alpha_sure: Σ α_j (probability), all and at sure positions.
    """

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
        """Share of positions where the target is sure and the draft's argmax is another token: the forecast gain."""
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
    """What :func:`forecast_headroom` found: the counts (every figure derives from them), the forecast gain with its
    interval, the verdict line, and the counts per sequence.

    Attributes:
        counts: over every masked position.
        gain: ``counts.greedy_learnable`` (probability: share of positions).
        gain_ci95: ``[low, high]``, a 95% bootstrap over sequences (:func:`specdraft.stats.ratio_ci`).
        verdict: one line (:func:`verdict`; with the swap diagnostic, its own verdict after ``"; vocabulary swap: "``).
        sequences: sequences scored.
        sure_threshold: τ (probability).
        per_sequence: ``(id, counts)`` per sequence.
        segmentation: the swap diagnostic (:meth:`~specdraft.segmentation.SegmentationReport.to_dict`), or None.
    """

    counts: HeadroomCounts
    gain: float
    gain_ci95: list[float]
    verdict: str
    sequences: int
    sure_threshold: float
    per_sequence: list[tuple[str, HeadroomCounts]] = field(default_factory=list)
    segmentation: dict[str, Any] | None = None

    def to_dict(self, per_sequence: bool = True) -> dict[str, Any]:
        """``{**HeadroomCounts.to_dict(), "gain", "gain_ci95", "verdict", "sequences", "sure_threshold",
        "per_sequence": [{"id", **counts}]}`` (``per_sequence`` left out when False) plus ``"segmentation"`` when
        the diagnostic ran."""
        d = self.counts.to_dict() | {"gain": self.gain, "gain_ci95": self.gain_ci95, "verdict": self.verdict,
                                     "sequences": self.sequences, "sure_threshold": self.sure_threshold}
        if per_sequence:
            d["per_sequence"] = [{"id": n} | asdict(c) for n, c in self.per_sequence]
        return d | ({} if self.segmentation is None else {"segmentation": self.segmentation})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadroomForecast:
        """Inverse of :meth:`to_dict` (derived figures and keys that are not the forecast's are ignored)."""
        counts = lambda x: HeadroomCounts(**{f.name: x[f.name] for f in fields(HeadroomCounts)})
        return cls(counts(d), d["gain"], list(d["gain_ci95"]), d["verdict"], d["sequences"], d["sure_threshold"],
                   [(x["id"], counts(x)) for x in d.get("per_sequence") or []], d.get("segmentation"))


@dataclass
class HeadroomRun:
    """:func:`run_headroom`'s result: the forecast and what it was made from (references, settings, examples)."""

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
    """Per-position ingredients of the forecast.

    Args:
        target_logits / draft_logits: ``[N, V] float`` logits of p and q at the same N positions, aligned to one
            width with padding rows at ``-inf`` (:func:`specdraft.sampling.align_logits`).
        sure: τ; the target is sure where ``max p ≥ τ`` (raw p, T = 1).
        serving: the filter α is computed after (temperature / top-k / top-p); None or plain: T = 1 unfiltered.

    Returns:
        ``(sure [N] bool, agree [N] bool, alpha [N] float64)``: sureness, greedy agreement and Σ min(p̃, q̃).
    """
    from specdraft.losses import sum_min
    from specdraft.sampling import filtered_probs

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
    """The forecast over the masked positions of ``sequences`` (teacher-forced; both models run once per batch).

    Args:
        target, draft: causal LMs of one tokenizer (widths may differ by padding rows).
        sequences: ``[n]`` token id lists.
        masks: ``[n]`` per sequence, True where the distribution of the next token counts (the dump's
            ``loss_mask`` convention; same length as the sequence).
        config: τ, the verdict bound and the batch size (:class:`~specdraft.config.HeadroomConfig`).
        names: an id per sequence (reported per sequence).
        serving: the filter of the sampled α (default: plain T = 1).
        real_vocab: ``len(tokenizer)``; ids past it are padding with zero probability.
        progress: called as ``progress(done, total)`` after each batch.
        twins / tokenizer: for a draft re-indexed from another tokenizer (:func:`specdraft.vocab.vocab_swap`):
            ``[V]`` per target id whether the original draft has a twin, and the target's tokenizer. Given, the
            draft's argmaxes of this same pass are split by kind of disagreement with the sequences' tokens
            (:func:`specdraft.segmentation.diagnose_masked`) and the verdict names the kind that dominates.
        target_cache: a directory of the target's logits per batch
            (:func:`specdraft.replay.counted_target_logits`), shared with the replays of the same sequences.

    Returns:
        a :class:`HeadroomForecast` (with ``twins``, its ``segmentation``); ``gain`` is ``greedy_learnable`` and its
        interval a bootstrap over sequences (:func:`specdraft.stats.ratio_ci`).

    Raises:
        ValueError: a mask whose length differs from its sequence's, or no masked position at all; ``twins``
            without ``tokenizer``.
        specdraft.sampling.ContextWindowError: a sequence longer than either model's context window (named with both
            lengths, before any pass).
    """
    import torch

    from specdraft.replay import counted_tail, counted_target_logits, tail_logits
    from specdraft.sampling import align_logits, check_windows, output_width
    from specdraft.stats import ratio_ci
    from specdraft.tokens import left_pad

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
        from specdraft.segmentation import diagnose_masked

        seg = diagnose_masked(tokenizer, twins, sequences, masks, draft_top1).to_dict()
        line = f"{line}; vocabulary swap: {seg['verdict']}"
    return HeadroomForecast(total, total.greedy_learnable, [ci.low, ci.high], line, len(per_sequence), config.sure,
                            list(zip(names, per_sequence, strict=True)), seg)


def headroom_sequences(target, tokenizer, examples: list[Example], config: HeadroomConfig,
                       ) -> tuple[list[str], list[list[int]], list[list[bool]]]:
    """The sequences a forecast runs on: ``(ids, sequences, masks)``.

    Without ``config.generate`` each example's existing reply (an assistant turn, or HumanEval's reference) is
    teacher-forced and only predictions of reply tokens count (:func:`specdraft.data.build_sequences` with
    ``answer_only``); with it, the target answers each prompt greedily with up to N tokens and the answers count
    (:func:`specdraft.responses.generate_responses`). Sequences are cut to ``config.max_length``.

    Raises:
        specdraft.data.DataError: an example with no reply while ``generate`` is not set (names it and the fix).
    """
    from specdraft.data import DataError, build_sequences, sequences_from_responses

    if config.generate is None:
        missing = [e.id for e in examples if e.messages[-1]["role"] != "assistant" and not e.reference]
        if missing:
            raise DataError(f"{len(missing)} example(s) have no reply to teacher-force (e.g. {missing[:3]}): pass "
                            "--generate N to let the target answer them, or use data with replies (sharegpt, "
                            "humaneval).")
        seqs = build_sequences(tokenizer, examples, answer_only=True, max_length=config.max_length)
    else:
        from specdraft.responses import generate_responses

        prompts, responses = generate_responses(target, tokenizer, examples, config.generate,
                                                real_vocab=len(tokenizer))
        seqs = [s for s in sequences_from_responses([e.id for e in examples], prompts, responses, answer_only=True,
                                                    max_length=config.max_length) if s is not None]
    return [s.id for s in seqs], [s.ids for s in seqs], [s.loss_mask for s in seqs]


def run_headroom(target_ref: str, draft_ref: str, examples: list[Example], config: HeadroomConfig | None = None,
                 progress: Callable[[int, int], None] | None = None) -> HeadroomRun:
    """Load the pair, check that it shares one tokenizer, build the sequences and forecast.

    Args:
        target_ref / draft_ref: embedded names, local HF directories or cached hub ids.
        examples: prompts with replies (or any prompts with ``config.generate``).
        config: :class:`~specdraft.config.HeadroomConfig`.

    A draft written by ``specdraft vocab-swap`` (its ``vocab_swap.json`` names the original draft) gets the swap
    diagnostic from the same pass (:func:`specdraft.vocab.swapped_draft_twins`; ``forecast_headroom``'s
    ``twins``).

    Returns:
        a :class:`HeadroomRun`: :func:`forecast_headroom`'s result with ``target``, ``draft``, ``config`` and
        ``examples``.

    Raises:
        specdraft.vocab.CompatibilityError: the tokenizers differ (before any weights load): re-index the draft
            first (``specdraft vocab-swap``) and forecast the swapped draft.
        specdraft.data.DataError: see :func:`headroom_sequences`.
        specdraft.sampling.ContextWindowError: a sequence (with ``generate``: a prompt + N, cut to ``max_length``)
            longer than either model's context window, named with both lengths before any forward pass.
    """
    from specdraft.check import check_compatible
    from specdraft.data import tokenizer_pad_id
    from specdraft.models import load_model, resolve
    from specdraft.vocab import CompatibilityError, swapped_draft_twins

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

        from specdraft.data import encode_prompts
        from specdraft.sampling import check_windows

        bound = [min(len(p) + config.generate, config.max_length) for p in encode_prompts(tok, examples)]
        check_windows(bound, [("target", target), ("draft", AutoConfig.from_pretrained(resolve(draft_ref)))],
                      "lower --generate or --max-length to fit it.", names=[e.id for e in examples])
    names, seqs, masks = headroom_sequences(target, tok, examples, config)
    draft, _ = load_model(draft_ref, dtype=config.dtype)
    pad = tokenizer_pad_id(tok)
    res = forecast_headroom(target, draft, seqs, masks, config, names=names, real_vocab=len(tok), pad_id=pad,
                            progress=progress, twins=twins, tokenizer=tok if twins is not None else None)
    return HeadroomRun(res, str(target_ref), str(draft_ref), config.model_dump(), len(examples))
