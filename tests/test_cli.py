"""The command line as a user meets it: expected errors as one line and exit 2, whole model names, a user's own
prompt file read from its first line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.testing import patch_everywhere, save_tiny_pair


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


def test_unexpected_errors_keep_their_traceback_and_never_exit_1(tmp_path, monkeypatch):
    """Only the expected error types become messages: a bug still surfaces as itself, with its traceback, and exits
    3 — not 1, which the README reserves for "the tokenizers differ" (python's own status for an uncaught error)."""
    import specdraft.data.sources
    from specdraft.cli import BUG_EXIT

    def broken(*_a, **_k):
        raise RuntimeError("a bug")

    patch_everywhere(monkeypatch, specdraft.data.sources, "load_examples", broken)
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", "x.jsonl"])
    assert BUG_EXIT == 3 and r.exit_code == 3, r.output
    assert "Traceback (most recent call last)" in r.output and r.output.rstrip().endswith("RuntimeError: a bug")
    assert not _error_lines(r.output)


def test_data_and_model_errors_are_exit_2(tmp_path):
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", str(tmp_path / "none.txt")])
    assert r.exit_code == 2 and _error_lines(r.output) == [f"error: --prompts {tmp_path / 'none.txt'}: no such file"]
    r = CliRunner().invoke(app, ["check", "--target", str(tmp_path / "nowhere"), "--draft", ddir])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert _error_lines(r.output) == [f"error: --target {tmp_path / 'nowhere'} does not exist"]


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


def test_every_option_has_help_and_every_dtype_states_its_default_one_way():
    """Defaults of --dtype were stated three ways (in the text, typer's [default: …], "(default …)"): now every one
    with a default shows typer's [default: …], and those offering auto explain it in the same words."""
    from specdraft.cli import AUTO_DTYPE

    explained = []
    for path, p in _options():
        assert p.help, f"{path} {p.opts}"
        if p.name in ("dtype", "export_dtype"):
            assert p.show_default is not False and f"default {p.default}" not in p.help and "(default" not in p.help, \
                (path, p.help)
            if "auto" in (getattr(p.type_descriptor, "choices", None) or ()):
                assert AUTO_DTYPE in p.help, (path, p.help)
                explained.append(path)
    assert {"check", "dump", "eval", "generate", "rank", "vocab-swap"} <= set(explained)
    (check_help,) = [p.help for path, p in _options() if path == "check" and p.name == "dtype"]
    assert "auto by default" in check_help and "bfloat16 by default" not in check_help  # eval's, not check's


def test_gamma_is_one_option_in_every_command_that_takes_it():
    """--gamma (or -g) everywhere γ is, no other spelling, its help from the config field the command fills (γ of
    decoding or γ an exported speculator records), both with the config's bound."""
    from specdraft.cli import GAMMA_HELP
    from specdraft.core.config import EvalConfig, ExportConfig

    for cfg in (EvalConfig, ExportConfig):
        (le,) = [m.le for m in cfg.model_fields["num_speculative_tokens"].metadata if getattr(m, "le", None)]
        assert le == 64
    gammas = {path: p for path, p in _options() if p.name in ("gamma", "num_speculative_tokens")}
    assert {"eval", "generate", "rank", "export", "distill"} <= set(gammas)
    for path, p in gammas.items():
        assert set(p.opts) == {"--gamma", "-g"}, path
        assert GAMMA_HELP == "γ: draft tokens proposed per target pass (1..64)" and p.help.startswith(GAMMA_HELP), path


def _one_error_line(r) -> str:
    """The whole output of a refused command: exactly one ``error:`` line, exit 2, no usage box or traceback (check
    and eval name their pair only once its references and prompts are good)."""
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    (line,) = r.output.splitlines()
    assert line.startswith("error: "), r.output
    return line


@pytest.mark.parametrize(("args", "expected"), [
    (["eval", "--num-prompts", "0"],
     "error: No such option: --num-prompts (Possible options: --prompts) (see specdraft eval --help)"),
    (["eval", "--dtype", "fp16"], "error: --dtype: 'fp16' is not one of 'auto', 'float32', 'bfloat16', 'float16'"),
    (["export", "--draft", "d", "--target", "t", "--out", "o", "--dtype", "fp16"],
     "error: --dtype: 'fp16' is not one of 'keep', 'bfloat16', 'float16', 'float32'"),
    (["export", "--draft", "d", "--target", "t", "--out", "o", "--gamma", "0"],
     "error: --gamma: 0 is not in the range 1<=x<=64"),
    (["export", "--draft", "d", "--target", "t", "--out", "o", "-g", "65"],
     "error: -g: 65 is not in the range 1<=x<=64"),
    (["distill", "--gamma", "65"], "error: --gamma: 65 is not in the range 1<=x<=64"),
    (["eval", "--temperature", "warm"],
     "error: --temperature: Input should be a valid number, unable to parse string as a number (got 'warm')"),
    (["eval", "--bogus"], "error: No such option: --bogus (Possible options: --out) (see specdraft eval --help)"),
    (["evl"], "error: No such command 'evl'. Did you mean 'eval'? (see specdraft --help)"),
    (["vocab-swap", "--draft", "d"], "error: Missing option '--out' / '-o' (see specdraft vocab-swap --help)"),
])
def test_values_click_rejects_are_one_error_line_naming_the_flag(args, expected):
    """No multi-line usage box with pydantic's wording ("Input should be greater than or equal to" / "1"): the
    flag as typed, the value given, the allowed range or choices, on one line."""
    r = CliRunner().invoke(app, args, terminal_width=80, prog_name="specdraft")
    assert _one_error_line(r) == expected


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--gamma", "0", "error: --gamma: 0 is not in the range 1<=x<=64"),  # the config's bound, the flag typed
    ("-g", "0", "error: -g: 0 is not in the range 1<=x<=64"),
    ("--top-p", "1.5", "error: --top-p: 1.5 is not in the range 0.0<x<=1.0"),
])
def test_config_rejections_read_like_click_ones(tmp_path, flag, value, expected):
    """Values a config (pydantic) refuses get the same line as click's, naming the flag typed, not the field."""
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--temperature", "0.5", flag, value])
    assert _one_error_line(r) == expected


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
    assert [row["id"] for row in report["per_prompt"]] == ["my:line-1", "my:line-2", "my:line-3"]
    assert report["config"]["prompt_offset"] == 0
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", f"{prompts}:2",
                                 "--max-new-tokens", "4", "--dtype", "float32", "--out",
                                 str(out), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert [row["id"] for row in json.loads((out / "report.json").read_text())["per_prompt"]] == ["my:line-3"]


def test_held_out_offsets_belong_to_the_embedded_datasets():
    from specdraft.data.prompts import load_prompts, parse_source
    from specdraft.data.sources import DATASETS, HELD_OUT_OFFSET, held_out_offset
    from specdraft.run.pipeline import PRESETS, preset_fields, prompt_overlap

    assert set(HELD_OUT_OFFSET) == set(DATASETS)
    assert held_out_offset("humaneval") == 100 and held_out_offset("my.jsonl") == 0
    # The presets evaluate inside the held-out split and train before it (mt-bench: split by stride), and no
    # evaluation prompt of either set is a training prompt.
    for preset in map(preset_fields, PRESETS):
        evals = preset["eval_prompts"] + preset.get("ood_prompts", [])
        for spec in evals:
            name, offset, _, _ = parse_source(spec)
            assert offset >= HELD_OUT_OFFSET[name], spec
        for spec in preset["train_prompts"]:
            name, offset, limit, stride = parse_source(spec)
            if name == "humaneval":
                assert offset + (limit - 1) * stride < HELD_OUT_OFFSET[name], spec
        assert not prompt_overlap(load_prompts(preset["train_prompts"]), load_prompts(evals))


@pytest.mark.parametrize("width", [80, 50])
def test_models_list_never_truncates_names(width):
    from specdraft.core.embedded import EMBEDDED

    r = CliRunner().invoke(app, ["models"], terminal_width=width, env={"COLUMNS": str(width)})
    assert r.exit_code == 0, r.output
    assert "…" not in r.output
    for name in EMBEDDED:
        assert f" {name} " in r.output, name


def test_models_json_lists_every_embedded_model():
    from specdraft.core.embedded import EMBEDDED, cache_dir

    r = CliRunner().invoke(app, ["models", "--json"], env={"COLUMNS": "40"})
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert [row["name"] for row in rows] == list(EMBEDDED)
    for row in rows:
        m = EMBEDDED[row["name"]]
        assert row["size_bytes"] == m.size_bytes and row["cache_path"] == str(cache_dir(m.name))
        assert row["pip_command"] == m.pip_command() and isinstance(row["cached"], bool)


def test_errors_of_subcommand_groups_are_handled_too():
    from specdraft.core.embedded import EMBEDDED

    r = CliRunner().invoke(app, ["models", "prepare", "no-such-model"])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)
    (line,) = _error_lines(r.output)
    # prepare takes embedded names only: no advice to pass a directory, the names instead.
    assert line.startswith("error: Unknown embedded model 'no-such-model'") and "directory" not in line
    assert all(name in line for name in EMBEDDED)


def test_gamma_policy_help_states_the_probe_cost():
    """adaptive is not free where no γ predicts a gain: the help's figure is AdaptiveGamma's longest wait."""
    import inspect

    from specdraft.decoding.speed import AdaptiveGamma

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
                    assert re.search(rf"(^|[\s,/]){re.escape(flag)}([\s,=]|$)", r.output, re.MULTILINE), (cmd, flag)
        del command, click


@pytest.mark.parametrize(("line", "says"), [('["a", "b"]', "expected an object, got a list"),
                                            ('{"messages": []}', "'messages' must be a non-empty list"),
                                            ('{"messages": [{"role": "wizard", "content": "x"}]}', "role \"wizard\"")])
def test_a_malformed_prompt_file_fails_before_any_model_loads(tmp_path, monkeypatch, line, says):
    """Was an AttributeError traceback and exit 1, or a crash after both models loaded: now `error: FILE:LINE: …`."""
    import specdraft.models.loading

    def no_loading(*_a, **_k):
        raise AssertionError("a model was loaded before the prompt file was checked")

    patch_everywhere(monkeypatch, specdraft.models.loading, "load_model", no_loading)
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n" + line + "\n")
    for cmd in (["eval", "--target", tdir, "--draft", ddir, "--prompts", str(prompts)],
                ["dump", "--target", tdir, "--prompts", str(prompts), "--out", str(tmp_path / "dump")],
                ["rank", ddir, "--target", tdir, "--prompts", str(prompts)]):
        r = CliRunner().invoke(app, cmd)
        line_ = _one_error_line(r)
        assert line_.startswith(f"error: {prompts}:2: ") and says in line_, (cmd, r.output)
    assert not (tmp_path / "dump").exists()


def test_inspect_of_a_speculator_without_weights_exits_2(tmp_path):
    """It printed the serve commands and exited 0; the README lists a checkpoint missing weights as exit 2."""
    from specdraft.serving.export import export_draft

    tdir, ddir = save_tiny_pair(tmp_path, 64)
    spec = tmp_path / "spec"
    export_draft(ddir, tdir, spec)
    r = CliRunner().invoke(app, ["inspect", str(spec)])
    assert r.exit_code == 0 and "model.safetensors" in r.output and "vllm.entrypoints.openai.api_server --model" in r.output
    (spec / "model.safetensors").unlink()
    r = CliRunner().invoke(app, ["inspect", str(spec)], terminal_width=300)
    assert _one_error_line(r) == (f"error: {spec} holds no weight files (*.safetensors or *.bin): the checkpoint is "
                                  "incomplete. Copy or export it again (specdraft export).")


def test_inspect_names_the_head_token_ranking_beside_a_speculator(tmp_path):
    """The trimmed head's ranking (head_tokens.json) was used by --draft-head-tokens without inspect naming it:
    its size, what it was counted over and whether its tokenizer is the speculator's are printed."""
    from specdraft.decoding.draft_model import head_tokens_info, rank_tokens, save_head_tokens
    from specdraft.serving.export import export_draft
    from specdraft.testing import tiny_tokenizer

    tdir, ddir = save_tiny_pair(tmp_path, 64)
    spec = tmp_path / "spec"
    export_draft(ddir, tdir, spec)

    def ranking_line() -> str:
        r = CliRunner().invoke(app, ["inspect", str(spec)])
        assert r.exit_code == 0, r.output
        rows: dict[str, str] = {}  # the table's rows: a value folded over several lines is joined
        field = ""
        for cells in (x.split("│")[1:-1] for x in r.output.splitlines() if x.startswith("│")):
            field = cells[0].strip() or field
            rows[field] = " ".join([rows.get(field, ""), cells[-1].strip()]).strip()
        return rows["head token ranking"]

    assert "none (head_tokens.json absent)" in ranking_line()
    tok = tiny_tokenizer(64)
    save_head_tokens(spec, rank_tokens(tok, token_lists=[[60, 60, 61]]), tok, "teacher dump (3 answer tokens)")
    assert head_tokens_info(spec, tok) == {"path": str(spec / "head_tokens.json"), "size": 64,
                                           "counted_over": "teacher dump (3 answer tokens)",
                                           "tokenizer_fingerprint": head_tokens_info(spec)["tokenizer_fingerprint"],
                                           "tokenizer_matches": True, "error": None}
    line = ranking_line()
    assert "64 token ids ranked, counted over teacher dump (3 answer tokens)" in line
    assert "counted with this speculator's tokenizer (fingerprints match)" in line
    other = tiny_tokenizer(80)
    save_head_tokens(spec, rank_tokens(other), other, "another vocabulary")
    line = ranking_line()
    assert "80 token ids ranked, counted over another vocabulary" in line
    assert "counted with another tokenizer than this speculator's" in line
    (spec / "head_tokens.json").write_text("{}")
    assert "head_tokens.json is not a specdraft token ranking" in ranking_line()


def test_checks_out_file_follows_the_one_output_rule_and_its_former_json_flag_names_it(tmp_path):
    """check --json used to overwrite an existing file silently; it now refuses it unless --overwrite, as every
    command's output does (and creates missing folders, as they do). The file is check's --out, as every command's
    output is: --json is models' switch, and check's former --json is one error line naming --out."""
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["check", "--target", tdir, "--draft", ddir, "--json", "c.json"])
    assert _one_error_line(r) == "error: check's --json is now --out (--out c.json); --json is models' switch"
    assert not (tmp_path / "c.json").exists()
    r = CliRunner().invoke(app, ["check", "--target", tdir, "--draft", ddir, "--out", str(tmp_path)])
    assert _one_error_line(r) == f"error: --out {tmp_path} is a directory: give a file name"
    out = tmp_path / "new" / "check.json"
    r = CliRunner().invoke(app, ["check", "--target", tdir, "--draft", ddir, "--out", str(out)])
    assert r.exit_code == 0, r.output
    first = json.loads(out.read_text())
    assert first["compat"]["verdict"] == "identical" and first["continuations"]["target"]
    out.write_text("{}")
    r = CliRunner().invoke(app, ["check", "--target", tdir, "--draft", ddir, "--out", str(out)])
    assert _one_error_line(r) == (f"error: --out {out} exists; pass --overwrite to replace it, or choose another "
                                  "--out")
    assert out.read_text() == "{}"
    r = CliRunner().invoke(app, ["check", "--target", tdir, "--draft", ddir, "--out", str(out), "--overwrite"])
    assert r.exit_code == 0 and json.loads(out.read_text())["compat"]["verdict"] == "identical"


def test_usage_names_arguments_and_switches_take_one_flag():
    """generate's usage said `{prompt}`; --overwrite was a flag in convert and --overwrite/--no-overwrite in
    vocab-swap. A switch that is off by default is one flag everywhere."""
    r = CliRunner().invoke(app, ["generate", "--help"], prog_name="specdraft")
    assert r.output.splitlines()[0] == "Usage: specdraft generate [OPTIONS] PROMPT"
    r = CliRunner().invoke(app, ["rank", "--help"], prog_name="specdraft")
    assert r.output.splitlines()[0] == "Usage: specdraft rank [OPTIONS] DRAFTS..."
    off_switches = [(path, p) for path, p in _options() if getattr(p, "is_flag", False) and p.default is False]
    assert {path for path, p in off_switches if p.name == "overwrite"} == {"check", "eval", "rank", "headroom", "export",
                                                                           "vocab-swap", "run"}
    for path, p in off_switches:
        assert not p.secondary_opts, (path, p.opts, p.secondary_opts)
    assert "<bool>" not in CliRunner().invoke(app, ["vocab-swap", "--help"]).output


def test_generate_summary_adds_up_and_says_why_the_last_round_was_short(tmp_path):
    """"acceptance 0.833, a histogram of 7 rounds at γ = 5" only added up if the last round was cut: the line now
    gives accepted / proposed / passes, and says which pass drafted fewer than γ and why."""
    import re

    tdir, _ = save_tiny_pair(tmp_path, 64)  # the target drafts for itself: every draft is accepted
    r = CliRunner().invoke(app, ["generate", "a b c d", "--target", tdir, "--draft", tdir, "--max-new-tokens", "8",
                                 "--gamma", "5", "--gamma-policy", "fixed", "--draft-quantization", "none",
                                 "--dtype", "float32"], terminal_width=400)
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == f"pair: target {tdir} ← draft {tdir}"  # eval/generate name the pair first
    line = r.output.strip().splitlines()[-1]
    m = re.search(r"^(\d+) tokens .*; (\d+) of (\d+) drafted tokens accepted \(acceptance rate ([\d.]+)\) in (\d+) "
                  r"target pass(?:es)?, ([\d.]+) tokens per pass; accepted-length histogram \[([\d, ]+)\]", line)
    emitted, accepted, proposed, rate, passes, per_pass = (float(x) for x in m.groups()[:6])
    hist = [int(x) for x in m.group(7).split(",")]
    assert rate == pytest.approx(accepted / proposed, abs=5e-4) and sum(hist) == passes
    assert per_pass == pytest.approx(emitted / passes, abs=5e-3) and emitted == 8
    # 6 + 2 tokens: a full pass of 5 drafts (+1), then the budget leaves room for 1 draft (+1).
    assert (accepted, proposed, passes) == (6, 6, 2) and proposed < passes * 5
    assert line.endswith("; the last pass checked 1 draft instead of γ = 5: --max-new-tokens 8 was reached")


def test_one_prompt_gives_no_interval_and_each_cost_ratio_says_what_it_is(tmp_path):
    """A one-prompt eval reported a zero-width 95% interval as if it meant something; report.json held two
    cost_ratio_c values with no word on which is which."""
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a b {w}"}) + "\n" for w in "cd"))
    reports = {}
    for n in (1, 2):
        out = tmp_path / f"out{n}"
        r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", f"{prompts}:0:{n}",
                                     "--max-new-tokens", "6", "--gamma", "2",
                                     "--gamma-policy", "fixed", "--dtype", "float32", "--out", str(out)],
                               terminal_width=200)
        assert r.exit_code == 0, r.output
        reports[n] = (r.output, json.loads((out / "report.json").read_text()))
    text, one = reports[1]
    assert one["summary"]["acceptance_rate_ci95"] is None and "one prompt gives no interval" in text
    _, two = reports[2]
    low, high = two["summary"]["acceptance_rate_ci95"]
    assert low <= two["summary"]["acceptance_rate"] <= high
    defs = one["definitions"]
    assert "timed while decoding" in defs["summary.cost_ratio_c"]
    assert "d / t(1)" in defs["summary.speed_model.cost_ratio_c"]


def test_export_writes_a_draft_of_another_tokenizer_as_given_and_points_to_vocab_swap_with_the_target_as_typed(tmp_path, monkeypatch):
    """A mismatched pair named the recorded reference (a hub id, an absolute path) and gave no way out."""
    from specdraft.testing import tiny_tokenizer

    monkeypatch.chdir(tmp_path)
    save_tiny_pair(tmp_path, 64)
    tiny_tokenizer(64, swap=(10, 20)).save_pretrained(tmp_path / "draft")
    r = CliRunner().invoke(app, ["export", "--draft", "draft", "--target", "target", "--out", "spec"],
                           terminal_width=400)
    # A draft of another tokenizer is written as given (it drafts through text), served by specdraft's proposer.
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_config"][
        "default_proposal_method"] == "text"
    assert '"method": "custom_class"' in r.output and "tokenizer check: mismatch" in r.output
    # The way to the re-indexed draft names the target as typed, not a recorded absolute path, and each printed
    # command carries its required options.
    assert (f"`specdraft vocab-swap --target target --draft {tmp_path / 'spec'} --out SWAPPED`, then `specdraft "
            "export --draft SWAPPED --target target --out SPECULATOR`") in r.output


def test_the_way_to_the_re_indexed_draft_names_an_embedded_verifier_by_the_name_that_resolves_offline(tmp_path):
    """inspect of a draft as given whose verifier is recorded by hub id suggested `vocab-swap --target <hub id>`,
    which fails offline; the embedded name resolves."""
    from specdraft.core.embedded import DEFAULT_TARGET, EMBEDDED
    from specdraft.serving.export import vllm_serve
    from specdraft.testing import tiny_tokenizer

    save_tiny_pair(tmp_path, 64)
    tiny_tokenizer(64, swap=(10, 20)).save_pretrained(tmp_path / "draft")
    r = CliRunner().invoke(app, ["export", "--draft", str(tmp_path / "draft"), "--target", str(tmp_path / "target"),
                                 "--out", str(tmp_path / "spec")], terminal_width=400)
    assert r.exit_code == 0, r.output
    serve = vllm_serve(str(tmp_path / "spec"), verifier=EMBEDDED[DEFAULT_TARGET].hub_id)
    note = next(n for n in serve.notes if "vocab-swap" in n)
    assert f"--target {DEFAULT_TARGET} --draft" in note and EMBEDDED[DEFAULT_TARGET].hub_id not in note.split("`")[1]
    assert f"--target {DEFAULT_TARGET} --out SPECULATOR" in note


def test_re_exporting_a_speculator_says_which_keys_changed(tmp_path):
    """Re-exporting at another γ listed every speculators_* key as "added"; the draft already held them."""
    import re

    tdir, ddir = save_tiny_pair(tmp_path, 64)
    args = ["--target", tdir, "--out"]
    r = CliRunner().invoke(app, ["export", "--draft", ddir, *args, str(tmp_path / "s1")], terminal_width=400)
    assert r.exit_code == 0, r.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in r.output.splitlines()
            if line.startswith("│ speculators_")}
    assert rows == dict.fromkeys(("speculators_config", "speculators_model_type", "speculators_version"), "added")
    r = CliRunner().invoke(app, ["export", "--draft", str(tmp_path / "s1"), *args, str(tmp_path / "s2"), "--gamma",
                                 "3"], terminal_width=400)
    assert r.exit_code == 0, r.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in r.output.splitlines()
            if line.startswith("│ speculators_")}
    assert rows == {"speculators_config": "changed", "speculators_model_type": "kept", "speculators_version": "kept"}
    cells = re.sub(r"[│\s]+", " ", r.output.split("│ speculators_config")[1].split("│ speculators_model_type")[0])
    assert cells.strip() == "changed proposal_methods[0].speculative_tokens: 5 → 3"


def test_models_shows_the_cache_size_on_disk_and_whole_words(tmp_path, monkeypatch):
    """`specdraft models` gave no size for the cache (6.7 GB for the target) and split descriptions mid-word."""
    from specdraft.core.embedded import EMBEDDED, cache_dir

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    name = next(iter(EMBEDDED))
    entry = cache_dir(name)
    (entry / "sub").mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"\0" * 2_500_000)
    (entry / "sub" / "x.json").write_bytes(b"\0" * 1_000)
    (entry / "specdraft-cache.json").write_text("{}")  # the marker of a complete entry
    r = CliRunner().invoke(app, ["models", "--json"])
    sizes = {row["name"]: row["cache_bytes"] for row in json.loads(r.output)}
    assert sizes[name] == 2_500_000 + 1_000 + 2 and all(v is None for k, v in sizes.items() if k != name)
    r = CliRunner().invoke(app, ["models"], terminal_width=80, env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    (row,) = [line for line in r.output.splitlines() if line.startswith(f"│ {name} ")]
    assert "│        2.5 MB │" in row
    words = r.output.split()
    for m in EMBEDDED.values():  # every word of every description is whole somewhere in the output
        for word in f"{m.description}; a build of {m.hub_id}".split():
            assert word in words, word


def test_inspect_refuses_a_checkpoint_of_two_weight_layouts_naming_the_files(tmp_path):
    """A stale model.safetensors beside a sharded index (transformers loads the stale one): inspect said nothing."""
    from specdraft.decoding.speculator_model import IndependentSpeculator
    from specdraft.serving.export import export_draft

    tdir, ddir = save_tiny_pair(tmp_path, 64)
    spec = tmp_path / "spec"
    export_draft(ddir, tdir, spec)
    sharded = IndependentSpeculator.from_pretrained(spec)
    sharded.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    for f in (tmp_path / "sharded").iterdir():
        (spec / f.name).write_bytes(f.read_bytes())  # shards + index beside the old model.safetensors
    r = CliRunner().invoke(app, ["inspect", str(spec)], terminal_width=300)
    line = _one_error_line(r)
    assert r.exit_code == 2 and "a model.safetensors lies beside the sharded index model.safetensors.index.json" in line


def test_generate_summary_names_the_policy_that_drafted_fewer_and_how_the_answer_ended():
    """A new user read "… (adaptive γ, --draft-confidence-threshold or a mapped draft), and the answer ended" as a
    line cut short: it now names the one policy that ran and says the answer ended at EOS."""
    from specdraft.cli import generate_summary
    from specdraft.core.acceptance import AcceptanceCounts

    counts = AcceptanceCounts(8)
    counts.record_round(2, n_proposed=3, bonus=True)
    counts.record_round(0, n_proposed=1, bonus=True)
    line = generate_summary(counts, 512, False, ["adaptive γ"])
    assert line.endswith("4 drafts over 2 passes, not 16: each pass drafts up to γ = 8 and drafts fewer where "
                         "adaptive γ says so; the last pass stops where the answer ended at EOS")
    assert generate_summary(counts, counts.emitted, False, ["adaptive γ"]).endswith(
        f"--max-new-tokens {counts.emitted} was reached")


def test_check_ends_with_the_next_command_for_the_pair(tmp_path):
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["check", "--target", tdir, "--draft", ddir, "--max-new-tokens", "2"],
                           env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    last = r.output.strip().splitlines()
    assert last[-1].startswith(f"next: specdraft eval --target {tdir} --draft {ddir}")
    assert last[-2].startswith("compatible (identical): the draft speaks the target's tokenizer"), last[-2]


def test_eval_table_caveats_a_few_prompt_interval_and_says_the_recommended_gamma_leaves_out_prefill(monkeypatch):
    import io

    from rich.console import Console

    from specdraft.cli import render

    keys = ["acceptance_rate", "alpha", "mean_accepted_length", "predicted_alpha_prompt", "predicted_alpha_response",
            "target_tokens_per_s", "speculative_tokens_per_s", "speedup", "hf_assisted_tokens_per_s",
            "speedup_vs_hf_assisted", "hf_assisted_matches_target", "cost_ratio_c", "analytic_speedup",
            "share_of_analytic", "predicted_speedup", "prediction_error"]

    def table(prompts):
        s = dict.fromkeys(keys, None) | {
            "prompts": prompts, "acceptance_rate_ci95": [0.4, 0.6], "recommended_gamma": 8,
            "predicted_speedup_at_recommended_gamma": 4.12, "analytic_recommended_gamma": 7,
            "analytic_speedup_at_recommended_gamma": 4.5, "divergences": 0, "divergences_beyond_tolerance": 0}
        out = io.StringIO()
        monkeypatch.setattr(render, "console", Console(file=out, width=240))
        render.print_eval_summary(s, 5)
        return out.getvalue()

    few, many = table(2), table(16)
    assert "[0.400, 0.600] (2 prompts: a rough interval)" in few
    assert "rough interval" not in many and "[0.400, 0.600]" in many
    assert "recommended γ (speed model; decoding rounds only, prefill left out)" in few


def test_a_truncated_config_json_is_named_with_its_line_not_reported_as_a_tokenizer_failure(tmp_path):
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    cfg = Path(ddir) / "config.json"
    text = cfg.read_text()
    cfg.write_text(text[: len(text) // 2])  # a copy cut short
    r = CliRunner().invoke(app, ["check", "--target", tdir, "--draft", ddir], env={"COLUMNS": "400"})
    line = _one_error_line(r)
    assert line.startswith(f"error: --draft {ddir}: {cfg} is not valid JSON (line ")
    assert "tokenizer" not in line and r.exit_code == 2


def test_a_missing_model_directory_is_named_with_its_flag(tmp_path):
    tdir, _ = save_tiny_pair(tmp_path, 64)
    missing = tmp_path / "nowhere"
    r = CliRunner().invoke(app, ["check", "--target", tdir, "--draft", str(missing)], env={"COLUMNS": "400"})
    assert _one_error_line(r) == f"error: --draft {missing} does not exist"


# --------------------------------------------------------------------- where --out goes: checked before any work

def _out_commands(tmp_path, out):
    """``{name: argv}`` of every command that takes --out, writing to ``out``; models are named, never opened."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n")
    pair = ["--target", "target-model", "--draft", "draft-model"]
    dump = tmp_path / "a-dump"  # a finished dump's manifest: distill reads it before the draft
    dump.mkdir(exist_ok=True)
    (dump / "manifest.json").write_text(json.dumps({"kind": "specdraft-teacher-dump", "tokenizer_fingerprint": "0",
                                                    "target": {"ref": "target-model"}}))
    return {
        "check": ["check", *pair, "--out", str(out)],
        "eval": ["eval", *pair, "--prompts", str(prompts), "--out", str(out)],
        "rank": ["rank", "draft-model", "--target", "target-model", "--prompts", str(prompts), "--out", str(out)],
        "headroom": ["headroom", *pair, "--prompts", str(prompts), "--out", str(out)],
        "export": ["export", *pair, "--out", str(out)],
        "export --format gguf": ["export", *pair, "--format", "gguf", "--out", str(out)],
        "vocab-swap": ["vocab-swap", *pair, "--out", str(out)],
        "dump": ["dump", "--target", "target-model", "--prompts", str(prompts), "--out", str(out)],
        "distill": ["distill", *pair, "--dump", str(dump), "--out", str(out)],
        "run": ["run", "--preset", "tiny", *pair, "--out", str(out)],
    }


def test_every_command_that_writes_an_out_is_in_the_out_tests():
    import inspect

    from specdraft.cli import COMMANDS

    takes_out = {name for name, callback, _, _ in COMMANDS if "out" in inspect.signature(callback).parameters}
    assert takes_out == {c.split()[0] for c in OUT_COMMANDS}


@pytest.fixture
def no_models(monkeypatch):
    """Every model reference resolved or loaded is recorded and refused (``error: no models here``): a test sees
    whether a command reached its models."""
    import specdraft.models.loading
    from specdraft.core.embedded import ModelResolutionError

    reached = []

    def refuse(ref, *_a, **_k):
        reached.append(str(ref))
        raise ModelResolutionError("no models here")

    for name in ("resolve", "resolve_ref", "load_model", "load_tokenizer"):
        if hasattr(specdraft.models.loading, name):
            patch_everywhere(monkeypatch, specdraft.models.loading, name, refuse)
    return reached


OUT_COMMANDS = ("check", "eval", "rank", "headroom", "export", "export --format gguf", "vocab-swap", "dump", "distill", "run")


@pytest.mark.parametrize("command", OUT_COMMANDS)
def test_an_out_under_a_file_is_one_error_line_naming_the_flag_before_any_model_loads(tmp_path, no_models, command):
    """`export --out FILE/spec` gave a bare `[Errno 17]` after loading the draft; eval's report, written after the
    whole evaluation, failed the same way. Every command with --out now refuses such a path first."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    out = a_file / "sub" / {"headroom": "out.json", "export --format gguf": "out.gguf"}.get(command, "out")
    r = CliRunner().invoke(app, _out_commands(tmp_path, out)[command])
    assert _one_error_line(r) == f"error: --out {out}: {a_file} is a file, not a folder", (command, r.output)
    assert no_models == [] and a_file.read_text() == "not a folder"


def test_an_out_in_a_folder_that_cannot_be_written_is_refused_before_the_evaluation(tmp_path, monkeypatch, no_models):
    """`eval --out` on a read-only file system ended in an OSError traceback (exit 3) after the whole evaluation."""
    import os

    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes through 0o555: a read-only file system is what os.access still says no to
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if os.path.abspath(p) == str(ro)
                            else real_access(p, mode, *a, **k))
    out = ro / "eval"
    for command in ("eval", "export", "run"):
        r = CliRunner().invoke(app, _out_commands(tmp_path, out)[command])
        assert _one_error_line(r) == f"error: --out {out}: {ro} cannot be written (read-only, or not yours)", command
    ro.chmod(0o755)
    assert no_models == [] and list(ro.iterdir()) == []


def test_a_folder_that_access_calls_writable_but_refuses_a_file_is_refused_with_the_reason(tmp_path, monkeypatch,
                                                                                         no_models):
    """The try is a real file: a folder os.access passes can still refuse one (a read-only mount seen through a
    network file system, an ACL), and the error line gives the system's reason."""
    import errno
    import tempfile

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    out = tmp_path / "eval"
    r = CliRunner().invoke(app, _out_commands(tmp_path, out)["eval"])
    assert _one_error_line(r) == f"error: --out {out}: {tmp_path} cannot be written (Read-only file system)"
    assert no_models == []


def test_an_existing_output_is_refused_without_overwrite_by_eval_as_by_export_and_resumed_by_run(tmp_path, no_models):
    """eval silently overwrote an existing --out while convert, vocab-swap and run refused one. One rule now: an
    existing file or a non-empty directory is replaced only with --overwrite; run, dump and distill resume theirs."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "report.json").write_text("{}")
    done_json, done_gguf = tmp_path / "done.json", tmp_path / "done.gguf"
    done_json.write_text("{}")
    done_gguf.write_text("GGUF")
    for command in ("check", "eval", "rank", "headroom", "export", "export --format gguf", "vocab-swap"):
        out = {"check": done_json, "headroom": done_json, "export --format gguf": done_gguf}.get(command, done)
        argv = _out_commands(tmp_path, out)[command]
        r = CliRunner().invoke(app, argv)
        what = "exists and is not empty" if out == done else "exists"
        assert _one_error_line(r) == (f"error: --out {out} {what}; pass --overwrite to replace it, or choose another "
                                      "--out"), (command, r.output)
        assert no_models == []
        r = CliRunner().invoke(app, [*argv, "--overwrite"])  # past the check: the command goes on to its models
        # ... where a command that reads prompts first says which will run (before any model loads)
        *said, last = r.output.splitlines()
        assert r.exit_code == 2 and last.startswith("error: ") and last.endswith("no models here"), (command, r.output)
        assert all(line.startswith(("prompts: ", f"specdraft {command}: target ")) for line in said), (command, r.output)
        assert no_models, command
        no_models.clear()
    assert (done / "report.json").read_text() == "{}" and done_json.read_text() == "{}"
    assert done_gguf.read_text() == "GGUF"
    for command in ("dump", "distill", "run"):  # resumable: what --out holds is the command's own work
        r = CliRunner().invoke(app, _out_commands(tmp_path, done)[command])
        assert r.output.splitlines()[-1].endswith("no models here"), (command, r.output)  # past the check
    (empty := tmp_path / "empty").mkdir()
    r = CliRunner().invoke(app, _out_commands(tmp_path, empty)["eval"])
    # The prompts are read, then the models looked for: a missing one is the only line (the pair not named yet).
    assert r.output.splitlines() == ["error: --target target-model: no models here"], r.output


def test_the_run_page_holds_no_library_notices_but_keeps_specdrafts_own_warnings():
    import warnings

    from transformers.utils import logging as hf_logging

    from specdraft.cli.render import library_warnings_off

    before = hf_logging.get_verbosity()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with library_warnings_off():
            assert hf_logging.get_verbosity() == hf_logging.ERROR
            for module in ("transformers.modeling_utils", "torch.nn.modules.module", "specdraft.run.pipeline"):
                warnings.warn_explicit(f"from {module}", UserWarning, "x.py", 1, module=module)
    assert [str(w.message) for w in seen] == ["from specdraft.run.pipeline"]
    assert hf_logging.get_verbosity() == before
# One fresh process's generation: the machine's live timings are faked (a draft step of DRAFT_MS, a target pass of
# 10 ms + 1 ms per token) and the CPU's counters show it quiet or busy as told, so neither the real load nor real speeds
# decide the test.
_SEEDED_GENERATION = """
import json, sys
import specdraft.decoding.calibration as cal
from specdraft.core.config import EvalConfig, SamplingConfig
from specdraft.measuring.pair import load_pair, prepare_generation

target, draft, draft_ms, looks = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
ticks = iter(range(1, 10**6))


def cpu_jiffies():  # other processes hold half of the CPU (busy) or none of it (quiet), however short the interval
    n = next(ticks)
    return (500_000 * n if looks == "busy" else 0), 1_000_000 * n


cal._cpu_jiffies = cpu_jiffies


def live_timings(model, context, widths, repeats=3, warmup=1, last_only=False):
    return {k: (draft_ms if last_only else 10.0 + k) / 1e3 for k in widths}, 0.005


cal.pass_seconds = live_timings
sampling = SamplingConfig(temperature=1.0)
config = EvalConfig(max_new_tokens=40, sampling=sampling, seed=7, dtype="float32")
gen = prepare_generation(load_pair(target, draft, "float32", sampling=sampling), "a b c", config)
tokens = []
counts = gen.run(lambda row, new: tokens.extend(new))
print(json.dumps({"tokens": tokens, "proposed": sum(counts.proposed), "source": gen.speed_source,
                  "note": gen.seed_note()}))
"""


def test_a_seeded_sampled_answer_under_adaptive_gamma_is_the_same_in_two_fresh_processes(tmp_path):
    """Adaptive γ drafts per round what the speed model predicts fastest, so the draws a round consumes follow the
    speed model. Two fresh processes whose live timings differ (a draft step of 0.5 ms, then 15 ms: within the
    cache's spot check) read one calibration and sample one answer from one seed; a process that measures its own
    speed model on a busy machine (not cached) drafts other k, samples another answer, and says a rerun may differ."""
    import subprocess
    import sys
    from pathlib import Path

    import specdraft

    tdir, ddir = save_tiny_pair(tmp_path, 96)
    src = str(Path(specdraft.__file__).parents[1])

    def run(draft_ms: float, looks: str, cache: str) -> dict:
        env = os.environ | {"PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "SPECDRAFT_SPEED_CACHE": str(tmp_path / cache)}
        out = subprocess.run([sys.executable, "-c", _SEEDED_GENERATION, tdir, ddir, str(draft_ms), looks],
                             capture_output=True, text=True, env=env, timeout=300, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run(0.5, "quiet", "cache")
    assert first["source"] == "measured" and first["proposed"] > 0 and len(first["tokens"]) > 5
    assert "measured now and cached" in first["note"]
    again = run(15.0, "quiet", "cache")
    assert again["source"].startswith("cache") and again["tokens"] == first["tokens"]
    assert again["proposed"] == first["proposed"]  # the same γ per round, not this process's timings
    assert "--seed 7 reproduces this answer" in again["note"]
    busy = run(15.0, "busy", "busy-cache")  # its own speed model: a draft step dearer than a target pass
    assert busy["source"].startswith("measured on a busy machine") and busy["tokens"] != first["tokens"]
    assert "not cached" in busy["note"] and "--gamma-policy fixed" in busy["note"]
    assert not (tmp_path / "busy-cache").exists() or not any((tmp_path / "busy-cache").iterdir())


def test_generate_says_when_its_seed_does_not_reproduce_the_answer(tmp_path, monkeypatch):
    """A speed model measured on a busy machine is not cached: generate's seed line says a rerun may sample another
    answer, and how to make the seed alone fix it; a fixed γ and greedy decoding print no seed line."""
    import specdraft.decoding.calibration as cal

    ticks = iter(range(1, 10**6))
    monkeypatch.setattr(cal, "_cpu_jiffies", lambda: (500_000 * (n := next(ticks)), 1_000_000 * n))  # others hold half the CPU
    # Its own cache: the session's may hold this tiny pair's speed model from an earlier test, and a cache hit measures
    # nothing (so nothing is busy).
    monkeypatch.setenv("SPECDRAFT_SPEED_CACHE", str(tmp_path / "speed-cache"))
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    base = ["generate", "a b c", "--target", tdir, "--draft", ddir, "--max-new-tokens", "6", "--dtype", "float32",
            "--seed", "3"]
    r = CliRunner().invoke(app, base + ["--temperature", "1"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "seed: the speed model was measured on a busy machine and not cached" in out
    assert "a rerun with --seed 3 measures again and may sample another answer" in out and "--gamma-policy fixed" in out
    for extra in (["--temperature", "1", "--gamma-policy", "fixed", "--gamma", "2"], []):
        r = CliRunner().invoke(app, base + extra)
        assert r.exit_code == 0 and "seed:" not in r.output, r.output


def test_a_prompt_past_the_window_is_refused_before_adaptive_gammas_calibration(tmp_path, monkeypatch):
    """Under adaptive γ a prompt longer than the model's window sat in calibration ("decoding 0/1") for minutes:
    only fixed γ gave the error line. The window is checked before calibrating now, by decoding's rule."""
    import specdraft.decoding.calibration as cal

    tdir, ddir = save_tiny_pair(tmp_path, 64)
    window = json.loads((Path(tdir) / "config.json").read_text())["max_position_embeddings"]
    monkeypatch.setattr(cal, "cached_speed_model", lambda *a, **k: pytest.fail("calibrated a prompt past the window"))
    prompt = " ".join(["a b c d"] * window)
    r = CliRunner().invoke(app, ["generate", prompt, "--target", tdir, "--draft", ddir, "--dtype", "float32",
                                 "--max-new-tokens", "4"], env={"COLUMNS": "400"})
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    (line,) = _error_lines(r.output)  # after the pair line: the models load before their windows are known
    assert "exceeds the target's context window" in line and f"({window})" in line, line


def test_eval_and_generate_say_they_calibrate_and_how_long_before_decoding_and_log_each_prompt(tmp_path, monkeypatch):
    """Off a terminal, eval printed its pair line and then nothing while the speed model was measured (minutes on a
    CPU), and generate the same; in a terminal the bar sat at 0 through it. A line names the calibration, another
    its expected length, both before the first prompt; then one line per finished prompt."""
    monkeypatch.setenv("SPECDRAFT_SPEED_CACHE", str(tmp_path / "speed-cache"))  # nothing cached: it measures
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a b c {w}"}) + "\n" for w in "def"))
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", str(prompts),
                                 "--max-new-tokens", "4", "--gamma", "2", "--dtype", "float32",
                                 "--out", str(tmp_path / "out")], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    calib = next(i for i, x in enumerate(lines) if x.startswith("calibrating the pair's speed model (once per pair "
                                                                 "and machine, then cached): 36 target passes"))
    eta = next(i for i, x in enumerate(lines) if x.startswith("calibrating: ") and " left" in x)
    decoded = [i for i, x in enumerate(lines) if x.startswith("decoding: ")]
    assert [lines[i].split(" (")[0] for i in decoded] == [f"decoding: {k}/3 prompts" for k in (1, 2, 3)]
    assert calib < eta < decoded[0]
    r = CliRunner().invoke(app, ["generate", "a b c", "--target", tdir, "--draft", ddir, "--max-new-tokens", "4",
                                 "--dtype", "float32"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert any(x.startswith(("calibrating the pair's speed model", "speed model: found in the calibration cache"))
               for x in r.output.splitlines()), r.output


@pytest.mark.parametrize(("command", "said"), [
    (["eval", "--prompts", "x.jsonl"], "interrupted"),
    (["run", "--preset", "tiny", "--eval-prompts", "x.jsonl", "--train-prompts", "y.jsonl"],
     "interrupted — rerun to resume (the same `specdraft run` command continues where this one stopped)")])
def test_ctrl_c_exits_130_with_one_line_that_says_how_to_resume_where_the_command_resumes(tmp_path, monkeypatch,
                                                                                           command, said):
    """Ctrl-C ended a command with exit 130 and no word, and 130 was in no exit-code table."""
    import specdraft.data.sources
    from specdraft.cli.errors import INTERRUPTED_EXIT

    def interrupt(*_a, **_k):
        raise KeyboardInterrupt

    patch_everywhere(monkeypatch, specdraft.data.sources, "load_examples", interrupt)
    r = CliRunner().invoke(app, [*command, "--out", str(tmp_path / "out")], env={"COLUMNS": "400"})
    assert INTERRUPTED_EXIT == 130 and r.exit_code == 130, r.output
    assert r.output.splitlines()[-1] == said and "Traceback" not in r.output
    doc = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    assert "| 130 | interrupted (Ctrl-C)" in doc


def test_a_mismatch_says_how_the_mapping_count_relates_to_the_moved_strings():
    """A Gemma draft read "24,520 in both under different ids" then "would pair 95968 string-identical tokens":
    two counts of what sounded like one thing, neither explained."""
    import io

    from rich.console import Console

    from specdraft.models.check import check_compatible, print_report
    from specdraft.testing import tiny_tokenizer

    report = check_compatible(tiny_tokenizer(128), tiny_tokenizer(128, swap=(5, 9)))
    out = io.StringIO()
    print_report(report, Console(file=out, width=400))
    text = out.getvalue()
    assert report.verdict == "mismatch" and f"{report.n_strings_moved:,} in both under different ids" in text
    assert (f"would pair {report.mapping['n_mapped']:,} twin tokens (the same text in both, matched by decoded text; "
            f"the {report.n_strings_moved:,} strings above are the raw vocabulary entries found in both under "
            "different ids, while a twin may also sit at the same id") in text
    assert "string-identical" not in text


def test_check_help_promises_continuations_only_where_the_tokenizers_agree():
    r = CliRunner().invoke(app, ["check", "--help"], env={"COLUMNS": "400"})
    text = " ".join(r.output.split())
    assert "When they agree, loads both models" in text and "On a tokenizer mismatch it stops after the comparison" in text


def test_vocab_swap_says_a_dropped_token_id_once_not_as_a_python_warning_too(tmp_path, monkeypatch):
    import warnings

    import specdraft.models.vocab
    from specdraft.cli import training

    def swap(*_a, **_k):
        warnings.warn("vocabulary swap: draft.eos_token_id draft ids [7] have no twin in the target's tokenizer; "
                      "dropped", UserWarning, stacklevel=2)
        return "report"

    patch_everywhere(monkeypatch, specdraft.models.vocab, "save_vocab_swap", swap)
    monkeypatch.setattr(training, "print_vocab_swap", lambda *a: print("dropped draft.eos_token_id: draft ids [7]"))
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        r = CliRunner().invoke(app, ["vocab-swap", "--draft", ddir, "--target", tdir, "--out", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    assert "UserWarning" not in r.output and r.output.count("[7]") == 1, r.output


def test_a_finished_run_leaves_no_trainer_checkpoints_unless_kept_and_its_first_line_names_the_pair_and_disk(tmp_path):
    """A ci run left two float32 Trainer checkpoints of 2.5 GB each; its first line left out disk and the pair."""
    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    train, ev = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"a b {w}"}) + "\n" for w in "cdefghij"))
    ev.write_text("".join(json.dumps({"prompt": f"a b {w}"}) + "\n" for w in "klm"))
    args = ["run", "--target", tdir, "--draft", ddir, "--train-prompts", str(train), "--eval-prompts", f"{ev}",
            "--preset", "tiny"]
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "run")], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    assert first.startswith(f"specdraft run: target {tdir} ← draft {ddir}, preset tiny (needs 1 CPU core, "), first
    assert all(w in first for w in ("RAM", "disk", "seconds")), first
    assert not (tmp_path / "run" / "distill" / "checkpoints").exists()
    assert (tmp_path / "run" / "distill" / "speculator" / "config.json").is_file()
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "kept"), "--keep-checkpoints"])
    assert r.exit_code == 0, r.output
    assert any((tmp_path / "kept" / "distill" / "checkpoints").glob("checkpoint-*"))
    distill_help = " ".join(CliRunner().invoke(app, ["distill", "--help"], env={"COLUMNS": "400"}).output.split())
    assert "--keep-checkpoints" in distill_help


def test_the_eval_tables_first_acceptance_row_is_alpha_per_reached_with_per_proposed_named_beside_it(monkeypatch):
    import io

    from rich.console import Console

    from specdraft.cli import render

    keys = ["acceptance_rate", "alpha", "mean_accepted_length", "predicted_alpha_prompt", "predicted_alpha_response",
            "target_tokens_per_s", "speculative_tokens_per_s", "speedup", "hf_assisted_tokens_per_s",
            "speedup_vs_hf_assisted", "hf_assisted_matches_target", "cost_ratio_c", "analytic_speedup",
            "share_of_analytic", "predicted_speedup", "prediction_error"]
    s = dict.fromkeys(keys, None) | {
        "prompts": 16, "alpha": 0.81, "alpha_ci95": [0.7, 0.9], "acceptance_rate": 0.34,
        "acceptance_rate_ci95": [0.3, 0.4], "recommended_gamma": 8, "predicted_speedup_at_recommended_gamma": 4.12,
        "analytic_recommended_gamma": 7, "analytic_speedup_at_recommended_gamma": 4.5, "divergences": 0,
        "divergences_beyond_tolerance": 0}
    out = io.StringIO()
    monkeypatch.setattr(render, "console", Console(file=out, width=240))
    render.print_eval_summary(s, 8)
    rows = [line for line in out.getvalue().splitlines() if "accept" in line]
    assert rows[0].split("│")[1].strip().startswith("α, accepted / reached")
    ci = next(line for line in out.getvalue().splitlines() if "│ α 95% CI (bootstrap over prompts)" in line)
    assert "0.810" in rows[0] and "[0.700, 0.900]" in ci
    per_proposed = [r for r in rows if "accepted / proposed" in r]
    assert "0.340" in per_proposed[0] and rows.index(per_proposed[0]) > 0


def test_check_of_a_pair_of_two_tokenizers_offers_the_draft_as_given_beside_the_whole_road(tmp_path):
    """check's `next:` for such a pair named only the whole road (tens of minutes); evaluating and exporting the draft
    as given take seconds to minutes, and export's help says what it writes for such a draft."""
    from specdraft.testing import tiny_bpe_tokenizer, tiny_model

    dirs = []
    for vocab, seed in ((300, 0), (360, 1)):
        d = tmp_path / f"m{vocab}"
        tiny_model("llama", vocab, seed=seed, layers=1).save_pretrained(d)
        tiny_bpe_tokenizer(vocab, seed=seed).save_pretrained(d)
        dirs.append(str(d))
    r = CliRunner().invoke(app, ["check", "--target", dirs[0], "--draft", dirs[1]], env={"COLUMNS": "400"})
    assert r.exit_code == 1, r.output
    names = f"--target {dirs[0]} --draft {dirs[1]}"
    lines = r.output.splitlines()
    assert f"next: specdraft eval {names} --map-vocab  (the draft as given, through a mapping: minutes)" in lines
    assert any(x.strip().startswith(f"specdraft export {names} --out DIR") for x in lines)
    assert any(x.strip().startswith(f"specdraft run {names}") for x in lines)
    helped = " ".join(CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "400"}).output.split())
    assert "A draft of another tokenizer is written as given" in helped and "specdraft vocab-swap" in helped
