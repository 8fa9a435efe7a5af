"""Independent speculator checkpoints: on-disk format, loading paths, wrapper transparency, verifier modes,
`export` / `inspect`, bad input and atomic writes. Tiny models built in the test; one real-weight test."""

from __future__ import annotations

import copy
import filecmp
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoConfig, AutoModelForCausalLM, BertConfig, BertForMaskedLM
from typer.testing import CliRunner

from specdraft import __version__
from specdraft.cli import app
from specdraft.core.embedded import ModelResolutionError
from specdraft.decoding.speculator_model import IndependentSpeculator
from specdraft.models.speculator import (
    MISSING,
    NUM_SPECULATIVE_TOKENS,
    SPECULATOR_KEYS,
    IndependentSpeculatorConfig,
    NotASpeculatorError,
    SpeculatorError,
    SpeculatorsConfig,
    config_diff,
    load_speculator_config,
)
from specdraft.serving.export import export_draft
from specdraft.testing import save_tiny_pair, tiny_model, tiny_tokenizer

ARCHS = ["llama", "qwen2", "gpt2", "mistral", "gemma"]
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def expected_speculators_config(gamma: int, name: str, archs: list[str]) -> dict:
    """The block the issue specifies, written out by hand."""
    return {
        "algorithm": "independent",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": gamma, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": name, "architectures": archs},
    }


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(d).iterdir() if p.is_file()}


def siblings(d: Path) -> list[str]:
    """Entries of ``d``'s parent other than ``d`` (to see leftover temporary directories)."""
    return sorted(p.name for p in d.parent.iterdir() if p != d)


@pytest.fixture(scope="module")
def verifier():
    return tiny_model("llama", seed=7, layers=2)


@pytest.fixture
def pair(tmp_path):
    """(target_dir, draft_dir) of a tiny llama pair sharing one tokenizer."""
    return save_tiny_pair(tmp_path / "pair")


# ------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_weights_config_and_reload(tmp_path, arch, tie, verifier):
    draft = tiny_model(arch, seed=1, layers=1, tie_word_embeddings=tie)
    spec = IndependentSpeculator(draft, num_speculative_tokens=3)
    spec.attach_verifier(verifier, name_or_path="org/verifier", check_tokenizer=False)
    spec.save_pretrained(tmp_path / "spec")
    draft.save_pretrained(tmp_path / "plain")
    s, p = files(tmp_path / "spec"), files(tmp_path / "plain")

    # Same files (no copied sources); every file but config.json byte-identical to the draft's own save.
    assert sorted(s) == sorted(p)
    assert all(s[n] == p[n] for n in p if n != "config.json")
    plain, saved = json.loads(p["config.json"]), json.loads(s["config.json"])
    diff = config_diff(plain, saved)
    assert sorted(diff) == sorted(SPECULATOR_KEYS) and all(before is MISSING for before, _ in diff.values())
    assert saved["tie_word_embeddings"] is tie and saved["architectures"] == [type(draft).__name__]
    assert "has_no_defaults_at_init" not in saved and "_auto_class" not in saved
    # Formatting too: removing the three keys gives the plain file's exact text.
    stripped = {k: v for k, v in saved.items() if k not in SPECULATOR_KEYS}
    assert json.dumps(stripped, indent=2, sort_keys=True) + "\n" == p["config.json"].decode()
    assert saved["speculators_model_type"] == "independent" and saved["speculators_version"] == __version__
    assert saved["speculators_config"] == expected_speculators_config(3, "org/verifier", ["LlamaForCausalLM"])

    # Reload: directory, dict, PretrainedConfig, base loader — all equal the config that wrote it.
    want = spec.speculator_config
    assert IndependentSpeculatorConfig.from_pretrained(tmp_path / "spec") == want
    assert IndependentSpeculatorConfig.from_pretrained(saved) == want
    assert IndependentSpeculatorConfig.from_pretrained(AutoConfig.from_pretrained(tmp_path / "spec")) == want
    assert load_speculator_config(tmp_path / "spec") == want
    assert want.to_dict() == saved

    # transformers loads the plain model, same class, identical logits.
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "spec")
        assert type(loaded) is type(draft)
        assert torch.equal(loaded(IDS).logits, draft(IDS).logits)

    again = IndependentSpeculator.from_pretrained(tmp_path / "spec")
    assert again.speculator_config == want and again.num_speculative_tokens == 3
    assert not any(hasattr(again.config, k) for k in SPECULATOR_KEYS)  # the wrapped draft stays plain
    sd, ref = again.state_dict(), draft.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


def test_from_pretrained_converts_plain_draft_with_overrides(tmp_path, pair):
    target_dir, draft_dir = pair
    spec = IndependentSpeculator.from_pretrained(draft_dir, verifier=target_dir, num_speculative_tokens=2)
    assert spec.num_speculative_tokens == 2 and spec.draft_source == draft_dir
    assert spec.speculator_config.verifier.name_or_path == target_dir
    spec.save_pretrained(tmp_path / "spec")
    # Reloading with a new γ changes only γ; the recorded verifier stays.
    again = IndependentSpeculator.from_pretrained(tmp_path / "spec", num_speculative_tokens=6)
    assert again.num_speculative_tokens == 6
    assert again.speculator_config.verifier == spec.speculator_config.verifier


# ------------------------------------------------------------------- plain configs, base loader


def test_base_loader_refuses_plain_config_and_conversion_needs_a_verifier(tmp_path, pair):
    target_dir, draft_dir = pair
    plain = json.loads((Path(draft_dir) / "config.json").read_text())
    for source in (draft_dir, plain, AutoConfig.from_pretrained(draft_dir)):
        with pytest.raises(NotASpeculatorError, match="not a speculator checkpoint — export it as one with "
                                                      "`specdraft export"):
            load_speculator_config(source)

    cfg = IndependentSpeculatorConfig.from_pretrained(draft_dir, num_speculative_tokens=7)
    assert cfg.verifier is None and cfg.num_speculative_tokens == 7 and cfg.draft_config == plain
    with pytest.raises(SpeculatorError, match=r"names no verifier.*attach_verifier.*--target"):
        cfg.save_pretrained(tmp_path / "cfg-only")
    assert not (tmp_path / "cfg-only" / "config.json").exists()

    cfg = IndependentSpeculatorConfig.from_pretrained(draft_dir, verifier=target_dir)
    assert cfg.num_speculative_tokens == NUM_SPECULATIVE_TOKENS
    assert cfg.to_dict()["speculators_config"] == expected_speculators_config(
        NUM_SPECULATIVE_TOKENS, target_dir, ["LlamaForCausalLM"])

    spec = IndependentSpeculator(tiny_model("qwen2"))
    with pytest.raises(SpeculatorError, match="attach_verifier"):
        spec.save_pretrained(tmp_path / "no-verifier")
    assert not (tmp_path / "no-verifier").exists()  # refused before the draft wrote anything


# ---------------------------------------------------------------------------------- schema


def _bad(mutate):
    def f(sc):
        sc = copy.deepcopy(sc)
        mutate(sc)
        return sc
    return f


SCHEMA_FAILURES = {
    "speculative_tokens 0": (_bad(lambda s: s["proposal_methods"][0].update(speculative_tokens=0)),
                             "speculative_tokens"),
    "speculative_tokens str": (_bad(lambda s: s["proposal_methods"][0].update(speculative_tokens="5")),
                               "speculative_tokens"),
    "verifier_accept_k 0": (_bad(lambda s: s["proposal_methods"][0].update(verifier_accept_k=0)),
                            "verifier_accept_k"),
    "accept_tolerance < 0": (_bad(lambda s: s["proposal_methods"][0].update(accept_tolerance=-0.5)),
                             "accept_tolerance"),
    "unknown proposal type": (_bad(lambda s: s["proposal_methods"][0].update(proposal_type="tree")),
                              "proposal_type"),
    "default not listed": (_bad(lambda s: s.update(default_proposal_method="sampling")), "default_proposal_method"),
    "no proposals": (_bad(lambda s: s.update(proposal_methods=[])), "proposal_methods"),
    "other algorithm": (_bad(lambda s: s.update(algorithm="eagle")), "algorithm"),
    "extra key": (_bad(lambda s: s.update(draft_tokens=3)), "draft_tokens"),
    "no verifier": (_bad(lambda s: s.pop("verifier")), "verifier"),
    "architectures not a list": (_bad(lambda s: s["verifier"].update(architectures="Qwen2ForCausalLM")),
                                 "architectures"),
}


@pytest.fixture(scope="module")
def saved_speculator(tmp_path_factory, verifier):
    out = tmp_path_factory.mktemp("saved") / "spec"
    spec = IndependentSpeculator(tiny_model("qwen2", layers=1), num_speculative_tokens=4)
    spec.attach_verifier(verifier, name_or_path="org/verifier", check_tokenizer=False).save_pretrained(out)
    return out


def test_saved_speculators_config_validates_against_the_mirror(saved_speculator):
    saved = json.loads((saved_speculator / "config.json").read_text())
    sc = SpeculatorsConfig.model_validate(saved["speculators_config"])
    assert sc.model_dump(mode="json") == saved["speculators_config"]
    assert sc.proposal_methods[0].speculative_tokens == 4 and sc.verifier.name_or_path == "org/verifier"


@pytest.mark.parametrize("case", list(SCHEMA_FAILURES))
def test_schema_rejects(case, saved_speculator):
    mutate, field_name = SCHEMA_FAILURES[case]
    saved = json.loads((saved_speculator / "config.json").read_text())
    bad = mutate(saved["speculators_config"])
    with pytest.raises(ValidationError, match=field_name):
        SpeculatorsConfig.model_validate(bad)
    # The loaders refuse the same checkpoint, naming the field.
    with pytest.raises(SpeculatorError, match=field_name) as e:
        load_speculator_config({**saved, "speculators_config": bad})
    assert "\n" not in str(e.value) and "Value error" not in str(e.value)  # one `error:` line in the CLI


def test_loader_rejects_bad_top_level_keys(saved_speculator):
    saved = json.loads((saved_speculator / "config.json").read_text())
    with pytest.raises(SpeculatorError, match="speculators_model_type 'eagle3' is not supported"):
        load_speculator_config({**saved, "speculators_model_type": "eagle3"})
    no_version = {k: v for k, v in saved.items() if k != "speculators_version"}
    with pytest.raises(SpeculatorError, match="speculators_version"):
        load_speculator_config(no_version)


# ------------------------------------------------------------------------------ transparency


def test_wrapper_is_transparent():
    draft = tiny_model("qwen2", seed=3)
    spec = IndependentSpeculator(draft)
    assert spec.config is draft.config and spec.model is draft.model and spec.device == draft.device
    with torch.no_grad():
        assert torch.equal(spec(IDS).logits, draft(IDS).logits)
        assert torch.equal(spec.forward(IDS).logits, draft(IDS).logits)
        kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(spec.generate(IDS, **kw), draft.generate(IDS, **kw))
    assert [n for n, _ in spec.named_parameters()] == [n for n, _ in draft.named_parameters()]
    assert list(spec.state_dict()) == list(draft.state_dict())
    assert not any(k.startswith("draft.") for k in spec.state_dict())

    other = tiny_model("qwen2", seed=9)
    spec.load_state_dict(other.state_dict())
    assert torch.equal(draft.lm_head.weight, other.lm_head.weight)

    assert spec.to(torch.float64) is spec and draft.dtype == torch.float64
    assert spec.train() is spec and draft.training and spec.eval() is spec and not draft.training
    spec.some_flag = 3  # attribute writes reach the draft as well
    assert draft.some_flag == 3


# --------------------------------------------------------------------------------- verifier


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_attach_modes_hold_what_they_say_and_never_save_it(tmp_path, arch):
    verifier = tiny_model(arch, seed=5, layers=2)
    spec = IndependentSpeculator(tiny_model("qwen2", seed=1, layers=1))
    draft_keys = list(spec.state_dict())

    spec.attach_verifier(verifier, "detached", name_or_path="org/v", check_tokenizer=False)
    assert spec.verifier is None and spec.verifier_head is None and spec.verifier_mode == "detached"
    assert spec.speculator_config.verifier.model_dump() == {"name_or_path": "org/v",
                                                            "architectures": [type(verifier).__name__]}
    spec.save_pretrained(tmp_path / "detached")

    spec.attach_verifier(verifier, "full", name_or_path="org/v", check_tokenizer=False)
    assert spec.verifier is verifier and list(spec.state_dict()) == draft_keys
    spec.save_pretrained(tmp_path / "full")
    assert files(tmp_path / "full") == files(tmp_path / "detached")  # the held verifier is never written
    spec.to(torch.float64)
    assert verifier.dtype == torch.float64  # a held verifier follows .to()
    spec.to(torch.float32)

    spec.attach_verifier(verifier, "train_only", name_or_path="org/v", check_tokenizer=False)
    head = spec.verifier_head
    assert spec.verifier is None and list(spec.state_dict()) == draft_keys
    # The head maps the verifier's pre-norm last hidden states to exactly its logits.
    captured = {}
    head.norm.register_forward_hook(lambda m, inp, out: captured.__setitem__("h", inp[0]))
    with torch.no_grad():
        want = verifier(IDS).logits  # [1, S, V]
        got = head(captured["h"])
    assert got.shape == want.shape and torch.equal(got, want)
    spec.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in head.parameters())
    assert sum(p.numel() for p in head.parameters()) < sum(p.numel() for p in verifier.parameters()) / 2


def test_attach_errors():
    spec = IndependentSpeculator(tiny_model("qwen2"))
    with pytest.raises(SpeculatorError, match="mode must be one of"):
        spec.attach_verifier(tiny_model("llama"), "partial", name_or_path="x", check_tokenizer=False)
    with pytest.raises(SpeculatorError, match="needs the verifier's weights"):
        spec.attach_verifier(AutoConfig.for_model("llama", architectures=["LlamaForCausalLM"]), "full",
                             name_or_path="x", check_tokenizer=False)
    with pytest.raises(SpeculatorError, match="name_or_path"):
        spec.attach_verifier(tiny_model("llama"), check_tokenizer=False)  # in-memory model with no name
    assert spec.speculator_config.verifier is None  # nothing recorded by a failed attach


def test_attach_runs_the_tokenizer_check(tmp_path, pair):
    target_dir, draft_dir = pair
    spec = IndependentSpeculator.from_pretrained(draft_dir)
    assert spec.attach_verifier(target_dir).compat_verdict == "identical"
    other = tmp_path / "other"
    tiny_model("llama", seed=4).save_pretrained(other)
    tiny_tokenizer(128, swap=(10, 20)).save_pretrained(other)
    with pytest.raises(SpeculatorError, match="do not share a tokenizer"):
        spec.attach_verifier(str(other))
    assert spec.speculator_config.verifier.name_or_path == target_dir  # the failed attach changed nothing


# ----------------------------------------------------------------------------- export: bad input


def test_draft_that_is_not_a_causal_lm(tmp_path, pair):
    target_dir, _ = pair
    bert = BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64))
    with pytest.raises(SpeculatorError, match="BertForMaskedLM.*not a causal language model"):
        IndependentSpeculator(bert)
    bert.save_pretrained(tmp_path / "bert")
    with pytest.raises(SpeculatorError, match="BertForMaskedLM"):
        IndependentSpeculatorConfig.from_pretrained(tmp_path / "bert")
    out = tmp_path / "out"
    with pytest.raises(SpeculatorError, match="BertForMaskedLM"):
        export_draft(tmp_path / "bert", target_dir, out)
    assert not out.exists()


def test_zero_speculative_tokens_names_the_flag(tmp_path, pair):
    target_dir, draft_dir = pair
    out = tmp_path / "out"
    with pytest.raises(SpeculatorError, match="--num-speculative-tokens"):
        export_draft(draft_dir, target_dir, out, num_speculative_tokens=0)
    with pytest.raises(SpeculatorError, match="--num-speculative-tokens"):
        IndependentSpeculator(tiny_model("qwen2"), num_speculative_tokens=0)
    res = CliRunner().invoke(app, ["export", "-d", draft_dir, "-t", target_dir, "-o", str(out),
                                   "--gamma", "0"])
    assert res.exit_code == 2 and "--gamma" in res.output
    assert not out.exists()


def test_unreadable_verifier_fails_before_writing(tmp_path, pair):
    _, draft_dir = pair
    out = tmp_path / "sub" / "out"
    with pytest.raises(ModelResolutionError):
        export_draft(draft_dir, tmp_path / "no-such-model", out)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    # Named with its line when the reference is resolved, before any weight is read.
    with pytest.raises(ModelResolutionError, match=r"broken/config.json is not valid JSON \(line 1, column 2"):
        export_draft(draft_dir, broken, out)
    assert not (tmp_path / "sub").exists()  # not even the parent directory


def test_output_directory_refusal_overwrite_and_empty(tmp_path, pair):
    target_dir, draft_dir = pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SpeculatorError, match="not empty; pass --overwrite"):
        export_draft(draft_dir, target_dir, out)
    assert (out / "keep.txt").read_text() == "mine"

    res = export_draft(draft_dir, target_dir, out, num_speculative_tokens=3, overwrite=True)
    assert not (out / "keep.txt").exists() and load_speculator_config(out).num_speculative_tokens == 3
    assert siblings(out) == ["pair"]  # no .tmp-/.old- leftovers
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
    assert res.out == out.absolute()

    empty = tmp_path / "empty"
    empty.mkdir()
    export_draft(draft_dir, target_dir, empty)  # an existing empty directory is fine without --overwrite
    assert load_speculator_config(empty).num_speculative_tokens == NUM_SPECULATIVE_TOKENS


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_failed_write_leaves_target_untouched(tmp_path, pair, monkeypatch):
    import specdraft.serving.export as ex

    target_dir, draft_dir = pair
    out = tmp_path / "out"

    def interrupted(src, dst):
        raise KeyboardInterrupt  # as if the user hit Ctrl-C after the weights were written

    monkeypatch.setattr(ex, "_copy_tokenizer_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_draft(draft_dir, target_dir, out)
    assert not out.exists() and siblings(out) == ["pair"]

    monkeypatch.undo()
    export_draft(draft_dir, target_dir, out, num_speculative_tokens=2)
    before = files(out)
    monkeypatch.setattr(ex, "_copy_tokenizer_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_draft(draft_dir, target_dir, out, num_speculative_tokens=4, overwrite=True)
    assert files(out) == before and siblings(out) == ["pair"]


def test_killed_convert_leaves_no_speculator(tmp_path, pair):
    """SIGKILL after every file is written but before the rename: the target path never appears."""
    target_dir, draft_dir = pair
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal
        import specdraft.core.io
        import specdraft.serving.export as ex
        specdraft.core.io.fsync_tree = lambda root: os.kill(os.getpid(), signal.SIGKILL)
        ex.export_draft({draft_dir!r}, {target_dir!r}, {str(out)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not out.exists()
    leftovers = [n for n in siblings(out) if n != "pair"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-out-")  # never read by anything
    with pytest.raises(ModelResolutionError):
        load_speculator_config(out)


def _rewrite(draft_dir: str, drop=(), config=None) -> None:
    """Edit a saved draft in place: drop tensors from model.safetensors, override config.json keys."""
    from safetensors.torch import load_file, save_file

    d = Path(draft_dir)
    sd = {k: v for k, v in load_file(d / "model.safetensors").items() if k not in drop}
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    if config:
        (d / "config.json").write_text(json.dumps(json.loads((d / "config.json").read_text()) | config))


def test_untied_draft_without_lm_head_is_never_converted(tmp_path, pair):
    """No random head in a shipped speculator: the missing weight is named, nothing is written, the CLI exits 2."""
    target_dir, draft_dir = pair
    _rewrite(draft_dir, drop=("lm_head.weight",))
    out = tmp_path / "out"
    with pytest.raises(ModelResolutionError, match=r"lm_head\.weight"):
        export_draft(draft_dir, target_dir, out)
    with pytest.raises(ModelResolutionError, match=r"lm_head\.weight"):
        IndependentSpeculator.from_pretrained(draft_dir)
    res = CliRunner().invoke(app, ["export", "-d", draft_dir, "-t", target_dir, "-o", str(out)])
    assert res.exit_code == 2 and "lm_head.weight" in res.output and "Traceback" not in res.output
    assert not out.exists()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n")
    res = CliRunner().invoke(app, ["eval", "-t", target_dir, "-d", draft_dir, "--prompts", str(prompts), "--out",
                                   str(tmp_path / "eval")])
    assert res.exit_code == 2 and "lm_head.weight" in res.output  # eval loads through the same check


def test_tie_flag_that_contradicts_the_tensors_is_exported_false(tmp_path, pair):
    """A draft whose config.json claims tied embeddings next to its own lm_head: the speculator says false, so a
    loader that trusts the flag serves the head that was evaluated; the change is reported and warned."""
    from safetensors.torch import load_file

    target_dir, draft_dir = pair
    _rewrite(draft_dir, config={"tie_word_embeddings": True})
    head = load_file(Path(draft_dir) / "model.safetensors")["lm_head.weight"]
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="tie_word_embeddings"):
        res = export_draft(draft_dir, target_dir, out)
    assert res.corrected == {"tie_word_embeddings": (True, False)} and "tie_word_embeddings" not in res.resaved
    written = json.loads((out / "config.json").read_text())
    assert written["tie_word_embeddings"] is False
    assert torch.equal(load_file(out / "model.safetensors")["lm_head.weight"], head)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.lm_head.weight, head)
    cli_out = tmp_path / "cli"
    r = CliRunner().invoke(app, ["export", "-d", draft_dir, "-t", target_dir, "-o", str(cli_out)])
    assert r.exit_code == 0, r.output
    assert "tie_word_embeddings: true" in " ".join(r.output.split())


def test_saving_a_draft_whose_flag_contradicts_its_tensors_writes_false(tmp_path, verifier):
    draft = tiny_model("llama", layers=1)
    draft.config.tie_word_embeddings = True  # a claim the two distinct tensors contradict
    spec = IndependentSpeculator(draft).attach_verifier(verifier, name_or_path="org/v", check_tokenizer=False)
    with pytest.warns(UserWarning, match="tie_word_embeddings"):
        spec.save_pretrained(tmp_path / "s")
    assert json.loads((tmp_path / "s" / "config.json").read_text())["tie_word_embeddings"] is False
    assert spec.corrections == {"tie_word_embeddings": (True, False)}


# ------------------------------------------------------------------------------------------- CLI


def test_cli_convert_and_inspect(tmp_path, pair):
    target_dir, draft_dir = pair
    out = tmp_path / "spec"
    runner = CliRunner()
    res = runner.invoke(app, ["export", "--draft", draft_dir, "--target", target_dir, "--out", str(out)])
    assert res.exit_code == 0, res.output
    cmd = (f"python -m vllm.entrypoints.openai.api_server --model {target_dir} --speculative-config "
           f"'{{\"method\": \"draft_model\", \"model\": "
           f"\"{out}\", \"num_speculative_tokens\": {NUM_SPECULATIVE_TOKENS}}}'")
    assert cmd in res.output
    assert "the speculator's 3 keys" in res.output and all(k in res.output for k in SPECULATOR_KEYS)
    # The draft's tokenizer files travel byte for byte; the config diff is the three keys.
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert filecmp.cmp(out / name, Path(draft_dir) / name, shallow=False)
    src = json.loads((Path(draft_dir) / "config.json").read_text())
    assert sorted(config_diff(src, json.loads((out / "config.json").read_text()))) == sorted(SPECULATOR_KEYS)
    assert filecmp.cmp(out / "model.safetensors", Path(draft_dir) / "model.safetensors", shallow=False)

    res = runner.invoke(app, ["inspect", str(out)])
    assert res.exit_code == 0, res.output
    assert target_dir in res.output and "LlamaForCausalLM" in res.output
    assert f"speculative_tokens (γ)={NUM_SPECULATIVE_TOKENS}" in res.output and cmd in res.output

    res = runner.invoke(app, ["inspect", draft_dir])
    assert res.exit_code == 2 and "specdraft export" in res.output

    res = runner.invoke(app, ["export", "-d", draft_dir, "-t", target_dir, "-o", str(out)])
    assert res.exit_code == 2 and "--overwrite" in res.output


# ----------------------------------------------------------------------------------- real weights


@pytest.mark.real
def test_real_qwen_draft_converts_and_reloads_with_identical_logits(tmp_path):
    from specdraft.core.embedded import DEFAULT_DRAFT, DEFAULT_TARGET, EMBEDDED
    from specdraft.models.loading import load_tokenizer, resolve

    out = tmp_path / "spec"
    res = export_draft(DEFAULT_DRAFT, DEFAULT_TARGET, out)  # the verifier's config and tokenizer only
    assert sorted(res.added) == sorted(SPECULATOR_KEYS) and res.resaved == {}
    # An embedded verifier is recorded portably: the hub id its (dequantised GGUF) weights derive from.
    assert res.config["speculators_config"] == expected_speculators_config(
        NUM_SPECULATIVE_TOKENS, EMBEDDED[DEFAULT_TARGET].hub_id, ["Qwen2ForCausalLM"])
    assert EMBEDDED[DEFAULT_TARGET].hub_id == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert res.compat_verdict in (None, "identical", "identical-up-to-padding")
    src = Path(resolve(DEFAULT_DRAFT))
    # The cache entry was written by this transformers' save_pretrained too: same bytes.
    assert filecmp.cmp(out / "model.safetensors", src / "model.safetensors", shallow=False)

    tok = load_tokenizer(DEFAULT_DRAFT)
    ids = tok("def fibonacci(n):", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(out)
        assert type(loaded).__name__ == "Qwen2ForCausalLM"
        got = loaded(ids).logits
        del loaded
        want = AutoModelForCausalLM.from_pretrained(src)(ids).logits
    assert torch.equal(got, want)


def test_full_mode_generate_is_speculative_decoding_of_the_verifier(pair):
    """attach_verifier(mode="full") gives the speculator a user path: generate() runs specdraft's lossless loop with
    the held verifier — the verifier's own greedy output, in transformers' layout — and records the counts."""
    target_dir, draft_dir = pair
    spec = IndependentSpeculator.from_pretrained(draft_dir, num_speculative_tokens=3)
    verifier = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = (ids != 0).long()
    plain = spec.generate(input_ids=ids[:1], max_new_tokens=6, do_sample=False)  # detached: the draft's own
    with torch.no_grad():
        assert torch.equal(plain, spec.draft.generate(input_ids=ids[:1], max_new_tokens=6, do_sample=False))
    spec.attach_verifier(verifier, "full", name_or_path=target_dir, check_tokenizer=False)
    out = spec.generate(ids, mask, max_new_tokens=12, eos_token_id=[])
    with torch.no_grad():
        ref = verifier.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    assert torch.equal(out, ref)
    c = spec.last_counts
    assert c.gamma == 3 and c.emitted == 24 and 0.0 <= c.acceptance_rate <= 1.0


def test_train_only_mode_is_the_teacher_head_of_distillation(pair):
    """attach_verifier(mode="train_only") holds the verifier's head: DistillModel.from_speculator turns the
    verifier's post-norm hidden states (what a hidden dump stores) into exactly the verifier's logits."""
    from specdraft.core.config import DistillConfig
    from specdraft.training.distill import DistillError
    from specdraft.training.distill_trainer import DistillModel

    target_dir, draft_dir = pair
    spec = IndependentSpeculator.from_pretrained(draft_dir)
    with pytest.raises(DistillError, match="train_only"):
        DistillModel.from_speculator(spec, DistillConfig())
    verifier = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    spec.attach_verifier(verifier, "train_only", name_or_path=target_dir, check_tokenizer=False)
    m = DistillModel.from_speculator(spec, DistillConfig())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        out = verifier(ids, output_hidden_states=True)
        _p, logits = m.teacher_probs(hidden=out.hidden_states[-1])  # the last entry is after the final norm
    torch.testing.assert_close(logits, out.logits.float())
    assert m.draft is spec.draft
