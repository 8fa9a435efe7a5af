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
from specdraft.testing import save_tiny_pair, tiny_model, tiny_tokenizer


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
    from specdraft.config import DumpConfig
    from specdraft.dump import run_dump
    from specdraft.export import export_draft

    tdir, ddir = save_tiny_pair(tmp_path / "models", 64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n")
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text(json.dumps({"prompt": "a b"}) + "\n[1]\n")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"prompt": "a b"}).encode() + b"\n" + '{"prompt": "caf\xe9"}'.encode("latin-1")
                       + b"\n")
    dump = tmp_path / "dump"
    run_dump(tdir, str(prompts), dump, DumpConfig(format="topk", top_k=4, dtype="float32"))
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
