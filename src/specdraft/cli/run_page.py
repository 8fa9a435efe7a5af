"""``run``'s page: what to serve where, the four answers, the summary tables, notes, stage times and the commands."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from specdraft.cli.render import console


def print_run(report: dict, out: Path, target: str, draft: str) -> None:
    """``run``'s page: the answers, the summary tables (:func:`summary_tables`), notes, stage times, where the
    report and the speculator are, and the serve commands."""
    from specdraft.measuring.recommend import engine_choices
    from specdraft.measuring.report import SUMMARY_LEGEND, questions_and_answers, speed_notes

    console.print(f"[bold]specdraft run — {escape(target)} ← {escape(draft)}[/]")
    choices = engine_choices(report)
    if choices:
        console.print(recommendation_table(choices))
    for q, a in questions_and_answers(report):
        console.print(f"[bold]{escape(q)}[/] {escape(a)}")
    console.print(SUMMARY_LEGEND, highlight=False)
    for table in summary_tables(report):
        console.print(table)
    for note in speed_notes(report):
        console.print(f"[yellow]note:[/] {escape(note)}")
    for k, v in report["timings"].items():
        console.print(f"  {k:<12} {v['seconds']:7.1f} s{'  (skipped: done earlier)' if v['skipped'] else ''}")
    exp = report["export"]
    console.print(f"report: {Path(out) / 'report.md'}\nplots: {Path(out) / 'report.png'}", highlight=False,
                  markup=False, soft_wrap=True)
    if choices:  # what to serve where, fastest first, each with the command as tested
        console.print(f"what to serve where: {Path(exp['path']).parent / 'README.md'}", highlight=False, markup=False,
                      soft_wrap=True)
        for c in choices:
            console.print(f"  {c.label}: {c.draft}{f' ({c.path})' if c.path else ''}\n    {c.command}",
                          highlight=False, markup=False, soft_wrap=True)
    else:
        console.print(f"speculator: {exp['path']}\nserve it with vLLM (tested with vLLM "
                      f"{exp.get('vllm_tested_version', '?')}):\n  {exp['vllm_command']}", highlight=False,
                      markup=False, soft_wrap=True)


def recommendation_table(choices) -> Table:
    """The run page's first table (:func:`specdraft.measuring.recommend.recommendation_rows`), commands left for the list at
    the end of the page (they are longer than a terminal line)."""
    from specdraft.measuring.recommend import RECOMMENDATION_HEADER, recommendation_rows

    table = Table(title="What to serve where (fastest first)", title_justify="left")
    for col in RECOMMENDATION_HEADER[:4]:
        table.add_column(col, justify="right" if "×" in col or "α" in col else "left")
    for row in recommendation_rows(choices):
        table.add_row(*(escape(x) for x in row[:4]))
    return table


def summary_tables(report: dict) -> list[Table]:
    """The run summary's sections (:func:`specdraft.measuring.report.summary_sections`) as rich tables: one row per figure,
    the set named in each table's title."""
    from specdraft.measuring.report import summary_sections

    tables = []
    for title, rows in summary_sections(report):
        table = Table(title=escape(title), title_justify="left")
        for col in ("measure", "before distillation", "after distillation"):
            table.add_column(col, justify="left" if col == "measure" else "right")
        for row in rows:
            table.add_row(*(escape(str(x)) for x in row))
        tables.append(table)
    return tables

