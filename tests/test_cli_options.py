"""One flag vocabulary: each concept one option with one default and the config's wording, every flag whole in
every command's help at 80 columns, every command body short (parse → library call → render)."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

import pytest
import typer.main
from typer.testing import CliRunner

from specdraft.cli import COMMANDS, app
from specdraft.config import (
    DistillConfig,
    DumpConfig,
    EvalConfig,
    ExportConfig,
    HeadroomConfig,
    SamplingConfig,
)


def _commands():
    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            yield f"{path} {name}".strip(), sub
            yield from walk(sub, f"{path} {name}".strip())

    return list(walk(typer.main.get_command(app), ""))


def _params(name: str):
    """``{command path: click parameter}`` for the parameter ``name`` of every command that takes it."""
    return {path: p for path, cmd in _commands() for p in cmd.params if p.name == name}


def test_each_concept_is_one_option_with_one_default_and_one_spelling_in_every_command():
    gammas = _params("gamma")
    assert {"eval", "generate", "rank", "export", "distill"} <= set(gammas) and not _params("num_speculative_tokens")
    for name, sources in (("gamma", None), ("overwrite", None), ("target", None), ("prompts", None)):
        params = _params(name)
        assert len({tuple(p.opts) for p in params.values()}) == 1, (name, {k: p.opts for k, p in params.items()})
    assert len({p.help for p in gammas.values()}) == 1 and {p.default for p in gammas.values()} == {None}
    overwrites = _params("overwrite")
    assert set(overwrites) == {"check", "eval", "rank", "headroom", "export", "vocab-swap", "run"}
    assert {p.help for p in overwrites.values()} == {ExportConfig.model_fields["overwrite"].description}
    # The seed, the sampling triple and the dtype: default and help from the config the command fills.
    config_of = {"eval": EvalConfig, "generate": EvalConfig, "rank": EvalConfig, "dump": DumpConfig,
                 "distill": DistillConfig, "headroom": HeadroomConfig}
    sampling_of = config_of | {"eval": SamplingConfig, "generate": SamplingConfig, "rank": SamplingConfig}
    for name in ("seed", "temperature", "top_k", "top_p", "dtype"):
        for path, p in _params(name).items():
            if path == "dump" and name == "top_k":  # the dump's top-k is the log-probs kept, not sampling
                continue
            cfg = (sampling_of if name in ("temperature", "top_k", "top_p") else config_of).get(path)
            if cfg is None:
                continue  # check's / vocab-swap's dtype (no config): default of their own, wording of eval's
            field = cfg.model_fields[name]
            assert p.default == field.default and p.help.startswith(field.description.rstrip(".")), (path, name)
    assert {p.default for p in _params("seed").values()} == {0}
    assert {tuple(p.opts) for p in _params("out").values()} == {("--out", "-o")}
    assert set(_params("out")) >= {"eval", "rank", "dump", "distill", "run", "headroom", "export", "vocab-swap"}


@pytest.mark.parametrize(("args", "spec"), [
    (["--num-prompts", "3"], "humaneval:100:3"),
    (["--prompts", "mt-bench", "--num-prompts", "2"], "mt-bench:0:2"),
    (["--prompts", "x.jsonl", "--prompt-offset", "2", "--num-prompts", "1"], "x.jsonl:2:1"),
])
def test_old_prompt_flags_fold_into_the_one_spec(args, spec):
    from specdraft.cli.options import legacy_args

    cmd = typer.main.get_command(app).commands["eval"]
    out = legacy_args(cmd, args)
    assert out[out.index("--prompts") + 1] == spec and "--num-prompts" not in out


def test_renamed_flags_still_read_and_a_spec_resolves_to_the_held_out_split():
    from specdraft.cli.options import legacy_args
    from specdraft.prompts import resolve_source

    group = typer.main.get_command(app)
    assert legacy_args(group.commands["export"], ["--verifier", "t"]) == ["--target", "t"]
    assert legacy_args(group.commands["dump"], ["--data=x", "--offset", "4"])[-2:] == ["--prompts", "x:4"]
    assert resolve_source("humaneval", held_out=True).offset == 100
    assert resolve_source("humaneval").offset == 0 and resolve_source("mt-bench:0:27:3").stride == 3


def test_writing_a_speculator_is_one_verb_and_the_old_command_name_still_runs_it():
    """convert (the command), export (the library, the pipeline's stage) and copy (the pipeline's call) named one act:
    the command is export now; convert runs the same command, unlisted, and the library's old names are aliases."""
    from specdraft import export

    r = CliRunner().invoke(app, ["--help"], terminal_width=80)
    listed = {line.split()[0] for line in r.output.splitlines() if line.startswith("  ") and line.split()}
    assert "export" in listed and "convert" not in listed, r.output
    group = typer.main.get_command(app)
    with group.make_context("specdraft", ["export", "--help"], resilient_parsing=True) as ctx:
        assert group.get_command(ctx, "convert") is group.get_command(ctx, "export") is not None
    old = CliRunner().invoke(app, ["convert", "--help"], terminal_width=80, prog_name="specdraft")
    new = CliRunner().invoke(app, ["export", "--help"], terminal_width=80, prog_name="specdraft")
    assert old.exit_code == new.exit_code == 0
    assert old.output.replace("specdraft convert", "specdraft export") == new.output
    assert export.convert is export.export_draft and export.ConvertResult is export.ExportResult
    assert export.copy_speculator is export.export_saved_speculator

def test_command_summaries_are_whole_sentences_at_80_columns():
    """`specdraft --help` cut summaries mid-sentence ("…over the...") and vocab-swap's was a paragraph: each
    command's first paragraph is now one sentence that the 80-column list shows whole."""
    for path, cmd in _commands():
        first = cmd.help.split("\n\n")[0]
        assert "\n" not in first and first.endswith("."), (path, first)
        assert cmd.get_short_help_str(limit=80 - 6 - len("vocab-swap")) == first, path
    for args in ([], ["models"]):
        r = CliRunner().invoke(app, [*args, "--help"], terminal_width=80, env={"COLUMNS": "80"})
        # The commands follow the options, under their panels (main job / stages / tools) or "Commands:".
        assert r.exit_code == 0 and "..." not in r.output.split("Options:")[1], r.output


@pytest.mark.parametrize("path", [path for path, _ in _commands()])
def test_every_flag_is_whole_in_every_commands_help_at_80_columns(path):
    cmd = dict(_commands())[path]
    r = CliRunner().invoke(app, [*path.split(), "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert r.exit_code == 0, r.output
    assert "…" not in r.output and max(len(line) for line in r.output.splitlines()) <= 80
    for p in cmd.params:
        for flag in (*p.opts, *getattr(p, "secondary_opts", [])):
            if flag.startswith("--") and not getattr(p, "hidden", False):
                assert re.search(rf"(^|[\s,/]){re.escape(flag)}([\s,=/]|$)", r.output, re.MULTILINE), (path, flag)


@pytest.mark.parametrize(("name", "callback"), [(n, c) for n, c, _, _ in COMMANDS])
def test_every_command_body_is_short(name, callback):
    """Parse → one library call → render: the body after the docstring is at most about 40 lines."""
    fn = ast.parse(textwrap.dedent(inspect.getsource(callback))).body[0]
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body
    lines = body[-1].end_lineno - body[0].lineno + 1
    assert lines <= 40, (name, lines)
