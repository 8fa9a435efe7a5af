"""``specdraft models``: the embedded models, listed, and their cache built."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from specdraft.cli.errors import _Command
from specdraft.cli.render import console, print_models, resolve_with_progress
from specdraft.core.embedded import (
    EMBEDDED,
    cache_bytes,
    cache_dir,
    installed_state,
    is_cached,
    unknown_embedded_error,
)

models_app = typer.Typer(help="Embedded models: listed, or cached by `models prepare NAME`.",
                         invoke_without_command=True,
                         rich_markup_mode=None)


@models_app.callback()
def models_list(
    ctx: typer.Context,
    json_out: Annotated[bool, typer.Option("--json", help="The list as JSON, for scripts, printed instead of the "
                                           "table.")] = False,
) -> None:
    """List embedded models with their installed / cached state and sizes (names always in full)."""
    if ctx.invoked_subcommand is not None:
        return

    rows = [{"name": m.name, "description": m.description, "gguf_file": m.gguf_filename, "size_bytes": m.size_bytes,
             "installed": installed_state(m), "cached": is_cached(m.name), "cache_path": str(cache_dir(m.name)),
             "cache_bytes": cache_bytes(m.name), "pip_command": m.pip_command(), "hub_id": m.hub_id}
            for m in EMBEDDED.values()]
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
        return
    print_models(rows)


@models_app.command("prepare", cls=_Command)
def models_prepare(name: Annotated[str, typer.Argument(help="Embedded model name.")]) -> None:
    """Build the safetensors cache of an embedded model.

    Joins its parts, verifies their sha256 and converts the GGUF file to safetensors."""
    import time

    if name not in EMBEDDED:  # embedded names only: a directory or hub id has nothing to prepare
        raise unknown_embedded_error(name)
    t0 = time.time()
    path = resolve_with_progress(name)
    console.print(f"[green]ready[/] {name} → {path} ({time.time() - t0:.1f} s)")
