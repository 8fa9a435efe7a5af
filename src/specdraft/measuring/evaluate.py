"""Measuring a pair: predicted α, measured acceptance and tokens/s, the analytic bound, the best γ.

Contenders (the target alone, speculative decoding, optionally transformers' assisted generation) run prompt by
prompt, interleaved, with the same explicit settings and nothing else; greedy outputs must match the target alone's,
and a divergence beyond the dtype's rounding tolerance fails. Entry points: :func:`run_eval`,
:func:`acceptance_eval`, :func:`interleaved_speed`. Sampled exactness: :mod:`specdraft.measuring.certify`; replay:
:mod:`specdraft.decoding.replay`; costs: :mod:`specdraft.decoding.calibration`; assisted generation: :mod:`specdraft.decoding.assisted`.
Like with like, in full: docs/architecture.md#specdraftmeasuringevaluate.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from specdraft.core.acceptance import AcceptanceCounts, best_gamma, expected_speedup, expected_tokens_per_pass
from specdraft.core.config import EvalConfig, SamplingConfig
from specdraft.core.sampling import output_width
from specdraft.core.stats import paired_ratio_ci, ratio_ci
from specdraft.data.sources import tokenizer_pad_id
from specdraft.decoding.assisted import assisted_generate, hf_generation_config
from specdraft.decoding.calibration import LoadMonitor, calibrate, machine_info
from specdraft.decoding.decode import check_max_new_tokens, speculative_generate, target_generate
from specdraft.decoding.draft_model import apply_draft_options, draft_configuration
from specdraft.decoding.drafters import proposal_mode
from specdraft.decoding.replay import predicted_alpha, replay_answer, replay_mapped
from specdraft.decoding.speed import SpeedModel
from specdraft.decoding.speed_run import Contender, ContenderSpeed, Decoded, Divergence, SpeedRow, SpeedRun
from specdraft.measuring.certify import certify_sampling
from specdraft.models.tokens import left_pad, stop_ids

# Largest top-2 logit margin that a change of pass shape (1 vs γ+1 tokens) can flip by rounding alone
# (derivation: docs/architecture.md#specdraftmeasuringevaluate).
ROUNDING_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}


@torch.no_grad()
def top2_margin(target, context: Sequence[int]) -> float:
    """Target's top-1 minus top-2 logit for the token after ``context`` (one plain forward pass)."""
    device = next(target.parameters()).device
    logits = target(torch.tensor([list(context)], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


#: What the figures of ``report.json`` that could be confused are (written into it as ``definitions``).
REPORT_DEFINITIONS = {
    "summary.cost_ratio_c": "c of the analytic model (analytic_speedup, analytic_recommended_gamma): the mean draft "
    "step of the speculative run over the mean target pass of the target-alone run, both timed while decoding",
    "summary.speed_model.cost_ratio_c": "d / t(1) of the measured speed model (predicted_speedup, recommended_gamma): "
    "one draft step over one one-token target pass, timed apart before decoding at one prompt's context; it "
    "differs from summary.cost_ratio_c by timing noise and context length",
    "summary.headline_measure": "the summary's first figure: alpha, accepted / reached (per reached position), "
    "which does not move with γ or the γ policy; acceptance_rate is per proposed token and does",
    "summary.alpha": "accepted / reached: accepted drafts over the draft positions verification reached (all earlier "
    "drafts accepted), pooled over positions; independent of γ and of the γ policy, the analytic model's α",
    "summary.acceptance_rate": "accepted / proposed: accepted drafts over every draft proposed, including those after "
    "a rejection that were never tested; it falls as γ grows (one draft reads 0.34 at γ 8, 0.64 at γ 2): compare it "
    "only between runs of one γ and γ policy",
    "summary.acceptance_rate_ci95": "95% bootstrap interval over prompts; null with fewer than 2 prompts (one prompt "
    "gives no interval)",
    "summary.draft_head": "the draft's trimmed output head (FR-Spec) that decoded, null for a full head: tokens = N, "
    "the head rows kept, the N most frequent of ranked token ids; source = saved ranking (path: the head_tokens.json "
    "read beside the draft, counted_over: what it counted, as specdraft inspect shows it) or embedded training "
    "prompts; said: the same in words",
    "summary.identity_not_tested": "why lossless (greedy outputs equal to the target's) proves nothing of "
    "verification, or null: the speculative runs proposed no draft, or had none rejected",
}


@dataclass
class EvalResult:
    """Everything ``specdraft eval`` measured (counts first; ratios derived in :meth:`summary`)."""

    config: dict[str, Any]
    spec_counts: AcceptanceCounts
    target_counts: AcceptanceCounts
    target_tokens: int = 0
    spec_tokens: int = 0
    target_seconds: float = 0.0
    spec_seconds: float = 0.0
    hf_tokens: int = 0
    hf_seconds: float = 0.0
    hf_matches: int = 0
    prompts: int = 0
    predicted_prompt: dict[str, Any] = field(default_factory=dict)
    predicted_response: dict[str, Any] = field(default_factory=dict)
    speed_model: dict[str, Any] | None = None
    load: dict[str, Any] | None = None
    certificate: dict[str, Any] | None = None
    divergences: list[Divergence] = field(default_factory=list)
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=machine_info)

    def summary(self) -> dict[str, Any]:
        """Derived figures: tokens/s (tokens per wall-clock second), speed-ups, α, c, analytic bound, best γ.

        ``acceptance_rate_ci95`` / ``alpha_ci95``: ``[low, high]`` 95% bootstrap intervals over prompts
        (:func:`specdraft.core.stats.ratio_ci`, seed 0) from the per-prompt counts; ``None`` without them or with fewer
        than 2 prompts (one prompt gives no interval). ``cost_ratio_c`` is timed while decoding; the speed model's
        own ``cost_ratio_c`` is timed apart (:data:`REPORT_DEFINITIONS`)."""
        c = self.spec_counts
        gamma = self.config["num_speculative_tokens"]
        tps = lambda tok, s: tok / s if s else 0.0
        t_tps, s_tps, h_tps = tps(self.target_tokens, self.target_seconds), tps(self.spec_tokens, self.spec_seconds), \
            tps(self.hf_tokens, self.hf_seconds)
        # c = one draft step / one target pass, the latter from the target-only run (Leviathan et al. §3.4).
        draft_step = c.time_draft / c.draft_calls if c.draft_calls else 0.0
        target_pass = self.target_counts.time_target / self.target_counts.target_calls \
            if self.target_counts.target_calls else 0.0
        cost_ratio = draft_step / target_pass if target_pass else 0.0
        # The analytic model takes α = accepted / reached, not accepted / proposed.
        alpha = c.alpha
        g_best, s_best = best_gamma(alpha, cost_ratio) if cost_ratio else (gamma, 0.0)
        speed = SpeedModel.from_dict(self.speed_model) if self.speed_model else None
        measured = s_tps / t_tps if t_tps else 0.0
        predicted = speed.predict(alpha, gamma, self.spec_tokens, self.prompts) if speed and self.prompts else None
        g_pred, s_pred = speed.best_gamma(alpha) if speed else (None, None)
        bugs = [d for d in self.divergences if not d.is_numerics and d.contender == "specdraft"]
        # The γ-independent measure leads; accepted / proposed follows, named per proposed token (definitions).
        return {
            "prompts": self.prompts,
            "headline_measure": "alpha",
            "alpha": alpha,
            "alpha_ci95": self._ci("accepted", "reached"),
            "acceptance_rate": c.acceptance_rate,
            "acceptance_rate_ci95": self._ci("accepted", "proposed"),
            "mean_accepted_length": c.mean_accepted_length,
            "alpha_per_position": c.alpha_per_position,
            "predicted_alpha_prompt": self.predicted_prompt.get("alpha"),
            "predicted_alpha_response": self.predicted_response.get("alpha"),
            "target_tokens_per_s": t_tps,
            "speculative_tokens_per_s": s_tps,
            "speedup": s_tps / t_tps if t_tps else 0.0,
            "hf_assisted_tokens_per_s": h_tps if self.hf_seconds else None,
            "speedup_vs_hf_assisted": s_tps / h_tps if h_tps else None,
            "hf_assisted_matches_target": f"{self.hf_matches}/{self.prompts}" if self.hf_seconds else None,
            "cost_ratio_c": cost_ratio,
            "draft_step_ms": draft_step * 1e3,
            "target_pass_ms": target_pass * 1e3,
            "analytic_tokens_per_pass": expected_tokens_per_pass(alpha, gamma),
            "analytic_speedup": expected_speedup(alpha, gamma, cost_ratio),
            "share_of_analytic": (s_tps / t_tps) / expected_speedup(alpha, gamma, cost_ratio)
            if t_tps and cost_ratio else None,
            "recommended_gamma": g_pred if g_pred is not None else g_best,
            "predicted_speedup_at_recommended_gamma": s_pred if s_pred is not None else s_best,
            "analytic_recommended_gamma": g_best,
            "analytic_speedup_at_recommended_gamma": s_best,
            # The measured speed model at the measured α, prefill included: comparable with the wall-clock speed-up.
            "predicted_speedup": predicted,
            "prediction_error": predicted / measured - 1 if predicted and measured else None,
            "speed_model": self.speed_model,
            "draft_head": draft_head(self.config.get("draft_options") or {}),
            "divergences": len([d for d in self.divergences if d.contender == "specdraft"]),
            "divergences_beyond_tolerance": len(bugs),
            "lossless": not bugs,
            "identity_not_tested": identity_not_tested(c),
            # Speeds measured on a busy machine are marked, never silently reported as the pair's.
            "sampling_certificate": self.certificate,
            "machine_load": self.load,
            "busy_machine": bool(self.load and self.load.get("busy")),
        }

    def _ci(self, numerator: str, denominator: str) -> list[float] | None:
        rows = self.per_prompt
        # One prompt: every bootstrap replicate is that prompt, a zero-width interval that says nothing: none.
        if len(rows) < 2 or any(numerator not in r or denominator not in r for r in rows):
            return None
        return ratio_ci([r[numerator] for r in rows], [r[denominator] for r in rows]).interval

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "machine": self.machine,
            "summary": self.summary(),
            "speculative_counts": self.spec_counts.to_dict(),
            "target_counts": self.target_counts.to_dict(),
            "predicted_alpha": {"prompt": self.predicted_prompt, "response": self.predicted_response},
            "divergences": [d.to_dict() for d in self.divergences],
            "per_prompt": self.per_prompt,
            "definitions": REPORT_DEFINITIONS,
        }


def draft_head(options: dict[str, Any]) -> dict[str, Any] | None:
    """The trimmed head that decoded, from a run's ``draft_options`` (:func:`specdraft.decoding.draft_model.draft_configuration`):
    :meth:`~specdraft.decoding.draft_model.HeadRanking.to_dict` (N, the ids ranked, the file or the embedded prompts, what was
    counted) plus ``said`` (the same in words); ``None`` for a full head."""
    if not options.get("head_tokens"):
        return None
    ranking = options.get("head_ranking") or {"tokens": options["head_tokens"]}
    return ranking | {"said": options.get("head_tokens_source")}


def identity_not_tested(counts: AcceptanceCounts) -> str | None:
    """Why greedy outputs equal to the target's prove nothing of verification, or ``None`` when the speculative
    runs proposed drafts and the target rejected some: with no proposal the target alone decoded, and with no
    rejection a verifier that accepts everything would give the same outputs."""
    proposed, rejected = sum(counts.proposed), sum(counts.reached) - sum(counts.accepted)
    if proposed == 0:
        return "speculation proposed no draft (the target decoded alone): the identity tests nothing of verification"
    if rejected == 0:
        return (f"none of {proposed} drafts was rejected: a verifier that accepts everything would match as well "
                "(more prompts or tokens, or a draft that differs from the target, test it)")
    return None


def eos_ids(model, tokenizer=None) -> list[int]:
    """The ids that end a row: :func:`specdraft.models.tokens.stop_ids` (the one stop set)."""

    return stop_ids(model, tokenizer)


def _specdraft_settings(config: EvalConfig, eos: list[int]) -> dict[str, Any]:
    """The settings specdraft's target-alone and speculative runs use, in transformers' field names."""
    s = config.sampling
    return {"do_sample": not s.greedy, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
            "max_new_tokens": config.max_new_tokens, "eos_token_id": eos,
            "logits_processors": "none: no repetition penalty, bias, suppressed or forced token"}


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _compare(target, prompt: Sequence[int], base: list[int], out: list[int], prompt_id: str, contender: str,
             tol: float, divergences: list[Divergence]) -> bool:
    """Greedy: does ``out`` equal the target alone (``base``)? A divergence is appended with the target's top-2
    logit margin at the first differing position."""
    pos = _first_difference(base, out)
    if pos is not None and pos < min(len(base), len(out)):
        margin = top2_margin(target, list(prompt) + base[:pos])
        divergences.append(Divergence(prompt_id, contender, pos, base[pos], out[pos], margin, tol))
    return pos is None


def run_eval(
    target,
    draft,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    prompt_names: Sequence[str] | None = None,
    config: EvalConfig | None = None,
    *,
    vocab_mapping=None,
    progress: Callable[[int, int], None] | None = None,
    record: dict[str, Any] | None = None,
    status: Callable[[str], None] | None = None,
) -> EvalResult:
    """Decode each prompt with the target alone, with speculative decoding, and (optionally) with
    transformers' assisted generation, interleaved, batch 1; compare outputs; gather counts and times.

    Args:
        target, draft: loaded causal LMs sharing ``tokenizer`` (checked by the caller), or a draft of another
            tokenizer with ``vocab_mapping``.
        tokenizer: the target's tokenizer.
        prompt_ids: target token ids per prompt (chat template already applied).
        prompt_names: one name per prompt (default its index), in the per-prompt table.
        config: γ, max new tokens, sampling (greedy by default; sampled outputs are not compared token by token —
            they are random; the χ² tests cover the law), seed, the HF comparison, the mapped-proposal mode, the
            draft options (int8 weights, a trimmed head: applied to a copy of ``draft`` that speculative decoding
            and predicted α use; transformers' assisted generation gets ``draft`` as given) and the γ policy. The
            pair's costs are measured once first (:func:`measure_speed_model`, ~10 s on CPU for the default pair).
        vocab_mapping: :class:`~specdraft.models.vocab.VocabMapping` for a draft of another tokenizer (see
            :func:`~specdraft.decoding.decode.speculative_generate`). Predicted α (teacher-forced) needs aligned
            positions and is left out; transformers' assisted generation runs as its universal assisted
            generation (``tokenizer`` + ``assistant_tokenizer``), greedy only, since its sampled variant prunes
            the draft's output head in place.
        progress: called as ``progress(done, total)`` after each prompt.
        record: extra facts stored in the result's ``config`` (e.g. the model references).
        status: told each step before decoding starts (the calibration, its expected length), as ``status(line)``.

    Every contender runs with the same explicit settings, none taken from the models' ``generation_config``
    (see the module docstring); ``result.config["contenders"]`` records each one's effective settings.

    Returns:
        :class:`EvalResult`.
    """
    config = config or EvalConfig()
    check_max_new_tokens(config.max_new_tokens)  # a config changed after construction
    sampling, seed, max_new_tokens = config.sampling, config.seed, config.max_new_tokens
    mapped_proposals, compare_hf = config.mapped_proposals, config.compare_hf
    draft_confidence_threshold = config.draft_confidence_threshold
    names = list(prompt_names or [str(i) for i in range(len(prompt_ids))])
    real_vocab = len(tokenizer)
    pad = tokenizer_pad_id(tokenizer)
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    tol = ROUNDING_TOLERANCE.get(dtype, 0.5)
    gamma = config.num_speculative_tokens
    res = EvalResult(
        config=(record or {}) | config.model_dump(exclude={"dtype"}) | {
            "dtype": str(dtype), "vocab_mapping": vocab_mapping.to_dict() if vocab_mapping is not None else None,
            "mapped_proposals": proposal_mode(mapped_proposals, sampling) if vocab_mapping is not None else None},
        spec_counts=AcceptanceCounts(gamma),
        target_counts=AcceptanceCounts(1),
    )
    spec_draft = apply_draft_options(draft, tokenizer, config, vocab_mapping)
    res.config["draft_options"] = draft_configuration(spec_draft)
    # The pair's costs, measured once on a prompt of median length (the speed model: predicted speed-up, best γ,
    # and the adaptive policy's costs).
    calibrated = calibrate(target, spec_draft, prompt_ids, config, vocab_mapping, say=status)
    if calibrated is not None:
        speed, source = calibrated
        res.speed_model = speed.to_dict() | {"source": source}
        res.config["speed_model_source"] = source
    elif config.gamma_policy == "adaptive":
        raise ValueError("--gamma-policy adaptive measures the pair's costs on a prompt of at least 2 tokens")
    eos = eos_ids(target, tokenizer)
    common_settings = _specdraft_settings(config, eos)
    contenders: dict[str, Any] = {
        "target": common_settings | {"decoder": "specdraft.decoding.decode.target_generate"},
        "specdraft": common_settings | {"decoder": "specdraft.decoding.decode.speculative_generate",
                                        "num_speculative_tokens": gamma,
                                        "draft_confidence_threshold": draft_confidence_threshold,
                                        "mapped_proposals": res.config["mapped_proposals"],
                                        "draft_options": res.config["draft_options"],
                                        "gamma_policy": config.gamma_policy},
    }
    res.config["contenders"] = contenders
    run_hf, hf_tokenizers = compare_hf, {}
    if compare_hf and vocab_mapping is not None:
        if sampling.greedy:
            hf_tokenizers = {"tokenizer": tokenizer, "assistant_tokenizer": vocab_mapping.draft_tokenizer}
        else:
            run_hf = False
            res.config["hf_assisted_skipped"] = ("sampled universal assisted generation prunes the draft's output "
                                                 "head in place; compared for greedy decoding only")
    hf_config = None
    if run_hf:
        hf_config = hf_generation_config(sampling, max_new_tokens, eos, pad, gamma, draft_confidence_threshold)
        contenders["hf_assisted"] = {k: v for k, v in hf_config.to_diff_dict().items() if k != "transformers_version"}
        contenders["hf_assisted"]["decoder"] = "transformers generate(assistant_model=draft)"
        contenders["hf_assisted"]["draft"] = "as loaded (without specdraft's draft options)"
    elif compare_hf:
        contenders["hf_assisted"] = {"skipped": res.config["hf_assisted_skipped"]}
    responses = []
    load = LoadMonitor().__enter__()  # other processes' CPU share over the timed decoding (a busy machine is said)
    for k, ids in enumerate(prompt_ids):
        inp, mask = left_pad([ids], pad, device)
        common = {"sampling": sampling, "max_new_tokens": max_new_tokens, "real_vocab": real_vocab,
                  "eos_token_id": eos}
        base, bc = target_generate(target, inp, mask, generator=torch.Generator(device=device).manual_seed(seed + k),
                                   **common)
        spec, sc = speculative_generate(target, spec_draft, inp, mask, num_speculative_tokens=gamma,
                                        generator=torch.Generator(device=device).manual_seed(seed + k),
                                        draft_confidence_threshold=draft_confidence_threshold,
                                        vocab_mapping=vocab_mapping, mapped_proposals=mapped_proposals,
                                        speed_model=speed if config.gamma_policy == "adaptive" else None, **common)
        res.target_counts = res.target_counts.merge(bc)
        res.spec_counts = res.spec_counts.merge(sc)
        res.target_tokens += len(base[0])
        res.spec_tokens += len(spec[0])
        res.target_seconds += bc.time_total
        res.spec_seconds += sc.time_total
        row = {"id": names[k], "prompt_tokens": len(ids), "target_tokens": len(base[0]),
               "target_s": bc.time_total, "spec_s": sc.time_total,
               # Counts, so intervals and paired gains can be computed over prompts (specdraft.core.stats).
               "accepted": sum(sc.accepted), "proposed": sum(sc.proposed), "reached": sum(sc.reached),
               "acceptance_rate": sc.acceptance_rate, "mean_accepted_length": sc.mean_accepted_length}
        if sampling.greedy:
            row["specdraft_matches"] = _compare(target, ids, base[0], spec[0], names[k], "specdraft", tol,
                                                res.divergences)
        if run_hf:
            t0 = time.perf_counter()
            hf_out = assisted_generate(target, draft, inp, mask, hf_config, tokenizers=hf_tokenizers,
                                       seed=None if sampling.greedy else seed + k)
            hf_s = time.perf_counter() - t0
            res.hf_tokens += len(hf_out)
            res.hf_seconds += hf_s
            if sampling.greedy:
                row["hf_matches"] = _compare(target, ids, base[0], hf_out, names[k], "hf_assisted", tol,
                                             res.divergences)
                res.hf_matches += row["hf_matches"]
            row["hf_s"] = hf_s
        res.per_prompt.append(row)
        responses.append(base[0])
        res.prompts += 1
        if progress:
            progress(k + 1, len(prompt_ids))
    # Predicted α from teacher-forced passes: over the prompts (available before any decoding), and over the
    # target's own responses (the positions speculative decoding actually drafts).
    load.__exit__(None, None, None)
    res.load = load.to_dict()
    if config.certify and not sampling.greedy and prompt_ids:
        res.certificate = certify_sampling(target, spec_draft, prompt_ids[0], sampling, config.certify, gamma,
                                           real_vocab=real_vocab, pad_id=pad, seed=seed, vocab_mapping=vocab_mapping)
    if vocab_mapping is not None:  # teacher-forced α needs one position grid for both models
        return res
    res.predicted_prompt = predicted_alpha(target, spec_draft, prompt_ids, sampling=sampling, real_vocab=real_vocab,
                                           pad_id=pad)
    seqs = [list(p) + r for p, r in zip(prompt_ids, responses) if r]
    # Position j predicts token j+1: response tokens are predicted from positions P−1..P+R−2; the last
    # position has no successor in the sequence.
    masks = [[0] * (len(p) - 1) + [1] * len(r) + [0] for p, r in zip(prompt_ids, responses) if r]
    if seqs:
        res.predicted_response = predicted_alpha(target, spec_draft, seqs, masks, sampling=sampling,
                                                 real_vocab=real_vocab, pad_id=pad)
    return res


@dataclass
class AcceptanceEval:
    """What :func:`acceptance_eval` measured on one set of prompts; :meth:`to_dict` is what the pipeline writes.

    Intervals are bootstrap intervals over prompts (95%, ``None`` without prompts); seconds are wall clock.
    """

    method: str  # "decoded" (the answers were decoded here) or "replayed" (given answers, counts replayed)
    prompts: int
    rows: list[dict[str, Any]]  # per prompt: id, accepted, proposed, reached, answer_tokens (+ matched,
    # match_positions, alpha_sum, positions where replayed)
    answers: list[list[int]]  # the target's greedy answers, token ids
    counts: dict[str, Any]  # the merged AcceptanceCounts (to_dict)
    acceptance_rate: float
    acceptance_rate_ci95: tuple[float, float] | None
    alpha: float
    alpha_ci95: tuple[float, float] | None
    match_rate: float | None  # matched proposals / answer token, the same at any γ; None for decoded-only counts
    match_rate_ci95: tuple[float, float] | None
    drafted: int  # tokens proposed
    mean_accepted_length: float
    alpha_per_position: list[float]
    alpha_sampled: float | None  # teacher-forced Σ min(p̃, q̃) under the serving filter; None for a decoded-only draft
    alpha_sampled_ci95: tuple[float, float] | None
    serving: dict[str, Any]  # the serving filter (SamplingConfig.model_dump)
    replay_check: str | None  # "<prompts where replayed == decoded>/<prompts>", or None
    decoded_acceptance_rate: float | None
    decoder_label: str | None  # what decoded the answers, in a report's words
    decode_seconds: float | None
    decoded_tokens: int | None
    seconds: float
    # The regime the counts belong to (accepted / proposed moves with each: compare only counts of one regime).
    gamma: int  # γ of every round (replay and the decoding here both run fixed γ)
    gamma_policy: str  # "fixed": the counts never follow an adaptive γ, whatever the config's policy
    proposals: str | None  # a draft of another tokenizer: "text" or "tokens" (drafters.proposal_mode); else None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def acceptance_eval(
    target,
    draft,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    prompt_names: Sequence[str],
    config: EvalConfig,
    serving: SamplingConfig,
    *,
    answers: Sequence[Sequence[int]] | None = None,
    vocab_mapping=None,
    progress: Callable[[int, int], None] | None = None,
    target_cache: str | Path | None = None,
) -> AcceptanceEval:
    """Greedy acceptance of ``draft`` on held-out prompts, per prompt, plus the teacher-forced α at the serving
    settings: the measure :func:`specdraft.run.pipeline.run_pipeline` compares before and after distillation.

    Without ``answers`` every prompt is decoded by greedy speculative decoding (batch 1; its output is the
    target's greedy answer); the counts are then replayed (:func:`~specdraft.decoding.replay.replay_answer`) on those
    answers, the number of prompts where replayed and decoded counts agree is reported (``replay_check``, and the
    decoded rate as ``decoded_acceptance_rate``), and the rows hold the replayed counts, so that every draft
    compared on these answers is counted by one method (a draft of another tokenizer decoded here keeps its decoded
    rows). With
    ``answers`` (the target's answers from an earlier call) nothing is decoded: the counts are replayed, so a
    second draft is compared on the very same target answers (a paired comparison) in one draft pass per
    prompt — or, for a draft of another tokenizer (``vocab_mapping``), by its drafter's rounds along each answer
    (:func:`~specdraft.decoding.replay.replay_mapped`: no target pass, no sampled α).

    Sampled acceptance: ``alpha_sampled`` is Σ min(p̃, q̃) under ``serving`` (the serving temperature / top-k /
    top-p), teacher-forced over the target's answers — the per-token acceptance probability of speculative
    sampling at those contexts (Leviathan et al. 2023, §3.1), not a decoded count.

    Args:
        target, draft: causal LMs sharing ``tokenizer`` (or a draft of another tokenizer with ``vocab_mapping``:
            no teacher-forced α, which needs one position grid).
        prompt_ids / prompt_names: the prompts (chat template applied) and their ids.
        config: γ and max new tokens (greedy; its ``sampling`` must be greedy).
        serving: the filter of the sampled α.
        target_cache: where the target's teacher-forced logits over the answers are kept and reused
            (:func:`~specdraft.decoding.replay.predicted_alpha`): every draft replayed on the same answers shares one
            target pass.

    Returns:
        an :class:`AcceptanceEval` (rows per prompt with counts, the answers, rates with intervals, the sampled α,
        and the regime the counts belong to: γ, the fixed policy, a mapped draft's proposal mode).

    Raises:
        ValueError: a sampled ``config``; ``config.max_new_tokens`` < 1 (:class:`specdraft.decoding.decode.DecodeError`).
    """
    if not config.sampling.greedy:
        raise ValueError("acceptance_eval measures greedy acceptance; the sampled figure is alpha_sampled")
    check_max_new_tokens(config.max_new_tokens)
    t0 = time.perf_counter()
    gamma, max_new = config.num_speculative_tokens, config.max_new_tokens
    eos = eos_ids(target, tokenizer)
    pad = tokenizer_pad_id(tokenizer)
    real_vocab = len(tokenizer)
    device = next(target.parameters()).device
    decoded: list[AcceptanceCounts] | None = None
    decode_seconds = 0.0
    if answers is None:
        answers, decoded = [], []
        for k, ids in enumerate(prompt_ids):
            inp, mask = left_pad([ids], pad, device)
            out, c = speculative_generate(target, draft, inp, mask, num_speculative_tokens=gamma,
                                          max_new_tokens=max_new, eos_token_id=eos, real_vocab=real_vocab,
                                          vocab_mapping=vocab_mapping, mapped_proposals=config.mapped_proposals)
            answers.append(out[0])
            decoded.append(c)
            decode_seconds += c.time_total
            if progress:
                progress(k + 1, len(prompt_ids))
    answers = [list(a) for a in answers]
    sampled, replayed = None, None
    if vocab_mapping is None:
        # One teacher-forced pass of each model gives the sampled α and the draft's argmax; greedy rounds replayed.
        seqs = [list(p) + a for p, a in zip(prompt_ids, answers)]
        masks = [[0] * (len(p) - 1) + [1] * len(a) + [0] for p, a in zip(prompt_ids, answers)]
        sampled = predicted_alpha(target, draft, seqs, masks, sampling=serving, real_vocab=real_vocab, pad_id=pad,
                                  target_cache=target_cache)
        replayed = [replay_answer(top1, y, gamma, max_new, set(eos))
                    for top1, y in zip(sampled["draft_top1"], answers, strict=True)]
        if progress and decoded is None:
            progress(len(prompt_ids), len(prompt_ids))
    elif decoded is None:
        # A draft of another tokenizer has no argmax over the target's tokens: its drafter runs round by round.
        replayed = replay_mapped(draft, vocab_mapping, prompt_ids, answers, gamma, max_new, set(eos),
                                 output_width(target), real_vocab, config.mapped_proposals, progress=progress)
    # Replayed counts whenever the draft can be replayed, so a gain between two drafts compares one method.
    counts_per_prompt = replayed if replayed is not None else decoded
    keys = ("proposed", "reached", "accepted", "accepted_hist")
    check, decoded_rate = None, None
    if decoded is not None:
        merged = AcceptanceCounts(gamma)
        for c in decoded:
            merged = merged.merge(c)
        decoded_rate = merged.acceptance_rate
    if decoded is not None and replayed is not None:
        same = sum(all(getattr(d, k) == getattr(r, k) for k in keys) for d, r in zip(decoded, replayed))
        check = f"{same}/{len(decoded)}"
    rows = []
    for k, c in enumerate(counts_per_prompt):
        row = {"id": prompt_names[k], "accepted": sum(c.accepted), "proposed": sum(c.proposed),
               "reached": sum(c.reached), "answer_tokens": len(answers[k])}
        if c.match_positions:
            row["matched"], row["match_positions"] = c.matched, c.match_positions
        if sampled is not None:
            row["alpha_sum"], row["positions"] = sampled["per_sequence"][k]
        rows.append(row)
    total = AcceptanceCounts(gamma)
    for c in counts_per_prompt:
        total = total.merge(c)
    ci = lambda num, den: ratio_ci([r[num] for r in rows], [r[den] for r in rows]).interval if rows else None
    return AcceptanceEval(
        method="decoded" if decoded is not None else "replayed", prompts=len(rows), rows=rows,
        answers=answers, counts=total.to_dict(), acceptance_rate=total.acceptance_rate,
        acceptance_rate_ci95=ci("accepted", "proposed"), alpha=total.alpha, alpha_ci95=ci("accepted", "reached"),
        match_rate=total.match_rate,
        match_rate_ci95=ci("matched", "match_positions") if total.match_positions else None,
        drafted=sum(total.proposed), mean_accepted_length=total.mean_accepted_length,
        alpha_per_position=total.alpha_per_position,
        alpha_sampled=sampled["alpha"] if sampled else None,
        alpha_sampled_ci95=ci("alpha_sum", "positions") if sampled else None,
        serving=serving.model_dump(), replay_check=check, decoded_acceptance_rate=decoded_rate,
        decoder_label=f"the draft as given, fixed γ {gamma}" if decoded is not None else None,
        decode_seconds=decode_seconds if decoded is not None else None,
        decoded_tokens=sum(len(a) for a in answers) if decoded is not None else None,
        seconds=time.perf_counter() - t0, gamma=gamma, gamma_policy="fixed",
        proposals=proposal_mode(config.mapped_proposals, config.sampling) if vocab_mapping is not None else None,
    )


class _Contending:
    """One contender of :func:`interleaved_speed` bound to its models and the run's settings: :meth:`run` decodes one
    prompt (batch 1, left-padded) and times it."""

    def __init__(self, contender: Contender, target, tokenizer, config: EvalConfig, eos: list[int]):
        self.contender, self.target, self.tokenizer, self.config, self.eos = contender, target, tokenizer, config, eos
        self.device = next(target.parameters()).device
        self.pad, self.real_vocab = tokenizer_pad_id(tokenizer), len(tokenizer)  # once: not inside the timing

    def run(self, ids: list[int], k: int, n_new: int) -> Decoded:
        """``n_new`` new tokens after prompt ``ids`` (the ``k``-th prompt: its seed is ``config.seed + k``)."""
        t0 = time.perf_counter()
        inp, mask = left_pad([ids], self.pad, self.device)
        tokens = self._decode(inp, mask, k, n_new)
        return Decoded(tokens, time.perf_counter() - t0)

    def _common(self, k: int, n_new: int) -> dict[str, Any]:
        return {"sampling": self.config.sampling, "max_new_tokens": n_new, "real_vocab": self.real_vocab,
                "eos_token_id": self.eos,
                "generator": torch.Generator(device=self.device).manual_seed(self.config.seed + k)}

    def _decode(self, inp: torch.Tensor, mask: torch.Tensor, k: int, n_new: int) -> list[int]:
        raise NotImplementedError


class _TargetAlone(_Contending):
    def _decode(self, inp, mask, k, n_new):
        return target_generate(self.target, inp, mask, **self._common(k, n_new))[0][0]


class _Speculative(_Contending):
    """specdraft's speculative decoding with a prepared draft, its vocabulary mapping and (adaptive γ) speed model."""

    def __init__(self, contender, target, tokenizer, config, eos, draft, mapping, speed: SpeedModel | None):
        super().__init__(contender, target, tokenizer, config, eos)
        self.draft, self.mapping, self.speed = draft, mapping, speed

    def _decode(self, inp, mask, k, n_new):
        c = self.config
        return speculative_generate(self.target, self.draft, inp, mask, num_speculative_tokens=c.num_speculative_tokens,
                                    draft_confidence_threshold=c.draft_confidence_threshold,
                                    vocab_mapping=self.mapping, mapped_proposals=c.mapped_proposals,
                                    speed_model=self.speed, **self._common(k, n_new))[0][0]


class _Assisted(_Contending):
    """transformers' assisted generation with a draft as given, under one complete generation config."""

    def __init__(self, contender, target, tokenizer, config, eos, draft, mapping, hf_config):
        super().__init__(contender, target, tokenizer, config, eos)
        self.draft, self.hf_config = draft, hf_config
        self.tokenizers = {"tokenizer": tokenizer, "assistant_tokenizer": mapping.draft_tokenizer} if mapping else {}

    def _decode(self, inp, mask, k, n_new):
        gc = self.hf_config if n_new == self.config.max_new_tokens else copy.deepcopy(self.hf_config)
        gc.max_new_tokens = n_new
        return assisted_generate(self.target, self.draft, inp, mask, gc, tokenizers=self.tokenizers,
                                 seed=None if self.config.sampling.greedy else self.config.seed + k)


def interleaved_speed(
    target,
    drafts: dict[str, Any],
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    prompt_names: Sequence[str],
    config: EvalConfig,
    *,
    hf_draft: str | None = None,
    vocab_mappings: dict[str, Any] | None = None,
    warmup_tokens: int = 8,
) -> SpeedRun:
    """Tokens/s of the target alone, of speculative decoding with each draft and (``hf_draft``: the name of one
    of ``drafts``) of transformers' assisted generation, in one run: after a warm-up (every contender decodes
    ``warmup_tokens`` of the first prompt, untimed), prompt by prompt with the contenders in a rotating order,
    so machine noise and warm caches hit all alike.

    Greedy outputs are compared with the target alone's (a divergence beyond the dtype's rounding tolerance is a
    bug: ``lossless`` False). Speed-ups are ratios of tokens/s on the same prompts with a paired bootstrap
    interval (:func:`specdraft.core.stats.paired_ratio_ci`).

    Returns:
        a :class:`~specdraft.decoding.speed_run.SpeedRun`; contender names: ``target``, ``speculative:<draft>``,
        ``hf_assisted:<draft>``.
    """

    check_max_new_tokens(config.max_new_tokens)
    sampling, gamma, max_new = config.sampling, config.num_speculative_tokens, config.max_new_tokens
    vocab_mappings = vocab_mappings or {}
    eos = eos_ids(target, tokenizer)
    pad = tokenizer_pad_id(tokenizer)
    tol = ROUNDING_TOLERANCE.get(next(target.parameters()).dtype, 0.5)
    # specdraft's contenders decode with the configuration's draft preparation and γ policy (transformers' assisted
    # generation gets each draft as given); the speed model of each prepared draft comes from the calibration cache.
    prepared = {n: apply_draft_options(m, tokenizer, config, vocab_mappings.get(n)) for n, m in drafts.items()}
    speeds: dict[str, SpeedModel] = {}
    speed_sources: dict[str, str] = {}
    if config.gamma_policy == "adaptive" and prompt_ids:
        for n, m in prepared.items():
            calibrated = calibrate(target, m, prompt_ids, config, vocab_mappings.get(n))
            if calibrated is not None:
                speeds[n], speed_sources[n] = calibrated

    shared = (target, tokenizer, config, eos)
    order: list[_Contending] = [_TargetAlone(Contender("target"), *shared)] + [
        _Speculative(Contender("speculative", d), *shared, prepared[d], vocab_mappings.get(d), speeds.get(d))
        for d in drafts]
    if hf_draft:
        hf_config = hf_generation_config(sampling, max_new, eos, pad, gamma, config.draft_confidence_threshold)
        order.append(_Assisted(Contender("hf_assisted", hf_draft), *shared, drafts[hf_draft],
                               vocab_mappings.get(hf_draft), hf_config))
    names = [c.contender.name for c in order]
    if prompt_ids:
        for who in order:  # warm-up: first calls pay for allocation and kernel selection
            who.run(list(prompt_ids[0]), 0, warmup_tokens)
    rows: list[SpeedRow] = []
    divergences: list[Divergence] = []
    load = LoadMonitor().__enter__()
    for k, ids in enumerate(prompt_ids):
        row = SpeedRow(prompt_names[k], {})
        outputs: dict[str, Decoded] = {}
        for who in order[k % len(order):] + order[: k % len(order)]:
            outputs[who.contender.name] = out = who.run(list(ids), k, max_new)
            row.timings[who.contender.name] = (len(out.tokens), out.seconds)
        if sampling.greedy:
            for name in names[1:]:
                row.matches[name] = _compare(target, ids, outputs["target"].tokens, outputs[name].tokens,
                                             prompt_names[k], name, tol, divergences)
        rows.append(row)
    load.__exit__(None, None, None)
    contenders = {}
    for name in names:
        tok, sec = [r.timings[name][0] for r in rows], [r.timings[name][1] for r in rows]
        c = ContenderSpeed(tokens=sum(tok), seconds=sum(sec), tokens_per_s=sum(tok) / sum(sec) if sum(sec) else 0.0,
                           tokens_per_s_ci95=ratio_ci(tok, sec).interval if rows else None)
        if name != "target" and rows:
            base_tok, base_sec = [r.timings["target"][0] for r in rows], [r.timings["target"][1] for r in rows]
            sp = paired_ratio_ci(tok, sec, base_tok, base_sec)
            c.speedup, c.speedup_ci95 = sp.value, sp.interval
            if sampling.greedy:
                c.matches_target = f"{sum(r.matches[name] for r in rows)}/{len(rows)}"
        contenders[name] = c
    bugs = [d for d in divergences if not d.is_numerics and Contender.from_name(d.contender).kind != "hf_assisted"]
    return SpeedRun(prompts=len(rows), contenders=contenders, rows=rows, warmup_tokens=warmup_tokens,
                    divergences=divergences, lossless=not bugs, max_new_tokens=max_new, num_speculative_tokens=gamma,
                    gamma_policy=config.gamma_policy, machine_load=load.to_dict(), busy_machine=load.busy,
                    draft_configuration={n: draft_configuration(m) for n, m in prepared.items()},
                    speed_models={n: sp.to_dict() | {"source": speed_sources[n]} for n, sp in speeds.items()})
