"""The command line as a user meets it: expected errors as one line and exit 2, whole model names, a user's own
prompt file read from its first line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.testing import save_tiny_pair


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def test_decode_error_reaches_the_user_as_one_line_and_exit_2(tmp_path):
    """A prompt longer than the draft's window is the user's to fix: a message, not a traceback."""
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    cfg_path = tmp_path / "draft" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = 24
    cfg_path.write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["generate", "a b c d e f g h", "--target", tdir, "--draft", ddir,
                                 "--max-new-tokens", "20", "--gamma", "3", "--dtype", "float32"])
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit)  # handled, not an uncaught DecodeError
    assert "Traceback" not in r.output
    (line,) = _error_lines(r.output)
    assert "draft's context window (24)" in " ".join(r.output.split())
    assert line.startswith("error: prompt (")


def test_unexpected_errors_keep_their_traceback(tmp_path, monkeypatch):
    """Only the expected error types become messages: a bug still surfaces as itself."""
    import specdraft.data

    def broken(*_a, **_k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(specdraft.data, "load_examples", broken)
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", "x.jsonl"])
    assert isinstance(r.exception, RuntimeError) and str(r.exception) == "a bug"


def test_data_and_model_errors_are_exit_2(tmp_path):
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", str(tmp_path / "none.txt")])
    assert r.exit_code == 2 and len(_error_lines(r.output)) == 1 and "Unknown prompt source" in r.output
    r = CliRunner().invoke(app, ["check", "--target", str(tmp_path / "nowhere"), "--draft", ddir])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert _error_lines(r.output) == [f"error: {tmp_path / 'nowhere'} does not exist"]


def test_expected_error_is_one_line_however_long(tmp_path):
    """rich wraps at the terminal width (80 in a pipe): an error line stays whole, without pydantic's prefix."""
    r = CliRunner().invoke(app, ["dump", "--out", str(tmp_path / "d"), "--temperature", "0.5"], terminal_width=40,
                           env={"COLUMNS": "40"})
    assert r.exit_code == 2, r.output
    msg = "error: --temperature only applies with --generate N (the target writes the responses)"
    assert len(msg) > 80 and r.output.splitlines() == [msg]


def test_check_given_two_positional_models_names_the_flags():
    r = CliRunner().invoke(app, ["check", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)
    (line,) = _error_lines(r.output)
    assert line.endswith("pass them as --target qwen2.5-coder-1.5b-instruct --draft smollm2-135m-instruct")


def test_version():
    from specdraft import __version__

    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output == f"specdraft {__version__}\n"


def _options():
    """``(command path, click parameter)`` for every visible option of every command."""
    import typer.main

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, f"{path} {name}".strip())
        for p in cmd.params:
            if not getattr(p, "hidden", False):
                yield path, p

    return list(walk(typer.main.get_command(app), ""))


def test_every_option_has_help_and_dtype_help_states_the_default():
    checked = []
    for path, p in _options():
        assert p.help, f"{path} {p.opts}"
        if p.name == "dtype" and path not in ("convert", "distill"):  # theirs: no "auto" (export / training dtype)
            assert f"default {p.default} (auto =" in p.help, (path, p.default, p.help)
            checked.append(path)
    assert sorted(checked) == ["check", "dump", "eval", "generate", "rank", "vocab-swap"]


def test_gamma_help_states_the_configs_bound():
    from specdraft.config import EvalConfig, ExportConfig

    for cfg in (EvalConfig, ExportConfig):
        (le,) = [m.le for m in cfg.model_fields["num_speculative_tokens"].metadata if getattr(m, "le", None)]
        assert le == 64
    helps = [p.help for _, p in _options() if p.name in ("gamma", "num_speculative_tokens")]
    assert len(helps) == 5 and all("(1..64)" in h for h in helps)  # eval, generate, rank, convert, distill


def test_eval_reads_a_prompt_file_from_its_first_line(tmp_path):
    """The held-out offset (100) belongs to the embedded HumanEval split, not to a user's 3-line file."""
    tdir, ddir = save_tiny_pair(tmp_path, 96)
    prompts = tmp_path / "my.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"a b c {w}"}) for w in "def") + "\n")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", str(prompts),
                                 "--max-new-tokens", "4", "--gamma", "2", "--dtype", "float32", "--out", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    assert [row["id"] for row in report["per_prompt"]] == ["line-1", "line-2", "line-3"]
    assert report["config"]["prompt_offset"] == 0
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", str(prompts),
                                 "--prompt-offset", "2", "--max-new-tokens", "4", "--dtype", "float32", "--out",
                                 str(out)])
    assert r.exit_code == 0, r.output
    assert [row["id"] for row in json.loads((out / "report.json").read_text())["per_prompt"]] == ["line-3"]


def test_held_out_offsets_belong_to_the_embedded_datasets():
    from specdraft.data import DATASETS, HELD_OUT_OFFSET, held_out_offset
    from specdraft.pipeline import PRESETS, load_sources, parse_source, prompt_overlap

    assert set(HELD_OUT_OFFSET) == set(DATASETS)
    assert held_out_offset("humaneval") == 100 and held_out_offset("my.jsonl") == 0
    # The presets evaluate inside the held-out split and train before it (mt-bench: split by stride), and no
    # evaluation prompt of either set is a training prompt.
    for preset in PRESETS.values():
        evals = preset["eval_prompts"] + preset.get("ood_prompts", [])
        for spec in evals:
            name, offset, _, _ = parse_source(spec)
            assert offset >= HELD_OUT_OFFSET[name], spec
        for spec in preset["train_prompts"]:
            name, offset, limit, stride = parse_source(spec)
            if name == "humaneval":
                assert offset + (limit - 1) * stride < HELD_OUT_OFFSET[name], spec
        assert not prompt_overlap(load_sources(preset["train_prompts"]), load_sources(evals))


@pytest.mark.parametrize("width", [80, 50])
def test_models_list_never_truncates_names(width):
    from specdraft.models import EMBEDDED

    r = CliRunner().invoke(app, ["models"], terminal_width=width, env={"COLUMNS": str(width)})
    assert r.exit_code == 0, r.output
    assert "…" not in r.output
    for name in EMBEDDED:
        assert f" {name} " in r.output, name


def test_models_json_lists_every_embedded_model():
    from specdraft.models import EMBEDDED, cache_dir

    r = CliRunner().invoke(app, ["models", "--json"], env={"COLUMNS": "40"})
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert [row["name"] for row in rows] == list(EMBEDDED)
    for row in rows:
        m = EMBEDDED[row["name"]]
        assert row["size_bytes"] == m.size_bytes and row["cache_path"] == str(cache_dir(m.name))
        assert row["pip_command"] == m.pip_command() and isinstance(row["cached"], bool)


def test_errors_of_subcommand_groups_are_handled_too():
    from specdraft.models import EMBEDDED

    r = CliRunner().invoke(app, ["models", "prepare", "no-such-model"])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)
    (line,) = _error_lines(r.output)
    # prepare takes embedded names only: no advice to pass a directory, the names instead.
    assert line.startswith("error: Unknown embedded model 'no-such-model'") and "directory" not in line
    assert all(name in line for name in EMBEDDED)


def test_gamma_policy_help_states_the_probe_cost():
    """adaptive is not free where no γ predicts a gain: the help's figure is AdaptiveGamma's longest wait."""
    import inspect

    from specdraft.speed import AdaptiveGamma

    (help_,) = [p.help for path, p in _options() if p.name == "gamma_policy" and path == "eval"]
    max_wait = inspect.signature(AdaptiveGamma).parameters["max_wait"].default
    assert f"one probe draft per {max_wait} target steps" in help_ and "never slower" not in help_


def test_eval_help_shows_every_long_flag_whole_at_80_columns():
    import re

    from typer.testing import CliRunner

    from specdraft.cli import app

    for cmd in ("eval", "generate", "rank", "run"):
        r = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert r.exit_code == 0, r.output
        assert "…" not in r.output and max(len(line) for line in r.output.splitlines()) <= 80
        command = next(c for c in app.registered_commands if (c.name or c.callback.__name__) in (cmd, f"{cmd}_cmd"))
        import click
        import typer.main

        params = typer.main.get_command(app).commands[cmd].params
        for p in params:
            for flag in p.opts:
                if flag.startswith("--"):
                    assert re.search(rf"(^|[\s,/]){re.escape(flag)}([\s,=]|$)", r.output, re.M), (cmd, flag)
        del command, click
