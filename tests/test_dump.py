"""Teacher dump: both formats against a plain forward pass, batch invariance, resume, corruption, refusals.

Tiny models (3-layer target, vocabulary 64 padded to 72 logits rows) are saved once per module; the stored
teacher is compared with ``model(ids).logits`` of the same ids run alone. Float32 hidden storage must give
the target's logits to float32 rounding (the capture is exactly the head's input); the default bfloat16 hidden
states are compared within their storage rounding, the float32 top-k log-probs within float32's. The ``real`` tests use the
embedded Qwen tokenizer and the 1.5B target.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import shutil

import pytest
import torch

from specdraft.core.config import DumpConfig
from specdraft.data.sources import DataError, Example, build_sequences, encode_prompts
from specdraft.decoding.decode import target_generate
from specdraft.models.dump_reader import (
    DumpError,
    TeacherDataset,
    head_fingerprint,
    load_manifest,
    pad_collate,
    teacher_logits_from_hidden,
    teacher_probs_from_topk,
    verify_dump,
)
from specdraft.models.loading import load_model
from specdraft.models.tokenizer_view import tokenizer_fingerprint
from specdraft.models.tokens import left_pad
from specdraft.testing import (
    add_default_system_turn,
    patch_everywhere,
    save_tiny_pair,
    tiny_model,
    tiny_tokenizer,
    tiny_words,
)
from specdraft.training import dump as dump_mod
from specdraft.training import teacher as teacher_mod
from specdraft.training.dump import merge_manifests, run_dump, split_work

VOCAB, WIDTH = 64, 72  # tokenizer ids, logits rows of the target (8 padding rows)
WORDS = [w for w in tiny_words(VOCAB - 5) if w.isalpha() and w not in ("user", "assistant")]


def chat(i: int, n_user: int = 4, n_answer: int = 5) -> Example:
    """A deterministic two-turn conversation of tiny-vocabulary words; lengths vary with ``i``."""
    u = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n_user + i % 3))
    a = " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(n_answer + i % 4))
    return Example(f"ex{i}", [{"role": "user", "content": u}, {"role": "assistant", "content": a}])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target, draft = save_tiny_pair(root, vocab_size=VOCAB, target_vocab=WIDTH)
    model, tok = load_model(target, dtype="float32", device="cpu")
    return {"target": target, "draft": draft, "model": model, "tok": tok}


def fp32(**kw) -> DumpConfig:
    """Tiny targets run in float32 wherever the tests run ("auto" would pick bfloat16 on CUDA)."""
    return DumpConfig(dtype="float32", **kw)


def plain_logits(model, ids) -> torch.Tensor:
    """``[S, V]`` float32 logits of one sequence run alone, no padding."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits[0].float()


def rows_by_id(ds: TeacherDataset) -> dict[str, dict]:
    return {ds[i]["id"]: ds[i] for i in range(len(ds))}


def dir_digest(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


# ------------------------------------------------------------------------------------------ the capture


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_hidden_states_last_is_after_the_final_norm(arch):
    """transformers' ``hidden_states[-1]`` is the head's input (after the final norm) for these archs, and
    the dump's capture is that very tensor."""
    model = tiny_model(arch, VOCAB, layers=2)
    ids = torch.randint(5, VOCAB, (2, 9))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        h = out.hidden_states[-1]
        torch.testing.assert_close(model.get_output_embeddings()(h), out.logits, atol=1e-5, rtol=1e-5)
        teacher = teacher_mod.Teacher(model, VOCAB)
        captured = teacher.hidden(ids, torch.ones_like(ids))
    assert torch.equal(captured, h) and teacher.final_norm == "model" and teacher.checked
    assert teacher.ops == [] and teacher._difference(h, out.logits) is None  # bit for bit, every position
    # The pre-norm residual stream is not the head's input: the check that guards the capture can tell.
    assert teacher._difference(out.hidden_states[-2], out.logits) > 1e-2


def test_pre_norm_capture_gets_the_norm_applied_or_is_refused(pair, tmp_path, monkeypatch):
    model = pair["model"]
    examples = [chat(i) for i in range(3)]
    # Capture the last decoder layer (pre-norm residual stream) instead of the base model's output.
    monkeypatch.setattr(teacher_mod, "_capture_module", lambda m: m.model.layers[-1])
    m = run_dump(pair["target"], examples, tmp_path / "applied", fp32(hidden_dtype="float32"))
    assert m["final_norm"] == "applied" and m["final_norm_applied"] is True
    ds = TeacherDataset(tmp_path / "applied")
    head = ds.head()
    for item in rows_by_id(ds).values():
        logits = teacher_logits_from_hidden(item["hidden"], head["lm_head.weight"])
        torch.testing.assert_close(logits[:, :VOCAB], plain_logits(model, item["input_ids"])[:, :VOCAB],
                                   atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(teacher_mod, "find_final_norm", lambda m: None)
    with pytest.raises(DumpError, match="pre-norm capture"):
        run_dump(pair["target"], examples, tmp_path / "refused", fp32())
    assert not (tmp_path / "refused" / "manifest.json").exists()


# ------------------------------------------------------------------------ final-logit transforms (soft-capping)


def _save_softcapped(arch: str, root, softcap: float) -> str:
    """A tiny soft-capping target (Gemma 2 / Gemma 3 text) with the tiny tokenizer, saved under ``root``."""
    d = root / f"{arch}-{softcap}"
    tiny_model(arch, VOCAB, layers=2, final_logit_softcapping=softcap).save_pretrained(d)
    tiny_tokenizer(VOCAB).save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("fmt", ["hidden", "topk"])
def test_soft_capping_is_part_of_the_recorded_teacher(arch, fmt, tmp_path):
    """Gemma soft-caps lm_head(h): the manifest records the transform and every reader (the dataset, distillation)
    applies it, so the teacher is the target's real output distribution."""
    from specdraft.core.config import DistillConfig
    from specdraft.training.distill_trainer import DistillModel, TeacherHead

    target = _save_softcapped(arch, tmp_path, softcap=2.0)  # a low cap: logits of ±7 are squeezed into ±2
    model, _ = load_model(target, dtype="float32", device="cpu")
    examples = [chat(i) for i in range(3)]
    m = run_dump(target, examples, tmp_path / "d", fp32(teacher_format=fmt, top_logprobs=8, hidden_dtype="float32"))
    assert m["logit_transform"] == [{"op": "softcap", "key": "final_logit_softcapping", "value": 2.0}]
    assert m["format_version"] == 2
    ds = TeacherDataset(tmp_path / "d")
    for item in rows_by_id(ds).values():
        ref = plain_logits(model, item["input_ids"])  # [S, V]
        assert ref.abs().max() < 2.0
        if fmt == "topk":
            top = ref.log_softmax(-1).topk(8)
            torch.testing.assert_close(item["topk_logprobs"].float(), top.values, atol=2e-3, rtol=1e-3)
            continue
        head = ds.head()
        logits = teacher_logits_from_hidden(item["hidden"], head["lm_head.weight"], logit_ops=ds.logit_ops)
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
        assert (teacher_logits_from_hidden(item["hidden"], head["lm_head.weight"]) - ref).abs().max() > 1.0
        torch.testing.assert_close(ds.teacher_probs(item, head), ref.softmax(-1), atol=1e-6, rtol=1e-5)
        distill = DistillModel(model, TeacherHead(head["lm_head.weight"], VOCAB, logit_ops=ds.logit_ops), DistillConfig())
        p, _ = distill.teacher_probs(hidden=item["hidden"][None])
        torch.testing.assert_close(p[0], ref.softmax(-1), atol=1e-6, rtol=1e-5)


def test_an_unrecorded_transform_is_refused_even_when_it_nearly_matches(tmp_path, monkeypatch):
    """A soft cap of 200 moves these logits by < 0.1 %: a tolerance check would pass it. Hidden from the known
    transforms, the dump must refuse the model (naming the key), not store a near match."""
    import specdraft.core.sampling

    target = _save_softcapped("gemma2", tmp_path, softcap=200.0)
    model, _ = load_model(target, dtype="float32", device="cpu")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        plain = model.get_output_embeddings()(out.hidden_states[-1])
    near = float((plain - out.logits).abs().max() / out.logits.abs().max())
    assert 0 < near < 1e-3  # what the old relative tolerance accepted
    monkeypatch.setattr(specdraft.core.sampling, "FINAL_LOGIT_KEYS",
                        tuple(k for k in specdraft.core.sampling.FINAL_LOGIT_KEYS if k[0] != "final_logit_softcapping"))
    for fmt in ("hidden", "topk"):
        with pytest.raises(DumpError, match=r"does not reproduce .*final_logit_softcapping.*near match"):
            run_dump(target, [chat(0)], tmp_path / fmt, fp32(teacher_format=fmt, top_logprobs=8))
        assert not (tmp_path / fmt / "manifest.json").exists()


def test_known_scalings_reproduce_the_models_logits_exactly():
    """Each operation of sampling.FINAL_LOGIT_KEYS is the modeling code's own: recomputed from the head's input,
    the logits equal the model's bit for bit (Cohere's logit_scale here; Granite divides)."""
    from transformers import AutoModelForCausalLM, CohereConfig, GraniteConfig

    from specdraft.core.sampling import final_logit_ops

    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "eos_token_id": 4}
    for cfg, op in ((CohereConfig(logit_scale=0.37, **common), "mul"),
                    (GraniteConfig(logits_scaling=3.0, **common), "div")):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        assert [o["op"] for o in final_logit_ops(model.config)] == [op]
        teacher = teacher_mod.Teacher(model, VOCAB)
        ids = torch.randint(5, VOCAB, (2, 6))
        h = teacher.hidden(ids, torch.ones_like(ids))  # raises unless the teacher equals the logits exactly
        assert teacher.checked and h.shape == (2, 6, 32)


# ------------------------------------------------------------------------------------------ both formats


def test_hidden_dump_is_the_target_head_input(pair, tmp_path):
    model, tok = pair["model"], pair["tok"]
    examples = [chat(i) for i in range(7)]
    out = tmp_path / "d"
    m = run_dump(pair["target"], examples, out, fp32(hidden_dtype="float32", batch_size=3, shard_size_mb=0.003),
                 command="pytest")
    # The manifest explains itself.
    assert m["format"] == "hidden" and m["dtype"] == {"hidden": "float32"} and m["top_k"] is None
    assert m["final_norm_applied"] is True and m["final_norm"] == "model"
    assert m["tokenizer_fingerprint"] == tokenizer_fingerprint(tiny_tokenizer(VOCAB))
    assert m["head_fingerprint"] == head_fingerprint(model)
    assert (m["target"]["vocab_width"], m["target"]["real_vocab"], m["target"]["dtype"]) == (WIDTH, VOCAB, "float32")
    assert m["command"] == "pytest" and m["versions"]["torch"] == torch.__version__
    assert m["loss_mask_convention"].startswith("loss_mask[j]: the prediction made at position j")
    seqs = build_sequences(tok, examples)
    assert m["sequences"] == 7 and m["tokens"] == sum(len(s.ids) for s in seqs)
    assert m["trained_tokens"] == sum(sum(s.loss_mask) for s in seqs) and m["dropped"] == m["truncated"] == 0
    assert len(m["shards"]) > 1 and sum(s["sequences"] for s in m["shards"]) == 7
    for s in m["shards"]:
        assert hashlib.sha256((out / s["file"]).read_bytes()).hexdigest() == s["sha256"]
    assert m["bytes"] == sum((out / s["file"]).stat().st_size for s in m["shards"])
    assert m["bytes_per_token"] == pytest.approx(m["bytes"] / m["tokens"])
    # Memory bound: a shard is flushed after the first whole batch that brings it to shard_size_mb (3000 B).
    row_bytes = [len(s.ids) * (32 * 4 + 5) for s in seqs]  # float32 hidden [S, 32] + int32 id + bool mask
    first = 0
    for s in m["shards"][:-1]:
        shard_rows = row_bytes[first:first + s["sequences"]]
        assert s["sequences"] % 3 == 0 and sum(shard_rows[:-3]) < 3000 <= sum(shard_rows)
        first += s["sequences"]

    ds = TeacherDataset(out, draft_tokenizer=tiny_tokenizer(VOCAB), verify=True)
    head = ds.head()
    assert head["lm_head.weight"].shape == (WIDTH, 32) and head_fingerprint(head) == m["head_fingerprint"]
    assert [ds[i]["id"] for i in range(len(ds))] == [e.id for e in examples]  # example order, across shards
    for i, seq in enumerate(seqs):
        item = ds[i]
        assert item["input_ids"].tolist() == seq.ids and item["loss_mask"].tolist() == seq.loss_mask
        assert item["input_ids"].dtype == torch.int64 and item["hidden"].dtype == torch.float32
        ref = plain_logits(model, seq.ids)  # [S, WIDTH]
        # Teacher logits are lm_head(h): equal to the target's own logits to float32 rounding.
        logits = teacher_logits_from_hidden(item["hidden"], head["lm_head.weight"], real_vocab=VOCAB)
        torch.testing.assert_close(logits[:, :VOCAB], ref[:, :VOCAB], atol=1e-4, rtol=1e-4)
        assert torch.isinf(logits[:, VOCAB:]).all()  # padding rows carry no probability
        p = ds.teacher_probs(item, head)  # [S, WIDTH]
        torch.testing.assert_close(p[:, :VOCAB], ref[:, :VOCAB].softmax(-1), atol=1e-5, rtol=1e-4)
        assert (p[:, VOCAB:] == 0).all()


def test_bfloat16_hidden_matches_within_bfloat16_rounding(pair, tmp_path):
    model = pair["model"]
    m = run_dump(pair["target"], [chat(i) for i in range(4)], tmp_path / "d", fp32(batch_size=2))
    assert m["dtype"] == {"hidden": "bfloat16"}
    ds = TeacherDataset(tmp_path / "d")
    head = ds.head()
    for item in rows_by_id(ds).values():
        assert item["hidden"].dtype == torch.bfloat16
        p = ds.teacher_probs(item, head)[:, :VOCAB]
        ref = plain_logits(model, item["input_ids"])[:, :VOCAB].softmax(-1)
        # bfloat16 keeps 8 bits of mantissa: the distribution moves by well under 2 % in total variation.
        assert 0.5 * (p - ref).abs().sum(-1).max() < 0.02
        assert torch.equal(p.argmax(-1), ref.argmax(-1))


def test_topk_dump_matches_the_target_distribution(pair, tmp_path):
    model = pair["model"]
    k = 8
    m = run_dump(pair["target"], [chat(i) for i in range(5)], tmp_path / "d",
                 fp32(teacher_format="topk", top_logprobs=k, batch_size=2))
    assert m["top_k"] == k and m["dtype"] == {"topk_logprobs": "float32", "topk_ids": "int32",
                                              "leftover_logmass": "float32"}
    assert "head" not in m and not (tmp_path / "d" / "head.safetensors").exists()
    ds = TeacherDataset(tmp_path / "d")
    for item in rows_by_id(ds).values():
        logp = plain_logits(model, item["input_ids"])[:, :VOCAB].double().log_softmax(-1)  # padding rows out
        top = logp.topk(k, dim=-1)
        assert item["topk_ids"].dtype == torch.int32 and item["topk_logprobs"].dtype == torch.float32
        assert torch.equal(item["topk_ids"].long(), top.indices)  # never a padding row (ids ≥ 64)
        torch.testing.assert_close(item["topk_logprobs"].double(), top.values, atol=1e-4, rtol=1e-5)
        leftover = torch.log1p(-top.values.exp().sum(-1))
        torch.testing.assert_close(item["leftover_logmass"].double(), leftover, atol=1e-4, rtol=1e-4)
        # The completed distribution is within the leftover mass of the true one (uniform rule).
        p_hat = ds.teacher_probs(item)
        assert p_hat.shape[-1] == WIDTH and (p_hat[:, VOCAB:] == 0).all()
        tv = 0.5 * (p_hat[:, :VOCAB].double() - logp.exp()).abs().sum(-1)
        assert (tv <= leftover.exp() + 2e-3).all()


def test_topk_leftover_rule_by_hand():
    """p = (.5, .3, .1, .06, .04) over 5 real ids + 1 padding row; k = 2 keeps .5 and .3, leftover .2."""
    lp = torch.tensor([[math.log(0.5), math.log(0.3)]])
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    left = torch.tensor([math.log(0.2)])
    p_hat = teacher_probs_from_topk(lp, ids, left, vocab_width=6, real_vocab=5)
    torch.testing.assert_close(p_hat, torch.tensor([[0.5, 0.3, 0.2 / 3, 0.2 / 3, 0.2 / 3, 0.0]]))
    p = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04, 0.0]])
    q = torch.tensor([[0.2, 0.2, 0.4, 0.1, 0.1, 0.0]])
    # α = Σ min(p, q) and TV move by at most the leftover mass (0.2).
    alpha, alpha_hat = torch.minimum(p, q).sum(), torch.minimum(p_hat, q).sum()
    assert abs(alpha - alpha_hat) <= 0.2 and abs(alpha - alpha_hat) > 0  # a real, bounded difference
    # No leftover (k covers the whole real vocabulary): nothing is spread, padding stays 0.
    full = teacher_probs_from_topk(torch.log(torch.tensor([[0.7, 0.3]])), torch.tensor([[1, 0]]),
                                   torch.tensor([float("-inf")]), vocab_width=3, real_vocab=2)
    torch.testing.assert_close(full, torch.tensor([[0.3, 0.7, 0.0]]))


@pytest.mark.parametrize("fmt", ["hidden", "topk"])
def test_rows_do_not_depend_on_batch_composition_or_order(pair, tmp_path, fmt):
    examples = [chat(i) for i in range(6)]
    cfg = {"teacher_format": fmt, "top_logprobs": 8, "hidden_dtype": "float32"}
    run_dump(pair["target"], examples, tmp_path / "solo", fp32(batch_size=1, **cfg))
    run_dump(pair["target"], examples[::-1], tmp_path / "batched", fp32(batch_size=4, **cfg))
    solo, batched = rows_by_id(TeacherDataset(tmp_path / "solo")), rows_by_id(TeacherDataset(tmp_path / "batched"))
    assert solo.keys() == batched.keys()
    for eid, a in solo.items():
        b = batched[eid]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        if fmt == "hidden":
            torch.testing.assert_close(a["hidden"], b["hidden"], atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(a["topk_ids"], b["topk_ids"])
            torch.testing.assert_close(a["topk_logprobs"], b["topk_logprobs"], atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(a["leftover_logmass"], b["leftover_logmass"], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------ sequences


def test_loss_mask_convention_on_the_tiny_chat_template(pair):
    tok = pair["tok"]
    ex = Example("c", [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"},
                       {"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}])
    full = build_sequences(tok, [ex])[0]
    assert full.loss_mask == [True] * (len(full.ids) - 1) + [False]
    ans = build_sequences(tok, [ex], answer_only=True)[0]
    assert ans.ids == full.ids
    predicted = [ans.ids[j + 1] for j, m in enumerate(ans.loss_mask) if m]  # tokens the trained predictions name
    assert tok.convert_ids_to_tokens(predicted) == ["c", "d", "<|im_end|>", "f", "<|im_end|>"]


@pytest.mark.real
def test_answer_only_mask_under_the_real_qwen_template():
    from transformers import AutoTokenizer

    from specdraft.models.loading import resolve

    tok = AutoTokenizer.from_pretrained(resolve("qwen2.5-coder-0.5b-instruct"))
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add two numbers."},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
            {"role": "user", "content": "And three?"},
            {"role": "assistant", "content": "def add3(a, b, c):\n    return a + b + c"}]
    seq = build_sequences(tok, [Example("q", msgs)], answer_only=True)[0]
    predicted = [seq.ids[j + 1] for j, m in enumerate(seq.loss_mask) if m]
    # Exactly the two answers and their end-of-turn tokens: no role header, no "\n" after <|im_end|>.
    assert tok.decode(predicted) == (msgs[2]["content"] + "<|im_end|>" + msgs[4]["content"] + "<|im_end|>")
    assert seq.ids == tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    # A prompt without an answer has nothing to train on: an error, not an empty row.
    with pytest.raises(DataError, match="empty loss mask"):
        build_sequences(tok, [Example("p", msgs[:2])], answer_only=True)


def test_generated_responses_are_the_targets_own(pair, tmp_path):
    model, tok = pair["model"], pair["tok"]
    prompts = [Example(f"p{i}", chat(i).messages[:1]) for i in range(3)]
    m = run_dump(pair["target"], prompts, tmp_path / "g", fp32(generate=6, answer_only=True, batch_size=2))
    ds = TeacherDataset(tmp_path / "g")
    prompt_tokens = 0
    for i, ex in enumerate(prompts):
        prompt = encode_prompts(tok, [ex])[0]
        prompt_tokens += len(prompt)
        ids, mask = left_pad([prompt], 0)
        response = target_generate(model, ids, mask, max_new_tokens=6, real_vocab=VOCAB)[0][0]
        item = ds[i]
        assert item["input_ids"].tolist() == prompt + response  # greedy: what the target writes alone
        S = len(prompt) + len(response)
        assert item["loss_mask"].tolist() == [len(prompt) - 1 <= j < S - 1 for j in range(S)]
    assert m["trained_tokens"] == m["tokens"] - prompt_tokens  # every response token, nothing else
    # Sampled generation is reproducible from the seed.
    cfg = fp32(generate=6, temperature=1.0, seed=3)
    run_dump(pair["target"], prompts, tmp_path / "s1", cfg)
    run_dump(pair["target"], prompts, tmp_path / "s2", cfg)
    a, b = TeacherDataset(tmp_path / "s1"), TeacherDataset(tmp_path / "s2")
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(3))


def test_dump_answers_the_very_rows_run_trains_on_for_one_training_spec(pair, tmp_path):
    """``conversations:0:32`` is 32 distinct prompts for ``run --train-prompts`` (the embedded chats repeat their first
    questions: rows 0–31 hold 7 distinct ones, so it reads on until it has 32); ``dump --prompts`` with a greedy
    ``--generate``, as library call and as command, answers exactly those, in order."""
    from typer.testing import CliRunner

    from specdraft.cli import app
    from specdraft.run.pipeline import make_config, run_prompts

    spec = "conversations:0:32"
    cfg = make_config("tiny", target=pair["target"], draft=pair["draft"], train_prompts=[spec])
    trains = run_prompts(cfg, ("train",))["train"].examples
    prompts = [json.dumps(e.prompt_messages) for e in trains]
    assert len(trains) == len(set(prompts)) == 32

    m = run_dump(pair["target"], spec, tmp_path / "lib", fp32(generate=2, answer_only=True, batch_size=16))
    r = CliRunner().invoke(app, ["dump", "--target", pair["target"], "--prompts", spec, "--generate", "2",
                                 "--answer-only", "--dtype", "float32", "--batch-size", "16", "--out",
                                 str(tmp_path / "cli")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert f"prompts: {spec} (32 prompts)" in r.output
    for out in ("lib", "cli"):
        ds = TeacherDataset(tmp_path / out)
        assert [ds.tokens(i)["id"] for i in range(len(ds))] == [e.id for e in trains], out
    assert m["data"] == spec and m["sequences"] == 32 and "num_examples" not in m["config"]
    # Teacher-forced, every row is its own sequence: the same spec is the first 32 rows, in run and in dump alike.
    forced = make_config("tiny", target=pair["target"], draft=pair["draft"], train_prompts=[spec],
                         dump=fp32(answer_only=True))
    rows = run_prompts(forced, ("train",))["train"].examples
    assert [e.id for e in rows] == [f"identity_{i}" for i in range(32)]
    m = run_dump(pair["target"], spec, tmp_path / "forced", fp32(answer_only=True, batch_size=16))
    ds = TeacherDataset(tmp_path / "forced")
    assert [ds.tokens(i)["id"] for i in range(len(ds))] == [e.id for e in rows]


def _as_older(settings: dict) -> dict:
    """``settings`` as an older specdraft recorded them: the retired fields, and the renamed ones under their old key."""
    from specdraft.core.config import RENAMED_DUMP_FIELDS

    old_key = {field: key for key, field in RENAMED_DUMP_FIELDS.items()}
    return {old_key.get(k, k): v for k, v in settings.items()} | {"num_examples": None, "offset": 0}


def test_a_dump_recording_retired_and_renamed_settings_still_verifies_resumes_and_reads(pair, tmp_path):
    """Older dumps recorded ``num_examples`` / ``offset`` in their settings (the rows came from them; the prompt
    selector gives them now) and the stored log-probs count as ``top_k``. Such a dump, killed or finished, resumes
    and verifies under the same plan."""
    from specdraft.core.config import recorded_settings

    examples = [chat(i) for i in range(6)]
    cfg = fp32(teacher_format="topk", top_logprobs=8, batch_size=2, shard_size_mb=0.001)  # one shard per batch
    out = tmp_path / "d"
    run_dump(pair["target"], examples, out, cfg)
    # Leave it as an older specdraft left a run killed after two of its three shards: the retired fields in its
    # settings, its plan their hash, the third shard and the manifest not written yet.
    path = out / "rank-00000.json"
    state = json.loads(path.read_text())
    (out / state["shards"][2]["file"]).unlink()
    (out / "manifest.json").unlink()
    state["status"], state["shards"] = "running", state["shards"][:2]
    state["identity"]["settings"] = _as_older(state["identity"]["settings"])
    state["header"]["config"] = _as_older(state["header"]["config"])
    assert state["header"]["config"]["top_k"] == 8
    state["header"]["identity"] = state["identity"]
    state["plan"] = dump_mod.sha256_json(state["identity"])
    path.write_text(json.dumps(state))

    m = run_dump(pair["target"], examples, out, cfg)
    assert (m["this_run"]["shards_skipped"], m["this_run"]["shards_written"]) == (2, 1) and m["sequences"] == 6
    assert m["plan"] == state["plan"] and m["identity"]["settings"]["num_examples"] is None
    assert m["identity"]["settings"]["top_k"] == 8  # the recorded plan, as written
    again = run_dump(pair["target"], examples, out, cfg)
    assert (again["this_run"]["shards_written"], again["this_run"]["shards_skipped"]) == (0, 3)
    verify_dump(out)
    manifest = load_manifest(out) | {"config": state["header"]["config"]}
    assert DumpConfig.model_validate(recorded_settings(manifest["config"])) == cfg
    # Other settings still refuse the directory, naming them.
    with pytest.raises(DumpError, match="settings"):
        run_dump(pair["target"], examples, out, fp32(teacher_format="topk", top_logprobs=4, batch_size=2))


# ------------------------------------------------------------------------------------------ resume, corruption


def test_resume_after_a_kill_skips_verified_shards(pair, tmp_path):
    examples = [chat(i) for i in range(9)]
    cfg = fp32(teacher_format="topk", top_logprobs=8, batch_size=2, shard_size_mb=0.001)  # one shard per batch
    out = tmp_path / "d"
    calls = []

    def kill_after_three_batches(done, total, tokens):
        calls.append(done)
        if len(calls) == 4:  # the initial report, then three batches
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_dump(pair["target"], examples, out, cfg, progress=kill_after_three_batches)
    with pytest.raises(DumpError, match="unfinished run"):
        load_manifest(out)
    state = json.loads((out / "rank-00000.json").read_text())
    assert state["status"] == "running" and [s["end"] for s in state["shards"]] == [2, 4, 6]
    before = {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in state["shards"]}
    (out / ".tmp-shard-r00000-00003.safetensors-killed").write_bytes(b"half a shard")  # a killed writer's file

    m = run_dump(pair["target"], examples, out, cfg)
    assert m["this_run"]["shards_skipped"] == 3 and m["this_run"]["shards_written"] == 2
    assert {f: (out / f).stat().st_mtime_ns for f in before} == before  # completed shards were not rewritten
    assert not list(out.glob(".tmp-*"))
    assert len(m["runs"]) == 2 and m["sequences"] == 9
    # The resumed dump equals an uninterrupted one, file for file.
    fresh = run_dump(pair["target"], examples, tmp_path / "fresh", cfg)
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in fresh["shards"]]
    # A finished dump rerun: everything verified, nothing written.
    again = run_dump(pair["target"], examples, out, cfg)
    assert (again["this_run"]["shards_written"], again["this_run"]["shards_skipped"]) == (0, 5)


def test_corrupt_or_missing_shards_are_named_and_redone(pair, tmp_path):
    examples = [chat(i) for i in range(6)]
    cfg = fp32(batch_size=2, shard_size_mb=0.001)
    out = tmp_path / "d"
    m = run_dump(pair["target"], examples, out, cfg)
    names = [s["file"] for s in m["shards"]]
    assert len(names) == 3
    data = bytearray((out / names[1]).read_bytes())
    data[-5] ^= 0xFF  # one flipped byte inside the tensor data: same size, other content
    (out / names[1]).write_bytes(bytes(data))
    with pytest.raises(DumpError, match=rf"{names[1]} is corrupt"):
        verify_dump(out)
    with pytest.raises(DumpError, match=names[1]):
        TeacherDataset(out, verify=True)
    (out / names[2]).unlink()
    with pytest.raises(DumpError, match=rf"2 of 4 files.*{names[1]} is corrupt.*{names[2]} is missing"):
        verify_dump(out)
    with pytest.raises(DumpError, match=rf"shard {names[2]} is missing"):
        TeacherDataset(out)
    again = run_dump(pair["target"], examples, out, cfg)
    assert again["this_run"]["shards_redone"] == 2 and again["this_run"]["shards_skipped"] == 1
    verify_dump(out)
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in m["shards"]]


# ------------------------------------------------------------------------------------------ refusals


def test_reader_refuses_a_draft_of_another_tokenizer(pair, tmp_path):
    run_dump(pair["target"], [chat(0)], tmp_path / "d", fp32())
    other = tiny_tokenizer(VOCAB, swap=(10, 11))  # same size, two ids exchanged
    fp_dump, fp_other = tokenizer_fingerprint(tiny_tokenizer(VOCAB)), tokenizer_fingerprint(other)
    with pytest.raises(DumpError) as err:
        TeacherDataset(tmp_path / "d", draft_tokenizer=other)
    assert fp_dump in str(err.value) and fp_other in str(err.value)
    assert len(TeacherDataset(tmp_path / "d", draft_tokenizer=pair["draft"])) == 1  # a reference, same tokenizer
    ds = TeacherDataset(tmp_path / "d", draft_tokenizer=other, vocab_mapping="mapping")
    assert ds.vocab_mapping == "mapping" and len(ds) == 1


def test_output_directory_of_another_dump_is_refused_untouched(pair, tmp_path):
    out = tmp_path / "d"
    run_dump(pair["target"], [chat(i) for i in range(3)], out, fp32())
    before = dir_digest(out)
    # The draft has the same tokenizer and architecture family but other weights and depth.
    with pytest.raises(DumpError, match="another target.*target_config"):
        run_dump(pair["draft"], [chat(i) for i in range(3)], out, fp32())
    with pytest.raises(DumpError, match="other settings.*format"):
        run_dump(pair["target"], [chat(i) for i in range(3)], out, fp32(teacher_format="topk", top_logprobs=8))
    with pytest.raises(DumpError, match="other settings or data.*data_fingerprint"):
        run_dump(pair["target"], [chat(i) for i in range(4)], out, fp32())
    assert dir_digest(out) == before
    foreign = tmp_path / "f"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DumpError, match="notes.txt"):
        run_dump(pair["target"], [chat(0)], foreign, fp32())
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_same_target_with_other_weights_is_refused_by_the_head_fingerprint(pair, tmp_path):
    out = tmp_path / "d"
    run_dump(pair["target"], [chat(0)], out, fp32(teacher_format="topk", top_logprobs=4))
    before = dir_digest(out)
    twin = tiny_model("llama", WIDTH, seed=5, layers=3)  # same config, other weights
    twin.save_pretrained(tmp_path / "twin")
    pair["tok"].save_pretrained(tmp_path / "twin")
    with pytest.raises(DumpError, match="another target.*head_fingerprint"):
        run_dump(tmp_path / "twin", [chat(0)], out, fp32(teacher_format="topk", top_logprobs=4))
    assert dir_digest(out) == before


def test_a_resumed_dump_refuses_shards_of_a_target_whose_body_was_fine_tuned_in_place(pair, tmp_path):
    """The head alone is no identity: a fine-tune of the body saved under the same path keeps the config, the
    tokenizer and the output head, and its shards would be resumed beside the old target's (two teachers in one
    dump). The whole target's fingerprint names the change; nothing in the directory is touched."""
    model, _ = load_model(pair["target"], dtype="float32", device="cpu")
    model.save_pretrained(tmp_path / "target")
    pair["tok"].save_pretrained(tmp_path / "target")
    out = tmp_path / "d"
    run_dump(tmp_path / "target", [chat(i) for i in range(4)], out, fp32(batch_size=2))
    (out / "manifest.json").unlink()  # as a run killed before its last merge leaves it: rank file and shards
    before = dir_digest(out)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0.01)
    model.save_pretrained(tmp_path / "target")
    assert head_fingerprint(load_model(tmp_path / "target", dtype="float32")[0]) == head_fingerprint(pair["model"])
    with pytest.raises(DumpError, match=r"another target \(rank-00000.json\): target_weights: the directory holds"):
        run_dump(tmp_path / "target", [chat(i) for i in range(4)], out, fp32(batch_size=2))
    assert dir_digest(out) == before


def test_a_resumed_dump_refuses_shards_rendered_by_a_template_since_edited_in_place(pair, tmp_path):
    """The vocabulary's fingerprint leaves the chat template out: a template edited in ``tokenizer_config.json`` (a
    default system turn) renders every prompt otherwise, and its shards would be resumed beside the old rendering's.
    The template is named; nothing in the directory is touched."""
    target = tmp_path / "target"
    shutil.copytree(pair["target"], target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())  # the template where older saves keep it
    cfg["chat_template"] = (target / "chat_template.jinja").read_text()
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    (target / "chat_template.jinja").unlink()
    out = tmp_path / "d"
    run_dump(target, [chat(i) for i in range(4)], out, fp32(batch_size=2))
    (out / "manifest.json").unlink()  # as a run killed before its last merge leaves it: rank file and shards
    before = dir_digest(out)
    add_default_system_turn(target)
    with pytest.raises(DumpError, match=r"another target \(rank-00000.json\): target_chat_template: the directory"):
        run_dump(target, [chat(i) for i in range(4)], out, fp32(batch_size=2))
    assert dir_digest(out) == before


def test_the_on_policy_teacher_must_be_the_dumps_whole_target_not_only_its_head(pair, tmp_path):
    """The scorer of the draft's on-policy answers is checked against the dump by the whole target's content: a body
    fine-tuned in place (same path, config, dtype and head) would score the draft's answers as another teacher than
    the one whose signal fills the dump, and is refused by name before it loads."""
    from specdraft.core.config import DistillConfig
    from specdraft.training.distill_data import DistillError, load_draft_writer

    model, _ = load_model(pair["target"], dtype="float32", device="cpu")
    model.save_pretrained(tmp_path / "target")
    pair["tok"].save_pretrained(tmp_path / "target")
    m = run_dump(tmp_path / "target", [chat(i) for i in range(2)], tmp_path / "d", fp32(answer_only=True))
    cfg = DistillConfig(on_policy_fraction=0.5)
    assert load_draft_writer(str(tmp_path / "target"), m, pair["tok"], cfg, "cpu").teacher.real_vocab == VOCAB
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.mul_(1.01)
    model.save_pretrained(tmp_path / "target")
    assert head_fingerprint(load_model(tmp_path / "target", dtype="float32")[0]) == m["head_fingerprint"]
    with pytest.raises(DistillError, match="not the target the dump was made with \\(target_weights: the dump holds"):
        load_draft_writer(str(tmp_path / "target"), m, pair["tok"], cfg, "cpu")


def test_bad_input(pair, tmp_path):
    with pytest.raises(DumpError, match="empty"):
        run_dump(pair["target"], [], tmp_path / "empty", fp32())
    long_ex = [chat(0, n_user=40, n_answer=30), chat(1)]  # ex0's answer starts past token 40
    n_long = len(build_sequences(pair["tok"], long_ex[:1])[0].ids)
    with pytest.raises(DataError, match=rf"ex0: {n_long} tokens exceed --max-length 40"):
        run_dump(pair["target"], long_ex, tmp_path / "refused", fp32(max_length=40, truncate=False))
    assert not (tmp_path / "refused").exists()  # refused before anything was written
    m = run_dump(pair["target"], long_ex, tmp_path / "cut", fp32(max_length=40))
    ds = TeacherDataset(tmp_path / "cut")
    assert m["truncated"] == 1 and len(ds[0]["input_ids"]) == 40 and ds[0]["loss_mask"][-1].item() is False
    # Answer-only: the long example's answer lies past the cut, so the row has nothing to train and is dropped.
    m = run_dump(pair["target"], long_ex, tmp_path / "drop", fp32(max_length=40, answer_only=True))
    assert (m["sequences"], m["dropped"]) == (1, 1) and TeacherDataset(tmp_path / "drop")[0]["id"] == "ex1"
    with pytest.raises(DumpError, match="nothing to dump"):
        run_dump(pair["target"], long_ex[:1], tmp_path / "none", fp32(max_length=40, answer_only=True))
    with pytest.raises(DataError, match="p0: no position is trained"):
        run_dump(pair["target"], [Example("p0", [{"role": "user", "content": "a b"}])], tmp_path / "noanswer",
                 fp32(answer_only=True))
    with pytest.raises(DumpError, match="--top-logprobs 64 must be below the real vocabulary"):
        run_dump(pair["target"], [chat(0)], tmp_path / "k", fp32(teacher_format="topk", top_logprobs=64))
    with pytest.raises(ValueError, match="--temperature only applies with --generate"):
        DumpConfig(temperature=0.7)
    with pytest.raises(ValueError, match="extra"):
        DumpConfig(topk=3)


# ------------------------------------------------------------------------------------------ ranks, reader


def test_split_work_covers_every_item_once_in_order():
    for n in range(11):
        for world in range(1, 5):
            parts = [split_work(n, r, world) for r in range(world)]
            assert [i for p in parts for i in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_split_work_in_whole_batches_keeps_the_single_rank_batches():
    """Each rank starts on a batch boundary of the one-rank run, so its batches are that run's batches."""
    for n in range(15):
        for batch in (1, 2, 3, 8):
            for world in range(1, 5):
                parts = [split_work(n, r, world, batch) for r in range(world)]
                assert [i for p in parts for i in p] == list(range(n))
                assert all(p.start % batch == 0 for p in parts if len(p))
                assert max(map(len, parts)) - min(map(len, parts)) <= batch


def test_merge_manifests_lists_every_rank_and_sums_counts():
    def shard(rank, index, seqs, tokens):
        return {"file": f"shard-r{rank:05d}-{index:05d}.safetensors", "index": index, "start": 0, "end": seqs,
                "sha256": "x", "bytes": 10 * tokens, "sequences": seqs, "tokens": tokens, "trained_tokens": tokens // 2,
                "truncated": 1, "dropped": 0}

    header = {"kind": "specdraft-teacher-dump", "format": "topk", "final_norm": None, "final_norm_applied": None}
    states = [{"rank": r, "world_size": 2, "plan": "P", "status": "complete", "dropped_before_split": 3 if r == 0 else 0,
               "header": dict(header, final_norm="model", final_norm_applied=True) if r == 1 else header,
               "shards": [shard(r, i, 2 + r, 10 * (i + 1)) for i in range(2)], "runs": [{"tokens": 5}]}
              for r in range(2)]
    m = merge_manifests(states[::-1])
    assert [s["file"] for s in m["shards"]] == ["shard-r00000-00000.safetensors", "shard-r00000-00001.safetensors",
                                                 "shard-r00001-00000.safetensors", "shard-r00001-00001.safetensors"]
    assert [s["rank"] for s in m["shards"]] == [0, 0, 1, 1]
    assert (m["sequences"], m["tokens"], m["trained_tokens"], m["truncated"], m["dropped"]) == (10, 60, 30, 4, 3)
    assert m["bytes_per_token"] == 10 and m["final_norm"] == "model" and m["world_size"] == 2
    assert [r["rank"] for r in m["runs"]] == [0, 1]
    with pytest.raises(DumpError, match="got ranks"):
        merge_manifests(states[:1])
    with pytest.raises(DumpError, match="has not finished"):
        merge_manifests([states[0], dict(states[1], status="running")])
    with pytest.raises(DumpError, match="another dump plan"):
        merge_manifests([states[0], dict(states[1], plan="Q")])


def test_dataset_batches_and_survives_pickling(pair, tmp_path):
    run_dump(pair["target"], [chat(i) for i in range(5)], tmp_path / "d", fp32(teacher_format="topk", top_logprobs=4))
    ds = TeacherDataset(tmp_path / "d")
    first = ds[0]
    clone = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker receives
    assert torch.equal(clone[0]["topk_ids"], first["topk_ids"]) and torch.equal(ds[-1]["input_ids"], ds[4]["input_ids"])
    with pytest.raises(IndexError):
        ds[5]
    loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=pad_collate)
    batch = next(iter(loader))
    lens = [len(ds[i]["input_ids"]) for i in range(2)]
    assert batch["input_ids"].shape == (2, max(lens)) and batch["topk_logprobs"].shape == (2, max(lens), 4)
    assert batch["attention_mask"].sum(1).tolist() == lens and batch["ids"] == ["ex0", "ex1"]
    assert not batch["loss_mask"][batch["attention_mask"] == 0].any()


def test_prompt_positions_train_every_prediction_past_the_shared_prefix(pair, tmp_path):
    """A dump of chats with one system turn: the shared prefix ends where the user's words begin, the widened
    mask trains every prediction from there on (the answer's as stored), and nothing else changes."""
    system = {"role": "system", "content": "be brief"}
    examples = [Example(e.id, [system, *e.messages]) for e in (chat(i) for i in range(4))]
    run_dump(pair["target"], examples, tmp_path / "d", fp32(teacher_format="topk", top_logprobs=4, answer_only=True))
    stored, wide = TeacherDataset(tmp_path / "d"), TeacherDataset(tmp_path / "d", prompt_positions=True)
    n = wide.shared_tokens
    tok = pair["tok"]
    assert stored.shared_tokens == 0 and n == stored.shared_prefix()
    seqs = [stored[i]["input_ids"] for i in range(len(stored))]
    assert all(torch.equal(s[:n], seqs[0][:n]) for s in seqs)  # shared ...
    assert len({s[n].item() for s in seqs}) > 1  # ... and no longer: the first user words differ
    # the user turn's header; its newline merges with the first word in this tokenizer, so the sequences differ there
    assert tok.convert_ids_to_tokens(seqs[0][n - 2:n].tolist()) == ["<|im_start|>", "user"]
    for i in range(len(stored)):
        a, b = stored[i], wide[i]
        length = len(a["input_ids"])
        expected = a["loss_mask"].clone()
        expected[n:length - 1] = True
        assert torch.equal(b["loss_mask"], expected) and not b["loss_mask"][:n].any() and not b["loss_mask"][-1]
        assert a["loss_mask"].sum() < b["loss_mask"].sum() == a["loss_mask"][:n].sum() + (length - 1 - n)
        assert torch.equal(a["topk_logprobs"], b["topk_logprobs"]) and torch.equal(a["topk_ids"], b["topk_ids"])
        assert torch.equal(wide.tokens(i)["loss_mask"], a["loss_mask"])  # where the answer starts, as stored
    words = examples[0].messages[1]["content"].split()
    trained = [seqs[0][j + 1].item() for j in range(len(seqs[0]) - 1) if wide[0]["loss_mask"][j]]
    assert tok.convert_ids_to_tokens(trained[:len(words) - 1]) == words[1:]  # the question's own words
    lone = tmp_path / "one"
    run_dump(pair["target"], examples[:1], lone, fp32(teacher_format="topk", top_logprobs=4, answer_only=True))
    one = TeacherDataset(lone, prompt_positions=True)  # a lone sequence shares all of itself: the mask as stored
    assert one.shared_tokens == len(one[0]["input_ids"]) and torch.equal(one[0]["loss_mask"], TeacherDataset(lone)[0]["loss_mask"])


# ------------------------------------------------------------------------------------------ command line


def test_dump_command(pair, tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": chat(i).messages}) for i in range(4)) + "\n")
    out = tmp_path / "d"
    res = CliRunner().invoke(app, ["dump", "--target", pair["target"], "--prompts", str(data), "--out", str(out),
                                   "--teacher-format", "topk", "--top-logprobs", "4", "--answer-only",
                                   "--batch-size", "3"])
    assert res.exit_code == 0, res.output
    m = load_manifest(out)
    assert m["sequences"] == 4 and m["top_k"] == 4 and m["config"]["answer_only"] is True
    assert "bytes per token" in res.output and "tokens/s" in res.output
    bad = CliRunner().invoke(app, ["dump", "--target", pair["target"], "--prompts", str(data), "--out",
                                   str(tmp_path / "x"), "--temperature", "0.5"])
    assert bad.exit_code == 2 and "--temperature" in bad.output
    other = CliRunner().invoke(app, ["dump", "--target", pair["draft"], "--prompts", str(data), "--out", str(out),
                                     "--teacher-format", "topk", "--top-logprobs", "4", "--answer-only"])
    assert other.exit_code == 2 and "another target" in other.output
    # dump's --format became --teacher-format (export's --format is what export writes): the old spelling is one
    # error line naming the new flag, before any model loads; --help shows only the new one.
    retired = CliRunner().invoke(app, ["dump", "--target", pair["target"], "--prompts", str(data), "--out",
                                       str(tmp_path / "y"), "--format", "topk"])
    assert retired.exit_code == 2 and "--teacher-format topk" in retired.output and not (tmp_path / "y").exists()
    assert "--format" not in CliRunner().invoke(app, ["dump", "--help"]).output.replace("--teacher-format", "")


# ------------------------------------------------------------------------------------------ real pair


@pytest.mark.real
def test_real_target_dump_matches_a_plain_forward_pass(tmp_path, real_model):
    """HumanEval prompts plus canonical solutions through the 1.5B target in bfloat16, in one right-padded
    batch: the stored teacher (both formats) gives the target's own distribution of a lone forward pass."""
    from specdraft.core.embedded import DEFAULT_TARGET
    from specdraft.data.sources import load_examples
    from specdraft.models.loading import load_tokenizer

    # The three shortest of the first 40 problems, so that prompt and solution fit in 160 tokens.
    candidates = load_examples("humaneval", limit=40)
    lengths = [len(s.ids) for s in build_sequences(load_tokenizer(DEFAULT_TARGET), candidates, max_length=10_000)]
    examples = [candidates[i] for i in sorted(range(40), key=lengths.__getitem__)[:3]]
    assert max(sorted(lengths)[:3]) <= 160
    common = {"max_length": 160, "dtype": "bfloat16", "batch_size": 3, "answer_only": True}
    m = run_dump(DEFAULT_TARGET, examples, tmp_path / "h", DumpConfig(**common))
    mk = run_dump(DEFAULT_TARGET, examples, tmp_path / "k", DumpConfig(teacher_format="topk", top_logprobs=16, **common))
    assert m["sequences"] == 3 and m["final_norm_applied"] is True and m["target"]["dtype"] == "bfloat16"
    assert m["target"]["revision"].startswith("gguf-sha256:")
    real, width = m["target"]["real_vocab"], m["target"]["vocab_width"]
    assert real < width  # Qwen pads its logits rows: the dump must give them no probability
    hidden = TeacherDataset(tmp_path / "h", draft_tokenizer="qwen2.5-coder-0.5b-instruct", verify=True)
    topk = TeacherDataset(tmp_path / "k", verify=True)
    head = hidden.head()
    model, _ = real_model(DEFAULT_TARGET, "bfloat16")
    assert head_fingerprint(model) == m["head_fingerprint"] == mk["head_fingerprint"]
    for i in range(3):
        item, item_k = hidden[i], topk[i]
        assert item["loss_mask"].any() and len(item["input_ids"]) <= 160
        assert torch.equal(item["input_ids"], item_k["input_ids"])
        p_ref = plain_logits(model, item["input_ids"])[:, :real].softmax(-1)  # [S, real]
        p = hidden.teacher_probs(item, head)
        assert (p[:, real:] == 0).all()
        # The batch (right-padded) and the lone forward differ only by bfloat16 rounding through 28 layers
        # (measured: mean TV 3e-4, max 0.02; the unpadded row is bit-identical).
        tv = 0.5 * (p[:, :real] - p_ref).abs().sum(-1)
        assert tv.mean() < 0.01 and tv.max() < 0.1, (tv.mean(), tv.max())
        assert (p[:, :real].argmax(-1) == p_ref.argmax(-1)).float().mean() > 0.98
        # Top-k: real ids only, the reference's most likely ids, and a leftover that closes the mass.
        assert int(item_k["topk_ids"].max()) < real
        # bfloat16 logits tie often and topk breaks ties unlike argmax: compare probabilities, not ids.
        top1 = p_ref.gather(-1, item_k["topk_ids"][:, :1].long())[:, 0]
        assert (p_ref.max(-1).values - top1).max() < 0.05
        mass = item_k["topk_logprobs"].float().exp().sum(-1) + item_k["leftover_logmass"].exp()
        torch.testing.assert_close(mass, torch.ones_like(mass), atol=1e-2, rtol=0)


def test_teacher_forced_dump_of_sharegpt_first_turns_trains_their_existing_replies(pair, tmp_path, monkeypatch):
    # ShareGPT's turns already hold a reply: without --generate the dump teacher-forces it (one prefill per
    # sequence) and --answer-only trains the reply's predictions only; the reader's counts reach the manifest.
    from specdraft.data import sources as data

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "SHAREGPT_FILTER", {"prompt_chars": (1, 100), "reply_chars": (1, 100), "min_ascii": 1})
    records = [{"id": f"s{i}_0", "conversations": [{"from": "human", "value": c.messages[0]["content"]},
                                                    {"from": "gpt", "value": c.messages[1]["content"]}]}
               for i, c in enumerate(chat(i) for i in range(3))]
    f = tmp_path / "sharegpt.json"
    f.write_text(json.dumps(records)[:-1] + ', {"id": "cut_0", "conversations": [{"from": "human", "val')
    monkeypatch.setattr(data, "data_file", lambda name: f)
    m = run_dump(pair["target"], "sharegpt", tmp_path / "d", fp32(answer_only=True, batch_size=2), command="pytest")
    assert m["data"] == "sharegpt" and m["data_counts"]["malformed"] == 1 and m["data_counts"]["kept"] == 3
    ds = TeacherDataset(tmp_path / "d", draft_tokenizer=tiny_tokenizer(VOCAB))
    tok = pair["tok"]
    for i in range(3):
        item = ds[i]
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        predicted = [ids[j + 1] for j, on in enumerate(mask) if on]
        reply = records[i]["conversations"][1]["value"]
        assert item["id"] == f"sharegpt/s{i}_0"
        assert predicted == tok(reply, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    # The command reports the reader's counts.
    from typer.testing import CliRunner

    from specdraft.cli import app

    r = CliRunner().invoke(app, ["dump", "--target", pair["target"], "--prompts", "sharegpt", "--answer-only",
                                 "--dtype", "float32", "--out", str(tmp_path / "d2")])
    assert r.exit_code == 0, r.output
    assert "records kept / malformed (skipped)" in r.output and "3 / 1" in r.output


def test_ids_past_the_targets_width_are_named_before_it_is_loaded(tmp_path, monkeypatch):
    """A tokenizer of 64 ids beside a target of 60 rows (tokens added after it was made): the dump names the ids
    its sequences hold past the target's rows, before any weight is loaded (was an IndexError in the forward)."""
    d = tmp_path / "narrow"
    tiny_model("llama", vocab_size=60, seed=0, layers=1).save_pretrained(d)
    tiny_tokenizer(VOCAB).save_pretrained(d)  # ids 60..63 are "at0", "au0", "av0", "aw0"
    examples = [Example("e0", [{"role": "user", "content": "a b at0"}, {"role": "assistant", "content": "c av0"}]),
                Example("e1", [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}])]
    patch_everywhere(monkeypatch, "specdraft.models.loading", "load_model", lambda *a, **k: pytest.fail("the target was loaded"))
    for generate in (None, 4):  # teacher-forced sequences, and prompts the target would answer
        with pytest.raises(DumpError, match=r"target cannot read or score: 60, 62 \(its input embedding has 60 rows"
                           if generate is None else r"target cannot read or score: 60 \("):
            run_dump(str(d), examples, tmp_path / f"out{generate}", fp32(generate=generate, answer_only=True))


def test_sequences_past_the_targets_window_are_named_before_it_is_loaded(tmp_path, monkeypatch):
    """A GPT-2 target of 16 absolute positions (its position table would raise an IndexError in the forward): the
    dump names the longest sequence, its length and the window before any weight is loaded — teacher-forced, and
    with --generate, where the target's own decoding needs prompt + N + 1 positions (decoding's rule)."""
    d = tmp_path / "short"
    tiny_model("gpt2", vocab_size=VOCAB, seed=0, layers=1, n_positions=16).save_pretrained(d)
    tiny_tokenizer(VOCAB).save_pretrained(d)
    examples = [chat(0), chat(1, n_user=12, n_answer=8)]
    lengths = [len(q.ids) for q in build_sequences(tiny_tokenizer(VOCAB), examples, max_length=64)]
    prompt = len(encode_prompts(tiny_tokenizer(VOCAB), examples[:1])[0])
    assert lengths[1] > 16 and lengths[0] <= 16 and prompt + 1 <= 16 < prompt + 8 + 1
    patch_everywhere(monkeypatch, "specdraft.models.loading", "load_model", lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(DumpError, match=rf"sequence 'ex1' \({lengths[1]} tokens\) exceeds the target's context "
                       r"window \(16\); lower --max-length \(now 64\)"):
        run_dump(str(d), examples, tmp_path / "forced", fp32(max_length=64))
    with pytest.raises(DumpError, match=rf"prompt 'ex0' \({prompt} tokens\) \+ --generate \(8\) \+ 1 = {prompt + 9} "
                       r"exceeds the target's context window \(16\)"):
        run_dump(str(d), examples[:1], tmp_path / "generated", fp32(max_length=64, generate=8, answer_only=True))


@pytest.mark.parametrize("fmt", ["hidden", "topk"])
def test_a_target_with_non_finite_logits_is_refused_and_nothing_is_stored(tmp_path, fmt):
    """NaN in the target's head (as an overflow gives): the dump names the target and its dtype and writes no
    shard of NaNs, in either format."""
    d = tmp_path / "nan"
    m = tiny_model("llama", vocab_size=VOCAB, seed=0, layers=1)
    with torch.no_grad():
        m.lm_head.weight[9] = float("nan")
    m.save_pretrained(d)
    tiny_tokenizer(VOCAB).save_pretrained(d)
    with pytest.raises(DumpError, match=r"target \(LlamaForCausalLM, float32\) gave non-finite logits"):
        run_dump(str(d), [chat(0), chat(1)], tmp_path / "out", fp32(teacher_format=fmt, top_logprobs=8))
    assert not list((tmp_path / "out").glob("shard-*"))


def test_a_topk_dump_stores_log_probs_as_computed_so_storage_neither_makes_nor_breaks_a_tie_at_the_cut(pair,
                                                                                                     tmp_path):
    """Log-probs 1e-3 apart (float16 spaces values near −4 by 0.004 and would merge them into a tie the serving
    filter then keeps whole) stay apart: the dump stores float32 values as computed, and its identity names
    the storage, so a dump begun with float16 log-probs is never resumed into float32 shards."""
    import json

    from specdraft.training.teacher import Teacher

    run_dump(pair["target"], [chat(i) for i in range(2)], tmp_path / "d", fp32(teacher_format="topk", top_logprobs=8))
    item = next(iter(rows_by_id(TeacherDataset(tmp_path / "d")).values()))
    teacher = Teacher(pair["model"], VOCAB)
    ids = item["input_ids"][None]
    h = teacher.hidden(ids, torch.ones_like(ids))[0]
    computed, _, _ = teacher.topk(h, 8)
    # As computed, to float32 rounding (the dump's batched pass and this lone one may differ in the last bits).
    torch.testing.assert_close(item["topk_logprobs"], computed, atol=1e-5, rtol=0)
    gaps = computed[:, :-1] - computed[:, 1:]
    close = (gaps > 0) & (gaps < 4e-3)
    assert close.any()  # values float16 would have merged into ties are there, and stay distinct
    assert not (item["topk_logprobs"][:, :-1] == item["topk_logprobs"][:, 1:])[close].any()
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["identity"]["topk_storage"]["topk_logprobs"] == "float32"


# ------------------------------------------------------------------------------------------ generated answers


def test_a_generated_answer_follows_the_whole_history_the_target_was_shown(pair, tmp_path):
    """A conversation ending with a user turn is asked whole, as a chat server renders it: the row's prompt part is
    the template over every message with the generation prompt, and only the target's answer is trained."""
    tok = pair["tok"]
    history = chat(0).messages + [{"role": "user", "content": " ".join(WORDS[:3])}]
    run_dump(pair["target"], [Example("h", history)], tmp_path / "h", fp32(generate=4, answer_only=True))
    item = TeacherDataset(tmp_path / "h")[0]
    shown = tok(tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"]
    assert item["input_ids"].tolist()[: len(shown)] == shown
    assert item["loss_mask"].tolist().index(True) == len(shown) - 1  # the first trained prediction is the answer's


def test_a_generate_dump_whose_every_answer_would_be_cut_away_is_refused_before_the_target_loads(pair, tmp_path):
    """Prompts of --max-length tokens or more keep no generated token: all of them is an error naming the fix before
    anything is written (it used to finish as a "complete" dump of nothing); some of them a warning."""
    long_prompt = Example("long", chat(0, n_user=40).messages[:1])
    n = len(encode_prompts(pair["tok"], [long_prompt])[0])
    with pytest.raises(DumpError, match=rf"all 1 prompts are --max-length {n} tokens or longer: the target's answers "
                                        rf"to them would be truncated away, leaving nothing to dump. Raise --max-length "
                                        rf"above {n} \+ --generate \({n + 4}\)"):
        run_dump(pair["target"], [long_prompt], tmp_path / "none", fp32(generate=4, answer_only=True, max_length=n))
    assert not (tmp_path / "none").exists()
    short = Example("short", chat(1).messages[:1])
    with pytest.warns(UserWarning, match=r"1 of 2 prompts \(long\) are --max-length"):
        m = run_dump(pair["target"], [long_prompt, short], tmp_path / "some",
                     fp32(generate=4, answer_only=True, max_length=n))
    assert (m["status"], m["sequences"], m["dropped"]) == ("complete", 1, 1)


def test_a_generate_dump_that_kept_no_sequence_is_not_marked_complete(pair, tmp_path, monkeypatch):
    """Whatever emptied it, a dump holding no sequence says so on disk and stops with an error, at the dump; a
    rerun of the same command says it again, never hands distillation an empty "complete" dump."""
    from specdraft.models.dump_reader import load_manifest

    def cut(model, tokenizer, batch, n, *a, **k):  # prompts that fill --max-length: every answer is cut away
        return [[5] * 20 for _ in batch], [[6] * n for _ in batch]

    monkeypatch.setattr(dump_mod, "generate_responses", cut)
    prompts = [Example(f"p{i}", chat(i).messages[:1]) for i in range(2)]
    cfg = fp32(generate=4, answer_only=True, max_length=20)
    for _ in range(2):
        with pytest.raises(DumpError, match=r"every one of the 2 sequences lost its trained positions to truncation "
                                            r"at --max-length 20 .* holds nothing to train on"):
            run_dump(pair["target"], prompts, tmp_path / "empty", cfg)
        assert load_manifest(tmp_path / "empty")["status"] == "empty"


def test_settings_written_under_the_older_keys_top_k_and_format_still_read(tmp_path):
    """A manifest, stage.json or config JSON written before the renames holds the stored log-probs count as top_k and
    the stored form as format: they read as top_logprobs and teacher_format; giving both names at once is refused."""
    from specdraft.core.config import (
        AsGivenTeacherConfig,
        PipelineConfig,
        SelfTeacherConfig,
        recorded_settings,
    )

    assert DumpConfig.model_validate({"format": "topk", "top_k": 12}) == DumpConfig(teacher_format="topk",
                                                                                     top_logprobs=12)
    assert SelfTeacherConfig.model_validate({"top_k": 3}).top_logprobs == 3
    assert AsGivenTeacherConfig.model_validate_json('{"top_k": 7, "carry": "twins"}').top_logprobs == 7
    assert recorded_settings({"top_k": 5, "offset": 0, "generate": 4}) == {"top_logprobs": 5, "generate": 4}
    with pytest.raises(ValueError, match="top_k is the older key of top_logprobs"):
        DumpConfig(top_k=4, top_logprobs=8)
    from specdraft.run.pipeline import make_config

    written = make_config("tiny").model_dump(mode="json")
    written["dump"] = {k: v for k, v in written["dump"].items() if k not in ("top_logprobs", "teacher_format")}
    written["dump"] |= {"top_k": 9, "format": "topk"}
    read = PipelineConfig.model_validate_json(json.dumps(written)).dump
    assert (read.top_logprobs, read.teacher_format) == (9, "topk")
