"""llama.cpp's price of a round: the speed model from ``llama-bench`` timings, the plan, the command, the calibration.

:func:`llama_bench_speed_model` turns the two GGUFs' ``llama-bench -o json`` tests into a
:class:`~specdraft.speed.SpeedModel` (one S, two engines: only the timings differ); :func:`llama_cpp_plan` picks
``--spec-draft-n-max`` at an α and :func:`llama_cpp_command` prints it with every drafting flag pinned;
:func:`rank_llama_cpp` ranks drafts so. :class:`LlamaCppCalibration` corrects llama-bench's price to what
``llama-speculative-simple`` measured (:func:`fit_llama_cpp_calibration`, leave-one-out error), and a calibrated plan
is served only where that error's band lies above 1x. The packaged fit, :data:`LLAMA_CPP_CALIBRATION`, is read from
``llamacpp_calibration.json`` (written by ``bench/llamacpp_check.py --refit``). Why llama-bench alone over-predicts:
docs/architecture.md, "llama_cpp_price".
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.acceptance import expected_tokens_per_pass
from specdraft.speed import SpeedModel


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



#: The packaged calibration's file (``bench/llamacpp_check.py --refit`` writes it from the bench's result file).
PACKAGED_CALIBRATION = Path(__file__).with_name("llamacpp_calibration.json")


def _packaged_calibration() -> LlamaCppCalibration | None:
    if not PACKAGED_CALIBRATION.is_file():
        return None
    return LlamaCppCalibration.from_dict(json.loads(PACKAGED_CALIBRATION.read_text(encoding="utf-8")))


#: The calibration ``rank --engine llama.cpp`` and the main job price llama.cpp plans with (``None``: none packaged).
LLAMA_CPP_CALIBRATION: LlamaCppCalibration | None = _packaged_calibration()
