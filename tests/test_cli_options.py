"""One flag vocabulary: each concept one option with one default and the config's wording, every flag whole in
every command's help at 80 columns, every command body short (parse → library call → render)."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from specdraft.cli import COMMANDS, GAMMA_HELP, app
from specdraft.core.config import (
    HELP_BY_COMMAND,
    SERVING_HELP,
    DistillConfig,
    DumpConfig,
    EvalConfig,
    ExportConfig,
    HeadroomConfig,
    SamplingConfig,
)


def _commands(cli: typer.Typer = app):
    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            yield f"{path} {name}".strip(), sub
            yield from walk(sub, f"{path} {name}".strip())

    return list(walk(typer.main.get_command(cli), ""))


def _params(name: str):
    """``{command path: click parameter}`` for the parameter ``name`` of every command that takes it."""
    return {path: p for path, cmd in _commands() for p in cmd.params if p.name == name}


def _options_by_flag():
    """``{flag: {command path: click option}}`` for every long flag of every command."""
    by_flag: dict[str, dict] = {}
    for path, cmd in _commands():
        for p in cmd.params:
            if getattr(p, "param_type_name", "") == "option":
                for flag in (*p.opts, *getattr(p, "secondary_opts", [])):
                    if flag.startswith("--"):
                        by_flag.setdefault(flag, {})[path] = p
    return by_flag


def test_each_concept_is_one_option_with_one_default_and_one_spelling_in_every_command():
    gammas = _params("gamma")
    assert {"eval", "generate", "rank", "export", "distill"} <= set(gammas) and not _params("num_speculative_tokens")
    for name, sources in (("gamma", None), ("overwrite", None), ("target", None), ("prompts", None)):
        params = _params(name)
        assert len({tuple(p.opts) for p in params.values()}) == 1, (name, {k: p.opts for k, p in params.items()})
    # γ of decoding (its default follows the gamma policy) and γ an exported speculator records (no policy): each
    # the description of the config field the command fills, both starting with γ's one wording.
    assert {p.default for p in gammas.values()} == {None}
    for path, p in gammas.items():
        cfg = ExportConfig if path in ("export", "distill") else EvalConfig
        assert p.help == cfg.model_fields["num_speculative_tokens"].description, path
        assert p.help.startswith(GAMMA_HELP), path
    for path in ("export", "distill"):
        assert "policy" not in gammas[path].help and "--" not in gammas[path].help, gammas[path].help
    overwrites = _params("overwrite")
    assert set(overwrites) == {"check", "eval", "rank", "headroom", "export", "vocab-swap", "run"}
    assert {p.help for path, p in overwrites.items() if path not in ("check", "run")} == {
        ExportConfig.model_fields["overwrite"].description}
    # The seed, the sampling triple and the dtype: default and help from the config the command fills.
    config_of = {"eval": EvalConfig, "generate": EvalConfig, "rank": EvalConfig, "dump": DumpConfig,
                 "distill": DistillConfig, "headroom": HeadroomConfig, "export": ExportConfig}
    # distill's serving filter is a SamplingConfig field with help of its own (test_the_serving_filter_and_…).
    sampling_of = config_of | {"eval": SamplingConfig, "generate": SamplingConfig, "rank": SamplingConfig,
                               "distill": None}
    for name in ("seed", "temperature", "top_k", "top_p"):
        for path, p in _params(name).items():
            cfg = (sampling_of if name in ("temperature", "top_k", "top_p") else config_of).get(path)
            if cfg is None:
                continue  # check's / vocab-swap's dtype (no config): the one wording, a default it states
            field = cfg.model_fields[name]
            assert p.default == field.default, (path, name)
            if name == "seed":  # worded per command: the lead and what this command seeds
                lead, by_command, _ = HELP_BY_COMMAND["seed"]
                assert p.help.startswith(lead) and by_command[path][1:] in p.help, (path, p.help)
            else:
                assert p.help == field.description, (path, name)
    assert {p.default for p in _params("seed").values()} == {0}
    assert {tuple(p.opts) for p in _params("out").values()} == {("--out", "-o")}
    assert set(_params("out")) >= {"eval", "rank", "dump", "distill", "run", "headroom", "export", "vocab-swap"}


#: Worded per command by design: every --prompts help is ``what: SYNTAX, name = SOURCES`` plus the command's note
#: (specdraft.cli.options.prompts_option); --dtype, --format, --out, --target and --draft say what this command does
#: with them and its own default (test_each_commands_help_speaks_only_of_that_command); --overwrite names what the
#: command writes (check's is its --json file: test_overwrite_names_only_what_its_command_writes); --json what the
#: command does with it; the fields of specdraft.core.config.HELP_BY_COMMAND (--seed, --max-new-tokens …) read a shared
#: lead and the command's own sentence; run's decoding flags default to the preset's
#: (test_a_shared_flags_help_in_each_command_names_no_other_command).
PER_COMMAND_WORDING = {"--prompts", "--dtype", "--format", "--out", "--target", "--draft", "--overwrite", "--json",
                       "--draft-quantization", "--draft-head-tokens", "--gamma-policy",
                       *("--" + name.replace("_", "-") for name in HELP_BY_COMMAND)}


def test_a_flag_spelled_the_same_in_two_commands_has_one_help_and_a_default_its_help_states():
    """--temperature was greedy 0 in eval and 1.0 in distill, --top-k the sampling filter everywhere but dump (the
    log-probs kept), --dtype had four defaults in seven wordings: now a flag name means one thing. Across every
    command, a flag spelled the same has one help; where its default differs between commands, that help names
    each command whose default is not the commonest one (the field description says which and why)."""
    for flag, params in _options_by_flag().items():
        if len(params) < 2 or flag in PER_COMMAND_WORDING:
            continue
        helps = {p.help for p in params.values()}
        if flag == "--gamma":  # two config fields (decoding's, the speculator's), checked above
            assert len(helps) == 2
        else:
            assert len(helps) == 1, (flag, {path: p.help for path, p in params.items()})
        defaults = {path: repr(p.default) for path, p in params.items()}
        if len(set(defaults.values())) == 1:
            continue
        common = max(set(defaults.values()), key=list(defaults.values()).count)
        for path, default in defaults.items():
            if default != common:
                assert re.search(rf"\b{re.escape(path)}\b", params[path].help), (flag, path, default, params[path].help)


def _value_type(p) -> tuple:
    """What one value of option ``p`` is, from typer's reading of its annotation: ``("choice", {values})`` for a
    ``Literal``, else the Python type's name (``Optional`` and ``list`` unwrapped: a repeatable flag's one value)."""
    a = p.type_descriptor.annotation
    if typing.get_origin(a) in (typing.Union, types.UnionType):
        a = next(x for x in typing.get_args(a) if x is not type(None))
    if typing.get_origin(a) is list:
        (a,) = typing.get_args(a)
    if typing.get_origin(a) is typing.Literal:
        return ("choice", frozenset(typing.get_args(a)))
    return (a.__name__,)


def _two_meanings(cli: typer.Typer) -> dict[str, dict[str, tuple]]:
    """``{flag: {command: (field, value type)}}`` for each long flag that means two things in ``cli``: another field
    (the parameter the value fills), another value type, or choices with no value in common (two vocabularies, as
    dump's hidden|topk beside export's speculator|gguf). A hidden option, a retired spelling kept to name its
    successor, is not a flag the user sees."""
    seen: dict[str, dict[str, tuple]] = {}
    for path, cmd in _commands(cli):
        for p in cmd.params:
            if getattr(p, "param_type_name", "") == "option" and not p.hidden:
                for flag in (*p.opts, *p.secondary_opts):
                    if flag.startswith("--"):
                        seen.setdefault(flag, {})[path] = (p.name, _value_type(p))
    two = {}
    for flag, by_command in seen.items():
        kinds = {(field, vt[0]) for field, vt in by_command.values()}
        choices = [vt[1] for _, vt in by_command.values() if vt[0] == "choice"]
        if len(kinds) > 1 or any(not a & b for a in choices for b in choices):
            two[flag] = by_command
    return two


def test_a_flag_name_means_one_field_and_one_value_type_in_every_command():
    """dump's --format (hidden|topk: what the teacher dump stores) and export's --format (speculator|gguf: what export
    writes) were one flag name for two unrelated settings, as check's --json (a file) and models' --json (a switch)
    were. Across every command a flag fills one config field with
    one type of value; choices offered under one flag share one vocabulary (export's --dtype adds keep to the
    model dtypes, distill offers two of them)."""
    two = _two_meanings(app)
    assert two == {}, two
    dump = {o: p for p in dict(_commands())["dump"].params for o in p.opts}
    assert dump["--teacher-format"].name == "teacher_format" and dump["--format"].hidden
    assert _value_type(dump["--teacher-format"]) == ("choice", frozenset({"hidden", "topk"}))
    check = {o: p for p in dict(_commands())["check"].params for o in p.opts}
    assert check["--out"].name == "out" and check["--json"].hidden


def test_the_flag_meaning_check_catches_one_flag_name_of_two_types():
    """The negative control: a toy app whose --format is a choice of forms in one command and a count in another,
    whose --k fills two fields, and whose --kind offers two vocabularies, is caught thrice; the same flag of one
    field and one type, and a hidden retired spelling, are not."""
    toy = typer.Typer()

    @toy.command()
    def write(format: typing.Literal["speculator", "gguf"] = typer.Option("speculator", "--format"),
              kind: typing.Literal["a", "b"] = typer.Option("a", "--kind"), k: int = typer.Option(1, "--k"),
              out: Path = typer.Option(Path("x"), "--out")) -> None:
        pass

    @toy.command()
    def store(format: int = typer.Option(1, "--format"), kind: typing.Literal["c"] = typer.Option("c", "--kind"),
              top_k: int = typer.Option(1, "--k"), out: Path | None = typer.Option(None, "--out"),
              old: str | None = typer.Option(None, "--old", hidden=True)) -> None:
        pass

    @toy.command()
    def read(old: int = typer.Option(0, "--old")) -> None:
        pass

    two = _two_meanings(toy)
    assert set(two) == {"--format", "--kind", "--k"}, two
    assert two["--format"] == {"write": ("format", ("choice", frozenset({"speculator", "gguf"}))),
                               "store": ("format", ("int",))}
    assert {field for field, _ in two["--k"].values()} == {"k", "top_k"}


def test_the_serving_filter_and_the_stored_log_probs_are_flags_of_their_own():
    """Distillation's serving filter (what tvd_deploy and α are computed after) and the dump's stored log-probs
    count are not decoding's --temperature / --top-k / --top-p: each has its own flag, its field's help."""
    group = typer.main.get_command(app)
    dump = {o: p for p in group.commands["dump"].params for o in p.opts}
    assert "--top-k" not in dump and dump["--top-logprobs"].name == "top_logprobs"
    assert dump["--top-logprobs"].help == DumpConfig.model_fields["top_logprobs"].description
    distill = {o: p for p in group.commands["distill"].params for o in p.opts}
    for name in ("temperature", "top_k", "top_p"):
        assert "--" + name.replace("_", "-") not in distill
        p = distill["--serving-" + name.replace("_", "-")]
        assert p.help == SERVING_HELP[name] and p.help in DistillConfig.model_fields["serving"].description
        assert p.help.startswith("Serving filter") and p.default == getattr(DistillConfig().serving, name)


@pytest.mark.parametrize(("args", "old"), [
    (["convert", "--help"], "command 'convert'"),
    (["eval", "--num-speculative-tokens", "3"], "option: --num-speculative-tokens"),
    (["export", "--verifier", "t"], "option: --verifier"),
    (["dump", "--data", "x"], "option: --data"),
    (["eval", "--num-prompts", "3"], "option: --num-prompts"),
    (["dump", "--num-examples", "3"], "option: --num-examples"),
    (["eval", "--prompt-offset", "3"], "option: --prompt-offset"),
    (["dump", "--offset", "3"], "option: --offset"),
    (["run", "--train-data", "x"], "option: --train-data"),
    (["dump", "--top-k", "8"], "option: --top-k"),
    (["distill", "--temperature", "0.7"], "option: --temperature"),
])
def test_a_removed_old_spelling_is_refused_as_no_such_name(args, old):
    r = CliRunner().invoke(app, args, terminal_width=200, prog_name="specdraft")
    assert r.exit_code == 2 and r.output.startswith(f"error: No such {old}"), r.output


def test_writing_a_speculator_is_one_verb_in_the_command_line_and_the_library():
    import specdraft
    from specdraft.serving import export

    r = CliRunner().invoke(app, ["--help"], terminal_width=80)
    listed = {line.split()[0] for line in r.output.splitlines() if line.startswith("  ") and line.split()}
    assert "export" in listed and "convert" not in listed, r.output
    for name in ("convert", "ConvertResult", "copy_speculator"):
        assert not hasattr(export, name) and name not in specdraft.__all__, name

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


def test_every_flag_an_example_in_docs_cli_md_uses_is_one_its_commands_help_lists():
    """docs/cli.md showed --data, --num-examples and --num-speculative-tokens after they were renamed."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    examples = text.split("## Examples", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = dict(_commands())
    checked = 0
    for line in examples.splitlines():
        words = line.split("#", 1)[0].split()
        if "specdraft" not in words and "specdraft.cli" not in words:
            continue
        rest = words[words.index("specdraft" if "specdraft" in words else "specdraft.cli") + 1:]
        path = " ".join(rest[:2]) if " ".join(rest[:2]) in commands else rest[0]
        flags = {o for p in commands[path].params for o in (*p.opts, *getattr(p, "secondary_opts", []))}
        for word in rest:
            if word.startswith("--"):
                assert word.split("=", 1)[0] in flags, (line, word)
                checked += 1
    assert checked > 20


def test_overwrite_names_only_what_its_command_writes():
    """check's --overwrite said "Replace what --out holds" when check had no --out (its file was --json's): each
    command's --overwrite names only flags it has."""
    for path, cmd in _commands():
        flags = {f for p in cmd.params for f in getattr(p, "opts", ())}
        for p in cmd.params:
            if p.name == "overwrite":
                named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", p.help))
                assert named and named <= flags, (path, named - flags, p.help)
    assert "--out" in _params("overwrite")["check"].help


def test_exports_target_help_says_a_gguf_target_is_taken_for_llama_cpp():
    """export --format gguf takes the target's .gguf (and prints the command serving it); --help did not say so."""
    text = " ".join(_params("target")["export"].help.split())
    assert "With --format gguf also the target's own .gguf file" in text and "TARGET.gguf" in text
    assert ".gguf" not in _params("target")["eval"].help


def test_each_commands_help_speaks_only_of_that_command():
    """export's --dtype help opened with an `auto` it rejects and listed every command's default, its --format help
    described dump's formats (dump's is --teacher-format now), and a required --draft said both "Default: …" and "[required]"."""
    from specdraft.core.config import DTYPE_BY_COMMAND

    commands = set(DTYPE_BY_COMMAND)
    for path, p in _params("dtype").items():
        others = {c for c in commands - {path} if re.search(rf"\b{re.escape(c)}\b", p.help.replace(path, ""))}
        assert not others, (path, others, p.help)
        offered = "auto" in (getattr(p.type_descriptor, "choices", None) or ())
        assert bool(re.search(r"\bauto\b", p.help)) == offered, (path, p.help)
    export_dtype = _params("dtype")["export"].help
    assert export_dtype.startswith("Weights dtype. Export's keep (the default) writes the draft's tensors")
    export_format, (dump_format,) = _params("format")["export"], _params("teacher_format").values()
    assert export_format.help.startswith("What export writes: speculator") and "topk" not in export_format.help
    assert dump_format.help.startswith("What the dump stores of the target's distribution: hidden")
    assert "gguf" not in dump_format.help and "export" not in dump_format.help
    for name in ("target", "draft", "out"):
        for path, p in _params(name).items():
            assert not (p.required and "Default" in p.help), (path, name, p.help)
            if name == "out":
                assert p.help.startswith(f"Where {path} writes "), (path, p.help)
                assert "runs/COMMAND" not in p.help and "need it" not in p.help, (path, p.help)
    assert _params("draft")["eval"].help.endswith("Default: qwen2.5-coder-0.5b-instruct (the embedded pair's draft).")
    assert _params("draft")["run"].help.endswith("Default: the preset's.")
    assert "the preset's" not in _params("target")["check"].help and "export needs" not in _params("draft")["eval"].help


#: Where a flag's help names another command on purpose: the command to read first, or to run next, on what this
#: one works with; each entry must still be there (a stale one fails).
NAMES_ANOTHER_COMMAND = {
    ("eval", "--map-vocab"): {"check"},  # check says whether a pair's vocabulary mapping is usable and lossless
    ("generate", "--map-vocab"): {"check"},
    ("vocab-swap", "--prompts"): {"headroom"},  # the swap diagnostic's prompts; headroom on the swapped draft next
}


def _commands_named(text: str) -> set[str]:
    """The top-level commands ``text`` names as whole words (a flag such as --generate or --vocab-swap is not one)."""
    names = typer.main.get_command(app).commands
    return {n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text, re.IGNORECASE)}


def test_a_shared_flags_help_in_each_command_names_no_other_command():
    """check's --max-new-tokens explained eval's, rank's and generate's defaults, its --json said what models does,
    --seed described dump's and distill's seeding in eval, --batch-size and --max-length listed each other command's
    default, and --overwrite spoke of "a stage of a run" in commands that have no stages. Now every flag that two or
    more commands take speaks, in each command's --help, of that command only; where a command has a default of its
    own, its help says that default; --overwrite speaks of a run's stages in run alone."""
    commands = dict(_commands())
    shared = {flag: params for flag, params in _options_by_flag().items()  # a --no-… spelling is its option's
              if len(params) > 1 and all(flag in p.opts for p in params.values())}
    assert len(commands) >= 10 and {"--seed", "--max-new-tokens", "--batch-size", "--max-length", "--overwrite",
                                    "--json", "--generate", "--dtype", "--gamma-policy"} <= set(shared), shared.keys()
    excepted = set()
    for flag, params in shared.items():
        for path, p in params.items():
            named = _commands_named(p.help) - {path.split()[0]}
            allowed = NAMES_ANOTHER_COMMAND.get((path, flag), set())
            excepted |= {(path, flag)} if named & allowed else set()
            assert named <= allowed, (path, flag, named - allowed, p.help)
    assert excepted == set(NAMES_ANOTHER_COMMAND)
    # Worded per command: each command's sentence (so the helps differ), naming its command and its own default.
    for name in HELP_BY_COMMAND:
        params = _params(name)
        assert len(params) > 1 and len({p.help for p in params.values()}) == len(params), (name, params)
        for path, p in params.items():
            assert re.search(rf"\b{path}\b", p.help, re.IGNORECASE), (path, name, p.help)
            if p.default is not None and name != "seed":
                assert re.search(rf"\b{p.default}\b", p.help), (path, name, p.default, p.help)
    assert set(_params("json_out")) == {"models"} and "table" in _params("json_out")["models"].help
    assert "check writes the report as JSON, a file" in _params("out")["check"].help
    for path, p in _params("overwrite").items():
        assert ("stage of a run" in p.help) == (path == "run"), (path, p.help)
    for name in ("draft_quantization", "draft_head_tokens", "gamma_policy"):  # run's: the preset's, not auto's
        for path, p in _params(name).items():
            said = p.help.rsplit(" Default", 1)[1]
            assert (said == ": the preset's.") == (path == "run") and p.help.count("Default") == 1, (path, p.help)
