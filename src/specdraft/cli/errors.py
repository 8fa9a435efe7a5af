"""Errors and exit codes of every command: one ``error:`` line for what a user can fix, a traceback for a bug.

Exit codes: 0 done; 1 the tokenizers of target and draft differ (``check``'s verdict, and ``eval`` /
``generate`` refusing such a pair without ``--map-vocab``, unless the draft is a speculator exported as given); 2 an
expected error — bad input, a missing or unfit model, data or dump, a prompt too long for a model
(:data:`EXPECTED_ERRORS`), printed as one ``error:`` message without a traceback, as are values or flags click
rejects (``eval`` also exits 2 when greedy outputs diverge beyond rounding); 3 (:data:`BUG_EXIT`) anything else: a
bug, printed with its traceback; 130 (:data:`INTERRUPTED_EXIT`, the shell's 128 + SIGINT) interrupted with Ctrl-C,
said in one line (with how to resume, for the commands that resume).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
import typer._click.exceptions as _click_errors  # typer >= 0.29 vendors click; UsageError is not re-exported
from rich.console import Console
from rich.markup import escape

from specdraft.core import config

err_console = Console(stderr=True)

#: Errors a user causes and can fix: bad flags, missing files, a model / tokenizer / dump that does not fit, a
#: prompt longer than a model's window. ``(module, class)`` pairs, resolved only among modules already imported
#: (an error of a module never imported cannot have been raised), so this list costs no import: a specdraft class
#: is named under the module that defines it (a module that re-exports it may not be imported when it is raised).
EXPECTED_ERRORS: tuple[tuple[str, str], ...] = (
    ("specdraft.data.sources", "DataError"),
    ("specdraft.core.embedded", "ModelResolutionError"),
    ("specdraft.models.vocab", "CompatibilityError"),
    ("specdraft.models.speculator", "SpeculatorError"),
    ("specdraft.decoding.drafters", "DecodeError"),
    ("specdraft.core.sampling", "TokenWidthError"),
    ("specdraft.core.sampling", "ContextWindowError"),
    ("specdraft.models.dump_reader", "DumpError"),
    ("specdraft.training.distill_data", "DistillError"),
    ("specdraft.run.runner", "PipelineError"),
    ("specdraft.measuring.rank", "RankError"),
    ("pydantic", "ValidationError"),
    ("builtins", "FileExistsError"),
)


def expected_error_types() -> tuple[type[BaseException], ...]:
    """The classes of :data:`EXPECTED_ERRORS` whose modules are loaded."""
    found = (getattr(sys.modules.get(mod), name, None) for mod, name in EXPECTED_ERRORS)
    return tuple(cls for cls in found if isinstance(cls, type))


#: Exit status of a bug: an exception no command expects, printed with its traceback. Never 1 (that means "the
#: tokenizers differ") nor 2 (an expected error).
BUG_EXIT = 3

#: Exit status after Ctrl-C: the shell's own for a process ended by SIGINT (128 + 2).
INTERRUPTED_EXIT = 130

#: The commands whose rerun continues where an interrupted one stopped (finished stages, dump shards, training
#: checkpoints are kept).
RESUMING_COMMANDS = ("run", "dump", "distill")


def interrupted_message(command: str | None) -> str:
    """The line printed after Ctrl-C: ``"interrupted — rerun to resume"`` for a command that resumes."""
    if command in RESUMING_COMMANDS:
        return (f"interrupted — rerun to resume (the same `specdraft {command}` command continues where this one "
                "stopped)")
    return "interrupted"


def _range_text(lo=None, hi=None, lo_open: bool = False, hi_open: bool = False) -> str | None:
    """A range as click writes it (``x>=1``, ``1<=x<=64``, ``0<x<=1``); None when unbounded."""
    if lo is None and hi is None:
        return None
    if hi is None:
        return f"x{'>' if lo_open else '>='}{lo}"
    right = f"{'<' if hi_open else '<='}{hi}"
    return f"x{right}" if lo is None else f"{lo}{'<' if lo_open else '<='}x{right}"


def _field_range(model_name: str, loc) -> str | None:
    """The bounds (``ge``/``gt``/``le``/``lt``) of the field at ``loc`` of the :mod:`specdraft.core.config` model named
    ``model_name``, as :func:`_range_text` writes them: the allowed range an error states, from the one source."""
    cls, info = getattr(config, model_name, None), None
    for name in loc:
        fields = getattr(cls, "model_fields", None)
        if not fields or name not in fields:
            return None
        info = fields[name]
        cls = info.annotation
    bounds = {k: getattr(m, k) for m in getattr(info, "metadata", ()) for k in ("gt", "ge", "lt", "le")
              if getattr(m, k, None) is not None}
    return _range_text(bounds.get("ge", bounds.get("gt")), bounds.get("le", bounds.get("lt")), "gt" in bounds,
                       "lt" in bounds)


def _value_error(flag: str, err: dict, allowed: str | None) -> str:
    """One pydantic error (typer's or a config's) as ``--flag: …``, with the value given and what is allowed."""
    value = err.get("input")
    if allowed and err.get("type") in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{flag}: {value} is not in the range {allowed}"
    if err.get("type") == "literal_error":
        return f"{flag}: {value!r} is not one of {err['ctx']['expected']}"
    msg = str(err["msg"]).removeprefix("Value error, ").rstrip(".")
    return f"{flag}: {msg}" if repr(value) in msg else f"{flag}: {msg} (got {value!r})"


def _flag_typed(param, args: list[str]) -> str:
    """The name the user typed for ``param`` (``--gamma`` or ``-g``): the last one in ``args``, else its first long
    name; an argument's name in capitals."""
    if getattr(param, "param_type_name", "") == "argument":
        return str(param.name).upper()
    names = [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]
    typed = [a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in names]
    return typed[-1] if typed else next((n for n in names if n.startswith("--")), f"--{param.name}")


def _flag_of_field(cmd, args: list[str]):
    """``field -> flag``: a config field's flag as the user typed it for command ``cmd`` (the option whose parameter
    is the field, ``num_speculative_tokens`` ↔ ``--gamma``, ``top_k`` ↔ dump's ``--top-logprobs``), else
    ``--field-name``."""

    def flag(field: str) -> str:
        dashed = "--" + field.replace("_", "-")
        for p in getattr(cmd, "params", ()):
            if p.name == field or dashed in getattr(p, "opts", ()):
                return _flag_typed(p, args)
        return dashed

    return flag


def error_message(exc: BaseException, flag_of=None) -> str:
    """The text shown for an expected error. A pydantic error names the flag (``flag_of(field)``, default
    ``--field-name``: field names equal flag names), the value given and the allowed range or choices."""
    if hasattr(exc, "errors") and type(exc).__name__ == "ValidationError":
        flag_of = flag_of or (lambda field: "--" + field.replace("_", "-"))
        msgs = []
        for e in exc.errors():
            if not e["loc"]:  # a model validator's message: it names its flags itself
                msgs.append(str(e["msg"]).removeprefix("Value error, "))
                continue
            msgs.append(_value_error(flag_of(str(e["loc"][-1])), e, _field_range(exc.title, e["loc"])))
        return "; ".join(msgs)
    return str(exc) or type(exc).__name__


def usage_error_message(exc, args: list[str]) -> str:
    """A value or flag click rejected, as the one line every other error is: the flag as typed, the value given,
    what is allowed, and where the help is (no usage box, no pydantic wording)."""
    param = getattr(exc, "param", None)
    cause = exc.__cause__
    if isinstance(exc, typer.BadParameter) and not isinstance(exc, _click_errors.MissingParameter) and param:
        # A value: worded as a config's own error is (error_message), so `--gamma 0` reads the same everywhere.
        flag = _flag_typed(param, args)
        errs = cause.errors() if hasattr(cause, "errors") else []
        return (_value_error(flag, errs[0], _range_text(getattr(param, "min", None), getattr(param, "max", None)))
                if errs else f"{flag}: {' '.join(exc.message.split()).rstrip('.')}")
    where = f" (see {exc.ctx.command_path} --help)" if getattr(exc, "ctx", None) is not None else ""
    return " ".join(exc.format_message().split()).rstrip(".") + where


def fail(msg: str, code: int = 2) -> None:
    """Print ``error: msg`` (no markup read in ``msg``) to stderr as one line, however long (soft_wrap: rich would
    otherwise wrap it at the terminal width, and a script reading the error line would get its first piece), and
    exit with ``code`` (2: an expected error). No emoji codes read either: a spec ``humaneval:100:8`` stays itself."""
    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True, emoji=False)
    raise typer.Exit(code)


def refuse_retired(command: str, flag: str, now: str, value: object, owner: str) -> None:
    """One error line when ``flag``, retired from ``command`` (:func:`specdraft.cli.options.retired_option`), was
    given: the same ``value`` under ``now``, and whose ``flag`` is (``owner``)."""
    if value is not None:
        fail(f"{command}'s {flag} is now {now} ({now} {value}); {flag} is {owner}")


#: The topmost folder or file each ``--out`` of the running command would create (:func:`check_out`): what a failed
#: command leaves of them without a file inside is removed (:func:`remove_new_empty_outputs`).
NEW_OUTPUTS: list[Path] = []


def remove_new_empty_outputs() -> None:
    """After a failed command: remove each output folder it created that holds no file (a resumable command's
    unfinished work, files, is kept for its rerun)."""
    import shutil

    for top in NEW_OUTPUTS:
        if top.is_dir() and not any(p.is_file() for p in top.rglob("*")):
            shutil.rmtree(top, ignore_errors=True)
    NEW_OUTPUTS.clear()


def check_out(path: Path | None, flag: str = "--out", *, file: bool = False, overwrite: bool | None = False) -> None:
    """The one rule for where a command writes, applied before any model loads (after its flags and prompt files
    are read): a place that cannot be written is one ``error:`` line (exit 2) now, not a traceback after the work.

    1. Below a directory: the nearest existing ancestor of ``path`` is a directory, not a file (``--out FILE/spec``);
       a directory output (``file=False``) is not an existing file, a file output (``file=True``: a JSON or GGUF)
       not an existing directory. Missing folders above it are created by the command's atomic write.
    2. Writable: that ancestor, and ``path`` where it is an existing directory, pass ``os.access(W_OK)`` (a
       read-only file system answers no, even to root) and take a temporary file, created and removed.
    3. Existing output: an existing file, or a directory that is not empty, is refused unless ``--overwrite``
       (``overwrite=True`` replaces it): one rule for eval, rank, headroom, export and vocab-swap.
       ``overwrite=None`` marks a resumable output (run's run directory, dump's and distill's output), whose
       contents are the command's own unfinished or finished work: it resumes them (run refuses a stage of other
       inputs unless --overwrite, dump a dump of another plan), so only 1 and 2 apply.
    """
    import os
    import tempfile

    if path is None:
        return
    here = path.expanduser().absolute()
    above = next(p for p in here.parents if p.exists())  # the root exists
    if not here.exists():
        NEW_OUTPUTS.append(next((p for p in reversed(here.parents) if not p.exists()), here))
    if not above.is_dir():
        fail(f"{flag} {path}: {above} is a file, not a folder")
    if file and here.is_dir():
        fail(f"{flag} {path} is a directory: give a file name")
    if not file and here.exists() and not here.is_dir():
        fail(f"{flag} {path} is a file: give a directory")
    for folder in (above, *([here] if here.is_dir() else [])):
        if not os.access(folder, os.W_OK | os.X_OK):
            fail(f"{flag} {path}: {folder} cannot be written (read-only, or not yours)")
        try:
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".specdraft-write-check-"):
                pass
        except OSError as exc:
            fail(f"{flag} {path}: {folder} cannot be written ({exc.strerror or exc})")
    if overwrite is False and (here.is_file() or (here.is_dir() and any(here.iterdir()))):
        what = "exists" if here.is_file() else "exists and is not empty"
        fail(f"{flag} {path} {what}; pass --overwrite to replace it, or choose another {flag}")


def _typed(param, args: list[str]) -> bool:
    """Whether ``args`` give ``param`` (``--out x``, ``--out=x``, ``-o x``, ``-ox``); an argument counts as given."""
    if getattr(param, "param_type_name", "") == "argument":
        return True
    return any(a == o or a.startswith(o + "=") or (len(o) == 2 and a.startswith(o) and not a.startswith("--"))
               for a in args for o in param.opts)


class _Command(typer.core.TyperCommand):
    """A command whose usage line names its arguments as click does (``PROMPT``, ``DRAFTS...``), not typer's
    ``{prompt}``."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        given = list(args)  # click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except _click_errors.MissingParameter as exc:
            missing = [p for p in self.get_params(ctx) if p.required and not _typed(p, given)]
            if len(missing) < 2:
                raise
            names = ", ".join(" / ".join(f"'{o}'" for o in p.opts) for p in missing)
            raise _click_errors.UsageError(f"Missing options {names}", ctx) from exc

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if getattr(p, "param_type_name", "") == "argument":
                name = p.metavar or str(p.name).upper()
                pieces.append((name if p.required else f"[{name}]") + ("..." if p.nargs != 1 else ""))
        return pieces


#: The panels of ``specdraft --help``, in order; a command names its panel (``rich_help_panel``).
PANELS = ("Main job", "Stages", "Tools")


class _Group(typer.core.TyperGroup):
    """The command group that turns every expected error of any command into ``error: …`` and exit 2 (one place
    for all commands; a command catches an error itself only to add context), a pair of two tokenizers into the
    tokenizer report and exit 1, click's rejections of a flag or value into the same one line, and a bug into its
    traceback and exit :data:`BUG_EXIT`. Its help lists the commands in :data:`PANELS`."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a bug (SystemExit, KeyboardInterrupt pass): its traceback, never exit 1
            import traceback

            traceback.print_exc()
            sys.exit(BUG_EXIT)

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except _click_errors.NoArgsIsHelpError:
            raise
        except _click_errors.UsageError as exc:  # `specdraft --bogus`
            fail(usage_error_message(exc, list(args)))

    def invoke(self, ctx):
        NEW_OUTPUTS.clear()
        try:
            return self._invoke(ctx)
        except BaseException as exc:
            if getattr(exc, "exit_code", getattr(exc, "code", 1)) not in (0, None):
                remove_new_empty_outputs()
            raise

    def _invoke(self, ctx):
        args = [*ctx._protected_args, *ctx.args]  # the command line after `specdraft`: the flags as typed
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # typer would exit 130 without a word
            err_console.print(interrupted_message(ctx.invoked_subcommand), highlight=False, markup=False,
                              soft_wrap=True)
            raise typer.Exit(INTERRUPTED_EXIT) from None
        except _click_errors.NoArgsIsHelpError:
            raise
        except _click_errors.UsageError as exc:
            fail(usage_error_message(exc, args))
        except Exception as exc:
            mismatch = getattr(sys.modules.get("specdraft.measuring.pair"), "TokenizerMismatchError", None)
            if mismatch is not None and isinstance(exc, mismatch):
                from specdraft.models.check import print_report

                print_report(exc.report, err_console)
                fail(str(exc), code=1)
            if not isinstance(exc, expected_error_types()):
                raise
            cmd = self.get_command(ctx, args[0]) if args else None
            fail(error_message(exc, _flag_of_field(cmd, args)))

    def format_commands(self, ctx, formatter) -> None:
        """The commands under their panel's heading (:data:`PANELS`), each summary whole where it fits."""
        commands = [(name, cmd) for name in self.list_commands(ctx)
                    if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if not commands:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in commands)
        panels: dict[str, list[tuple[str, str]]] = {}
        for name, cmd in commands:
            panel = getattr(cmd, "rich_help_panel", None) or "Commands"
            panels.setdefault(panel, []).append((name, cmd.get_short_help_str(limit)))
        for panel in sorted(panels, key=lambda p: PANELS.index(p) if p in PANELS else len(PANELS)):
            with formatter.section(panel):
                formatter.write_dl(panels[panel])
