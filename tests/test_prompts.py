"""Prompt specs: one parser and one loader, so a spec means the same rows in every command that evaluates, a bad
spec is one line naming the flag, the part and the grammar, and every command says what it will run before any
model loads. Fast: no model is loaded (the loader is stood in for where a command would reach it)."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.data.prompts import (
    HELD_OUT_LIMIT,
    SPEC_GRAMMAR,
    SPEC_GRAMMAR_NO_STRIDE,
    PromptSpecError,
    parse_source,
    resolve_source,
    select_prompts,
)
from specdraft.data.sources import DataError
from specdraft.run.pipeline import make_config, run_prompts
from specdraft.testing import patch_everywhere, save_tiny_pair


class _ModelLoad(Exception):
    """Raised where a command first loads a model: the test has seen what it needed by then."""


@pytest.fixture
def no_models(monkeypatch):
    """``load_model`` stood in for: each call records the command's output so far, then stops the command."""
    import specdraft.models.loading

    seen: list[str] = []

    def stop(*_a, **_k):
        sys.stdout.flush()
        seen.append(sys.stdout.buffer.getvalue().decode())  # CliRunner's stdout: what was printed before the load
        raise _ModelLoad("a model load")

    patch_everywhere(monkeypatch, specdraft.models.loading, "load_model", stop)
    return seen


def _lines(output: str, prefix: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(prefix)]


# ------------------------------------------------------------------------------------------------ one meaning


def test_a_spec_means_the_same_rows_in_eval_and_in_runs_held_out_flags():
    """``eval --prompts humaneval`` read HumanEval's held-out problems (100+) while ``run --eval-prompts humaneval``
    read rows 0+, the presets' training prompts: one loader now reads both, and ``--ood-prompts`` too."""
    for spec in ("humaneval", "humaneval:120", "mt-bench", "sharegpt", "conversations:3:5"):
        evaluated = select_prompts(spec, "--prompts", held_out=True)
        run = run_prompts(make_config("tiny", eval_prompts=[spec], ood_prompts=[spec]), ("eval", "ood"))
        ids = [e.id for e in evaluated.examples]
        assert [e.id for e in run["eval"].examples] == ids == [e.id for e in run["ood"].examples], spec
    humaneval = select_prompts("humaneval", held_out=True)
    assert humaneval.sources[0] == ("humaneval", 100, HELD_OUT_LIMIT, 1)
    assert [e.id for e in humaneval.examples] == [f"HumanEval/{i}" for i in range(100, 100 + HELD_OUT_LIMIT)]


def test_the_training_flags_read_a_spec_from_the_first_example_and_all_of_it():
    trains = run_prompts(make_config("tiny", train_prompts=["humaneval"]), ("train",))["train"]
    assert len(trains.examples) == 164 and trains.examples[0].id == "HumanEval/0"
    assert parse_source("humaneval") == ("humaneval", 0, None, 1) == resolve_source("humaneval", held_out=False)


def test_eval_and_run_print_the_same_resolved_spec_for_the_same_written_one(tmp_path, no_models, monkeypatch):
    import specdraft.run.pipeline

    tdir, ddir = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", "humaneval",
                                 "--out", str(tmp_path / "eval")])
    assert no_models, r.output  # eval reached its model load, having said what it will run
    assert _lines(no_models[0], "prompts:") == ["prompts: humaneval:100:8:1 (8 prompts, held out)"]

    given = {}

    def pipeline(cfg, out, **kwargs):
        given.update(kwargs)
        raise _ModelLoad("the pipeline")

    monkeypatch.setattr(specdraft.run.pipeline, "run_pipeline", pipeline)
    r = CliRunner().invoke(app, ["run", "--preset", "tiny", "--target", tdir, "--draft", ddir, "--eval-prompts",
                                 "humaneval", "--ood-prompts", "mt-bench", "--train-prompts", "humaneval:0:4",
                                 "--out", str(tmp_path / "run")])
    assert given, r.output
    assert _lines(r.output, "eval prompts:") == ["eval prompts: humaneval:100:8:1 (8 prompts, held out)"]
    assert _lines(r.output, "ood prompts:") == ["ood prompts: mt-bench:0:8:3 (8 prompts, held out)"]
    assert _lines(r.output, "train prompts:") == ["train prompts: humaneval:0:4:1 (4 prompts)"]
    assert [e.id for e in given["eval_examples"]] == [f"HumanEval/{i}" for i in range(100, 108)]


def test_a_set_that_is_not_held_out_is_never_called_held_out():
    """conversations has no held-out split, and mt-bench's rows between every third are training rows."""
    (line,) = select_prompts("conversations", "--eval-prompts", held_out=True).lines()
    assert ", held out" not in line and line.endswith("(8 prompts; not held out: conversations has no held-out split)")
    (line,) = select_prompts("mt-bench:0", held_out=True).lines()
    assert line == "prompts: mt-bench:0:8:1 (8 prompts; 5 not held out: mt-bench holds out rows 0, 3, 6 and so on)"
    # A training flag makes no claim either way; a user's file has no split specdraft could know.
    assert select_prompts("mt-bench").lines() == ["prompts: mt-bench:0:80:1 (80 prompts)"]


def test_every_preset_evaluates_on_held_out_rows_and_trains_outside_them():
    from specdraft.run.pipeline import PRESETS

    for name in PRESETS:
        if name == "tiny":
            continue
        sets = run_prompts(make_config(name))
        for key in ("eval", "ood"):
            assert not sets[key].picks or ", held out" in sets[key].lines()[0], (name, sets[key].lines())
        held = [e.id for e in sets["eval"].examples + sets["ood"].examples]
        assert not {e.id for e in sets["train"].examples} & set(held), name


# ------------------------------------------------------------------------------------------------ bad specs


@pytest.mark.parametrize(("spec", "part"), [
    ("humaneval:abc", "the offset 'abc' is not a whole number"),
    ("humaneval:-1:2", "the offset '-1' is not a whole number"),
    ("humaneval::8", "the offset is empty"),
    ("humaneval:100:8:2:1", "'1' after the stride: one part too many"),
    ("", "the spec is empty"),
    ("humaneval:100:0", "the limit 0 is below 1"),
])
def test_each_bad_spec_is_one_error_line_naming_the_flag_the_bad_part_and_the_grammar(tmp_path, no_models, spec,
                                                                                        part):
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", spec])
    assert r.exit_code == 2 and not no_models, r.output
    (line,) = _lines(r.output, "error:")
    assert line.startswith(f"error: --prompts {spec!r}: ") and part in line and SPEC_GRAMMAR in line, line
    with pytest.raises(PromptSpecError, match="--eval-prompts"):
        run_prompts(make_config("tiny", eval_prompts=["mt-bench", spec]), ("eval",))


def test_a_stride_of_zero_is_refused_not_dropped():
    """``mt-bench:0:27:0`` used to read as stride 1 without a word."""
    with pytest.raises(PromptSpecError, match=r"--prompts 'mt-bench:0:27:0': the stride 0 is below 1"):
        parse_source("mt-bench:0:27:0")
    assert isinstance(PromptSpecError("x"), DataError)  # the CLI's expected error: one line, exit 2


def test_dump_shows_and_takes_no_stride(tmp_path, no_models):
    r = CliRunner().invoke(app, ["dump", "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    help_text = " ".join(r.output.split("--prompts", 1)[1].split("--teacher-format", 1)[0].split())
    assert SPEC_GRAMMAR_NO_STRIDE in help_text and "stride]" not in help_text, help_text
    tdir, _ = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["dump", "--target", tdir, "--prompts", "humaneval:0:8:2", "--out",
                                 str(tmp_path / "dump")])
    (line,) = _lines(r.output, "error:")
    assert r.exit_code == 2 and "'2' after the limit" in line and SPEC_GRAMMAR_NO_STRIDE in line, r.output
    assert not (tmp_path / "dump").exists()


# ------------------------------------------------------------------------------------------------ what will run


def test_a_spec_that_gives_fewer_prompts_than_its_limit_warns_and_runs_on(tmp_path, no_models):
    lines = select_prompts("humaneval:160:8").lines()
    assert lines == ["prompts: humaneval:160:8:1 (4 prompts)",
                     "warning: --prompts humaneval:160:8 gives 4 prompts, not 8 (humaneval has 164 rows)"]
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", "humaneval:160:8",
                                 "--out", str(tmp_path / "eval")])
    assert no_models and not _lines(r.output, "error:"), r.output  # a warning: eval went on to load its models
    assert "warning: --prompts humaneval:160:8 gives 4 prompts, not 8 (humaneval has 164 rows)" in no_models[0]


def test_every_command_prints_what_will_run_before_any_model_loads(tmp_path, no_models):
    tdir, ddir = save_tiny_pair(tmp_path / "pair", 64)
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"prompt": f"a b {w}"}) + "\n" for w in "cdef"))
    commands = {
        "eval": (["eval", "--target", tdir, "--draft", ddir, "--prompts", f"{mine}:1"], f"prompts: {mine}:1:8:1"),
        "rank": (["rank", ddir, "--target", tdir, "--prompts", str(mine)], f"prompts: {mine}:0:8:1"),
        "headroom": (["headroom", "--target", tdir, "--draft", ddir, "--prompts", f"{mine}:0:2"],
                     f"prompts: {mine}:0:2:1"),
        "dump": (["dump", "--target", tdir, "--prompts", str(mine), "--out", str(tmp_path / "dump")],
                 f"prompts: {mine}:0:4 "),
        "run": (["run", "--preset", "tiny", "--target", tdir, "--draft", ddir, "--train-prompts", str(mine),
                 "--eval-prompts", f"{mine}:2", "--out", str(tmp_path / "run")], f"eval prompts: {mine}:2:8:1"),
    }
    for name, (args, says) in commands.items():
        no_models.clear()
        r = CliRunner().invoke(app, [*args, *(["--out", str(tmp_path / name)] if name in ("eval", "rank") else [])])
        assert no_models, (name, r.output)  # the command reached a model load
        assert says in no_models[0], (name, no_models[0])


# ------------------------------------------------------------------------------------------------ unique ids


def _file(path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_two_prompt_files_without_ids_give_their_rows_distinct_ids(tmp_path):
    """Rows without an ``id`` are named by their file: two files' line 1 no longer share ``line-1`` (results are
    paired by id, and the repeat ended a whole run with a raw error at its last step)."""
    code = _file(tmp_path / "code.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    chat = _file(tmp_path / "chat.jsonl", [{"prompt": "c"}, {"prompt": "d"}])
    chosen = select_prompts([code, chat], "--eval-prompts", held_out=True)
    assert [e.id for e in chosen.examples] == ["code:line-1", "code:line-2", "chat:line-1", "chat:line-2"]


def test_a_prompt_id_that_repeats_is_refused_naming_every_place_before_any_model_loads(tmp_path, no_models):
    one = _file(tmp_path / "a" / "p.jsonl", [{"prompt": "a"}, {"id": "q", "prompt": "b"}])
    other = _file(tmp_path / "b" / "p.jsonl", [{"prompt": "c"}])  # the same file name: its line 1 is p:line-1 too
    third = _file(tmp_path / "q.jsonl", [{"id": "q", "prompt": "d"}])
    with pytest.raises(DataError) as err:
        select_prompts([one, other, third], "--eval-prompts", held_out=True)
    says = str(err.value)
    assert says.startswith(f"--eval-prompts: 2 prompt id(s) occur more than once: 'p:line-1' at {one} row 0, {other} "
                           f"row 0; 'q' at {one} row 1, {third} row 0. "), says
    assert "distinct 'id'" in says and "rename one of two files" in says
    with pytest.raises(DataError, match=r"'p:line-1' at .* row 0, .* row 0"):  # one file named twice
        select_prompts([f"{one}:0:1", one], "--prompts")
    tdir, ddir = save_tiny_pair(tmp_path / "pair", 64)
    r = CliRunner().invoke(app, ["run", "--preset", "tiny", "--target", tdir, "--draft", ddir, "--eval-prompts", one,
                                 "--eval-prompts", other, "--out", str(tmp_path / "run")])
    (line,) = _lines(r.output, "error:")
    assert r.exit_code == 2 and "'p:line-1'" in line and not no_models, r.output


def test_an_unknown_source_is_one_error_line_naming_the_flag_as_typed(tmp_path, no_models):
    """`--prompts nosuchset` said "Unknown prompt source 'nosuchset'" without the flag, unlike every other spec error."""
    from typer.testing import CliRunner

    from specdraft.cli import app

    for cmd, flag in (("eval", "--prompts"), ("run", "--eval-prompts")):
        r = CliRunner().invoke(app, [cmd, flag, "nosuchset", "--out", str(tmp_path / cmd)], terminal_width=200)
        assert r.exit_code == 2, r.output
        line = [x for x in r.output.splitlines() if x.startswith("error:")]
        assert line and line[0].startswith(f"error: {flag} 'nosuchset': Unknown prompt source 'nosuchset'"), r.output
