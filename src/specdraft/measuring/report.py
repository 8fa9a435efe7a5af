"""The main job's summary: one list of rows, rendered as the rich table, ``report.md``, ``report.json`` and plots.

:func:`summary_rows` is the single source of what a user sees after ``specdraft run``: the CLI renders it as a
rich table, :func:`render_markdown` as report.md's tables amid the stages' sections. Units are in row names.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.core.io import atomic_path, atomic_write_text
from specdraft.core.stats import MIN_PROMPTS, Estimate, paired_gain_from_rows
from specdraft.decoding.speed_run import Contender, ContenderSpeed, SpeedRun, SpeedStage
from specdraft.measuring.headroom import HeadroomForecast
from specdraft.measuring.recommend import (
    distillation_verdict,
    draft_names,
    engine_choices,
    format_speedup,
    recommendation_markdown,
    teaching_road,
)

#: The speed stage's keys of the pipeline's two drafts (the draft as given, the distilled one).
ORIGINAL = Contender("speculative", "original").name
DISTILLED = Contender("speculative", "distilled").name


def _draft_of(contender: str) -> str:
    """The draft a divergence's contender decoded with (its kind for a contender without one)."""
    c = Contender.from_name(contender)
    return c.draft or c.kind


def _draft_label(report: dict[str, Any], contender: str) -> str:
    """A speed contender's draft in words: the run's draft names (:func:`specdraft.measuring.recommend.draft_names`) when the
    report holds its configuration, else "the original draft" / "the distilled draft"."""
    which = Contender.from_name(contender).draft or "?"
    if "config" in report and "check" in report:
        return draft_names(report).get(which, which)
    return f"the {which} draft"


def _fmt(v: Any, spec: str = "{:.3f}") -> str:
    return "—" if v is None else spec.format(v)


def format_interval(ci: list[float] | None, prompts: int | None, spec: str = "{:.3f}",
                    drafted: int | None = None) -> str:
    """Every printed 95% interval over prompts, one way (the terminal's tables and notes, ``eval``'s table,
    report.md): ``"[low, high]"``, marked ``" (N prompts: a rough interval)"`` below
    :data:`specdraft.core.stats.MIN_PROMPTS` prompts (:attr:`specdraft.core.stats.Estimate.thin`); ``"— (one prompt gives no
    interval)"`` for one prompt, ``"— (nothing drafted)"`` when ``drafted`` is 0, ``"—"`` without an interval.
    ``prompts=None``: not over prompts (no mark)."""
    if drafted == 0:
        return "— (nothing drafted)"
    if prompts is not None and prompts < 2:
        return "— (one prompt gives no interval)"
    if not ci:
        return "—"
    rough = f" ({prompts} prompts: a rough interval)" if prompts is not None and prompts < MIN_PROMPTS else ""
    return f"[{spec.format(ci[0])}, {spec.format(ci[1])}]{rough}"


#: How each evaluation set is named in the report.
SET_LABELS = {"held_out": "held-out", "ood": "out-of-domain"}


def _sets(report: dict[str, Any]) -> list[str]:
    return list(report["eval_before"]["sets"])


def swap_baseline(report: dict[str, Any]) -> dict[str, Any] | None:
    """For a draft of another tokenizer, the re-indexed draft's evaluation sets before distillation (counted by
    replay in the ``vocab_swap`` stage; ``eval_before`` then holds the draft as given, decoded through the
    vocabulary mapping); ``None`` for a draft of the target's tokenizer (or a report from before the swap counted)."""
    return (report.get("vocab_swap") or {}).get("sets") or None


def baseline_sets(report: dict[str, Any]) -> dict[str, Any]:
    """The evaluation sets of the draft *before distillation* as it was trained: :func:`swap_baseline` when there is
    one (the swap's cost is its difference from ``eval_before``), ``eval_before``'s sets otherwise."""
    return swap_baseline(report) or report["eval_before"]["sets"]


#: What each proposal mode of a mapped draft (:func:`specdraft.decoding.drafters.proposal_mode`) counts, in the words the
#: summary's legend gives a row labelled ``mapped/<mode>``.
PROPOSAL_WORDS = {"text": "text proposals (the draft's greedy text re-encoded in the target's tokens)",
                  "tokens": "token intersection (the draft's tokens that have a twin in the target's vocabulary)"}


@dataclass(frozen=True)
class CountingRegime:
    """The rounds an evaluation set's greedy counts were taken in. Accepted / proposed moves with each part, so two
    sets' per-proposed figures are compared only within one regime.

    Attributes:
        gamma: γ, drafts per round (``None``: not recorded).
        gamma_policy: ``"fixed"`` or ``"adaptive"``.
        proposals: a draft of another tokenizer decoded through the vocabulary mapping: ``"text"`` (its greedy text
            re-encoded in the target's tokens) or ``"tokens"`` (its tokens with a target twin, the token
            intersection); ``None`` for a draft of the target's tokenizer.
    """

    gamma: int | None
    gamma_policy: str = "fixed"
    proposals: str | None = None

    @property
    def rounds(self) -> str:
        """``"fixed γ 5"`` / ``"adaptive γ ≤ 5"``."""
        g = "?" if self.gamma is None else self.gamma
        return f"adaptive γ ≤ {g}" if self.gamma_policy == "adaptive" else f"fixed γ {g}"

    def differs(self, other: CountingRegime) -> list[str]:
        """What differs from ``other``, one short phrase per part (``"γ 2 vs 5"``); ``[]`` for one regime. An
        unrecorded γ is taken as equal (a report of one run evaluates both sides with one config)."""
        said = []
        if None not in (self.gamma, other.gamma) and self.gamma != other.gamma:
            said.append(f"γ {self.gamma} vs {other.gamma}")
        if self.gamma_policy != other.gamma_policy:
            said.append(f"{self.gamma_policy} vs {other.gamma_policy} γ")
        if self.proposals != other.proposals:
            words = lambda p: "own tokens" if p is None else f"mapped/{p}"
            said.append(f"{words(self.proposals)} vs {words(other.proposals)}")
        return said


def counting_regime(side: dict[str, Any], report: dict[str, Any] | None = None,
                    mapped: bool = False) -> CountingRegime:
    """The :class:`CountingRegime` of one evaluation set (an :class:`~specdraft.measuring.evaluate.AcceptanceEval` dict).
    A set written before the regime was recorded takes γ from its counts or ``report``'s eval config, the fixed
    policy (replayed and decoded counts both run fixed γ) and, where ``mapped``, the config's proposal mode (text
    by default: the counts are greedy)."""
    ev = ((report or {}).get("config") or {}).get("eval") or {}
    gamma = side.get("gamma", (side.get("counts") or {}).get("gamma", ev.get("num_speculative_tokens")))
    proposals = side["proposals"] if "proposals" in side else (ev.get("mapped_proposals") or "text") if mapped \
        else None
    return CountingRegime(gamma, side.get("gamma_policy", "fixed"), proposals)


def _mapped_before(report: dict[str, Any]) -> bool:
    """Whether ``eval_before`` counted the draft as given through a vocabulary mapping."""
    return report.get("vocab_swap") is not None or (report.get("check") or {}).get("verdict") == "mismatch"


def regimes(report: dict[str, Any], name: str = "held_out") -> tuple[CountingRegime, CountingRegime]:
    """The counting regimes of one set's *before* (:func:`baseline_sets`) and *after* sides."""
    b = counting_regime(baseline_sets(report)[name], report,
                        mapped=swap_baseline(report) is None and _mapped_before(report))
    return b, counting_regime(report["eval_after"]["sets"][name], report)


def unpaired_reason(report: dict[str, Any], name: str = "held_out") -> str | None:
    """Why the per-proposed gain of one set is refused: its two sides were counted in different regimes
    (:meth:`CountingRegime.differs`: another γ, γ policy or proposal mode, so the difference would be the regime's,
    not the draft's); ``None`` when they share one."""
    b, a = regimes(report, name)
    differs = b.differs(a)
    if not differs:
        return None
    return (f"before and after were counted in different regimes ({'; '.join(differs)}): accepted / proposed "
            "moves with the regime, so their difference is no gain; compare matched / answer token or α at the "
            "serving settings")


def acceptance_gain(report: dict[str, Any], name: str = "held_out") -> Estimate | None:
    """After − before greedy acceptance (accepted / proposed) on the same prompts (and the same target answers)
    with a paired 95% bootstrap interval (:func:`specdraft.core.stats.paired_gain_from_rows`); ``None`` when a set has
    no rows, or when the two sides were counted in different regimes (:func:`unpaired_reason` says why): a draft
    is never compared with itself at another γ. *Before* is the draft that was trained (:func:`baseline_sets`): the
    gain is distillation's alone."""
    b = baseline_sets(report).get(name, {}).get("rows")
    a = report["eval_after"]["sets"].get(name, {}).get("rows")
    if not b or not a or unpaired_reason(report, name) is not None:
        return None
    return paired_gain_from_rows(b, a)


def matched_gain(report: dict[str, Any], name: str = "held_out") -> Estimate | None:
    """After − before matched proposals per answer token (:data:`specdraft.core.acceptance.MEASURES` ``"matched"``: the
    same figure at any γ), paired over prompts; ``None`` where either side's rows were not replayed."""
    b = baseline_sets(report).get(name, {}).get("rows")
    a = report["eval_after"]["sets"].get(name, {}).get("rows")
    if not b or not a or any("match_positions" not in r for r in (*b, *a)):
        return None
    return paired_gain_from_rows(b, a, numerator="matched", denominator="match_positions")


def sampled_alpha_gain(report: dict[str, Any], name: str = "held_out") -> Estimate | None:
    """After − before teacher-forced α at the serving settings, paired over prompts; ``None`` without it."""
    b = baseline_sets(report).get(name, {}).get("rows")
    a = report["eval_after"]["sets"].get(name, {}).get("rows")
    if not b or not a or any("alpha_sum" not in r for r in (*b, *a)):
        return None
    return paired_gain_from_rows(b, a, numerator="alpha_sum", denominator="positions")


def _with_ci(value: float | None, ci: list[float] | None, prompts: int | None, spec: str = "{:.3f}",
             drafted: int | None = None) -> str:
    """``value`` then its interval (:func:`format_interval`); the value alone where there is no interval to say."""
    if value is None:
        return "—"
    interval = format_interval(ci, prompts, spec, drafted)
    return spec.format(value) if interval == "—" else f"{spec.format(value)} {interval}"


#: Said once above the summary tables (terminal and report.md) instead of in every row's label: what the brackets
#: hold, and the definition each row's label names (:data:`specdraft.core.acceptance.MEASURES`).
SUMMARY_LEGEND = ("Intervals in brackets are 95% bootstrap CIs over prompts; gains and speed-ups are paired "
                  "(the same prompts before and after). Acceptance, bonus tokens never counted: matched = the draft's "
                  "greedy proposal equals the target's token, per answer token (the same at any γ: the figure to "
                  "compare); per reached = accepted / drafted positions verification tested; per proposed = accepted "
                  "/ proposed drafts in the rounds the section's title names (it moves with γ: a per-proposed gain "
                  "is shown only between counts of one γ, γ policy and proposal mode); mapped/text / "
                  "mapped/tokens = the draft as given, decoded through the vocabulary mapping with " + PROPOSAL_WORDS["text"]
                  + " / " + PROPOSAL_WORDS["tokens"] + ".")


def _regime_title(b: CountingRegime, a: CountingRegime) -> str:
    """The rounds an acceptance section was counted in, for its title: ``", fixed γ 5"`` when both sides share
    them, ``", fixed γ 2 before, fixed γ 5 after"`` otherwise, ``""`` when γ is unrecorded."""
    if b.gamma is None and a.gamma is None:
        return ""
    return f", {b.rounds}" if b.rounds == a.rounds else f", {b.rounds} before, {a.rounds} after"


def summary_sections(report: dict[str, Any]) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """The summary as sections: ``[(title, [(measure, before distillation, after distillation), …]), …]`` — per
    evaluation set the acceptance figures, each row named by its definition (:data:`SUMMARY_LEGEND`) with its
    interval, the paired gains (refused, ``not paired: …``, across counting regimes: :func:`unpaired_reason`), the
    drafted tokens and α at the serving settings; then per timed set the interleaved speed run. A title names the
    rounds counted in; a mapped row its proposal mode (``mapped/text``). Rows fit one line at 80 columns."""
    sections: list[tuple[str, list[tuple[str, str, str]]]] = []
    swapped = swap_baseline(report) is not None
    for name in _sets(report):
        b, a = baseline_sets(report)[name], report["eval_after"]["sets"][name]
        gain, sgain = acceptance_gain(report, name), sampled_alpha_gain(report, name)
        mgain = matched_gain(report, name)
        rb, ra = regimes(report, name)
        mapped = report["eval_before"]["sets"][name]

        def over(side: dict[str, Any]):  # an acceptance figure of one side: its prompts and drafted tokens
            return lambda v, ci: _with_ci(v, ci, side.get("prompts"), drafted=side.get("drafted"))

        mw, bw, aw = over(mapped), over(b), over(a)
        mode = counting_regime(mapped, report, mapped=True).proposals
        rows = [] if not swapped else [
            # The draft as given, decoded through the vocabulary mapping; the columns below are the re-indexed draft.
            (f"mapped/{mode}: per proposed", mw(mapped["acceptance_rate"], mapped.get("acceptance_rate_ci95")),
             "—"),
            # Decoded counts hold no matched proposals: the swap's cost compares accepted / reached on both sides.
            (f"mapped/{mode}: per reached", mw(mapped.get("alpha"), mapped.get("alpha_ci95")), "—"),
        ]
        if b.get("match_rate") is not None or a.get("match_rate") is not None:
            rows += [("matched / answer token", bw(b.get("match_rate"), b.get("match_rate_ci95")),
                      aw(a.get("match_rate"), a.get("match_rate_ci95"))),
                     ("matched gain (paired)", "—",
                      "—" if mgain is None else _with_ci(mgain.value, mgain.interval, mgain.prompts, "{:+.3f}"))]
        differs = rb.differs(ra)
        rows += [
            ("accepted, per reached", bw(b.get("alpha"), b.get("alpha_ci95")),
             aw(a.get("alpha"), a.get("alpha_ci95"))),
            ("accepted, per proposed", bw(b["acceptance_rate"], b.get("acceptance_rate_ci95")),
             aw(a["acceptance_rate"], a.get("acceptance_rate_ci95"))),
            ("gain per proposed (paired)", "—",
             f"not paired: {'; '.join(differs)}" if differs else
             "—" if gain is None else _with_ci(gain.value, gain.interval, gain.prompts, "{:+.3f}")),
            ("drafted tokens", f"{b['drafted']:,}", f"{a['drafted']:,}"),
            ("tokens / target pass", _fmt(b["mean_accepted_length"], "{:.2f}"), _fmt(a["mean_accepted_length"], "{:.2f}")),
            ("α at serving settings", _with_ci(b.get("alpha_sampled"), b.get("alpha_sampled_ci95"), b.get("prompts")),
             _with_ci(a.get("alpha_sampled"), a.get("alpha_sampled_ci95"), a.get("prompts"))),
        ]
        if sgain is not None:
            rows.append(("α gain (paired)", "—", _with_ci(sgain.value, sgain.interval, sgain.prompts, "{:+.3f}")))
        if b.get("replay_check"):
            # The after figures replay the target's answers written before; this says replay reproduces decoding.
            rows += [("replayed = decoded", f"{b['replay_check']} prompts", "—"),
                     ("decoded, per proposed", _fmt(b.get("decoded_acceptance_rate")), "—")]
        title = f"{SET_LABELS.get(name, name)} set, {b['prompts']} prompts: acceptance{_regime_title(rb, ra)}"
        sections.append((title, rows))
    for name, sp in speed_sets(report).items():
        o, d = sp.contenders.get(ORIGINAL), sp.contenders.get(DISTILLED)
        t = sp.contenders["target"]
        hf = next(iter(sp.of_kind("hf_assisted").values()), None)
        # A thin set's caveat is said once, in the title, not in every cell.
        thin = 2 <= sp.prompts < MIN_PROMPTS
        n = None if thin else sp.prompts
        rows = [
            ("target alone, tokens/s", _tps(t, n), "(same run)"),
            ("speculative, tokens/s", _tps(o, n), _tps(d, n)),
            ("speed-up (paired)", _speedup(o, n), _speedup(d, n)),
            ("HF assisted, tokens/s", _tps(hf, n), "—"),
            ("× assisted (as given)", _over(o, hf), _over(d, hf)),
            ("output = target alone", o.matches_target or "—" if o else "—", d.matches_target or "—" if d else "—"),
        ]
        busy = (" (busy machine)" if sp.busy_machine else "") + (" (rough intervals)" if thin else "")
        before = f"; before = the draft as given, mapped/{_speed_proposals(report)}" if swapped else ""
        sections.append((f"{SET_LABELS.get(name, name)} set, {sp.prompts} prompts: speed, interleaved{busy}{before}",
                         rows))
    return sections


def _speed_proposals(report: dict[str, Any]) -> str:
    """The proposal mode the speed stage decoded a mapped draft with (:func:`specdraft.decoding.drafters.proposal_mode` of the
    run's eval config: text when greedy, tokens when sampling, unless ``mapped_proposals`` says)."""
    ev = (report.get("config") or {}).get("eval") or {}
    sampled = ((ev.get("sampling") or {}).get("temperature") or 0) > 0
    return ev.get("mapped_proposals") or ("tokens" if sampled else "text")


def _tps(c: ContenderSpeed | None, prompts: int | None) -> str:
    return "—" if c is None else _with_ci(c.tokens_per_s, c.tokens_per_s_ci95, prompts, "{:.2f}")


def _speedup(c: ContenderSpeed | None, prompts: int | None) -> str:
    return "—" if c is None else _with_ci(c.speedup, c.speedup_ci95, prompts, "{:.2f}")


def _over(c: ContenderSpeed | None, hf: ContenderSpeed | None) -> str:
    """``c``'s tokens/s over transformers' assisted generation's."""
    return "—" if hf is None or not hf.tokens_per_s or c is None or not c.tokens_per_s else \
        f"{c.tokens_per_s / hf.tokens_per_s:.2f}x"


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """:func:`summary_sections` flattened: each measure prefixed with its section's title in brackets."""
    return [(f"[{title}] {k}", v1, v2) for title, rows in summary_sections(report) for k, v1, v2 in rows]


def speed_stage(report: dict[str, Any]) -> SpeedStage | None:
    """The speed stage's result (:class:`~specdraft.decoding.speed_run.SpeedStage`), ``None`` without a speed stage."""
    sp = report.get("speed")
    return SpeedStage.from_dict(sp) if sp else None


def speed_sets(report: dict[str, Any]) -> dict[str, SpeedRun]:
    """The speed stage's interleaved runs by evaluation set (``held_out`` first), ``{}`` without a speed stage."""
    stage = speed_stage(report)
    return stage.by_set() if stage else {}


def configuration_line(report: dict[str, Any]) -> str | None:
    """What specdraft's decoder ran in the speed stage (the original draft's preparation, the γ policy) and why; a
    trimmed head names its N and where its token ranking came from."""
    stage = speed_stage(report)
    if stage is None:
        return None
    sp = stage.held_out
    confs = sp.draft_configuration
    conf = confs.get("original") or {}
    policy, gamma = sp.gamma_policy, sp.num_speculative_tokens
    how = f"adaptive γ ≤ {gamma}" if policy == "adaptive" else f"fixed γ = {gamma}"
    dist = confs.get("distilled") or {}
    other = (f"; the distilled draft: {dist['label']} ({dist.get('reason', '')})"
             if dist.get("label") and dist.get("label") != conf.get("label") else "")
    head = f"; head: {conf['head_tokens_source']}" if conf.get("head_tokens_source") else ""
    return (f"draft {conf.get('label', 'as given')}, {how}; why: {conf.get('reason', 'the draft as given')}{head}{other}. "
            "The exported speculator stays the dense draft (what vLLM serves); the prepared copy is the decoder's "
            "own.")


def slowdown_notes(report: dict[str, Any]) -> list[str]:
    """One sentence per timed set where speculative decoding was slower than the target alone (point estimate
    < 1), naming each draft that was, with its paired interval; none for a set timed on a busy machine
    (:func:`busy_note` says so instead)."""
    notes = []
    for name, sp in speed_sets(report).items():
        if sp.busy_machine:  # timings taken beside other work say nothing about the pair: no conclusion from them
            continue
        slow = [f"the {who} draft {o.speedup:.2f}x {format_interval(o.speedup_ci95, sp.prompts, '{:.2f}')}"
                for who in ("original", "distilled")
                if (o := sp.contender("speculative", who)) and o.speedup is not None and o.speedup < 1.0]
        if slow:
            notes.append(f"on the {SET_LABELS.get(name, name)} set speculative decoding was slower than the target "
                         f"alone ({', '.join(slow)}): this pair cannot win there at this acceptance and draft cost "
                         "(adaptive γ drafts less where it predicts no gain)")
    return notes


def slower_note(report: dict[str, Any]) -> str | None:
    """A warning when the distilled draft decoded slower than the original in the interleaved run, else ``None``
    (``None`` too when the run was timed on a busy machine: such timings rank no draft)."""
    stage = speed_stage(report)
    if stage is None or stage.held_out.busy_machine:
        return None
    sp = stage.held_out
    o, d = sp.contenders.get(ORIGINAL), sp.contenders.get(DISTILLED)
    if not o or not d or d.speedup >= o.speedup:
        return None
    said = (f"the distilled draft decoded slower than the original in the interleaved run ({d.speedup:.2f}x vs "
            f"{o.speedup:.2f}x the target alone on {sp.prompts} prompt(s); intervals "
            f"{format_interval(d.speedup_ci95, sp.prompts, '{:.2f}')} vs "
            f"{format_interval(o.speedup_ci95, sp.prompts, '{:.2f}')}); ")
    if swap_baseline(report) is not None:
        # The original speaks another tokenizer: only specdraft's decoder and transformers can use it.
        return said + ("the draft as given is the one to serve where it can go (specdraft's decoder, transformers' "
                       "assisted generation, vLLM through specdraft's text proposer; the table above); llama.cpp and "
                       "vLLM's draft_model need a draft of the target's tokenizer, which the exported, distilled one "
                       "is. Distil longer (more data, more steps, the `large` preset) to win back more of what the "
                       "swap cost.")
    return said + ("keep the original draft unless its acceptance gain holds, or distil longer (more data, more "
                   "steps, the `large` preset).")


def busy_note(report: dict[str, Any]) -> str | None:
    """The note that replaces every speed conclusion when a timed set ran while other processes held the CPU
    (:class:`specdraft.decoding.calibration.LoadMonitor`): which sets, and what to do; ``None`` when every set ran quiet."""
    busy = [SET_LABELS.get(n, n) for n, sp in speed_sets(report).items() if sp.busy_machine]
    if not busy:
        return None
    return (f"the {' and '.join(busy)} speed set{'s were' if len(busy) > 1 else ' was'} timed while other processes "
            "held the CPU: its tokens/s and speed-ups are the busy machine's, so no conclusion is drawn from them "
            "(which draft is faster, whether the pair wins); rerun on a quiet machine (the finished stages are "
            "skipped, `--overwrite` redoes the speed stage)")


def speed_notes(report: dict[str, Any]) -> list[str]:
    """Every note the run's page and report.md print under the tables about speed, in order: the busy machine
    (:func:`busy_note`), a distilled draft slower than the original (:func:`slower_note`), each slow set
    (:func:`slowdown_notes`)."""
    return [n for n in (busy_note(report), slower_note(report)) if n is not None] + slowdown_notes(report)


def exported_draft(report: dict[str, Any]) -> str:
    """Which draft the export holds and why, in words: the distilled one, always (the run's product), and for a
    draft of another tokenizer the reason the original could not be exported instead."""
    why = ("the draft as given speaks another tokenizer: vLLM's draft_model and llama.cpp's -md serve only the "
           "re-indexed one"
           if swap_baseline(report) is not None or (report.get("check") or {}).get("verdict") == "mismatch"
           else "the run exports the draft it trained; the draft as given is unchanged where it was")
    return f"the distilled draft ({why})"


def as_given_offer(report: dict[str, Any]) -> str | None:
    """For a draft of another tokenizer whose run also wrote it as given (``export.as_given``): the sentence that
    offers it beside the distilled draft, with both held-out acceptances measured by the run (the draft as given
    through the mapping, ``eval_before``; the re-indexed and distilled one, ``eval_after``), and which engine serves
    which. ``None`` otherwise."""
    given = (report.get("export") or {}).get("as_given")
    if not given:
        return None
    name = "held_out" if "held_out" in report["eval_before"]["sets"] else next(iter(report["eval_before"]["sets"]))
    before = report["eval_before"]["sets"][name]
    after = (report.get("eval_after") or {}).get("sets", {}).get(name, {})
    regime = counting_regime(before, report, mapped=True).proposals
    return (f"The draft as given is written too, `{given['path']}`: vLLM serves it drafting through text "
            f"(specdraft's custom_class proposer) with `{given['vllm_command']}`. On the {SET_LABELS.get(name, name)} "
            f"it accepted {_fmt(before.get('acceptance_rate'))} of its proposals as given (mapped/{regime}) against "
            f"{_fmt(after.get('acceptance_rate'))} re-indexed and distilled; llama.cpp serves only the re-indexed one.")


#: One colour per draft (and contender) in every panel of report.png.
COLORS = {"original": "#DD8452", "re_indexed": "#4C72B0", "distilled": "#55A868", "target": "#999999",
          "hf_assisted": "#C44E52"}


def write_pipeline_report(report: dict[str, Any], out: Path,
                          sections: list[Callable[[dict[str, Any]], list[str]]]) -> None:
    """``report.json``, ``report.md`` (its stages' ``sections``: :func:`render_markdown`) and ``report.png``
    (acceptance per set with intervals, α per position, speed with intervals, learning curve), atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _sets(report)
    B, A = baseline_sets(report), report["eval_after"]["sets"]
    curve = (report.get("distill") or {}).get("curve") or []
    sp = stage.held_out if (stage := speed_stage(report)) else None
    panels = 2 + bool(sp) + bool(curve)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.6))
    ax = axes[0]
    # A re-indexed draft's "before" is the swap's; the draft as given stands beside it, lest the swap's cost read as gain.
    swapped = swap_baseline(report) is not None
    bars = ([(report["eval_before"]["sets"], "as given (mapped)", COLORS["original"])] if swapped else []) + [
        (B, "re-indexed, before", COLORS["re_indexed"]) if swapped else (B, "as given (before)", COLORS["original"]),
        (A, "distilled (after)", COLORS["distilled"])]
    width = 0.8 / len(bars)
    for j, (side, label, color) in enumerate(bars):
        vals = [side[n]["acceptance_rate"] for n in names]
        cis = [side[n].get("acceptance_rate_ci95") or [v, v] for n, v in zip(names, vals)]
        err = [[v - c[0] for v, c in zip(vals, cis)], [c[1] - v for v, c in zip(vals, cis)]]
        ax.bar([i + (j - (len(bars) - 1) / 2) * width for i in range(len(names))], vals, width, yerr=err, capsize=3,
               color=color, label=label)
    ax.set_xticks(range(len(names)), [SET_LABELS.get(n, n) for n in names])
    ax.set(ylabel="accepted / proposed", ylim=(0, 1.05), title="greedy acceptance (95% CI)")
    ax.legend()
    g = len(B[names[0]]["alpha_per_position"])
    xs = list(range(1, g + 1))
    axes[1].bar([x - 0.2 for x in xs], B[names[0]]["alpha_per_position"], 0.4,
                label="re-indexed, before" if swapped else "as given (before)",
                color=COLORS["re_indexed" if swapped else "original"])
    axes[1].bar([x + 0.2 for x in xs], A[names[0]]["alpha_per_position"], 0.4, label="distilled (after)",
                color=COLORS["distilled"])
    axes[1].set(xlabel="draft position", ylabel="P(accept | reached)", ylim=(0, 1.05),
                title=f"α per position ({SET_LABELS.get(names[0], names[0])})")
    axes[1].legend()
    k = 2
    if sp:
        keys = list(sp.contenders)
        vals = [sp.contenders[x].tokens_per_s for x in keys]
        cis = [sp.contenders[x].tokens_per_s_ci95 or [v, v] for x, v in zip(keys, vals)]
        err = [[v - ci[0] for v, ci in zip(vals, cis)], [ci[1] - v for v, ci in zip(vals, cis)]]
        axes[k].bar(range(len(keys)), vals, yerr=err, capsize=3,
                    color=[COLORS.get(Contender.from_name(x).draft if Contender.from_name(x).kind == "speculative"
                                      else Contender.from_name(x).kind, "#999") for x in keys])
        axes[k].set_xticks(range(len(keys)), [x.replace(":", "\n") for x in keys], fontsize=7)
        axes[k].set(ylabel="tokens/s", title=speed_panel_title(sp))
        if sp.busy_machine:  # the bars alone would read as the pair's speed
            axes[k].title.set_color("#C44E52")
        k += 1
    if curve:
        _plot_curve(axes[k], curve, B[names[0]], A[names[0]], COLORS["re_indexed" if swapped else "original"])
    fig.tight_layout()
    with atomic_path(out / "report.png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    gains = {n: (e.to_dict() if (e := acceptance_gain(report, n)) else None) for n in names}
    payload = report | {"acceptance_gain": gains}
    refused = {n: why for n in names if (why := unpaired_reason(report, n)) is not None}
    if refused:  # a null gain says why: the sides were counted in different regimes
        payload["acceptance_gain_refused"] = refused
    atomic_write_text(out / "report.json", json.dumps(payload, indent=2, default=str))
    atomic_write_text(out / "report.md", render_markdown(report, sections))


def speed_panel_title(sp: SpeedRun) -> str:
    """report.png's speed panel title; a run timed on a busy machine says so in it (drawn red)."""
    return (f"decoding speed (interleaved, {sp.prompts} prompts)"
            + ("\nBUSY MACHINE: not the pair's speed" if sp.busy_machine else ""))


def _plot_curve(ax, curve: list[dict[str, Any]], b: dict[str, Any], a: dict[str, Any],
                before_color: str = COLORS["original"]) -> None:
    """Held-out teacher-forced α by step (predicted) beside the acceptance measured before and after (with its 95%
    interval): does the cheap curve foretell the measured gain?"""
    steps = [p["step"] for p in curve]
    ax.plot(steps, [p["eval_alpha"] for p in curve], marker="o", ms=3, label="validation α (teacher-forced, training prompts)")
    for x, ev, name, color in ((0, b, "before", before_color), (steps[-1], a, "after", COLORS["distilled"])):
        ci = ev.get("acceptance_rate_ci95")
        err = [[ev["acceptance_rate"] - ci[0]], [ci[1] - ev["acceptance_rate"]]] if ci else None
        ax.errorbar([x], [ev["acceptance_rate"]], yerr=err, fmt="s", color=color, capsize=3,
                    label=f"measured acceptance ({name})")
    ax.set(xlabel="optimizer step", ylabel="probability", ylim=(0, 1.05), title="learning curve")
    ax.legend(fontsize=7)


def questions_and_answers(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The four questions a user asks of a pair, answered from a ``specdraft run`` report, figures after words:
    ``[(question, answer), …]`` — the terminal summary and ``report.md`` lead with these."""
    verdict = (r.get("check") or {}).get("verdict", "?")
    works = {"identical": "yes: the tokenizers are identical over the whole vocabulary",
             "identical-up-to-padding": "yes: identical tokenizers; the output widths differ only by padding rows",
             "mismatch": "not as they are: the tokenizers differ"}.get(verdict, f"verdict {verdict}")
    if verdict == "mismatch" and r.get("vocab_swap"):
        works += (f"; yes through a vocabulary mapping ({r['vocab_swap']['target_coverage']:.1%} of the target "
                  "vocabulary reachable; specdraft's decoder and transformers only), and yes after the vocabulary "
                  "swap, as a draft of the target's own tokenizer (what vLLM and llama.cpp serve)")
    out = [("Can these two work together?", works + ".")]
    faster, verdicts = [], []
    for name, sp in speed_sets(r).items():
        spec = sp.of_kind("speculative")
        # The draft that measured fastest leads: it is the one the recommendation serves (the others: the tables).
        best = max(spec, key=lambda k: spec[k].speedup or 0, default=None)
        if best is None:
            continue
        b: ContenderSpeed = sp.contenders[best]
        hf = next(iter(sp.of_kind("hf_assisted").values()), None)
        vs_hf = f", {b.tokens_per_s / hf.tokens_per_s:.2f}x transformers' assisted generation" if hf and \
            hf.tokens_per_s else ""
        if sp.busy_machine:  # other work held the CPU while timing: the ratio says nothing about the pair
            word = "no verdict (the machine was busy while timing; re-run on a quiet machine)"
        else:
            word = "faster" if (b.speedup_ci95 or [0])[0] > 1 else "not faster" if (b.speedup or 0) < 1 \
                else "about as fast (interval includes 1x)"
        verdicts.append(word)
        faster.append(f"{SET_LABELS.get(name, name)}: {word} — {b.speedup:.2f}x the target alone "
                      f"{format_interval(b.speedup_ci95, sp.prompts, '{:.2f}')} with {_draft_label(r, best)}{vs_hf}, "
                      f"outputs equal {b.matches_target or '—'} ({sp.prompts} prompt{'s' if sp.prompts != 1 else ''} × "
                      f"{sp.max_new_tokens or '?'} tokens{'; busy machine' if sp.busy_machine else ''})")
    if (conf := configuration_line(r)) is not None:
        faster.append(f"configuration: {conf}")
    out.append(("How much faster will it be?", "; ".join(faster) if faster else "not timed (speed_prompts = 0)."))
    learn = []
    if r.get("headroom"):
        road = (f"; the road this run takes: {teaching_road(True)}"
                if (r.get("dump") or {}).get("teacher") == "draft-as-given" else "")
        learn.append(f"forecast (against the target's answers): {HeadroomForecast.from_dict(r['headroom']).verdict}"
                     + road)
    sw = (swap_baseline(r) or {}).get("held_out")
    if sw:
        m = r["eval_before"]["sets"]["held_out"]
        # Decoded through the mapping vs replayed at fixed γ: accepted / proposed depends on the regime, so the
        # per-reached figures (counted alike by both) come with it.
        learn.append(f"the vocabulary swap: held-out greedy acceptance {_fmt(m['acceptance_rate'])} as given through "
                     f"the mapping → {_fmt(sw['acceptance_rate'])} re-indexed (accepted / proposed at each run's γ; "
                     f"accepted / reached {_fmt(m.get('alpha'))} → {_fmt(sw.get('alpha'))}), before training")
    if (unpaired := unpaired_reason(r, "held_out")) is not None:
        learn.append(f"measured: not compared — {unpaired}")
    if (gain := acceptance_gain(r, "held_out")) is not None:
        word = "yes" if gain.low > 0 else "no measurable change" if gain.low <= 0 <= gain.high else "it agreed less"
        # Distillation's own gain, on the draft it trained (a re-indexed copy: not the draft as given, above).
        trained = "the re-indexed copy" if swap_baseline(r) is not None else "the draft"
        learn.append(f"measured on {trained}, before → after training: {word} — held-out greedy acceptance "
                     f"{gain.value:+.3f} {format_interval(gain.interval, gain.prompts, '{:+.3f}')} (paired, "
                     f"{gain.prompts} prompts)")
        if (ood := acceptance_gain(r, "ood")) is not None:
            ood_word = "better" if ood.low > 0 else "worse" if ood.high < 0 else "no measurable change"
            learn.append(f"out-of-domain {ood.value:+.3f} {format_interval(ood.interval, ood.prompts, '{:+.3f}')} "
                         f"({ood.prompts} prompts; {ood_word})")
    if (verdict := distillation_verdict(r)) is not None:
        learn.insert(0, f"did distillation pay? {verdict.answer} (teacher: {verdict.teacher})")
        if verdict.swap and None not in verdict.swap.values():
            sw_ = verdict.swap
            learn.insert(1, f"the vocabulary swap cost {sw_['as_given'] - sw_['re_indexed']:.3f} accepted / proposed "
                            f"({sw_['as_given']:.3f} as given → {sw_['re_indexed']:.3f} re-indexed); distillation won "
                            f"back {sw_['distilled'] - sw_['re_indexed']:+.3f} ({sw_['distilled']:.3f})")
    out.append(("Can the draft agree more?", ("; ".join(learn) + ".") if learn else "not measured."))
    exp = r.get("export") or {}
    divs = [d for sp in speed_sets(r).values() for d in sp.divergences
            if Contender.from_name(d.contender).kind != "hf_assisted"]
    if speed_sets(r):
        same = ", ".join(f"{SET_LABELS.get(n, n)} {sp.contenders[ORIGINAL].matches_target or '—'}"
                         for n, sp in speed_sets(r).items() if ORIGINAL in sp.contenders)
        detail = "; ".join(f"{d.prompt_id} token {d.position} ({_draft_of(d.contender)} draft): top-2 margin "
                           f"{d.margin:.4f} ({'a bf16 near-tie, within' if d.is_numerics else 'BEYOND'} the "
                           f"{d.tolerance} tolerance)" for d in divs)
        word = "no, a bug: a divergence beyond bf16 rounding" if any(not d.is_numerics for d in divs) else \
            "yes, up to bf16 near-ties" if divs else "yes"
        out.append(("Is it lossless on this pair?", f"{word} — greedy outputs equal to the target alone's: {same}"
                    + (f"; divergences: {detail}" if detail else "") + "."))
    caveat = (" It ships, but it did not decode faster here: serve it where the timings say it pays, or re-measure "
              "on the serving machine." if verdicts and all(v == "not faster" for v in verdicts) else "")
    choices = engine_choices(r)
    if exp and choices:
        top = choices[0]
        serve = "; ".join(f"{c.label}: {c.draft}" + (f" (`{c.path}`)" if c.path else "") for c in choices)
        lead = (f"yes — the fastest: {top.draft} in {top.label}, {format_speedup(top)} the target alone"
                if top.which is not None else
                "not for speed on this machine: no draft decoded faster than the target alone here; the speculators "
                "are written, to serve where timings say they pay")
        out.append(("Can I ship it?", f"{lead}. Per engine: {serve}. `{Path(exp['path']).parent / 'README.md'}` "
                    "names them with the commands; each speculator is a plain transformers checkpoint plus "
                    "`speculators_*` keys." + (caveat if top.which is not None else "")))
        return out
    out.append(("Can I ship it?", f"yes: `{exp.get('path', '?')}` holds {exported_draft(r)}, an independent "
                "speculator (a plain transformers checkpoint plus `speculators_*` keys); serve it with "
                f"`{exp.get('vllm_command', '?')}`.{caveat}"
                + (f" {offer}" if (offer := as_given_offer(r)) else "")
                if exp else "no export was written."))
    return out


def _resumed_total(r: dict[str, Any]) -> str:
    """For a run that skipped stages done earlier: the sum of every stage's own recorded seconds (empty otherwise)."""
    timings = r.get("timings") or {}
    if not any(t.get("skipped") for t in timings.values()):
        return ""
    total = sum(t.get("seconds") or 0.0 for t in timings.values())
    return f" (this invocation; stages done earlier were skipped, every stage's own time sums to {total / 60:.1f} min)"


def _answers_writer(sets: dict[str, Any]) -> str:
    """The sentence naming the decoder that wrote the target's answers before distillation (empty when unknown)."""
    labels = {v.get("decoder_label") for v in sets.values()} - {None}
    if not labels:
        return ""
    secs = sum(v.get("decode_seconds") or 0.0 for v in sets.values())
    toks = sum(v.get("decoded_tokens") or 0 for v in sets.values())
    rate = f", {toks / secs:.2f} tokens/s" if secs > 0 else ""
    return (f" The answers were written by {'; '.join(sorted(labels))}{rate} (the target's own greedy answers); "
            "the figures count each draft as exported, by replay.")


def _forecast_line(h: HeadroomForecast) -> str:
    """report.md's sentence on the forecast made before training."""
    c = h.counts
    return (f"Forecast before training (`specdraft headroom` on the held-out answers): {h.verdict}; top-1 "
            f"agreement {c.greedy:.3f} per position (not the table's accepted / proposed, which counts whole "
            f"rounds and is lower), ceiling {c.greedy + c.greedy_learnable:.3f} (95% CI of the gain "
            f"[{h.gain_ci95[0]:+.3f}, {h.gain_ci95[1]:+.3f}]; the target is sure, max p ≥ {h.sure_threshold}, "
            f"at {c.sure / c.positions if c.positions else 0.0:.0%} of {c.positions:,} positions). The measured gain "
            "is in the table below.")


def _moved_as_saved(dist: dict[str, Any]) -> str:
    """``", N% of them changed as saved in DTYPE"`` (what the export kept of training's update), plus the loss
    warning when most of the update rounded away; "" for a run that did not measure it."""
    if dist.get("moved_fraction_saved") is None:
        return ""
    text = f", {dist['moved_fraction_saved']:.1%} of their weights changed as saved in {dist['saved_dtype']}"
    return text + (f" — **warning:** {dist['saved_update_lost']}" if dist.get("saved_update_lost") else "")


def evaluation_section(r: dict[str, Any]) -> list[str]:
    """``eval_before``'s lines: how acceptance was counted, on which prompts and answers."""
    cfg, sets = r["config"], r["eval_before"]["sets"]
    serving = cfg["distill"].get("serving") or cfg["distill"]  # a run config written with the flat keys too
    return [("Evaluation: greedy speculative decoding, γ = "
             f"{cfg['eval']['num_speculative_tokens']}, {cfg['eval']['max_new_tokens']} new tokens per prompt, on "
             + "; ".join(f"{SET_LABELS.get(n, n)} {v['prompts']} prompts ({', '.join(v.get('sources') or ['given'])}), "
                         f"{sum(row.get('answer_tokens', 0) for row in v['rows']):,} target answer tokens"
                         for n, v in sets.items())
             + ". The distilled draft is replayed on the target's answers written before (the same answers: a paired "
             "gain); the sampled figure is α = Σ min(p̃, q̃), p̃ and q̃ the target's and the draft's probabilities "
             f"after the serving settings (temperature {serving['temperature']}, top-k {serving['top_k']}, "
             f"top-p {serving['top_p']}), teacher-forced on those answers."
             + _answers_writer(sets)), ""]


def swap_section(r: dict[str, Any]) -> list[str]:
    """``vocab_swap``'s lines: the mapped evaluation, the re-indexing, and what *before distillation* holds."""
    if not (sw := r.get("vocab_swap")):
        return []
    return [(f"The draft speaks another tokenizer: the evaluation above decoded it as given through a vocabulary "
             f"mapping ({sw['target_coverage']:.1%} of the target vocabulary reachable; the rows *mapped/"
             f"{counting_regime(next(iter(r['eval_before']['sets'].values())), r, mapped=True).proposals}*); "
             f"it was then re-indexed into the target's tokenizer ({sw['copied']:,} rows copied from a twin, "
             f"{sw['from_pieces']:,} set to the mean of their draft pieces, {sw['initialised'] - sw['from_pieces']:,} "
             "to the mean row) and distilled, so the *after distillation* column decodes without a mapping"
             + ("; *before distillation* is the re-indexed draft, replayed on the same answers, so the gain is "
                "distillation's alone and the swap's own cost is the difference from the mapped row."
                if swap_baseline(r) is not None else ".")), ""]


def forecast_section(r: dict[str, Any]) -> list[str]:
    """``headroom``'s line: the forecast beside which the measured gain is read."""
    return [_forecast_line(HeadroomForecast.from_dict(r["headroom"])), ""] if r.get("headroom") else []


def distill_section(r: dict[str, Any]) -> list[str]:
    """``distill``'s lines: steps, sequences, trainable parameters, validation α and loss, on-policy data."""
    dist, cfg, onp = r["distill"], r["config"], r["distill"].get("on_policy")
    return [(f"Distillation: {dist['steps']} steps on {dist['train_sequences']} sequences "
             f"({dist['trainable_parameters'] / 1e6:.1f} M trainable parameters{_moved_as_saved(dist)}), loss "
             f"`{cfg['distill']['loss']}`; validation α (teacher-forced on the "
             f"{cfg['distill']['held_out_fraction']:.1%} of training sequences kept out of the steps, not the "
             f"evaluation sets) {_fmt(dist['eval_before'].get('eval_alpha'))} → "
             f"{_fmt(dist['eval_after'].get('eval_alpha'))}, validation loss "
             f"{_fmt(dist['eval_before'].get('eval_loss'), '{:.4f}')} → {_fmt(dist['eval_after'].get('eval_loss'), '{:.4f}')}."
             + ("" if not onp else
                f" On-policy: λ = {cfg['distill']['on_policy_fraction']}, {onp['sequences']} sequences written by the "
                f"draft ({onp['generated_tokens']:,} tokens, {onp['generate_seconds']:.0f} s) and scored by the target "
                f"({onp['teacher_tokens']:,} tokens, {onp['teacher_seconds']:.0f} s), regenerated at steps "
                f"{onp['refresh_steps']}.")), ""]


def summary_section(r: dict[str, Any]) -> list[str]:
    """``eval_after``'s lines: the legend and one table per :func:`summary_sections` section under its title (a
    merged table would repeat each title in every row)."""
    return [SUMMARY_LEGEND, "", *[line for title, rows in summary_sections(r) for line in (
        f"**{title}**", "", "| measure | before distillation | after distillation |",
        "| --- | ---: | ---: |", *[f"| {k} | {v1} | {v2} |" for k, v1, v2 in rows], "")]]


def speed_section(r: dict[str, Any]) -> list[str]:
    """``speed``'s lines: every :func:`speed_notes` note."""
    return [f"**Note:** {n.rstrip('.')}.\n" for n in speed_notes(r)]


def export_section(r: dict[str, Any]) -> list[str]:
    """``export``'s lines: the exported speculator, its vLLM command and notes, and the draft as given's offer."""
    exp = r["export"]
    return [(f"Exported speculator: `{exp['path']}` (γ = {exp['num_speculative_tokens']}, weights "
             f"{exp.get('dtype', 'keep')}). Serve it with vLLM (tested with vLLM "
             f"{exp.get('vllm_tested_version', '?')}):"), "", "```bash", exp["vllm_command"], "```", "",
            *([] if not exp.get("vllm_one_path") else [
                f"or, with specdraft installed next to vLLM (its plugin): `{exp['vllm_one_path']}`.", ""]),
            *[f"Note: {n}" for n in exp.get("vllm_notes", [])], *([""] if exp.get("vllm_notes") else []),
            *([] if not (tpl := exp.get("chat_template")) else [f"Chat template: {tpl['note']}.", ""]),
            *([] if (offer := as_given_offer(r)) is None else [offer, ""])]


def render_markdown(r: dict[str, Any], sections: list[Callable[[dict[str, Any]], list[str]]]) -> str:
    """``report.md``: what to serve where, the four answers, the run's line, then each stage's ``sections`` in the
    stages' order (:attr:`specdraft.run.runner.Stage.section`), the timings and the plots."""
    cfg = r["config"]
    choices = engine_choices(r)
    lines = [
        f"# specdraft run — {cfg['target']} ← {cfg['draft']}", "",
        *([] if not choices else ["## What to serve where (fastest first)", "", *recommendation_markdown(choices), "",
                                  *[f"- {c.label}: {c.basis}." for c in choices], ""]),
        *[f"**{q}** {a}\n" for q, a in questions_and_answers(r)],
        (f"{r['date']}, {r['versions']['machine']}, torch {r['versions']['torch']}, transformers "
         f"{r['versions']['transformers']}. Command: `{r['command']}`. Total {r['total_seconds'] / 60:.1f} min"
         + _resumed_total(r) + "."),
        "",
        *[line for section in sections for line in section(r)],
        "| stage | seconds | |", "| --- | ---: | --- |",
        *[f"| {k} | {v['seconds']:.1f} | {'skipped (done earlier)' if v['skipped'] else ''} |"
          for k, v in r["timings"].items()],
        "", "![before vs after](report.png)", ""]
    if r.get("overlap"):
        lines.insert(4, f"**Warning**: {len(r['overlap'])} evaluation prompts also occur in training.\n")
    return "\n".join(lines)
