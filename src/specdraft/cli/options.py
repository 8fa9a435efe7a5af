"""The flag vocabulary: one option per concept, declared once here and used by every command that takes it.

A flag fills one config field with one type of value in every command; its help is the field's description and its
default the field's, or, where the flag's default is the command's own (``--dtype``, ``--seed`` …), that command's
sentence of a per-command table. Every prompt source is one ``--prompts`` spec (:mod:`specdraft.data.prompts`). No torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, get_args

import typer
from pydantic import BaseModel

from specdraft.core.config import (
    AUTO_DTYPE,
    DTYPE_BY_COMMAND,
    HELP_BY_COMMAND,
    MAX_SPECULATIVE_TOKENS,
    EvalConfig,
    ExportConfig,
    PipelineConfig,
    SpeculativeTokens,
    command_help,
)
from specdraft.core.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdraft.data.prompts import (
    HELD_OUT_LIMIT,
    SPEC_GRAMMAR,
    SPEC_GRAMMAR_NO_STRIDE,
    PromptSet,
    select_prompts,
)
from specdraft.data.sources import DATASETS, held_out_split_text  # json/gzip only, like config

__all__ = ["AUTO_DTYPE", "GAMMA_HELP"]

#: The prompt sources a ``--prompts`` spec names (the names come from specdraft.data.sources's registry).
SOURCES_HELP = " | ".join(DATASETS) + " | a .jsonl | a saved dataset."
#: How every ``--prompts`` spec is written (:data:`specdraft.data.prompts.SPEC_GRAMMAR`).
SOURCE_SYNTAX = SPEC_GRAMMAR
#: Two lines of a user's ``.jsonl`` prompt file, shown in every ``--prompts`` help (narrow enough for 80 columns).
JSONL_EXAMPLE = ('{"prompt": "Reverse a string in Python."}', '{"messages":[{"role":"user","content":"Hi"}]}')

def field_help(config: type[BaseModel], name: str) -> str:
    """The description of ``config``'s field ``name``: the one wording of its flag's help."""
    return config.model_fields[name].description or ""


#: ``config_option``'s "no default given": the field's default is the option's.
_FIELD_DEFAULT: Any = object()


def config_option(config: type[BaseModel], name: str, *flags: str, default: Any = _FIELD_DEFAULT,
                  command: str | None = None, **kwargs: Any):
    """The option of ``config``'s field ``name``: the field's description as help, the field's default unless
    ``default`` is given (a command whose default differs, as its help says; ``None`` where the command fills it from
    elsewhere, ``...`` where it is required); ``flags`` default to ``--field-name``.

    A field worded per command (:data:`specdraft.core.config.HELP_BY_COMMAND`) needs ``command``: its help is the lead
    and that command's own sentence, never another command's.
    """
    if default is _FIELD_DEFAULT:
        default = config.model_fields[name].get_default(call_default_factory=True)
    flags = flags or ("--" + name.replace("_", "-"),)
    if name in HELP_BY_COMMAND and "help" not in kwargs:
        if command is None:
            raise TypeError(f"--{name.replace('_', '-')} is worded per command: give config_option its command")
        lead, by_command, tail = HELP_BY_COMMAND[name]
        kwargs["help"] = command_help(lead, by_command, command, tail)
    kwargs.setdefault("help", field_help(config, name))
    return typer.Option(default, *flags, **kwargs)


def preset_option(config: type[BaseModel], name: str, **kwargs: Any):
    """An option of ``run`` that overrides one field of its preset's ``config``: the field's description with its
    default clause (its last sentence, ``Default …``) said as the preset's; default ``None``, the preset's value."""
    body = field_help(config, name).rsplit(" Default", 1)[0]
    return config_option(config, name, default=None, help=f"{body} Default: the preset's.", show_default=False,
                         **kwargs)


def dtype_option(config: type[BaseModel], command: str, default: Any = _FIELD_DEFAULT):
    """``--dtype`` of ``command``, whose weights ``config`` describes: what auto means where the command offers it,
    and the command's own default and why (:data:`specdraft.core.config.DTYPE_BY_COMMAND`), never another command's."""
    auto = f" ({AUTO_DTYPE})" if "auto" in get_args(config.model_fields["dtype"].annotation) else ""
    return config_option(config, "dtype", "--dtype", default=default,
                         help=f"Weights dtype{auto}. {DTYPE_BY_COMMAND[command][0].upper()}{DTYPE_BY_COMMAND[command][1:]}.")


def seed_option(config: type[BaseModel], command: str):
    """``--seed`` of ``command``: default 0, the lead and what it seeds in this command
    (:data:`specdraft.core.config.SEED_BY_COMMAND`)."""
    return config_option(config, "seed", "--seed", command=command)


def sampling_options(config: type[BaseModel], prefix: str = ""):
    """``--temperature``, ``--top-k``, ``--top-p`` of ``config`` (a :class:`~specdraft.core.config.SamplingConfig`), or
    with ``prefix`` ``"serving-"`` a stage's own serving filter (``--serving-temperature`` …)."""
    return tuple(config_option(config, name, f"--{prefix}{name.replace('_', '-')}")
                 for name in ("temperature", "top_k", "top_p"))


#: The first clause of γ's description: every γ option's help starts with it.
GAMMA_HELP = SpeculativeTokens.__metadata__[0].description.split(";")[0]
#: γ of decoding (eval, generate, rank): its default depends on the gamma policy, as its description says.
GammaOpt = Annotated[int | None, typer.Option(
    "--gamma", "-g", min=1, max=MAX_SPECULATIVE_TOKENS, help=field_help(EvalConfig, "num_speculative_tokens"),
    show_default=False)]
#: γ an exported speculator records (export, distill): default 5, no policy.
SpeculatorGammaOpt = Annotated[int | None, typer.Option(
    "--gamma", "-g", min=1, max=MAX_SPECULATIVE_TOKENS, help=field_help(ExportConfig, "num_speculative_tokens"),
    show_default=False)]

#: distill's and run's: a finished training's Trainer checkpoints (several times the draft's size) are removed.
KeepCheckpointsOpt = Annotated[bool, typer.Option(
    "--keep-checkpoints", help="Keep the Trainer checkpoints once the distillation has finished (removed by default: "
    "each is several times the draft's size, and a finished training is not resumed).")]

def _model_default(role: str, default: str | None) -> str:
    """What a ``--target`` / ``--draft`` of this ``default`` falls back to: the embedded model, the preset's, or
    nothing where it is required (typer says ``[required]``)."""
    if default is None:
        return " Default: the preset's."
    return "" if default is ... else f" Default: {default} (the embedded pair's {role})."


def target_option(default: str | None = DEFAULT_TARGET, note: str = ""):
    """``--target`` / ``-t``: required when ``default`` is ``...``; ``None`` means the preset's; ``note``: what this
    command also accepts (export's .gguf target)."""
    return typer.Option(default, "--target", "-t", show_default=False,
                        help=field_help(PipelineConfig, "target") + note + _model_default("target", default))


#: export's --target: what --format gguf does with it (:func:`specdraft.serving.gguf_export.target_gguf_path`).
GGUF_TARGET_NOTE = (" With --format gguf also the target's own .gguf file: the draft's vocabulary is checked against "
                    "it and the printed llama.cpp command serves it (a model reference: its vocabulary is converted "
                    "for the comparison and the command names TARGET.gguf; an embedded target: its packaged GGUF).")


def draft_option(default: str | None = DEFAULT_DRAFT):
    """``--draft`` / ``-d``: required when ``default`` is ``...``; ``None`` means the preset's."""
    return typer.Option(default, "--draft", "-d", show_default=False,
                        help=field_help(PipelineConfig, "draft") + _model_default("draft", default))


#: What each command writes into ``--out``.
OUT_WHAT = {
    "eval": "report.json and the plots",
    "rank": "rank.json (and the confirmation's report)",
    "headroom": "the forecast, as a JSON file (nothing is written without one)",
    "dump": "the teacher dump: shards and a manifest (an unfinished or finished dump of the same plan is resumed)",
    "distill": "checkpoints/, speculator/ and training.json (an interrupted training is resumed)",
    "export": "the speculator directory (--format gguf: the .gguf file)",
    "vocab-swap": "the re-indexed draft, a plain HF checkpoint",
    "run": "every stage's results, the run directory (a rerun resumes it)",
    "check": "the report as JSON, a file, beside the printed report (nothing is written without one)",
}


def out_option(default: Path | None, command: str):
    """``--out`` / ``-o`` of ``command`` (:data:`OUT_WHAT`): required when ``default`` is ``...``."""
    return typer.Option(default, "--out", "-o", help=f"Where {command} writes {OUT_WHAT[command]}; checked before any "
                        "model loads.")


#: ``--overwrite`` where it replaces more, or other, than what ``--out`` holds (the config's wording,
#: :data:`specdraft.core.config.Overwrite`): run's directory holds stages.
OVERWRITE_BY_COMMAND = {
    "run": field_help(ExportConfig, "overwrite")[:-1] + ", or a stage of a run made from other inputs (other prompts "
           "or settings).",
}


def retired_option(command: str, flag: str, now: str):
    """``flag``, retired from ``command`` for ``now``: hidden from ``--help``, kept so that giving it is one error
    naming ``now`` (:func:`specdraft.cli.errors.refuse_retired`) rather than click's bare "no such option"."""
    return typer.Option(None, flag, hidden=True, help=f"Retired: {command}'s {now}.")


def overwrite_option(command: str):
    """``--overwrite`` of ``command``: what it replaces instead of refusing (:data:`OVERWRITE_BY_COMMAND`, else what
    its ``--out`` holds, :data:`OUT_WHAT`)."""
    if command in OVERWRITE_BY_COMMAND:
        return typer.Option(False, "--overwrite", help=OVERWRITE_BY_COMMAND[command])
    if command not in OUT_WHAT:
        raise KeyError(f"{command} has neither --out nor a --overwrite of its own")
    return typer.Option(False, "--overwrite", help=field_help(ExportConfig, "overwrite"))


def prompts_option(default: str | list[str] | None, what: str, note: str = "", flag: str = "--prompts",
                   strides: bool = True):
    """A prompt source option: ``name[:offset[:limit[:stride]]]`` specs (without the stride where ``strides`` is
    False), repeatable where ``default`` is a list; ``--prompts`` shows two lines of a ``.jsonl`` file."""
    many = isinstance(default, list) or default is None
    grammar = SPEC_GRAMMAR if strides else SPEC_GRAMMAR_NO_STRIDE
    # "\b" keeps click from joining the example's lines; the last paragraph takes typer's "[default: …]".
    example = ("\n\n\b\nA .jsonl holds one JSON object a line, e.g.\n" + "\n".join(JSONL_EXAMPLE) + "\n\n"
               if flag == "--prompts" else " ")
    return typer.Option(default, flag, help=f"{what}: {grammar}{' (repeatable)' if many else ''}, name = "
                        f"{SOURCES_HELP}{note}{example}What they resolve to is printed before any model loads.")


def read_prompts(specs: str | list[str], flag: str = "--prompts", *, held_out: bool = False, strides: bool = True,
                 unique: bool = False, say=typer.echo) -> PromptSet:
    """The examples a prompt flag names (:func:`specdraft.data.prompts.select_prompts`: held out where the command
    evaluates, :data:`HELD_OUT_NOTE`; with ``unique`` a repeated prompt dropped, for a teacher that answers greedily),
    every line checked, with what will run said through ``say`` first: ``prompts: humaneval:100:8:1 (8 prompts, held
    out)``, and a warning per spec that gave fewer than its limit.

    Raises:
        specdraft.data.sources.DataError: a malformed spec (names the flag, the bad part and the grammar), an unknown
            source, a malformed line.
    """
    chosen = select_prompts(specs, flag, held_out=held_out, unique=unique, strides=strides)
    for line in chosen.lines():
        say(line)
    return chosen


#: The meaning of a held-out flag's spec (:func:`specdraft.data.prompts.resolve_source`), said in its help.
HELD_OUT_NOTE = (" Held out: a spec without an offset starts at an embedded dataset's held-out split ("
                 + "; ".join(held_out_split_text(name) for name in DATASETS) + "; the presets train on the other "
                 f"rows), a file at its first line; without a limit, {HELD_OUT_LIMIT} prompts.")
#: The meaning of a training flag's spec (:func:`specdraft.data.prompts.parse_source`), said in its help.
TRAINING_NOTE = (" A spec without an offset starts at the first example; without a limit, all of them. Where the "
                 "teacher answers greedily, a repeated prompt is dropped before the limit counts (its answer would "
                 "repeat).")

MapVocabOpt = Annotated[bool | None, typer.Option(
    "--map-vocab/--no-map-vocab", show_default=False,
    help="A draft with another tokenizer is decoded as given through a vocabulary mapping (it re-reads the context as "
    "text and proposes text, greedy, or tokens with a string-identical target twin, sampling; lossless, see specdraft "
    "check) whenever the mapping is usable; --no-map-vocab refuses such a pair instead.")]

