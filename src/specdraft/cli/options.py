"""The flag vocabulary: one option per concept, declared once here and used by every command that takes it.

A concept a config holds (γ, the seed, the sampling triple, the dtype, ``--overwrite``) takes its help from the
:mod:`specdraft.config` field's description (no second wording) and its default from the field. Every prompt
source is one ``--prompts`` spec, ``name[:offset[:limit[:stride]]]``, read by one loader (:mod:`specdraft.prompts`).
Old spellings (``--verifier``, ``--data``, ``--num-prompts`` …) still work, hidden from ``--help``
(:func:`legacy_args`).

Nothing here imports torch: ``--help`` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel

from specdraft.config import (
    ADAPTIVE_MAX_SPECULATIVE_TOKENS,
    AUTO_DTYPE,
    MAX_SPECULATIVE_TOKENS,
    NUM_SPECULATIVE_TOKENS,
    DraftQuantization,
    ExportConfig,
    GammaPolicy,
    PipelineConfig,
    ProposalMode,
    SpeculativeTokens,
)
from specdraft.data import DATASETS, held_out_split_text  # json/gzip only, like config
from specdraft.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdraft.prompts import HELD_OUT_LIMIT, SPEC_GRAMMAR, SPEC_GRAMMAR_NO_STRIDE, PromptSet, select_prompts

__all__ = ["AUTO_DTYPE", "GAMMA_HELP"]

#: The prompt sources a ``--prompts`` spec names (the names come from specdraft.data's registry).
SOURCES_HELP = " | ".join(DATASETS) + " | a .jsonl | a saved dataset."
#: How every ``--prompts`` spec is written (:data:`specdraft.prompts.SPEC_GRAMMAR`).
SOURCE_SYNTAX = SPEC_GRAMMAR
#: Two lines of a user's ``.jsonl`` prompt file, shown in every ``--prompts`` help (narrow enough for 80 columns).
JSONL_EXAMPLE = ('{"prompt": "Reverse a string in Python."}', '{"messages":[{"role":"user","content":"Hi"}]}')
#: Commands that evaluate: a spec without an offset starts at an embedded dataset's held-out split there.
HELD_OUT_COMMANDS = frozenset({"eval", "rank"})


def field_help(config: type[BaseModel], name: str) -> str:
    """The description of ``config``'s field ``name``: the one wording of its flag's help."""
    return config.model_fields[name].description or ""


def config_option(config: type[BaseModel], name: str, *flags: str, note: str = "", default: Any = None,
                  **kwargs: Any):
    """The option of ``config``'s field ``name``: its default (unless ``default`` is given) and its description
    as help, ``note`` after; ``flags`` default to ``--field-name``."""
    field = config.model_fields[name]
    value = field.get_default(call_default_factory=True) if default is None else default
    return typer.Option(value, *flags, help=field_help(config, name) + note, **kwargs)


def dtype_option(config: type[BaseModel], note: str = "", default: str | None = None):
    """The ``--dtype`` of a command that loads models as ``config`` says; ``auto`` explained in the one wording
    (:data:`specdraft.config.AUTO_DTYPE`) where it is offered."""
    field = config.model_fields["dtype"]
    text = field.description or ""
    if "auto" in str(field.annotation):
        text = f"{text.rstrip('.')} ({AUTO_DTYPE})."
    return typer.Option(field.default if default is None else default, "--dtype", help=text + note)


def seed_option(config: type[BaseModel]):
    """``--seed``: default 0 everywhere, help from ``config``'s ``seed`` (what it seeds differs per stage)."""
    return config_option(config, "seed", "--seed")


def sampling_options(config: type[BaseModel]):
    """``--temperature``, ``--top-k``, ``--top-p``: the sampling triple of ``config`` (a
    :class:`~specdraft.config.SamplingConfig`, or a stage's own serving filter)."""
    return tuple(config_option(config, name, "--" + name.replace("_", "-")) for name in ("temperature", "top_k",
                                                                                          "top_p"))


#: The first clause of γ's description: every γ option's help starts with it.
GAMMA_HELP = SpeculativeTokens.__metadata__[0].description.split(";")[0]
GammaOpt = Annotated[int | None, typer.Option(
    "--gamma", "--num-speculative-tokens", "-g", min=1, max=MAX_SPECULATIVE_TOKENS,
    help=f"{SpeculativeTokens.__metadata__[0].description} The most a round drafts with --gamma-policy adaptive or "
    f"--draft-confidence-threshold; an exported speculator records it. Default: {ADAPTIVE_MAX_SPECULATIVE_TOKENS} "
    f"where γ adapts (--gamma-policy adaptive), else {NUM_SPECULATIVE_TOKENS}.", show_default=False)]

OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help=field_help(ExportConfig, "overwrite"))]


def target_option(default: str | None = DEFAULT_TARGET, note: str = ""):
    """``--target`` / ``-t``: required when ``default`` is ``...``; ``None`` means the preset's."""
    preset = " Default: the preset's." if default is None else ""
    return typer.Option(default, "--target", "-t", help=field_help(PipelineConfig, "target") + note + preset)


def draft_option(default: str | None = DEFAULT_DRAFT, note: str = ""):
    """``--draft`` / ``-d``: required when ``default`` is ``...``; ``None`` means the preset's."""
    preset = " Default: the preset's." if default is None else ""
    return typer.Option(default, "--draft", "-d", help=field_help(PipelineConfig, "draft") + note + preset)


def out_option(default: Path | None, what: str):
    """``--out`` / ``-o``: where a command writes ``what``; required when ``default`` is ``...``."""
    return typer.Option(default, "--out", "-o", help=what)


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
                 say=typer.echo) -> PromptSet:
    """The examples a prompt flag names (:func:`specdraft.prompts.select_prompts`: held out where the command
    evaluates, :data:`HELD_OUT_NOTE`), every line checked, with what will run said through ``say`` first:
    ``prompts: humaneval:100:8:1 (8 prompts, held out)``, and a warning per spec that gave fewer than its limit.

    Raises:
        specdraft.data.DataError: a malformed spec (names the flag, the bad part and the grammar), an unknown
            source, a malformed line.
    """
    chosen = select_prompts(specs, flag, held_out=held_out, strides=strides)
    for line in chosen.lines():
        say(line)
    return chosen


#: The meaning of a held-out flag's spec (:func:`specdraft.prompts.resolve_source`), said in its help.
HELD_OUT_NOTE = (" Held out: a spec without an offset starts at an embedded dataset's held-out split ("
                 + "; ".join(held_out_split_text(name) for name in DATASETS) + "; the presets train on the other "
                 f"rows), a file at its first line; without a limit, {HELD_OUT_LIMIT} prompts.")
#: The meaning of a training flag's spec (:func:`specdraft.prompts.parse_source`), said in its help.
TRAINING_NOTE = " A spec without an offset starts at the first example; without a limit, all of them."

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


# ---------------------------------------------------------------------------------------- old spellings

#: Flags renamed to the one vocabulary: the old spelling → today's (applied where the command has today's).
RENAMED = {"--verifier": "--target", "--data": "--prompts", "--train-data": "--train-prompts",
           "--eval-data": "--eval-prompts", "--ood-data": "--ood-prompts"}
#: The old count and offset flags of a prompt source, folded into its ``--prompts`` spec: flag → (part, least value).
SOURCE_PARTS = {"--num-prompts": ("limit", 1), "--num-examples": ("limit", 1), "--prompt-offset": ("offset", 0),
                "--offset": ("offset", 0)}


def legacy_args(cmd, args: list[str]) -> list[str]:
    """``args`` with the old spellings of ``cmd``'s flags rewritten: a renamed flag (:data:`RENAMED`) to its name,
    ``--num-prompts N`` / ``--prompt-offset K`` (``--num-examples`` / ``--offset``) into the ``--prompts`` spec
    ``name:K:N``. A bad count is refused as click refuses a value (``--num-prompts: 0 is not in the range x>=1``)."""
    from specdraft.cli.errors import fail

    opts = {o for p in cmd.params for o in getattr(p, "opts", ())}
    out: list[str] = []
    parts: dict[str, int] = {}
    it = iter(args)
    for a in it:
        if a == "--":
            out += [a, *it]
            break
        name, eq, value = a.partition("=")
        if name in RENAMED and RENAMED[name] in opts and name not in opts:
            out += [RENAMED[name], value] if eq else [RENAMED[name]]
        elif name == "--prompts" and eq:  # `--prompts=SPEC`: two tokens, so a count below can find its spec
            out += [name, value]
        elif name in SOURCE_PARTS and "--prompts" in opts and name not in opts:
            value = value if eq else next(it, "")
            part, least = SOURCE_PARTS[name]
            if not value.isdigit():
                fail(f"{name}: {value!r} is not a valid integer")
            if int(value) < least:
                fail(f"{name}: {value} is not in the range x>={least}")
            parts[part] = int(value)
        else:
            out.append(a)
    if not parts:
        return out
    given = [i for i, a in enumerate(out) if a == "--prompts" and i + 1 < len(out)]
    default = next(p.default for p in cmd.params if p.name == "prompts")
    spec = out[given[-1] + 1] if given else default if isinstance(default, str) else default[0]
    from specdraft.prompts import resolve_source

    source = resolve_source(spec, held_out=cmd.name in HELD_OUT_COMMANDS)
    source = source.replace(**parts)
    if given:
        out[given[-1] + 1] = source.spec
        return out
    return [*out, "--prompts", source.spec]
