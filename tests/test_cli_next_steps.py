"""What a newcomer meets after each command: the files it leaves and the commands it prints next, on tiny pairs
(a target and a draft of another tokenizer, built in the test)."""

from __future__ import annotations

import json
import re
import shlex

from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.testing import save_tiny_pair, tiny_tokenizer


def _other_tokenizer_pair(root):
    """A tiny target and a draft whose tokenizer differs by two swapped tokens (a usable mapping)."""
    tdir, ddir = save_tiny_pair(root, 64)
    tiny_tokenizer(64, swap=(10, 20)).save_pretrained(ddir)
    return tdir, ddir


def _invoke(args):
    return CliRunner().invoke(app, args, terminal_width=400)


def test_vocab_swap_of_a_speculator_as_given_writes_a_plain_draft_not_the_text_proposer(tmp_path):
    """The re-indexed copy of an exported as-given speculator kept its speculators_config, so it still offered the
    text proposer (and named the old tokenizer's way of drafting) though it now speaks the target's tokenizer."""
    tdir, ddir = _other_tokenizer_pair(tmp_path)
    spec, swapped = tmp_path / "spec", tmp_path / "swapped"
    assert _invoke(["export", "--draft", ddir, "--target", tdir, "--out", str(spec)]).exit_code == 0
    assert json.loads((spec / "config.json").read_text())["speculators_config"]["default_proposal_method"] == "text"
    r = _invoke(["vocab-swap", "--draft", str(spec), "--target", tdir, "--out", str(swapped)])
    assert r.exit_code == 0, r.output
    config = json.loads((swapped / "config.json").read_text())
    assert not {k for k in config if k.startswith("speculators_")}, config
    # Exported again, the re-indexed draft is a token speculator of the target's tokenizer.
    r = _invoke(["export", "--draft", str(swapped), "--target", tdir, "--out", str(tmp_path / "spec2")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "spec2" / "config.json").read_text())["speculators_config"][
        "default_proposal_method"] == "greedy"


def test_vocab_swap_offers_the_export_of_the_re_indexed_draft_before_the_long_run(tmp_path):
    """vocab-swap's next: pointed only at `specdraft run` (the whole job: half an hour on the real pair), not at the
    seconds-long export of the draft it had just written."""
    tdir, ddir = _other_tokenizer_pair(tmp_path)
    swapped = tmp_path / "swapped"
    r = _invoke(["vocab-swap", "--draft", ddir, "--target", tdir, "--out", str(swapped)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    first = next(i for i, line in enumerate(lines) if "next:" in line)
    assert f"specdraft export --draft {swapped} --target {tdir} --out " in lines[first]
    assert any("specdraft run" in line for line in lines[first + 1:])


def test_generate_with_a_speculator_as_given_maps_the_vocabulary_without_being_asked(tmp_path):
    """A speculator exported as given (a draft of another tokenizer that says it drafts through text) was refused by
    generate without --map-vocab: the tokenizer report and exit 1, for the pair its own config.json names; so was
    the README's eval line for any pair of two tokenizers."""
    tdir, ddir = _other_tokenizer_pair(tmp_path)
    spec = tmp_path / "spec"
    assert _invoke(["export", "--draft", ddir, "--target", tdir, "--out", str(spec)]).exit_code == 0
    r = _invoke(["generate", "a b c", "--target", tdir, "--draft", str(spec), "--max-new-tokens", "4",
                 "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert "drafts through text" in " ".join(r.output.split())
    # A plain draft of another tokenizer is mapped too (its mapping is usable), unless --no-map-vocab refuses it.
    r = _invoke(["generate", "a b c", "--target", tdir, "--draft", ddir, "--max-new-tokens", "4",
                 "--dtype", "float32"])
    assert r.exit_code == 0 and "decoded as given, through a vocabulary mapping" in " ".join(r.output.split())
    r = _invoke(["generate", "a b c", "--target", tdir, "--draft", ddir, "--max-new-tokens", "4",
                 "--dtype", "float32", "--no-map-vocab"])
    assert r.exit_code == 1 and "Drop --no-map-vocab" in " ".join(r.output.split())


# ------------------------------------------------------------------ every printed command parses as printed

#: A command specdraft prints: after ``next:``, alone on a continuation line, or in backticks; up to two spaces (its
#: comment), a backtick or the line's end. ``specdraft check: target …`` (a pair line) is not one.
PRINTED = re.compile(r"(?:^\s*|next: |`)(specdraft (?![\w-]+:)[^`\n]*?)(?=`|  |\s*$)", re.MULTILINE)


def printed_commands(output: str) -> list[str]:
    """Every specdraft command in ``output`` (a command's whole output, at a width that wraps nothing)."""
    return [m.group(1) for m in PRINTED.finditer(output)]


def assert_parses(command: str) -> None:
    """``command`` as printed (shlex-split) passes the CLI's argument parsing: the subcommand exists, every flag is
    its own, every required option is given and every value is of its type; nothing runs."""
    import typer._click.exceptions as click_errors  # typer >= 0.29 vendors click (as specdraft.cli.errors reads it)
    import typer.main
    from typer._click import Context

    argv = shlex.split(command)
    assert argv[0] == "specdraft", command
    group = typer.main.get_command(app)
    sub = group.get_command(Context(group), argv[1])
    assert sub is not None, f"no command {argv[1]!r}: {command}"
    args = argv[2:]
    if hasattr(sub, "commands"):  # specdraft models prepare …
        sub, args = sub.get_command(Context(sub), args[0]), args[1:]
    try:
        ctx = sub.make_context(argv[1], list(args), parent=Context(group))
    except click_errors.UsageError as exc:
        raise AssertionError(f"{command}: {exc.format_message()}") from None
    assert not ctx.args, f"{command}: arguments it does not take: {ctx.args}"


def test_the_command_parser_check_refuses_a_wrong_flag_and_a_missing_required_option():
    assert_parses("specdraft export --draft D --target T --out SPECULATOR")
    for bad in ("specdraft export --draft D --out SPECULATOR", "specdraft export --draft D --target T --out O --x 1",
                "specdraft eval --gamma zero", "specdraft nosuch"):
        try:
            assert_parses(bad)
        except AssertionError:
            continue
        raise AssertionError(f"{bad} was taken")
    assert printed_commands("specdraft check: target a ← draft b\nnext: specdraft eval --target a  (why)\n"
                            "see `specdraft run --target a`, then") == ["specdraft eval --target a",
                                                                        "specdraft run --target a"]


def test_every_command_printed_on_the_way_from_check_to_a_speculator_parses_as_printed(tmp_path):
    """A printed next step with a missing required option or a flag its command lacks was found only by pasting it.
    Each command check, export, vocab-swap and inspect print for a tiny pair (of one tokenizer and of two) is parsed
    as printed, and llama.cpp's pricing commands too."""
    from specdraft.serving.gguf_export import rank_llama_cpp_command
    from specdraft.serving.llama_cpp import run_plan

    tdir, ddir = save_tiny_pair(tmp_path / "same", 64)
    other_t, other_d = _other_tokenizer_pair(tmp_path / "two")
    runs = {
        "check (one tokenizer)": ["check", "--target", tdir, "--draft", ddir, "--max-new-tokens", "2"],
        "check (two tokenizers)": ["check", "--target", other_t, "--draft", other_d],
        "export": ["export", "--draft", ddir, "--target", tdir, "--out", str(tmp_path / "spec")],
        "export as given": ["export", "--draft", other_d, "--target", other_t, "--out", str(tmp_path / "given")],
        "inspect as given": ["inspect", str(tmp_path / "given")],
        "vocab-swap": ["vocab-swap", "--draft", str(tmp_path / "given"), "--target", other_t,
                       "--out", str(tmp_path / "swapped")],
    }
    found = {}
    for name, args in runs.items():
        r = _invoke(args)
        assert r.exit_code in (0, 1), (name, r.output)
        found[name] = printed_commands(r.output)
    assert all(found[name] for name in ("check (one tokenizer)", "check (two tokenizers)", "export as given",
                                        "vocab-swap")), found
    found["llama.cpp"] = [rank_llama_cpp_command(t, "DRAFT", "/d.gguf") for t in (tdir, "/t.gguf",
                                                                                  "qwen2.5-coder-1.5b-instruct")]
    # An embedded target's packaged GGUF is rank's to find: no TARGET.gguf placeholder to fill (it failed as printed).
    assert "--target-gguf" not in found["llama.cpp"][2] and "--target-gguf TARGET.gguf" in found["llama.cpp"][0]
    plan = run_plan("another-target", "/d.gguf", 1000, None, "distilled", draft_ref="runs/x/speculator")
    found["llama.cpp plan"] = printed_commands(plan["basis"])
    for name, commands in found.items():
        for command in commands:
            assert_parses(command)
