"""Shipping a speculator: the recorded verifier resolves elsewhere, the printed vLLM command works from any
directory and says what a padded draft needs, and a dtype cast is the one change to the weights. Tiny models
built in the test (a fake embedded-model cache stands in for the real one)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.core.embedded import DEFAULT_TARGET, EMBEDDED, cache_dir
from specdraft.models.loading import embedded_for_hub_id, local_reference, portable_reference, serving_path
from specdraft.models.speculator import NotASpeculatorError, SpeculatorError
from specdraft.models.weights import CheckpointWeightsError
from specdraft.serving.export import (
    VLLM_TESTED_VERSION,
    export_draft,
    export_saved_speculator,
    export_speculator,
    vllm_serve,
    vllm_speculative_config,
)
from specdraft.testing import save_tiny_pair, tiny_model, tiny_tokenizer

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


@pytest.fixture
def pair(tmp_path):
    return save_tiny_pair(tmp_path / "models", 96)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty HF cache and a private specdraft cache: no hub id is cached, no embedded model is built."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "specdraft-cache"))


def fake_embedded_cache(name: str, source_dir: str) -> Path:
    """Put a tiny checkpoint where specdraft's cache keeps embedded model ``name`` (marker included)."""
    d = cache_dir(name)
    d.mkdir(parents=True)
    for f in Path(source_dir).iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "specdraft-cache.json").write_text(json.dumps({"name": name}))
    return d


def dtypes(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {str(f.get_tensor(k).dtype) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable


def serve_args(command: str) -> tuple[str, dict]:
    """``python -m vllm.entrypoints.openai.api_server --model TARGET --speculative-config JSON`` → (TARGET, the JSON):
    the server as ``make test-vllm`` starts it."""
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert argv[5] == "--speculative-config"
    return argv[4], json.loads(argv[6])


# ------------------------------------------------------------------------------ references


def test_every_embedded_model_names_the_hub_id_its_weights_derive_from():
    for m in EMBEDDED.values():
        assert m.hub_id.count("/") == 1 and m.quant, m.name
        assert embedded_for_hub_id(m.hub_id) is m
        assert portable_reference(m.name) == m.hub_id
        assert m.provenance.startswith(f"a dequantised {m.quant} GGUF build of {m.hub_id}")
    assert EMBEDDED[DEFAULT_TARGET].hub_id == "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def test_references_travel_and_come_back(tmp_path, offline_hub, monkeypatch):
    target_dir, _ = save_tiny_pair(tmp_path / "models", 96)
    monkeypatch.chdir(tmp_path)
    assert portable_reference("models/target") == target_dir  # relative → absolute
    assert portable_reference("models/../models/target") == target_dir
    assert portable_reference("org/not-embedded") == "org/not-embedded"
    hub = EMBEDDED[DEFAULT_TARGET].hub_id
    # The embedded cache directory records as the hub id too (the pipeline may pass a resolved path).
    assert portable_reference(str(cache_dir(DEFAULT_TARGET))) == hub or not cache_dir(DEFAULT_TARGET).is_dir()
    # Not in the (empty) HF cache: the hub id of an embedded model opens the embedded build here.
    assert local_reference(hub) == DEFAULT_TARGET
    assert serving_path(hub) == serving_path(DEFAULT_TARGET) == str(cache_dir(DEFAULT_TARGET))
    assert local_reference("org/not-embedded") == serving_path("org/not-embedded") == "org/not-embedded"
    assert serving_path("models/target") == target_dir


# ----------------------------------------------------------------------- the vLLM command


def test_convert_records_absolute_paths_and_prints_a_command_that_works_anywhere(tmp_path, monkeypatch):
    save_tiny_pair(tmp_path / "models", 96)
    monkeypatch.chdir(tmp_path)
    res = export_draft("models/draft", "models/target", "spec")  # both typed relative
    target_abs = str(tmp_path / "models" / "target")
    assert res.config["speculators_config"]["verifier"]["name_or_path"] == target_abs
    target, spec = serve_args(res.vllm_command)
    assert target == target_abs and spec == {"method": "draft_model", "model": str(tmp_path / "spec"),
                                             "num_speculative_tokens": 5}
    assert os.path.isabs(target) and os.path.isabs(spec["model"])
    assert res.serve.one_path == f"python -m vllm.entrypoints.openai.api_server --model {tmp_path / 'spec'}"
    assert VLLM_TESTED_VERSION in res.serve.header
    monkeypatch.chdir("/")  # the same command from elsewhere names the same directories
    assert serve_args(vllm_serve(tmp_path / "spec").command) == (target_abs, spec)


def test_the_printed_vllm_command_pins_gamma_and_names_the_build_it_holds_for(tmp_path):
    import shlex

    save_tiny_pair(tmp_path / "models", 96)
    res = export_draft(tmp_path / "models" / "draft", tmp_path / "models" / "target", tmp_path / "spec",
                  num_speculative_tokens=3)
    _, spec = serve_args(res.vllm_command)
    assert spec["num_speculative_tokens"] == res.config["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 3
    assert res.vllm_command.endswith(f" # for vLLM {VLLM_TESTED_VERSION}")
    assert shlex.split(res.vllm_command, comments=True)[-1] == json.dumps(spec)  # the comment is no argument


def test_padded_draft_gets_use_heterogeneous_vocab(tmp_path):
    target_dir, draft_dir = save_tiny_pair(tmp_path / "models", 96, draft_vocab=128)  # 32 padding rows
    res = export_draft(draft_dir, target_dir, tmp_path / "spec", num_speculative_tokens=3)
    assert res.compat_verdict == "identical-up-to-padding"
    _, spec = serve_args(res.vllm_command)
    assert spec == {"method": "draft_model", "model": str(tmp_path / "spec"), "num_speculative_tokens": 3,
                    "use_heterogeneous_vocab": True}
    # Equal widths: no such key.
    target_dir, draft_dir = save_tiny_pair(tmp_path / "same", 96)
    assert "use_heterogeneous_vocab" not in serve_args(export_draft(draft_dir, target_dir, tmp_path / "s2").vllm_command)[1]


def test_embedded_verifier_records_hub_id_and_is_served_from_the_cache(tmp_path, offline_hub):
    target_dir, draft_dir = save_tiny_pair(tmp_path / "models", 96)
    cached = fake_embedded_cache(DEFAULT_TARGET, target_dir)
    res = export_draft(draft_dir, DEFAULT_TARGET, tmp_path / "spec")
    hub = EMBEDDED[DEFAULT_TARGET].hub_id
    assert res.config["speculators_config"]["verifier"]["name_or_path"] == hub
    for serve in (res.serve, vllm_serve(tmp_path / "spec")):  # as typed, and from the record
        assert serve.target == str(cached)
        assert any("dequantised Q4_K_M GGUF build of " + hub in n for n in serve.notes)
    # The record reads back: from_pretrained opens the embedded build for the recorded hub id.
    from specdraft.decoding.speculator_model import IndependentSpeculator

    spec = IndependentSpeculator.from_pretrained(tmp_path / "spec", verifier_mode="full")
    assert spec.verifier is not None and spec.speculator_config.verifier.name_or_path == hub  # still portable


def test_unreadable_verifier_leaves_a_note_not_a_guess(tmp_path, pair, offline_hub):
    target_dir, draft_dir = pair
    res = export_draft(draft_dir, target_dir, tmp_path / "spec")
    conf = json.loads((tmp_path / "spec" / "config.json").read_text())
    conf["speculators_config"]["verifier"]["name_or_path"] = "org/elsewhere"
    (tmp_path / "spec" / "config.json").write_text(json.dumps(conf))
    serve = vllm_serve(res.out)
    assert serve.target == "org/elsewhere" and "use_heterogeneous_vocab" not in serve.speculative_config
    assert any("not readable here" in n for n in serve.notes)


def test_vllm_speculative_config_is_pure_and_validates(tmp_path, pair):
    target_dir, draft_dir = pair
    conf = export_draft(draft_dir, target_dir, tmp_path / "spec", num_speculative_tokens=4).config
    assert vllm_speculative_config(conf, "/x", 96) == {"method": "draft_model", "model": "/x",
                                                       "num_speculative_tokens": 4}
    assert vllm_speculative_config(conf, "/x", 97)["use_heterogeneous_vocab"] is True
    assert "use_heterogeneous_vocab" not in vllm_speculative_config(conf, "/x", None)  # unknown: not guessed
    with pytest.raises(NotASpeculatorError):
        vllm_speculative_config(json.loads((Path(draft_dir) / "config.json").read_text()), "/x")
    bad = json.loads(json.dumps(conf))
    bad["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 0
    with pytest.raises(SpeculatorError):
        vllm_speculative_config(bad, "/x")


# ------------------------------------------------------------------------------------- dtype


def test_convert_dtype_casts_and_keep_is_byte_identical(tmp_path, pair):
    target_dir, draft_dir = pair
    keep = export_draft(draft_dir, target_dir, tmp_path / "keep")
    assert (keep.out / "model.safetensors").read_bytes() == (Path(draft_dir) / "model.safetensors").read_bytes()
    bf = export_draft(draft_dir, target_dir, tmp_path / "bf16", dtype="bfloat16")
    assert bf.dtype == "bfloat16" and dtypes(bf.out) == {"torch.bfloat16"}
    assert bf.config["dtype"] == "bfloat16" and bf.resaved["dtype"] == ("float32", "bfloat16")
    assert (bf.out / "model.safetensors").stat().st_size < 0.6 * (keep.out / "model.safetensors").stat().st_size
    # Same model up to bf16 rounding (logits of a 1-layer tiny model: agreement of argmax is the check).
    ref = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    cast = AutoModelForCausalLM.from_pretrained(bf.out, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ref(IDS).logits, cast(IDS).logits
    assert torch.allclose(a, b, atol=0.2, rtol=0.05) and torch.equal(a.argmax(-1), b.argmax(-1))
    with pytest.raises(SpeculatorError, match="--dtype"):
        export_draft(draft_dir, target_dir, tmp_path / "bad", dtype="int8")


def test_export_and_copy_cast_without_touching_the_model(tmp_path, pair):
    target_dir, _ = pair
    draft = tiny_model("llama", vocab_size=96, seed=3, layers=1)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    out = export_speculator(draft, tiny_tokenizer(96), target_dir, tmp_path / "spec", 3, training={"x": 1},
                            dtype="bfloat16")
    kept = {"carried": "draft", "changed": False, "note": "the draft's chat template renders as the target's (4 "
            "probe conversations): kept"}
    assert dtypes(out) == {"torch.bfloat16"}
    assert json.loads((out / "training.json").read_text()) == {"x": 1, "chat_template": kept}
    assert all(torch.equal(v, draft.state_dict()[k]) and v.dtype == torch.float32 for k, v in before.items())
    # The pipeline's export stage: copy (float32 → bfloat16), everything else travels.
    f32 = export_speculator(draft, tiny_tokenizer(96), target_dir, tmp_path / "f32", 3, training={"x": 1})
    info = export_saved_speculator(f32, tmp_path / "copy", verifier=target_dir, dtype="bfloat16")
    copied = tmp_path / "copy"
    assert dtypes(copied) == {"torch.bfloat16"} and (copied / "tokenizer.json").is_file()
    assert json.loads((copied / "training.json").read_text()) == {"x": 1, "chat_template": kept}
    conf = json.loads((copied / "config.json").read_text())
    assert conf["dtype"] == "bfloat16" and conf["speculators_config"]["verifier"]["name_or_path"] == target_dir
    assert info["dtype"] == "bfloat16" and info["vllm_tested_version"] == VLLM_TESTED_VERSION
    assert info["chat_template"] == kept
    assert serve_args(info["vllm_command"])[0] == target_dir and info["vllm_one_path"].endswith(str(copied))


def test_cli_export_dtype_says_not_byte_identical(tmp_path, pair):
    target_dir, draft_dir = pair
    runner = CliRunner()
    res = runner.invoke(app, ["export", "-d", draft_dir, "-t", target_dir, "-o", str(tmp_path / "s"),
                              "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    assert "not byte-identical" in res.output and "tested with vLLM " + VLLM_TESTED_VERSION in res.output
    assert f"api_server --model {tmp_path / 's'}" in res.output  # the one-path command (plugin)
    res = runner.invoke(app, ["export", "--help"])
    assert "byte-identical" in res.output and "bfloat16" in res.output


# ------------------------------------------------------------------------------ prepared drafts


@pytest.mark.parametrize("quantization, keep_every, tie", [("int4", 3, False), ("int8", None, True),
                                                            (None, 2, True), ("int4", None, False)])
def test_a_prepared_draft_exports_dense_and_reloads_to_the_logits_it_drafted_with(tmp_path, pair, quantization,
                                                                                   keep_every, tie):
    """An exported prepared draft (int8/int4 layers, trimmed head) reloads with AutoModelForCausalLM, nothing
    missing or dropped, to the q it drafted with: kept logits within 0.3 (the kernels round activations to
    bfloat16, the reload runs float32), the same argmax, and no excluded token ever scoring above the best kept one."""
    from specdraft.decoding.draft_model import is_prepared, prepare_draft

    target_dir, _ = pair
    draft = tiny_model("llama", vocab_size=96, seed=3, layers=2, tie_word_embeddings=tie)
    kept = torch.arange(0, 96, keep_every) if keep_every else None
    # dense_prefill off: every input runs through the quantised kernels, as a one-token draft step does.
    prepared = prepare_draft(draft, quantization, kept, dense_prefill=False)
    ids = torch.randint(5, 96, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        evaluated = prepared(ids).logits  # [3, 9, 96], -inf outside the kept set
    out = export_speculator(prepared, tiny_tokenizer(96), target_dir, tmp_path / "spec", 3)
    assert is_prepared(prepared)  # the prepared copy is not changed by its export
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = reloaded.eval()(ids).logits
    cols = kept if kept is not None else torch.arange(96)
    # 0.3: the kernels round activations to bfloat16 (the int8 export matches exactly once the reload rounds them
    # too), against an int4 rounding error of ~3.6 and ~5 for layers initialised at random (logits up to ~6).
    assert (logits[..., cols] - evaluated[..., cols]).abs().max() < 0.3
    top2 = evaluated.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 0.6  # positions whose argmax the tolerance cannot flip
    assert clear.sum() >= 5 and torch.equal(logits.argmax(-1)[clear], evaluated.argmax(-1)[clear])
    if kept is not None:
        dropped = torch.ones(96, dtype=torch.bool)
        dropped[kept] = False
        assert (logits[..., dropped].amax(-1) < logits[..., cols].amax(-1)).all()
    # The copy the pipeline makes (and a cast) reload the same.
    export_saved_speculator(out, tmp_path / "copy", verifier=target_dir, dtype="float32")
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "copy")(ids).logits, logits)


def test_weights_that_would_not_reload_are_refused_before_anything_is_written(tmp_path, pair):
    from specdraft.decoding.draft_model import prepare_draft

    target_dir, _ = pair
    draft = tiny_model("llama", vocab_size=96, seed=3, layers=1)
    prepared = prepare_draft(draft, "int8", torch.arange(0, 96, 2), dense_prefill=False)
    # A prepared draft saved by transformers itself holds its buffers: a copy of it refuses, naming them.
    raw = tmp_path / "raw"
    prepared.save_pretrained(raw)
    with pytest.raises(CheckpointWeightsError, match=r"weight_int8.*prepared for decoding"):
        export_saved_speculator(raw, tmp_path / "copy", verifier=target_dir)
    assert not (tmp_path / "copy").exists()
    # A module its class does not have: the export refuses and writes nothing.
    draft.model.extra = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointWeightsError, match=r"unexpected.*model\.extra\.weight"):
        export_speculator(draft, tiny_tokenizer(96), target_dir, tmp_path / "spec", 3)
    assert not (tmp_path / "spec").exists()


# ------------------------------------------------------------------------------ chat template


THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}")
SAME_RENDERING = ("{%- for x in messages -%}{{ '<|im_start|>' ~ x.role ~ '\\n' ~ x.content ~ '<|im_end|>\\n' }}"
                  "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def _renders(tok) -> list[str]:
    from specdraft.models.check import PROBE_CONVERSATIONS

    return [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g) for m, g in PROBE_CONVERSATIONS.values()]


def test_every_export_carries_the_template_the_target_serves_with(tmp_path, pair):
    """A draft whose chat template renders differently (an empty think block after the generation prompt) was
    exported with its own: the speculator's tokenizer now renders as the target's, and each export says so."""
    from transformers import AutoTokenizer

    target_dir, draft_dir = pair
    target_tok = AutoTokenizer.from_pretrained(target_dir)
    tiny_tokenizer(96, chat_template=THINK_TEMPLATE).save_pretrained(draft_dir)
    assert _renders(AutoTokenizer.from_pretrained(draft_dir)) != _renders(target_tok)

    res = export_draft(draft_dir, target_dir, tmp_path / "conv")
    assert res.chat_template["carried"] == "target" and res.chat_template["changed"]
    assert "carries the target's chat template" in res.chat_template["note"]
    assert _renders(AutoTokenizer.from_pretrained(res.out)) == _renders(target_tok)
    assert "chat_template" not in json.loads((res.out / "tokenizer_config.json").read_text())
    r = CliRunner().invoke(app, ["export", "--draft", draft_dir, "--target", target_dir, "--out", str(tmp_path / "cli")])
    assert r.exit_code == 0, r.output
    assert "chat template: the chat templates render 3 of the 4 probe conversations differently" in " ".join(
        r.output.split())

    # export_speculator (distill's export): the draft's tokenizer object is given, the target's template written.
    draft = tiny_model("llama", vocab_size=96, seed=3, layers=1)
    out = export_speculator(draft, tiny_tokenizer(96, chat_template=THINK_TEMPLATE), target_dir, tmp_path / "exp", 3,
                            training={"x": 1})
    assert _renders(AutoTokenizer.from_pretrained(out)) == _renders(target_tok)
    assert json.loads((out / "training.json").read_text())["chat_template"]["carried"] == "target"
    # export_saved_speculator (the pipeline's export) of a speculator that still holds the draft's template.
    stale = tmp_path / "stale"
    export_draft(draft_dir, target_dir, stale)
    (stale / "chat_template.jinja").write_text(THINK_TEMPLATE)
    info = export_saved_speculator(stale, tmp_path / "copy", verifier=target_dir)
    assert info["chat_template"]["carried"] == "target" and info["chat_template"]["changed"]
    assert _renders(AutoTokenizer.from_pretrained(tmp_path / "copy")) == _renders(target_tok)


def test_a_template_written_otherwise_that_renders_the_same_is_kept_byte_for_byte(tmp_path, pair):
    from transformers import AutoTokenizer

    target_dir, draft_dir = pair
    tiny_tokenizer(96, chat_template=SAME_RENDERING).save_pretrained(draft_dir)
    assert AutoTokenizer.from_pretrained(draft_dir).chat_template != AutoTokenizer.from_pretrained(target_dir).chat_template
    res = export_draft(draft_dir, target_dir, tmp_path / "conv")
    assert res.chat_template["carried"] == "draft" and not res.chat_template["changed"]
    assert "renders as the target's" in res.chat_template["note"]
    assert all((res.out / f).read_bytes() == (Path(draft_dir) / f).read_bytes() for f in res.tokenizer_files)
