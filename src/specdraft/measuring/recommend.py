"""What to ship where: one recommendation per engine from a finished run, and the verdict on distillation.

:func:`engine_choices` names per engine the draft to serve (as given, distilled, or none), its measured speed-up
with interval, what was timed and the command — fastest first; a draft is never recommended over a faster one the
run holds. :func:`distillation_verdict` compares the distilled draft with the draft as given (paired).
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from specdraft.core.io import atomic_write_text
from specdraft.core.stats import Estimate, paired_gain_from_rows, paired_ratio_ci
from specdraft.decoding.speed_run import Contender, SpeedRun, SpeedStage
from specdraft.serving.export import VLLM_SERVER

ORIGINAL, DISTILLED = "original", "distilled"

#: Engines in the order a tie keeps them.
ENGINES = ("specdraft", "transformers", "vllm", "llama.cpp")
ENGINE_LABELS = {"specdraft": "specdraft's decoder", "transformers": "transformers (assisted generation)",
                 "vllm": "vLLM", "llama.cpp": "llama.cpp"}


@dataclass
class EngineChoice:
    """One engine's recommendation: the ``draft`` in words and ``which`` (``"original"``, ``"distilled"``,
    None for the target alone), ``speedup`` (tokens/s × the target alone, or a forecast) with ``speedup_ci95``, the
    served draft's held-out α, the ``basis`` of the figure, the ``command``, the draft's ``path`` and the ``others``.
    """

    engine: str
    draft: str
    which: str | None
    speedup: float | None
    speedup_ci95: list[float] | None
    alpha: float | None
    basis: str
    command: str
    path: str | None = None
    others: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return ENGINE_LABELS[self.engine]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"label": self.label}


def vllm_server() -> str:
    """vLLM's server as specdraft's printed commands start it (:data:`specdraft.serving.export.VLLM_SERVER`)."""

    return VLLM_SERVER


def pick_fastest(speedups: dict[str, float | None]) -> str | None:
    """The draft with the highest measured speed-up above 1, else None (the target alone); ties keep the
    first."""
    measured = {k: v for k, v in speedups.items() if v is not None}
    if not measured:
        return None
    best = max(measured, key=lambda k: measured[k])  # max keeps the first of equal values
    return best if measured[best] > 1.0 else None


def paired_speed_ratio(run: SpeedRun, a: str, b: str) -> Estimate | None:
    """Tokens/s of contender ``a`` over ``b``, paired over shared prompts
    (:func:`specdraft.core.stats.paired_ratio_ci`); None when they share none."""
    rows = [r.timings for r in run.rows if a in r.timings and b in r.timings]
    if not rows:
        return None
    return paired_ratio_ci([t[a][0] for t in rows], [t[a][1] for t in rows], [t[b][0] for t in rows],
                           [t[b][1] for t in rows])


def _speed(report: dict[str, Any]) -> SpeedRun | None:
    sp = report.get("speed")
    return SpeedStage.from_dict(sp).held_out if sp else None


def _mapped(report: dict[str, Any]) -> bool:
    return (report.get("check") or {}).get("verdict") == "mismatch"


def _alpha(report: dict[str, Any], which: str | None, name: str = "held_out") -> float | None:
    side = {ORIGINAL: report.get("eval_before"), DISTILLED: report.get("eval_after")}.get(which or "")
    return ((side or {}).get("sets") or {}).get(name, {}).get("alpha")


def _cfg(report: dict[str, Any]) -> dict[str, Any]:
    """The run's configuration, with words for a report that lacks one."""
    return {"target": "the target", "draft": "the draft"} | (report.get("config") or {})


def draft_names(report: dict[str, Any]) -> dict[str, str]:
    """``{"original": …, "distilled": …}``: the run's two drafts in words."""
    draft = _cfg(report)["draft"]
    return {ORIGINAL: f"{draft} as given",
            DISTILLED: f"{draft} re-indexed + distilled" if _mapped(report) else f"{draft} distilled"}


def _decoder_command(report: dict[str, Any], which: str, path: str) -> str:
    """``specdraft generate`` with the speed stage's decoding settings (what was timed)."""
    cfg = _cfg(report)
    ev = cfg.get("eval") or {}
    flags = [f"--target {shlex.quote(cfg['target'])}", f"--draft {shlex.quote(path)}"]
    if which == ORIGINAL and _mapped(report):
        flags.append("--map-vocab")
    for key, flag in (("num_speculative_tokens", "--gamma"), ("gamma_policy", "--gamma-policy"),
                      ("draft_quantization", "--draft-quantization"), ("draft_head_tokens", "--draft-head-tokens")):
        if ev.get(key) is not None:
            flags.append(f"{flag} {ev[key]}")
    return f"specdraft generate {' '.join(flags)} PROMPT"


def _paths(report: dict[str, Any]) -> dict[str, str]:
    """Where each draft lives: the draft as given where the user has it, the distilled one as exported."""
    exp = report.get("export") or {}
    given = (exp.get("as_given") or {}).get("path") or _cfg(report)["draft"]
    return {ORIGINAL: given, DISTILLED: exp.get("path") or (report.get("distill") or {}).get("speculator", "?")}


def _vllm_commands(report: dict[str, Any]) -> dict[str, str]:
    exp = report.get("export") or {}
    out = {DISTILLED: exp.get("vllm_command")}
    if exp.get("as_given"):
        out[ORIGINAL] = exp["as_given"].get("vllm_command")
    return {k: v for k, v in out.items() if v}


def _configuration(run: SpeedRun, which: str) -> str:
    conf = (run.draft_configuration or {}).get(which) or {}
    return conf.get("label") or "as loaded"


def engine_choices(report: dict[str, Any]) -> list[EngineChoice]:
    """One :class:`EngineChoice` per engine the run can speak for, fastest first (the target alone = 1x);
    empty when nothing was timed. The decoder's and vLLM's drafts follow the speed stage, transformers serves the
    draft
    as given, llama.cpp is priced by the run's forecast."""
    run = _speed(report)
    if run is None:
        return []
    names, paths, mapped = draft_names(report), _paths(report), _mapped(report)
    spec = {w: run.contender("speculative", w) for w in (ORIGINAL, DISTILLED)}
    speedups = {w: c.speedup if c else None for w, c in spec.items()}
    best = pick_fastest(speedups)
    timed = f"{run.prompts} prompt{'s' if run.prompts != 1 else ''} × {run.max_new_tokens} tokens"

    def others(chosen: str | None, allowed: tuple[str, ...] = (ORIGINAL, DISTILLED)) -> list[str]:
        return [f"{names[w]}: {speedups[w]:.2f}x" for w in allowed if w != chosen and speedups.get(w) is not None]

    def measured(w: str | None) -> tuple[float | None, list[float] | None]:
        if w is None:
            return 1.0, None
        return spec[w].speedup, spec[w].speedup_ci95

    rows = []
    s, ci = measured(best)
    rows.append(EngineChoice(
        "specdraft", names[best] if best else "none: serve the target alone", best, s, ci, _alpha(report, best),
        (f"timed in specdraft's decoder, {_configuration(run, best)}, {timed}" if best else
         f"no draft decoded faster than the target alone ({timed})"),
        _decoder_command(report, best, paths[best]) if best else "model.generate(**inputs)",
        paths[best] if best else None, others(best)))
    hf = next(iter(run.of_kind("hf_assisted").items()), None)
    if hf is not None and hf[1].speedup is not None:
        hf_name, hf_speed = hf
        draft_key = Contender.from_name(hf_name).draft or ORIGINAL
        pays = (hf_speed.speedup or 0) > 1.0
        rows.append(EngineChoice(
            "transformers", names.get(draft_key, draft_key) if pays else "none: serve the target alone",
            draft_key if pays else None, hf_speed.speedup if pays else 1.0, hf_speed.speedup_ci95 if pays else None,
            _alpha(report, draft_key) if pays else None,
            f"timed: transformers' generate(assistant_model=…), the draft as loaded, {timed}"
            + ("" if pays else f" (measured {hf_speed.speedup:.2f}x)"),
            ("model.generate(**inputs, assistant_model=draft"
             + (", tokenizer=target_tokenizer, assistant_tokenizer=draft_tokenizer)" if mapped else ")"))
            if pays else "model.generate(**inputs)", paths.get(draft_key) if pays else None))
    vllm = _vllm_commands(report)
    if vllm:
        servable = tuple(w for w in (ORIGINAL, DISTILLED) if w in vllm)
        v_best = pick_fastest({w: speedups[w] for w in servable})
        s, ci = measured(v_best)
        how = {ORIGINAL: "drafting through text (specdraft's custom_class proposer)" if mapped else "draft_model",
               DISTILLED: "draft_model"}
        rows.append(EngineChoice(
            "vllm", names[v_best] if v_best else "none: serve the target alone", v_best, s, ci, _alpha(report, v_best),
            (f"timed in specdraft's decoder ({_configuration(run, v_best)}), not in vLLM: vLLM serves the dense "
             f"export, {how[v_best]}; `make test-vllm` checks that it loads and decodes the target's tokens"
             if v_best else "no servable draft decoded faster than the target alone in specdraft's decoder"),
            vllm[v_best] if v_best else f"{vllm_server()} --model {shlex.quote(_cfg(report)['target'])}",
            paths[v_best] if v_best else None, others(v_best, servable)))
    plan = (report.get("export") or {}).get("llama_cpp")
    if plan:
        rows.append(llama_cpp_choice(plan, names, report))
    if run.busy_machine:  # other work held the CPU while timing: the order may be the machine's, not the drafts'
        for row in rows:
            if row.engine != "llama.cpp":
                row.basis += "; timed on a busy machine: re-run the speed stage on a quiet one before relying on it"
    order = {e: i for i, e in enumerate(ENGINES)}
    return sorted(rows, key=lambda r: (-(r.speedup if r.speedup is not None else 0.0), order[r.engine]))


def llama_cpp_choice(plan: dict[str, Any], names: dict[str, str], report: dict[str, Any]) -> EngineChoice:
    """llama.cpp's row from the run's plan: the GGUF draft at the forecast's n_max, the target alone
    when the band reaches 1x, unpriced without timings."""
    which, n = plan["which"], plan.get("n_max", 0)
    priced = plan.get("predicted_speedup") is not None
    if not priced:
        return EngineChoice("llama.cpp", f"{names[which]} (GGUF; not priced here)", which, None, None,
                            _alpha(report, which), plan["basis"], plan["command"], plan.get("gguf"))
    if n:
        return EngineChoice("llama.cpp", f"{names[which]} (GGUF, n_max {n})", which, plan["predicted_speedup"],
                            plan.get("band"), _alpha(report, which), plan["basis"], plan["command"], plan.get("gguf"))
    return EngineChoice("llama.cpp", "none: serve the target alone", None, 1.0, None, None, plan["basis"],
                        plan["command"], None,
                        [(f"{names[which]} (GGUF {plan.get('gguf')}): forecast {plan['predicted_speedup']:.2f}x at "
                         f"n_max {plan.get('best_n')}")])


@dataclass
class DistillVerdict:
    """Did distillation pay against the draft as given? ``answer`` (yes / no / not measurably, and why),
    the ``teacher``, ``alpha_gain`` (accepted / reached, paired over held-out prompts), ``speed_ratio`` (tokens/s,
    paired) and, for a re-indexed draft, ``swap`` (what the swap cost and distillation won back)."""

    answer: str
    teacher: str
    alpha_gain: Estimate | None
    speed_ratio: Estimate | None
    swap: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"answer": self.answer, "teacher": self.teacher,
                "alpha_gain": self.alpha_gain.to_dict() if self.alpha_gain else None,
                "speed_ratio": self.speed_ratio.to_dict() if self.speed_ratio else None, "swap": self.swap}


def teacher_of(report: dict[str, Any]) -> str:
    """Who taught the draft, in words, from the dump stage's record."""
    dump = report.get("dump") or {}
    n = dump.get("sequences")
    if dump.get("teacher") == "draft-as-given":
        return (f"{_cfg(report)['draft']} as given (the self-teacher: its own greedy answers to {n} training "
                "prompts, re-encoded in the target's tokenizer; no target compute)")
    return f"the target ({_cfg(report)['target']}: its answers to {n} training prompts, its distribution)"


def teaching_road(self_teacher: bool) -> str:
    """The road a run's distillation takes, in words (self-teacher or target dump)."""
    if self_teacher:
        return ("the draft as given teaches its re-indexed copy (the self-teacher: its own answers, no target "
                "compute), winning back what the swap cost rather than the target's distribution")
    return "the target's answers teach the draft"


def distillation_verdict(report: dict[str, Any]) -> DistillVerdict | None:
    """The distilled draft against the draft as given; ``None`` before a distillation was evaluated."""
    after = ((report.get("eval_after") or {}).get("sets") or {}).get("held_out")
    before = ((report.get("eval_before") or {}).get("sets") or {}).get("held_out")
    if not after or not before:
        return None
    gain = paired_gain_from_rows(before.get("rows") or [], after.get("rows") or [], numerator="accepted",
                                 denominator="reached") if before.get("rows") and after.get("rows") else None
    run = _speed(report)
    ratio = paired_speed_ratio(run, Contender("speculative", DISTILLED).name,
                               Contender("speculative", ORIGINAL).name) if run else None
    if gain is None and ratio is None:
        return None
    swap = None
    sw = ((report.get("vocab_swap") or {}).get("sets") or {}).get("held_out")
    if sw:
        swap = {"as_given": before.get("acceptance_rate"), "re_indexed": sw.get("acceptance_rate"),
                "distilled": after.get("acceptance_rate")}
    better = (gain and gain.low > 0, ratio and ratio.low > 1)
    worse = (gain and gain.high < 0, ratio and ratio.high < 1)
    if any(worse) and not any(better):
        word = "no"
    elif all(better) and not any(worse):
        word = "yes"
    else:
        word = "not measurably"
    parts = []
    if gain is not None:
        parts.append(f"acceptance per reached position {before.get('alpha', 0):.3f} → {after.get('alpha', 0):.3f} "
                     f"({gain.value:+.3f} [{gain.low:+.3f}, {gain.high:+.3f}], paired over {gain.prompts} prompts)")
    if ratio is not None:
        parts.append(f"{ratio.value:.2f}x its tokens/s [{ratio.low:.2f}, {ratio.high:.2f}] ({ratio.prompts} prompts)")
    answer = f"{word}, against the draft as given: " + ("; ".join(parts) if parts else "not compared")
    return DistillVerdict(answer, teacher_of(report), gain, ratio, swap)


def format_speedup(c: EngineChoice) -> str:
    """``"1.98x [1.66, 2.37]"``; a forecast's band in the same brackets; ``"—"`` when not priced."""
    if c.speedup is None:
        return "—"
    return f"{c.speedup:.2f}x" + (f" [{c.speedup_ci95[0]:.2f}, {c.speedup_ci95[1]:.2f}]" if c.speedup_ci95 else "")


def recommendation_rows(choices: list[EngineChoice]) -> list[tuple[str, str, str, str, str]]:
    """``(engine, draft, × target alone, α, command)`` per choice: the one recommendation table."""
    return [(c.label, c.draft, format_speedup(c), "—" if c.alpha is None else f"{c.alpha:.3f}", c.command)
            for c in choices]


RECOMMENDATION_HEADER = ("engine", "serve", "× target alone [95% CI]", "α (per reached)", "command")


def recommendation_markdown(choices: list[EngineChoice]) -> list[str]:
    """The recommendation as Markdown table lines (commands in backticks)."""
    return (["| " + " | ".join(RECOMMENDATION_HEADER) + " |", "| --- | --- | ---: | ---: | --- |"]
            + ["| " + " | ".join(x if i != 4 else f"`{x}`" for i, x in enumerate(row)) + " |"
               for row in recommendation_rows(choices)])


def manifest_markdown(report: dict[str, Any], choices: list[EngineChoice]) -> str:
    """``export/README.md``: which speculator to serve in which engine, fastest first."""
    lines = [f"# What to serve: {_cfg(report)['target']} ← {_cfg(report)['draft']}", "",
             ("Fastest first; × target alone is tokens/s over the target decoding alone, 95% interval over prompts "
             "(a forecast's error band for llama.cpp)."), "", *recommendation_markdown(choices)]
    lines += ["", *[f"- {c.label}: {c.basis}" + (f"; path `{c.path}`" if c.path else "")
                    + (f"; also measured: {', '.join(c.others)}" if c.others else "") for c in choices], ""]
    return "\n".join(lines)


def write_export_manifest(report: dict[str, Any], export_dir) -> list[EngineChoice]:
    """Write ``export/README.md`` and ``export/recommendation.json`` atomically; returns the
    choices."""
    import json
    from pathlib import Path


    choices = engine_choices(report)
    d = Path(export_dir)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_text(d / "README.md", manifest_markdown(report, choices))
    atomic_write_text(d / "recommendation.json", json.dumps([c.to_dict() for c in choices], indent=1, default=str))
    return choices
