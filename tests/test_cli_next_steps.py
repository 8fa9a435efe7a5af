"""What a newcomer meets after each command: the files it leaves and the commands it prints next, on tiny pairs
(a target and a draft of another tokenizer, built in the test)."""

from __future__ import annotations

import json

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
    generate without --map-vocab: the tokenizer report and exit 1, for the pair its own config.json names."""
    tdir, ddir = _other_tokenizer_pair(tmp_path)
    spec = tmp_path / "spec"
    assert _invoke(["export", "--draft", ddir, "--target", tdir, "--out", str(spec)]).exit_code == 0
    r = _invoke(["generate", "a b c", "--target", tdir, "--draft", str(spec), "--max-new-tokens", "4",
                 "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert "drafts through text" in " ".join(r.output.split()) and "--map-vocab" in r.output
    # A plain draft of another tokenizer still needs the flag: nothing it carries says how it drafts.
    r = _invoke(["generate", "a b c", "--target", tdir, "--draft", ddir, "--max-new-tokens", "4",
                 "--dtype", "float32"])
    assert r.exit_code == 1 and "--map-vocab" in r.output
