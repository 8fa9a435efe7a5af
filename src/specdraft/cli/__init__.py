"""specdraft's command line: one thin command per stage, each parsing its flags, calling the library and rendering.

=================  ===============================================================================
module             what it holds
=================  ===============================================================================
``errors``         exit codes, the one ``error:`` line, the command and group classes
``options``        the flag vocabulary: one option per concept, help from the config field
``render``         every table and line a command prints (beside :mod:`specdraft.measuring.report`)
``pair``           check, eval, generate, rank
``training``       headroom, dump, distill, vocab-swap
``shipping``       export, inspect
``run``            run (the main job)
``models``         models, models prepare
=================  ===============================================================================

No torch/transformers import at module top: ``specdraft --help`` answers instantly. Exit codes:
:mod:`specdraft.cli.errors`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from specdraft.cli import models, pair, run, shipping, training
from specdraft.cli.errors import BUG_EXIT, EXPECTED_ERRORS, _Command, _Group, error_message, fail
from specdraft.cli.options import AUTO_DTYPE, GAMMA_HELP
from specdraft.cli.render import generate_summary
from specdraft.cli.run_page import summary_tables

__all__ = ["AUTO_DTYPE", "BUG_EXIT", "EXPECTED_ERRORS", "GAMMA_HELP", "app", "error_message", "fail",
           "generate_summary", "main", "summary_tables"]

app = typer.Typer(
    cls=_Group,
    help="Speculative decoding with an independent draft model: check a target/draft pair, measure the "
    "speed-up, distill the draft, and ship it as a speculator checkpoint.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # click's plain help: rich's option table truncates long flag names at 80 columns ("--draft-confiden…"); click
    # wraps the help text and always prints every flag whole. The panels are click sections (_Group).
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from specdraft import __version__

        typer.echo(f"specdraft {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print specdraft's version and exit.")] = False,
) -> None:
    # Only --version (eager, handled by its callback); no docstring, so the app's help stays the Typer's help=.
    return None


#: ``(name, callback, panel, click context settings)`` of every command, in the order ``--help`` lists them.
COMMANDS = (
    ("run", run.run, "Main job", None),
    ("check", pair.check, "Stages", {"allow_extra_args": True}),  # positional models: a hint, not a bare refusal
    ("eval", pair.eval_cmd, "Stages", None),
    ("headroom", training.headroom, "Stages", None),
    ("vocab-swap", training.vocab_swap, "Stages", None),
    ("dump", training.dump, "Stages", None),
    ("distill", training.distill, "Stages", None),
    ("export", shipping.export, "Stages", None),
    ("generate", pair.generate, "Tools", None),
    ("rank", pair.rank, "Tools", None),
    ("inspect", shipping.inspect_speculator, "Tools", None),
)
for _name, _callback, _panel, _settings in COMMANDS:
    app.command(_name, cls=_Command, rich_help_panel=_panel, context_settings=_settings)(_callback)
app.add_typer(models.models_app, name="models", rich_help_panel="Tools")


def main() -> None:  # pragma: no cover
    app()
