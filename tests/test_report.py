"""The run's summary as a person reads it: the terminal tables at 80 columns, report.md's rows."""

from __future__ import annotations

import pytest


def _rows(n: int, accepted: int, alpha: float) -> list[dict]:
    return [{"id": f"p{i}", "accepted": accepted + i % 3, "proposed": 40, "alpha_sum": alpha * 8 + i % 2,
             "positions": 8} for i in range(n)]


def _eval_set(accepted: int, alpha: float) -> dict:
    return {"prompts": 24, "rows": _rows(24, accepted, alpha), "acceptance_rate": accepted / 40,
            "acceptance_rate_ci95": [accepted / 40 - 0.112, accepted / 40 + 0.108], "drafted": 12_345,
            "mean_accepted_length": 2.37, "alpha_sampled": alpha, "alpha_sampled_ci95": [alpha - 0.05, alpha + 0.05],
            "replay_check": "24/24", "decoded_acceptance_rate": accepted / 40}


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
    from specdraft.report import summary_sections

    sections = summary_sections(wide_report())
    assert [t for t, _ in sections] == ["held-out set, 24 prompts: acceptance", "out-of-domain set, 24 prompts: acceptance",
                                        "held-out set, 24 prompts: speed, interleaved (busy machine)",
                                        "out-of-domain set, 24 prompts: speed, interleaved (busy machine)"]
    held = {k: (b, a) for k, b, a in sections[0][1]}
    assert held["gain (paired)"][1].startswith("-0.100 [") and held["α gain (paired)"][1].startswith("-0.014 [")
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
    from specdraft.report import slowdown_notes

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
    from specdraft.report import questions_and_answers

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
    assert quiet["Can I ship it?"].startswith("yes: `out/export`")
    assert "It ships, but it did not decode faster here" in quiet["Can I ship it?"]
    assert "did not decode faster" not in answers(False, 1.9)["Can I ship it?"]


def test_a_busy_speed_set_draws_no_speed_conclusion_and_the_page_names_the_exported_draft():
    """A busy run headlined "no verdict", then noted "this pair cannot win there" and "keep the original draft",
    then "Can I ship it? yes: …/export/speculator" without naming which draft it held."""
    from specdraft.report import questions_and_answers, speed_notes, speed_panel_title, speed_sets

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
    assert ship.startswith("yes: `out/export/speculator` holds the distilled draft (the run exports the draft it "
                           "trained")
    assert "BUSY MACHINE" in speed_panel_title(speed_sets(r)["held_out"])
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
    from specdraft.report import format_interval

    assert format_interval(ci, prompts, drafted=drafted) == shown


def test_a_one_prompt_run_shows_no_interval_in_its_tables_or_report_md_as_eval_does():
    """A one-prompt speed-up read `[1.08, 1.08]` in run and "—" in eval; a thin set is marked in both."""
    from specdraft.report import summary_sections

    r = wide_report()
    r["speed"]["prompts"] = 1
    r["eval_before"]["sets"]["held_out"] |= {"prompts": 3}
    rows = {(title, k): (b, a) for title, rs in summary_sections(r) for k, b, a in rs}
    assert rows[("held-out set, 1 prompts: speed, interleaved (busy machine)", "speed-up (paired)")] == (
        "0.90 — (one prompt gives no interval)", "1.90 — (one prompt gives no interval)")
    assert rows[("held-out set, 3 prompts: acceptance", "greedy acceptance")][0].endswith(
        "(3 prompts: a rough interval)")
