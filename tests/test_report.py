"""The run's summary as a person reads it: the terminal tables at 80 columns, report.md's rows."""

from __future__ import annotations

import pytest


def _rows(n: int, accepted: int, alpha: float) -> list[dict]:
    return [{"id": f"p{i}", "accepted": accepted + i % 3, "proposed": 40, "alpha_sum": alpha * 8 + i % 2,
             "positions": 8} for i in range(n)]


def _eval_set(accepted: int, alpha: float, gamma: int = 5) -> dict:
    return {"prompts": 24, "rows": _rows(24, accepted, alpha), "acceptance_rate": accepted / 40,
            "acceptance_rate_ci95": [accepted / 40 - 0.112, accepted / 40 + 0.108], "drafted": 12_345,
            "mean_accepted_length": 2.37, "alpha_sampled": alpha, "alpha_sampled_ci95": [alpha - 0.05, alpha + 0.05],
            "replay_check": "24/24", "decoded_acceptance_rate": accepted / 40, "gamma": gamma,
            "gamma_policy": "fixed", "proposals": None}


def _contender(tps: float, speedup: float | None = None) -> dict:
    c = {"tokens_per_s": tps, "tokens_per_s_ci95": [tps - 11.11, tps + 11.11], "matches_target": "24/24"}
    return c | ({} if speedup is None else {"speedup": speedup, "speedup_ci95": [speedup - 0.11, speedup + 0.12]})


def _speed() -> dict:
    contenders = {"target": _contender(123.45), "speculative:original": _contender(111.11, 0.9),
                  "speculative:distilled": _contender(234.56, 1.9), "hf_assisted:original": _contender(101.01)}
    return {"prompts": 24, "contenders": contenders, "busy_machine": True}


def wide_report() -> dict:
    """A report whose figures are as wide as a run's get (4-5 digit counts, signed gains, 3-digit tokens/s)."""
    speed = _speed() | {"other_sets": {"ood": _speed()}}
    return {"eval_before": {"sets": {"held_out": _eval_set(30, 0.612), "ood": _eval_set(20, 0.512)}},
            "eval_after": {"sets": {"held_out": _eval_set(26, 0.598), "ood": _eval_set(24, 0.544)}},
            "speed": speed}


def test_every_summary_row_is_one_line_at_80_columns():
    """At 80 columns the label column wrapped every long label over two or three lines (and a value with its gain
    over three): labels are short now, one figure per row, the interval legend said once."""
    from rich.console import Console

    from specdraft.cli import summary_tables
    from specdraft.measuring.report import summary_sections

    sections = summary_sections(wide_report())
    assert [t for t, _ in sections] == ["held-out set, 24 prompts: acceptance, fixed γ 5",
                                        "out-of-domain set, 24 prompts: acceptance, fixed γ 5",
                                        "held-out set, 24 prompts: speed, interleaved (busy machine)",
                                        "out-of-domain set, 24 prompts: speed, interleaved (busy machine)"]
    held = {k: (b, a) for k, b, a in sections[0][1]}
    assert held["gain per proposed (paired)"][1].startswith("-0.100 [")
    assert held["α gain (paired)"][1].startswith("-0.014 [")
    assert held["replayed = decoded"] == ("24/24 prompts", "—")
    console = Console(record=True, width=80)
    for table in summary_tables(wide_report()):
        console.print(table)
    lines = console.export_text().splitlines()
    body = [x for x in lines if x.startswith("│")]  # one per table row unless a cell wrapped
    assert len(body) == sum(len(rows) for _, rows in sections), "\n".join(lines)
    assert max(map(len, lines)) <= 80


@pytest.mark.parametrize(("original", "distilled", "said"), [
    (0.9, 1.9, "(the original draft 0.90x [0.79, 1.02])"),
    (0.9, 0.8, "(the original draft 0.90x [0.79, 1.02], the distilled draft 0.80x [0.69, 0.92])"),
    (1.1, 1.9, None)])
def test_a_slow_set_is_one_note_naming_each_slow_draft(original, distilled, said):
    from specdraft.measuring.report import slowdown_notes

    r = wide_report()
    for sp in (r["speed"], r["speed"]["other_sets"]["ood"]):
        sp["busy_machine"] = False  # a busy machine's timings draw no conclusion (tested below)
        sp["contenders"]["speculative:original"] |= {"speedup": original, "speedup_ci95": [original - 0.11,
                                                                                          original + 0.12]}
        sp["contenders"]["speculative:distilled"] |= {"speedup": distilled, "speedup_ci95": [distilled - 0.11,
                                                                                            distilled + 0.12]}
    notes = slowdown_notes(r)
    if said is None:
        assert notes == []
    else:
        assert len(notes) == 2 and notes[0].startswith("on the held-out set speculative decoding was slower than "
                                                       f"the target alone {said}: this pair cannot win there")
        assert notes[1].startswith("on the out-of-domain set")


def test_a_busy_speed_run_yields_no_verdict_and_a_slow_shipped_draft_is_said_before_shipping():
    """A report concluded "not faster — 0.83x" from timings taken while others held the CPU, and "Can I ship it?
    yes" followed "not faster" without a word."""
    from specdraft.measuring.report import questions_and_answers

    def answers(busy: bool, speedup: float) -> dict:
        r = wide_report() | {"export": {"path": "out/export", "vllm_command": "vllm serve T"}}
        for sp in (r["speed"], r["speed"]["other_sets"]["ood"]):
            sp["busy_machine"] = busy
            for k in ("speculative:original", "speculative:distilled"):
                sp["contenders"][k] |= {"speedup": speedup, "speedup_ci95": [speedup - 0.1, speedup + 0.1]}
        return dict(questions_and_answers(r))

    busy = answers(True, 0.83)
    assert busy["How much faster will it be?"].count("no verdict (the machine was busy while timing") == 2
    assert "not faster" not in busy["How much faster will it be?"]
    assert "did not decode faster" not in busy["Can I ship it?"]
    quiet = answers(False, 0.83)
    assert quiet["How much faster will it be?"].count("not faster — 0.83x") == 2
    # No draft decoded faster: the answer says so before naming what was written, engine by engine.
    assert quiet["Can I ship it?"].startswith("not for speed on this machine: no draft decoded faster than the "
                                              "target alone here")
    assert "specdraft's decoder: none: serve the target alone" in quiet["Can I ship it?"]
    fast = answers(False, 1.9)["Can I ship it?"]
    assert fast.startswith("yes — the fastest: ") and "did not decode faster" not in fast


def test_a_busy_speed_set_draws_no_speed_conclusion_and_the_page_names_the_exported_draft():
    """A busy run headlined "no verdict", then noted "this pair cannot win there" and "keep the original draft",
    then "Can I ship it? yes: …/export/speculator" without naming which draft it held."""
    from specdraft.measuring.report import questions_and_answers, speed_notes, speed_panel_title, speed_sets

    r = wide_report() | {"export": {"path": "out/export/speculator", "vllm_command": "vllm serve T"},
                         "check": {"verdict": "identical"}}
    for sp in (r["speed"], r["speed"]["other_sets"]["ood"]):  # both drafts slower, the distilled slowest
        sp["contenders"]["speculative:original"] |= {"speedup": 0.9, "speedup_ci95": [0.8, 1.0]}
        sp["contenders"]["speculative:distilled"] |= {"speedup": 0.7, "speedup_ci95": [0.6, 0.8]}
    notes = speed_notes(r)
    assert len(notes) == 1 and notes[0].startswith("the held-out and out-of-domain speed sets were timed while other "
                                                   "processes held the CPU")
    text = " ".join(notes + [a for _, a in questions_and_answers(r)])
    assert "cannot win" not in text and "keep the original draft" not in text
    ship = dict(questions_and_answers(r))["Can I ship it?"]
    assert ship.startswith("not for speed on this machine") and "`out/export/README.md` names them" in ship
    assert "BUSY MACHINE" in speed_panel_title(speed_sets(r)["held_out"])
    # The headline quotes the draft that measured fastest, the one the recommendation serves (a run once headlined
    # the distilled draft because it was exported, while the draft as given was the faster one).
    faster = dict(questions_and_answers(r))["How much faster will it be?"]
    assert "0.90x the target alone" in faster and "with the original draft" in faster
    assert "with the distilled draft" not in faster
    quiet = wide_report() | {"export": r["export"]}
    for sp in (quiet["speed"], quiet["speed"]["other_sets"]["ood"]):
        sp["busy_machine"] = False
        sp["contenders"]["speculative:distilled"] |= {"speedup": 0.7, "speedup_ci95": [0.6, 0.8]}
    assert any("keep the original draft" in n for n in speed_notes(quiet))
    assert "BUSY" not in speed_panel_title(speed_sets(quiet)["held_out"])
    assert "speed sets were timed while other processes" not in "".join(speed_notes(quiet))


@pytest.mark.parametrize(("ci", "prompts", "drafted", "shown"), [
    ([1.08, 1.08], 1, None, "— (one prompt gives no interval)"),
    ([0.4, 0.6], 3, None, "[0.400, 0.600] (3 prompts: a rough interval)"),
    ([0.4, 0.6], 10, None, "[0.400, 0.600]"),
    ([0.0, 0.0], 12, 0, "— (nothing drafted)"),
    (None, 12, None, "—")])
def test_every_interval_is_rendered_by_one_rule(ci, prompts, drafted, shown):
    from specdraft.measuring.report import format_interval

    assert format_interval(ci, prompts, drafted=drafted) == shown


def test_a_one_prompt_run_shows_no_interval_in_its_tables_or_report_md_as_eval_does():
    """A one-prompt speed-up read `[1.08, 1.08]` in run and "—" in eval; a thin set is marked in both."""
    from specdraft.measuring.report import summary_sections

    r = wide_report()
    r["speed"]["prompts"] = 1
    r["eval_before"]["sets"]["held_out"] |= {"prompts": 3}
    rows = {(title, k): (b, a) for title, rs in summary_sections(r) for k, b, a in rs}
    assert rows[("held-out set, 1 prompts: speed, interleaved (busy machine)", "speed-up (paired)")] == (
        "0.90 — (one prompt gives no interval)", "1.90 — (one prompt gives no interval)")
    assert rows[("held-out set, 3 prompts: acceptance, fixed γ 5", "accepted, per proposed")][0].endswith(
        "(3 prompts: a rough interval)")


#: What an acceptance row's label must name: its definition (SUMMARY_LEGEND), or a figure that has no γ in it.
DEFINED = ("matched", "per reached", "per proposed", "tokens / target pass", "α at serving settings", "α gain",
           "drafted tokens", "replayed = decoded")


def test_a_draft_is_never_paired_with_itself_at_another_gamma_and_every_row_names_its_definition():
    """One draft replayed at γ 2 (0.64 accepted / proposed) and at γ 8 (0.34) printed a paired "gain" of −0.30; the
    per-proposed gain between two regimes is refused now, the section says which rounds each side counted, and
    every acceptance row names the definition it counts."""
    from rich.console import Console

    from specdraft.cli import summary_tables
    from specdraft.measuring.report import (
        SUMMARY_LEGEND,
        acceptance_gain,
        questions_and_answers,
        summary_rows,
        summary_sections,
        unpaired_reason,
    )

    r = {"eval_before": {"sets": {"held_out": _eval_set(int(0.64 * 40), 0.6, gamma=2)}},
         "eval_after": {"sets": {"held_out": _eval_set(int(0.34 * 40), 0.6, gamma=8)}}}
    (title, rows), = summary_sections(r)
    assert title == "held-out set, 24 prompts: acceptance, fixed γ 2 before, fixed γ 8 after"
    shown = {k: (b, a) for k, b, a in rows}
    assert shown["gain per proposed (paired)"] == ("—", "not paired: γ 2 vs 8")
    assert acceptance_gain(r) is None and "accepted / proposed moves with the regime" in unpaired_reason(r)
    agree = dict(questions_and_answers(r))["Can the draft agree more?"]
    assert agree.startswith("measured: not compared — before and after were counted in different regimes (γ 2 vs 8)")
    assert "-0.3" not in " ".join(v for _, b, a in summary_rows(r) for v in (b, a))
    # The same γ but another policy, or a mapped side against a draft of the target's tokens: refused too.
    r["eval_after"]["sets"]["held_out"] |= {"gamma": 2, "gamma_policy": "adaptive"}
    assert acceptance_gain(r) is None and "fixed vs adaptive γ" in unpaired_reason(r)
    r["eval_after"]["sets"]["held_out"] |= {"gamma_policy": "fixed", "proposals": "tokens"}
    assert "own tokens vs mapped/tokens" in unpaired_reason(r)
    r["eval_after"]["sets"]["held_out"]["proposals"] = None  # one regime again: the gain is paired
    assert unpaired_reason(r) is None and acceptance_gain(r).prompts == 24
    for label, _, _ in rows:
        assert any(word in label for word in DEFINED), label
    for word in ("matched = ", "per reached = ", "per proposed = "):
        assert word in SUMMARY_LEGEND
    console = Console(record=True, width=80)
    for table in summary_tables(r):
        console.print(table)
    assert max(map(len, console.export_text().splitlines())) <= 80


@pytest.mark.parametrize("mode", ["text", "tokens"])
def test_a_mapped_row_names_the_proposal_regime_it_was_counted_in(mode):
    """The draft as given, decoded through the vocabulary mapping, read "as given, mapped: acceptance" whether its
    proposals were its greedy text re-encoded or the token intersection; each row names the regime, on one line."""
    from rich.console import Console

    from specdraft.cli import summary_tables
    from specdraft.measuring.report import SUMMARY_LEGEND, summary_sections

    mapped = _eval_set(26, 0.6) | {"proposals": mode, "alpha": 0.7, "alpha_ci95": [0.6, 0.8]}
    r = {"eval_before": {"sets": {"held_out": mapped}}, "vocab_swap": {"sets": {"held_out": _eval_set(12, 0.5)}},
         "eval_after": {"sets": {"held_out": _eval_set(20, 0.6)}}, "speed": _speed(),
         "config": {"eval": {"mapped_proposals": mode, "sampling": {"temperature": 0.0}}}}
    sections = summary_sections(r)
    labels = [k for k, _, _ in sections[0][1]]
    assert labels[:2] == [f"mapped/{mode}: per proposed", f"mapped/{mode}: per reached"]
    assert sections[0][1][0][1].startswith("0.650 [")
    assert sections[1][0].endswith(f"before = the draft as given, mapped/{mode}")
    assert ("text proposals" in SUMMARY_LEGEND) and ("token intersection" in SUMMARY_LEGEND)
    console = Console(record=True, width=80)
    for table in summary_tables(r):
        console.print(table)
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80 and f"│ mapped/{mode}: per reached" in text
    # A report written before the mode was recorded: the run's eval config says it (greedy default: text).
    del mapped["proposals"]
    r["config"]["eval"]["mapped_proposals"] = None
    assert summary_sections(r)[0][1][0][0] == "mapped/text: per proposed"
