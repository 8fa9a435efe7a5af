"""llama.cpp's price of a round: the speed model from ``llama-bench`` timings, the plan, the command, the calibration.

:func:`llama_bench_speed_model` turns the two GGUFs' ``llama-bench -o json`` tests into a
:class:`~specdraft.decoding.speed.SpeedModel` (one S, two engines: only the timings differ); :func:`llama_cpp_plan` picks
``--spec-draft-n-max`` at an α and :func:`llama_cpp_command` prints it with every drafting flag pinned;
:func:`rank_llama_cpp` ranks drafts so. :class:`LlamaCppCalibration` corrects llama-bench's price to what
``llama-speculative-simple`` measured; a calibrated plan is served only where its error band lies above 1x. The
packaged fit is :data:`LLAMA_CPP_CALIBRATION`. Model and evidence: docs/architecture.md#specdraftdecodingllama_cpp_price.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.core.acceptance import expected_tokens_per_pass
from specdraft.core.embedded import LLAMA_CPP_PACKAGE, LLAMA_CPP_VERSION
from specdraft.decoding.speed import SpeedModel


def llama_bench_speed_model(target_bench: list[dict], draft_bench: list[dict]) -> SpeedModel:
    """A :class:`SpeedModel` from ``llama-bench -o json`` tests: t(1) and d from the ``tg`` tests, t(k ≥ 2) from the
    target's ``pp`` tests of k tokens (``avg_ts`` tokens/s).

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


#: What a llama.cpp forecast assumes of every round: the draft proposes its full n_max, as specdraft's fixed-γ
#: rounds that measured α; every command pins both, for builds change their defaults.
LLAMA_CPP_N_MIN = 0
LLAMA_CPP_P_MIN = 0.0


def llama_cpp_engine() -> str:
    """The pinned llama.cpp build the forecasts and commands are for."""

    return f"llama.cpp ({LLAMA_CPP_PACKAGE} {LLAMA_CPP_VERSION})"


def llama_cpp_draft_args(n_max: int, n_min: int = LLAMA_CPP_N_MIN, p_min: float = LLAMA_CPP_P_MIN) -> list[str]:
    """llama.cpp's drafting flags, each pinned: the one source for the commands measured and printed."""
    return ["--spec-draft-n-max", str(n_max), "--spec-draft-n-min", str(n_min), "--spec-draft-p-min", str(p_min)]


@dataclass
class LlamaCppPlan:
    """What llama.cpp should draft at one acceptance α (:func:`llama_cpp_plan`).

    Attributes:
        n_max: ``--spec-draft-n-max`` to serve (0: the target alone); calibrated, ``best_n`` only when its whole
            error band lies above 1. ``predicted_speedup``: the forecast at ``best_n``, tokens/s × llama.cpp's target
            alone; ``by_n``: n → forecast. ``band``: ``(low, high)``, None uncalibrated; ``raw_speedup``:
            llama-bench's own S(α, best_n); ``note``: why ``n_max`` is what it is.
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
    """What llama.cpp should draft at ``alpha`` (accepted / reached, as ``specdraft eval`` measures it), n up to
    ``max_n`` (at most ``speed.max_gamma``). Without a ``calibration`` that applies to ``conditions``: llama-bench's
    pricing alone; with one: only its ``n_range``, served when the band lies above 1. Rules:
    docs/architecture.md#specdraftdecodingllama_cpp_price.
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
    """The llama.cpp command serving ``target_gguf`` with ``draft_gguf`` as ``-md`` draft, drafting flags pinned
    (``n_max`` 0: the target alone), ending in a comment naming the build. ``--spec-type draft-simple`` is needed:
    llama.cpp's common/arg.cpp infers a type from the ``-md`` GGUF only for MTP / DFlash heads."""
    exe = "llama-server" if server else "llama-speculative-simple"
    build = f" # for {engine or llama_cpp_engine()}"
    if n_max == 0:
        return f"{'llama-server' if server else 'llama-completion'} -m {target_gguf} -t {threads}{build}"
    return (f"{exe} -m {target_gguf} --spec-type draft-simple -md {draft_gguf} "
            f"{' '.join(llama_cpp_draft_args(n_max, n_min, p_min))} -t {threads} -td {threads}{build}")


@dataclass
class LlamaCppForecast:
    """One draft of :func:`rank_llama_cpp`: its α, :class:`LlamaCppPlan`'s fields, d and t(1) in ms, c = d / t(1),
    the :class:`SpeedModel`, and the calibration that priced it (None: llama-bench's alone; not in :meth:`to_dict`).
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
    """Drafts (``alphas``: name → α, accepted / reached) ranked by llama.cpp's predicted speed-up, best first:
    each one's :func:`llama_bench_speed_model`, then :func:`llama_cpp_plan` (``specdraft rank --engine llama.cpp``).

    Raises:
        ValueError: a draft without results in ``draft_benches``; results without the tests
            :func:`llama_bench_speed_model` needs.
    """
    missing = [name for name in alphas if name not in draft_benches]
    if missing:
        raise ValueError(f"no llama-bench results for draft {', '.join(missing)}")
    applied = None if calibration is None or conditions is not None and calibration.applies_to(conditions) \
        else calibration
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
    """α from llama.cpp's accepted / drafted ``rate`` at ``n`` drafts: the root of (α + … + αⁿ) / n = rate.

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
    """One llama.cpp decode of one prompt as llama.cpp reported it (``draft`` None: the target alone):
    tokens decoded, decode seconds (prompt excluded), ``n_drafted`` / ``n_accept``."""

    config: str
    draft: str | None
    n_max: int
    tokens: int
    seconds: float
    drafted: int = 0
    accepted: int = 0

    @property
    def rounds(self) -> int:
        """Target verifications (each round emits its accepted drafts plus one)."""
        return self.tokens - self.accepted


@dataclass
class LlamaCppCalibration:
    """llama.cpp's round cost beyond llama-bench's pricing, fitted to measured runs:
    round(n) = overhead · t(1) + round_factor · (n·d + t(n+1)); the target alone costs plain_factor · t(1) per token.

    ``n_range``: the n_max measured (the plans it backs); ``loo_errors``: configuration → leave-one-out
    predicted / measured speed-up − 1; ``provenance``: what it was fitted to. Derivation:
    docs/architecture.md#specdraftdecodingllama_cpp_price.
    """

    overhead: float
    round_factor: float
    plain_factor: float
    n_range: tuple[int, int]
    loo_errors: dict[str, float]
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def error(self) -> float:
        """The largest |leave-one-out error| (the half-width of :meth:`band`)."""
        return max(abs(e) for e in self.loo_errors.values())

    def round_seconds(self, speed: SpeedModel, n: int) -> float:
        """One round of ``n`` ≥ 1 drafts as llama-speculative-simple runs it, seconds."""
        return self.overhead * speed.target_s[0] + self.round_factor * speed.round_seconds(n)

    def speedup(self, speed: SpeedModel, alpha: float, n: int) -> float:
        """S(α, n) = E(α, n) · plain_factor · t(1) / round(n), × llama.cpp's target alone (n = 0: 1).

        Raises:
            ValueError: a round priced at no time (timings far from those fitted).
        """
        if n == 0:
            return 1.0
        seconds = self.round_seconds(speed, n)
        if seconds <= 0:
            raise ValueError(f"the calibration prices a round of {n} drafts at {seconds * 1e3:.1f} ms: these timings "
                             "are far from those it was fitted to; refit it on this pair (bench/llamacpp_check.py)")
        return expected_tokens_per_pass(alpha, n) * self.plain_factor * speed.target_s[0] / seconds

    def describe(self) -> str:
        """What it was fitted to and how well it held, in one sentence."""
        lo, hi = self.n_range
        return (f"{self.provenance.get('said') or 'fitted to unrecorded runs'}; leave-one-out error ±{self.error:.1%} "
                f"over {len(self.loo_errors)} configurations; it backs n_max {lo}–{hi}")

    def band(self, speedup: float) -> tuple[float, float]:
        """The measured speed-up a forecast of ``speedup`` backs: ``(speedup / (1 + error), speedup / (1 − error))``."""
        return speedup / (1 + self.error), speedup / (1 - self.error) if self.error < 1 else float("inf")

    def applies_to(self, conditions: Mapping[str, Any]) -> str | None:
        """``None`` when ``conditions`` (:func:`llama_cpp_conditions`: machine, threads, backend, target_gguf,
        llama.cpp) match the provenance, else why not in words; a condition unknown on either side is not compared.
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
    """What llama-bench rows were taken under (threads, backend, target_gguf, machine), for
    :meth:`LlamaCppCalibration.applies_to`; values the rows disagree on are kept as a list, matching nothing."""
    def one(key: str) -> Any:
        seen = list(dict.fromkeys(r[key] for r in target_bench if r.get(key) not in (None, "")))
        return seen[0] if len(seen) == 1 else ", ".join(map(str, seen)) if seen else None

    gguf = target_gguf if target_gguf is not None else one("model_filename")
    out = {"threads": one("n_threads") if one("n_threads") is not None else threads, "backend": one("backends"),
           "target_gguf": None if gguf is None else Path(str(gguf)).name, "machine": machine}
    return {k: v for k, v in out.items() if v is not None}


def _fit_round(runs: list[EngineRun], speeds: Mapping[str, SpeedModel]) -> tuple[float, float]:
    """``(overhead, round_factor)`` by least squares on each run's seconds, weighted by 1 / seconds."""
    sxx = sxy = syy = bx = by = 0.0
    for r in runs:
        sp = speeds[r.draft]  # type: ignore[index]
        priced = r.drafted * sp.draft_s + r.rounds * sp.target_s[0] + r.drafted * (sp.target_s[1] - sp.target_s[0])
        x, y = r.rounds * sp.target_s[0] / r.seconds, priced / r.seconds
        sxx, sxy, syy, bx, by = sxx + x * x, sxy + x * y, syy + y * y, bx + x, by + y
    det = sxx * syy - sxy * sxy
    if det <= 1e-12 * sxx * syy:
        raise ValueError("the runs cannot tell a per-round cost from a factor on the priced round (their rounds are "
                         "priced alike): measure at least two --spec-draft-n-max values (bench/llamacpp_check.py "
                         "--embedded --n-max 3,8)")
    return (bx * syy - by * sxy) / det, (by * sxx - bx * sxy) / det


def _measured_speedup(runs: list[EngineRun], plain: list[EngineRun]) -> float:
    """Σ tokens / Σ seconds of ``runs`` over the target alone's."""
    return (sum(r.tokens for r in runs) / sum(r.seconds for r in runs)) / (
        sum(r.tokens for r in plain) / sum(r.seconds for r in plain))


def fit_llama_cpp_calibration(runs: list[EngineRun], target_bench: list[dict], draft_benches: Mapping[str, list[dict]],
                              provenance: Mapping[str, Any] | None = None) -> LlamaCppCalibration:
    """Fit :class:`LlamaCppCalibration` to ``runs`` (the target alone's and the speculative ones, per prompt) with
    its leave-one-out error per configuration.

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



#: The packaged calibration's file (written by ``bench/llamacpp_check.py --refit``).
PACKAGED_CALIBRATION = Path(__file__).with_name("llamacpp_calibration.json")


def _packaged_calibration() -> LlamaCppCalibration | None:
    if not PACKAGED_CALIBRATION.is_file():
        return None
    return LlamaCppCalibration.from_dict(json.loads(PACKAGED_CALIBRATION.read_text(encoding="utf-8")))


#: The calibration ``rank --engine llama.cpp`` and the main job price llama.cpp plans with (``None``: none packaged).
LLAMA_CPP_CALIBRATION: LlamaCppCalibration | None = _packaged_calibration()
