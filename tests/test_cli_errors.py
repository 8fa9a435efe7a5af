"""Every error a user can fix ends the command with one ``error:`` line naming the flag as typed and exit 2, before
any long work: never a traceback (exit 3)."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.cli.errors import EXPECTED_ERRORS
from specdraft.testing import patch_everywhere, save_tiny_pair, tiny_model, tiny_tokenizer


def _one_error_line(r) -> str:
    """A refused command's last line: its one ``error:`` line (after what it said it would run), exit 2, no
    traceback."""
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    lines = r.output.splitlines()
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], r.output
    assert "Traceback" not in r.output
    return lines[-1]


def _invoke(args):
    return CliRunner().invoke(app, args, terminal_width=300, prog_name="specdraft")


@pytest.mark.parametrize(("module", "name"), EXPECTED_ERRORS)
def test_every_expected_error_is_named_under_the_module_that_defines_it(module, name):
    """The table resolves a class only among modules already imported: a class named under a module that merely
    re-exports it (or no longer has it) is missed whenever that module was not imported, and the error becomes a
    traceback. A specdraft class is named where it is defined, so raising it means its module is loaded."""
    cls = getattr(importlib.import_module(module), name, None)
    assert isinstance(cls, type) and issubclass(cls, BaseException), (module, name)
    if module.startswith("specdraft"):
        assert cls.__module__ == module, f"{name} is defined in {cls.__module__}, not {module}"


def _other_tokenizer_draft(root):
    other = root / "other"
    tiny_model("llama", 64, seed=3, layers=1).save_pretrained(other)
    tiny_tokenizer(64, swap=(10, 11)).save_pretrained(other)
    return str(other)


def _documented_cases(tmp_path):
    """``{case: (argv, what the error line must contain)}``: the exit-2 cases docs/cli.md lists, and those a
    newcomer met as tracebacks."""
    from specdraft.core.config import DumpConfig
    from specdraft.serving.export import export_draft
    from specdraft.training.dump import run_dump

    tdir, ddir = save_tiny_pair(tmp_path / "models", 64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n")
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text(json.dumps({"prompt": "a b"}) + "\n[1]\n")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"prompt": "a b"}).encode() + b"\n" + '{"prompt": "caf\xe9"}'.encode("latin-1")
                       + b"\n")
    dump = tmp_path / "dump"
    run_dump(tdir, str(prompts), dump, DumpConfig(teacher_format="topk", top_logprobs=4, dtype="float32"))
    other = _other_tokenizer_draft(tmp_path)
    no_weights = tmp_path / "no-weights"
    export_draft(ddir, tdir, no_weights)
    (no_weights / "model.safetensors").unlink()
    short = tmp_path / "short-window"
    shutil.copytree(ddir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 24}))
    pair = ["--target", tdir, "--draft", ddir]
    return {
        "a bad value": (["eval", *pair, "--gamma", "0"], "error: --gamma: 0 is not in the range"),
        "an unknown flag": (["eval", "--bogus"], "error: No such option: --bogus"),
        "a missing prompt file": (["eval", *pair, "--prompts", str(tmp_path / "none.jsonl")], "none.jsonl"),
        "a malformed line": (["eval", *pair, "--prompts", str(bad_line)], f"error: {bad_line}:2: "),
        "a prompt file not in UTF-8": (["eval", *pair, "--prompts", str(latin1)],
                                       f"error: {latin1}:2: not UTF-8 text"),
        "a checkpoint missing weights": (["inspect", str(no_weights)], "holds no weight files"),
        "a prompt past the window": (["generate", "a b c d e f g h", "--target", tdir, "--draft", str(short),
                                      "--max-new-tokens", "20", "--gamma", "3", "--dtype", "float32"],
                                     "error: prompt ("),
        "distill of no dump": (["distill", *pair, "--dump", str(tmp_path / "nodump"), "--out",
                                str(tmp_path / "o1")], f"error: --dump {tmp_path / 'nodump'}: "),
        "distill of a draft not re-indexed": (
            ["distill", "--target", tdir, "--draft", other, "--dump", str(dump), "--out", str(tmp_path / "o2")],
            f"specdraft vocab-swap --draft {other} --target {tdir} --out "),
    }


CASES = ("a bad value", "an unknown flag", "a missing prompt file", "a malformed line", "a prompt file not in UTF-8",
         "a checkpoint missing weights", "a prompt past the window", "distill of no dump",
         "distill of a draft not re-indexed")


def test_every_documented_exit_2_case_is_one_error_line_through_the_command_line(tmp_path):
    """Each case was an expected error: distill of a missing dump, of a draft of another tokenizer, and a prompt
    file in another encoding each printed a traceback and exited 3."""
    cases = _documented_cases(tmp_path)
    assert set(cases) == set(CASES)
    for case, (argv, says) in cases.items():
        r = _invoke(argv)
        assert r.exit_code == 2, (case, r.output)
        line = _one_error_line(r)
        assert says in line, (case, line)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_plain_distill_without_a_dump_says_which_folder_it_looked_in_and_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(_invoke(["distill"]))
    assert line.startswith("error: --dump runs/dump: ") and "specdraft dump --out runs/dump" in line
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------- bad input fails before the work

@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model's weights fails the test: a refusal must come before it."""
    import specdraft.models.loading

    def refuse(*_a, **_k):
        raise AssertionError("a model was loaded before the input was checked")

    patch_everywhere(monkeypatch, specdraft.models.loading, "load_model", refuse)


def test_an_empty_prompt_is_refused_before_any_model_is_named(no_loading):
    """`generate ""` ran for minutes and answered an empty message."""
    line = _one_error_line(_invoke(["generate", "  ", "--target", "target-model", "--draft", "draft-model"]))
    assert line.startswith("error: PROMPT is empty: give the user message to answer")


def test_a_self_teacher_of_the_targets_own_tokenizer_is_refused_as_vocab_swap_refuses_it(tmp_path, no_loading):
    tdir, ddir = save_tiny_pair(tmp_path / "models", 64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n")
    out = tmp_path / "new" / "dump"
    line = _one_error_line(_invoke(["dump", "--out", str(out), "--target", tdir, "--prompts", str(prompts),
                                    "--self-teacher", ddir]))
    assert line.startswith(f"error: --self-teacher {ddir}: the draft already speaks the target's tokenizer")
    assert "drop --self-teacher" in line and not (tmp_path / "new").exists()


def test_a_missing_text_file_is_refused_before_the_self_teacher_starts(tmp_path, no_loading):
    """Before the models are even looked for (it was checked once the self-teacher had started)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n")
    line = _one_error_line(_invoke(["dump", "--out", str(tmp_path / "dump"), "--prompts", str(prompts),
                                    "--self-teacher", "no-such-draft", "--text", str(tmp_path / "nosuch.py")]))
    assert line == f"error: --text {tmp_path / 'nosuch.py'}: no such file"


def test_a_gguf_export_of_a_draft_of_another_tokenizer_is_refused_before_llama_cpp_is_looked_for(tmp_path,
                                                                                                monkeypatch):
    import specdraft.serving.gguf_export

    def no_converter(*_a, **_k):
        raise AssertionError("llama.cpp's converter was looked for before the tokenizers were compared")

    monkeypatch.setattr(specdraft.serving.gguf_export, "find_llama_cpp", no_converter)
    tdir, _ = save_tiny_pair(tmp_path / "models", 64)
    other = _other_tokenizer_draft(tmp_path)
    out = tmp_path / "new" / "draft.gguf"
    line = _one_error_line(_invoke(["export", "--draft", other, "--target", tdir, "--format", "gguf", "--out",
                                    str(out)]))
    assert line.startswith(f"error: llama.cpp would refuse {other} as the draft of {tdir} (its vocabulary check: "
                           "token 10: ")
    assert "specdraft vocab-swap" in line and not (tmp_path / "new").exists()


def test_run_without_vocab_swap_on_the_self_teacher_preset_says_both_ways_out(no_loading):
    line = _one_error_line(_invoke(["run", "--no-vocab-swap"]))
    assert line.startswith("error: --no-vocab-swap: preset default's teacher is the draft itself")
    assert "pass --vocab-swap" in line and "--preset same-family --draft DRAFT" in line
    assert "self_teacher" not in line and "vocab_swap" not in line  # flags, not config fields


def test_every_missing_required_option_is_named_at_once():
    line = _one_error_line(_invoke(["export"]))
    assert line == ("error: Missing options '--draft' / '-d', '--target' / '-t', '--out' / '-o' (see specdraft "
                    "export --help)")
    line = _one_error_line(_invoke(["export", "-ofoo", "--draft=x"]))
    assert line == "error: Missing option '--target' / '-t' (see specdraft export --help)"


def test_a_missing_prompt_file_is_named_with_its_flag_as_typed(tmp_path):
    line = _one_error_line(_invoke(["eval", "--prompts", "nosuch.jsonl", "--target", "t", "--draft", "d"]))
    assert line == "error: --prompts nosuch.jsonl: no such file"


def test_a_failed_command_leaves_no_out_folder_it_created_behind(tmp_path, no_loading):
    """run created --out (and the folders above it), then refused the overlapping prompts: an empty folder stayed."""
    tdir, ddir = save_tiny_pair(tmp_path / "models", 64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n")
    out = tmp_path / "new" / "run"
    r = _invoke(["run", "--preset", "tiny", "--target", tdir, "--draft", ddir, "--train-prompts", str(prompts),
                 "--eval-prompts", str(prompts), "--ood-prompts", str(prompts), "--refuse-overlap", "--out", str(out)])
    assert "also occur in the training prompts" in _one_error_line(r)
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------- which pair a command runs

def _models_found_never_loaded(monkeypatch):
    """Every reference resolves (as a cached model would) and the first step that reads a model refuses: ``no
    models here``."""
    import specdraft.core.embedded
    import specdraft.measuring.pair
    import specdraft.models.check
    import specdraft.models.loading
    from specdraft.core.embedded import ModelResolutionError

    def refuse(*_a, **_k):
        raise ModelResolutionError("no models here")

    monkeypatch.setattr(specdraft.core.embedded, "is_cached", lambda _ref: True)
    patch_everywhere(monkeypatch, specdraft.models.loading, "resolve", lambda ref, *_a, **_k: str(ref))
    monkeypatch.setattr(specdraft.models.check, "run_check", refuse)
    monkeypatch.setattr(specdraft.measuring.pair, "load_pair", refuse)


@pytest.mark.parametrize("command", ["check", "eval"])
def test_check_and_eval_without_arguments_name_the_embedded_pair_and_runs_other_draft_first(command, monkeypatch):
    """check and eval default to the embedded pair, run's default preset to another draft: a newcomer comparing them
    learnt it only from the numbers. The first line says it, before any model loads."""
    _models_found_never_loaded(monkeypatch)
    r = _invoke([command])
    assert r.output.splitlines()[0] == (f"specdraft {command}: target qwen2.5-coder-1.5b-instruct ← draft "
                                        "qwen2.5-coder-0.5b-instruct (the embedded pair; `run`'s default preset uses "
                                        "smollm2-135m-instruct)")
    assert r.output.splitlines()[-1].endswith("no models here")


def test_a_pair_given_is_named_without_the_embedded_note(tmp_path, monkeypatch):
    _models_found_never_loaded(monkeypatch)
    r = _invoke(["check", "--target", "t-model", "--draft", "d-model"])
    assert r.output.splitlines()[0] == "specdraft check: target t-model ← draft d-model"


def test_check_and_eval_refusing_a_bad_input_print_only_the_error(tmp_path):
    """check and eval named their pair first, so a missing model or prompt file was two lines: the pair, then the
    error. The error is now the whole output."""
    tdir, ddir = save_tiny_pair(tmp_path, 64)
    missing = tmp_path / "nowhere"
    cases = [["check", "--target", tdir, "--draft", str(missing)],
             ["eval", "--target", tdir, "--draft", str(missing), "--out", str(tmp_path / "e1")],
             ["eval", "--target", tdir, "--draft", ddir, "--prompts", str(tmp_path / "none.jsonl"),
              "--out", str(tmp_path / "e2")]]
    for args in cases:
        r = _invoke(args)
        assert r.exit_code == 2 and len(r.output.splitlines()) == 1, r.output
        assert r.output.startswith("error: "), r.output
