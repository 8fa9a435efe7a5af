"""The self-teacher: the draft as given answers prompts in its own tokenizer, its answers re-encoded in the target's
are a teacher dump its re-indexed copy distils on (alone or beside a target dump). Tiny models of two byte-level BPE
tokenizers that segment text differently."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.core.config import DistillConfig, DumpConfig, SelfTeacherConfig
from specdraft.core.io import sha256_json
from specdraft.data.sources import encode_conversation, encode_prompts
from specdraft.decoding.responses import answer_stop_ids, generate_from_ids, generate_responses
from specdraft.models.dump_reader import (
    DumpError,
    TeacherDataset,
    TeacherMix,
    answers_written_by,
    load_manifest,
)
from specdraft.models.vocab import build_vocab_mapping
from specdraft.testing import (
    TINY_PROMPTS,
    tiny_bpe_tokenizer,
    tiny_examples,
    tiny_llama_tokenizer,
    tiny_model,
)
from specdraft.training.self_teacher import (
    DraftTeacher,
    aligned_positions,
    decode_text,
    end_of_turn_ids,
    run_self_teacher,
    text_sequences,
    well_formed_prefix,
)

PROMPTS, _examples = TINY_PROMPTS, tiny_examples


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target (only its tokenizer and config are read) and a draft as given, each with its own BPE tokenizer. The
    draft's generation config adds, as a stop id, the token its greedy answer to the first prompt writes fourth, so
    some answers end at a stop and some at the budget."""
    root = tmp_path_factory.mktemp("pair")
    t_tok, d_tok = tiny_bpe_tokenizer(300), tiny_bpe_tokenizer(360, seed=1)
    target = tiny_model("llama", 300, seed=0, layers=1)
    draft = tiny_model("llama", 360, seed=1, layers=2)
    _, (answer,) = generate_responses(draft, d_tok, _examples(1), 8)
    draft.generation_config.eos_token_id = [4, int(answer[3])]
    for name, model, tok in (("target", target, t_tok), ("draft", draft, d_tok)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "t_tok": t_tok, "d_tok": d_tok,
            "model": draft, "stop": int(answer[3]), "root": root}


def _reference(pair, examples, budget):
    """What the self-teacher must store, computed here by hand: the draft's greedy answer, its text, the target ids."""
    d_prompts, answers = generate_responses(pair["model"], pair["d_tok"], examples, budget)
    t_prompts = encode_prompts(pair["t_tok"], examples)
    out = []
    for dp, tp, r in zip(d_prompts, t_prompts, answers, strict=True):
        ended = bool(r) and r[-1] in answer_stop_ids(pair["model"], pair["d_tok"])
        body = r[:-1] if ended else r
        text, cut = well_formed_prefix(decode_text(pair["d_tok"], body))
        ended = ended and not cut
        ids = pair["t_tok"](text, add_special_tokens=False)["input_ids"] + ([3] if ended else [])
        out.append({"prompt": tp, "answer": ids, "text": text, "body": body, "ended": ended, "draft_prompt": dp,
                    "response": r})
    return out


def test_the_end_of_turn_is_what_the_chat_template_writes_after_an_answer():
    tok = tiny_bpe_tokenizer(300)
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")] == [3]
    tok.chat_template = None
    assert end_of_turn_ids(tok) == [tok.eos_token_id]


def _ends_its_turn_after(model, tok, examples, k):
    """``model`` made to write ``<|im_end|>`` (id 3, not its EOS 4) where its greedy answer writes its ``k``-th token:
    that token's head row, scaled up, moved to id 3."""
    _, (answer,) = generate_responses(model, tok, examples, 8)
    assert 3 not in answer and 4 not in answer
    with torch.no_grad():
        model.lm_head.weight[3] = 3 * model.lm_head.weight[answer[k]]
    return model


def test_a_turn_ends_at_the_templates_end_of_turn_token_where_the_eos_is_another():
    """Every writer of an answer (dump --generate, the self-teacher's draft, the draft's on-policy answers) stops at
    its template's terminator, also where its EOS is another token: nothing after it is trained as answer."""
    tok, examples = tiny_bpe_tokenizer(300), _examples(1)
    model = _ends_its_turn_after(tiny_model("llama", 300, seed=2, layers=1), tok, examples, 2)
    assert tok.eos_token_id == 4 and answer_stop_ids(model, tok) == [3, 4]
    prompts, (answer,) = generate_responses(model, tok, examples, 8)
    assert answer[-1] == 3 and 3 not in answer[:-1] and len(answer) <= 3
    target = tiny_model("llama", 300, seed=3, layers=1)  # on-policy: the draft writes, the target's stops apply
    assert generate_from_ids(model, tok, prompts, 8, stop_model=target) == [answer]
    teacher = DraftTeacher(model, tok, tok, SelfTeacherConfig(generate=8, dtype="float32"))
    ((seq, _),), dropped, _, _ = teacher.answer(examples)
    assert seq.ids == prompts[0] + answer and teacher.stats["ended"] == 1 and dropped == 0


def _metaspace_tokenizer():
    """A SentencePiece-style BPE of the Metaspace kind (``▁`` before every word, the first one included), trained
    here on the tiny corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from specdraft.testing import SPECIAL_TOKENS, _tiny_fast_tokenizer, tiny_corpus

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.train_from_iterator(tiny_corpus(), trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, show_progress=False, limit_alphabet=1000))
    return _tiny_fast_tokenizer(tok, False)


def test_an_answer_is_encoded_in_its_context_as_the_conversation_encoder_writes_it(pair):
    """The self-teacher's answer ids are the ones the conversation encoder gives the same answer after the same
    prompt: no SentencePiece ``▁`` before its first word (an answer encoded alone would start with one)."""
    examples = _examples()
    _, responses = generate_responses(pair["model"], pair["d_tok"], examples, 6)
    stops = answer_stop_ids(pair["model"], pair["d_tok"])
    texts = [well_formed_prefix(decode_text(pair["d_tok"], r[:-1] if r[-1] in stops else r)) for r in responses]
    # The answers the encoder takes whole (it strips an answer's outer whitespace), the ill-formed ones left out.
    whole = [i for i, (t, cut) in enumerate(texts) if t and not cut and t == t.strip()]
    assert len(whole) >= 2
    for ttok in (tiny_bpe_tokenizer(300), tiny_llama_tokenizer(300, bos=False), _metaspace_tokenizer()):
        teacher = DraftTeacher(pair["model"], pair["d_tok"], ttok, SelfTeacherConfig(generate=6, dtype="float32"))
        out, _, _, _ = teacher.answer(examples)
        prompts = encode_prompts(ttok, examples)
        for i in whole:
            (seq, _), p, text = out[i], prompts[i], texts[i][0]
            ids, assistant = encode_conversation(ttok, [*examples[i].messages, {"role": "assistant", "content": text}])
            written = [t for t, a in zip(ids, assistant, strict=True) if a]  # the answer, then <|im_end|>
            assert ids[:len(p)] == p and written[-1] == 3
            assert seq.ids == p + (written if responses[i][-1] in stops else written[:-1])


def test_an_answer_is_cut_before_its_first_ill_formed_byte_and_has_no_end_of_turn_then():
    """A byte-level draft that writes a byte no UTF-8 text holds mid-answer: the text after it is dropped (never
    trained as U+FFFD), the answer has no end of turn (the draft's stop came after the cut) and the cut is counted."""
    tok, examples = tiny_bpe_tokenizer(300), _examples(1)
    model = tiny_model("llama", 300, seed=2, layers=1)
    _, (answer,) = generate_responses(model, tok, examples, 8)
    stray = next(i for i in range(5, 300) if tok.decode([i]) == "\ufffd")  # a lone continuation byte
    with torch.no_grad():
        model.lm_head.weight[stray] = 3 * model.lm_head.weight[answer[1]]
    _, (written,) = generate_responses(model, tok, examples, 8)
    text = decode_text(tok, written)
    at = text.index("\ufffd")
    assert 0 < at and text[at:].strip("\ufffd")  # well-formed text before and after the ill-formed byte
    teacher = DraftTeacher(model, tok, tok, SelfTeacherConfig(generate=8, dtype="float32"))
    ((seq, _),), _, _, _ = teacher.answer(examples)
    prompt = encode_prompts(tok, examples)[0]
    assert seq.ids == prompt + tok(text[:at], add_special_tokens=False)["input_ids"]
    assert "\ufffd" not in decode_text(tok, seq.ids) and teacher.stats["cut_ill_formed"] == 1
    assert teacher.stats["ended"] == 0


def test_a_text_file_that_is_not_utf8_is_refused_by_name_and_line(pair, tmp_path):
    src = tmp_path / "latin.py"
    src.write_bytes("def total(items):\n    return count\nvalue = 'caf\u00e9'\n".encode("latin-1"))
    with pytest.raises(DumpError, match=r"--text .*latin\.py: line 3 is not UTF-8 .*convert the file to UTF-8"):
        text_sequences(pair["t_tok"], [src], 40)


def test_a_self_teacher_sequence_is_the_targets_prompt_then_the_drafts_answer_text_in_target_ids(pair, tmp_path):
    """The prompt part is the target's rendering (what the target is shown), the answer part the target tokenizer's
    encoding of the text the draft wrote (+ the end-of-turn token where the draft stopped), the loss mask exactly on
    the answer's predictions, and every trained position a hard label: the next token at log-prob 0, nothing left."""
    examples = _examples()
    cfg = SelfTeacherConfig(generate=10, dtype="float32", batch_size=4)
    m = run_self_teacher(pair["draft"], pair["target"], examples, tmp_path / "st", cfg)
    ref = _reference(pair, examples, 10)
    assert any(r["ended"] for r in ref) and not all(r["ended"] for r in ref)  # both endings are exercised
    ds = TeacherDataset(tmp_path / "st", draft_tokenizer=pair["t_tok"])  # the target's tokenizer fingerprint
    assert len(ds) == len(examples) and m["signal"]["answers"] == len(examples)
    assert m["teacher"]["kind"] == "draft-as-given" and m["head_fingerprint"] is None and m["top_k"] == 1
    assert answers_written_by(load_manifest(tmp_path / "st")) == f"the draft as given ({pair['draft']})"
    for i, r in enumerate(ref):
        item = ds[i]
        ids = item["input_ids"].tolist()
        assert ids == r["prompt"] + r["answer"]
        trained = item["loss_mask"].nonzero().flatten().tolist()
        assert trained == list(range(len(r["prompt"]) - 1, len(ids) - 1))
        assert item["topk_ids"][trained, 0].tolist() == ids[len(r["prompt"]):]
        assert bool((item["topk_logprobs"][trained, 0] == 0).all())
        assert bool(torch.isneginf(item["leftover_logmass"]).all())
    assert m["signal"]["ended"] == sum(r["ended"] for r in ref)
    assert m["signal"]["soft_positions"] == 0 and m["signal"]["hard_positions"] == m["trained_tokens"]
    with pytest.raises(DumpError, match="tokenizer differs"):  # the draft as given cannot train on it
        TeacherDataset(tmp_path / "st", draft_tokenizer=pair["d_tok"])


def test_token_level_positions_are_exactly_where_a_twin_starts_at_a_boundary_of_both_segmentations():
    """Checked against the tokenizers' character offsets (another route to the boundaries than decoding prefixes):
    a target token is aligned when its draft twin exists and its first character starts a draft token too."""
    t_tok, d_tok = tiny_bpe_tokenizer(300), tiny_bpe_tokenizer(360, seed=1)
    twins = (build_vocab_mapping(t_tok, d_tok, target_config=300, draft_config=360).target_to_draft >= 0).tolist()
    text = "def total(items):\n    return count + index\nhello world lambda value"
    d_enc = d_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    t_enc = t_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    d_ids, t_ids = d_enc["input_ids"], t_enc["input_ids"] + [3]
    d_starts = {a for a, _ in d_enc["offset_mapping"]} | {len(text)}
    t_starts = [a for a, _ in t_enc["offset_mapping"]] + [len(text)]
    pairs = aligned_positions(d_tok, d_ids, t_tok, t_ids, text, twins, ended=True, end_of_turn=[3])
    expected = [k for k, y in enumerate(t_ids) if twins[y] and t_starts[k] in d_starts]
    assert [k for k, _ in pairs] == expected
    assert len(t_ids) - 1 in expected  # the end of turn: the draft's stop at the end of the text
    assert 0 < len(expected) < len(t_ids)  # some align and some do not
    starts = [a for a, _ in d_enc["offset_mapping"]] + [len(text)]
    assert all(starts[i] == t_starts[k] for k, i in pairs)  # the draft's context ends where the target token starts
    # Not stopped: no end-of-turn position.
    assert aligned_positions(d_tok, d_ids, t_tok, t_ids[:-1], text, twins) == pairs[:-1]


def test_token_level_signal_is_the_drafts_own_distribution_mapped_to_twins_at_aligned_positions_only(pair, tmp_path):
    examples = _examples()
    cfg = SelfTeacherConfig(generate=10, dtype="float32", batch_size=3, top_logprobs=4, token_level=True)
    m = run_self_teacher(pair["draft"], pair["target"], examples, tmp_path / "st", cfg)
    mapping = build_vocab_mapping(pair["target"], pair["draft"])
    twins = (mapping.target_to_draft >= 0).tolist()
    ds = TeacherDataset(tmp_path / "st")
    soft_total = ends = 0
    for i, r in enumerate(_reference(pair, examples, 10)):
        item = ds[i]
        p_t, p_d = len(r["prompt"]), len(r["draft_prompt"])
        pairs = aligned_positions(pair["d_tok"], r["body"], pair["t_tok"], r["answer"], r["text"], twins, r["ended"],
                                  [3])
        want = {p_t + k - 1: p_d + j - 1 for k, j in pairs}
        hard = (item["topk_logprobs"][:, 0] == 0) & torch.isneginf(item["leftover_logmass"])
        soft = set((~hard & item["loss_mask"]).nonzero().flatten().tolist())
        assert soft == set(want)
        soft_total += len(soft)
        # The stored values: the draft as given alone on its own sequence, log-softmax, top-4 of its twins.
        with torch.no_grad():
            logq = pair["model"](torch.tensor([r["draft_prompt"] + r["response"]])).logits[0].float().log_softmax(-1)
        end = p_t + len(r["answer"]) - 2 if r["ended"] else None  # predicts the end-of-turn token
        ends += end in want
        if end in want:  # the draft's probability of stopping, by any of its stop ids, on the stored token's twin
            stops = torch.tensor(answer_stop_ids(pair["model"], pair["d_tok"]))
            stopping = logq[want[end], stops].logsumexp(-1)
            logq[want[end], stops] = float("-inf")
            logq[want[end], mapping.target_to_draft[3]] = stopping
        for t, d in want.items():
            ids = item["topk_ids"][t].long()
            assert torch.allclose(item["topk_logprobs"][t], logq[d, mapping.target_to_draft[ids]], atol=1e-5)
            assert bool((mapping.target_to_draft[ids] >= 0).all())
            rest = torch.ones_like(logq[d], dtype=torch.bool)
            rest[mapping.target_to_draft[ids]] = False
            assert torch.allclose(item["leftover_logmass"][t], logq[d][rest].logsumexp(-1), atol=1e-5)
        assert all(bool(hard[j]) for j in item["loss_mask"].nonzero().flatten().tolist() if j not in want)
    assert soft_total > 0 and m["signal"]["soft_positions"] == soft_total
    assert ends > 0  # end-of-turn positions are exercised
    assert m["signal"]["hard_positions"] == m["trained_tokens"] - soft_total


def test_text_files_become_pieces_trained_at_every_position(pair, tmp_path):
    src = tmp_path / "lib.py"
    src.write_text("def total(items):\n    return count + index\n" * 8)
    pieces = text_sequences(pair["t_tok"], [src], 40)
    ids = pair["t_tok"](src.read_text(), add_special_tokens=False)["input_ids"]
    assert len(pieces) > 1 and [len(q.ids) for q in pieces[:-1]] == [40] * (len(pieces) - 1)
    assert [i for q in pieces for i in q.ids] == ids[: len(ids) - (len(ids) % 40 == 1)]
    assert all(q.loss_mask == [True] * (len(q.ids) - 1) + [False] for q in pieces)
    cfg = SelfTeacherConfig(generate=4, dtype="float32", max_length=40)
    m = run_self_teacher(pair["draft"], pair["target"], _examples(2), tmp_path / "st", cfg, texts=[src])
    assert m["sequences"] == 2 + len(pieces) and m["texts"][0][0] == "lib.py"
    item = TeacherDataset(tmp_path / "st")[2]
    assert item["id"] == "text:lib.py:0" and item["topk_ids"][:-1, 0].tolist() == item["input_ids"][1:].tolist()
    with pytest.raises(DumpError, match="no such file"):
        run_self_teacher(pair["draft"], pair["target"], None, tmp_path / "none", cfg, texts=[tmp_path / "missing.py"])


def test_a_killed_self_teacher_dump_resumes_to_the_uninterrupted_one_and_refuses_another_teacher(pair, tmp_path):
    examples = _examples()
    cfg = SelfTeacherConfig(generate=6, dtype="float32", batch_size=2, shard_size_mb=0.0001)  # a shard per batch
    out = tmp_path / "st"
    calls = []

    def kill_after_two_batches(done, total, tokens):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_self_teacher(pair["draft"], pair["target"], examples, out, cfg, progress=kill_after_two_batches)
    state = json.loads((out / "rank-00000.json").read_text())
    assert state["status"] == "running" and [s["end"] for s in state["shards"]] == [2, 4]
    m = run_self_teacher(pair["draft"], pair["target"], examples, out, cfg)
    assert (m["this_run"]["shards_skipped"], m["this_run"]["shards_written"]) == (2, 1)
    fresh = run_self_teacher(pair["draft"], pair["target"], examples, tmp_path / "fresh", cfg)
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in fresh["shards"]]
    # Another teacher (the draft's weights changed in place) or other prompts: refused, nothing touched.
    other = tmp_path / "other-draft"
    model = tiny_model("llama", 360, seed=5, layers=2)
    model.save_pretrained(other)
    pair["d_tok"].save_pretrained(other)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    with pytest.raises(DumpError, match="teacher"):
        run_self_teacher(other, pair["target"], examples, out, cfg)
    with pytest.raises(DumpError, match="data_fingerprint"):
        run_self_teacher(pair["draft"], pair["target"], examples[:4], out, cfg)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before
    assert load_manifest(out)["sequences"] == len(examples)


@pytest.fixture(scope="module")
def swapped(pair):
    """The draft re-indexed into the target's tokenizer (specdraft vocab-swap)."""
    from specdraft.models.vocab import save_vocab_swap

    out = pair["root"] / "swapped"
    save_vocab_swap(pair["draft"], pair["target"], out)
    return str(out)


def _distil(pair, swapped, dumps, out, steps=4, **overrides):
    from specdraft.training.distill import run_distill

    cfg = DistillConfig(loss="soft_ce", lr=3e-3, row_lr=1e-2, untie_head=True, max_steps=steps, batch_size=4,
                        held_out_fraction=0.0, logging_steps=1, save_steps=100, scheduler="constant", **overrides)
    return run_distill(pair["target"], swapped, dumps, out, cfg, num_speculative_tokens=3)


def test_run_distill_trains_a_re_indexed_draft_on_a_self_teacher_dump_and_soft_ce_is_its_cross_entropy(
        pair, swapped, tmp_path):
    from specdraft.models.dump_reader import pad_collate
    from specdraft.models.loading import load_model
    from specdraft.training.distill_trainer import DistillModel, TeacherHead

    st = tmp_path / "st"
    run_self_teacher(pair["draft"], pair["target"], _examples(), st, SelfTeacherConfig(generate=10, dtype="float32"))
    ds = TeacherDataset(st)
    batch = pad_collate([ds[i] for i in range(len(ds))])
    draft, _ = load_model(swapped, dtype="float32")
    model = DistillModel(draft, TeacherHead(None, ds.manifest["target"]["real_vocab"], width=ds.manifest["target"]["vocab_width"]), DistillConfig(loss="soft_ce"), trained_columns_only=False)
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k != "ids"})
        logits = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    labels = torch.cat([batch["input_ids"][:, 1:], batch["input_ids"][:, :1]], dim=1)
    ce = torch.nn.functional.cross_entropy(logits[mask], labels[mask])
    assert torch.allclose(out.loss, ce, atol=1e-5)  # hard labels: soft_ce is the cross-entropy, exactly
    res = _distil(pair, swapped, st, tmp_path / "out")
    losses = [h["loss"] for h in res.training["history"] if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert res.metrics.moved_fraction > 0.5


def test_a_restricted_head_trains_on_a_hard_label_dump_and_refuses_a_token_level_one(pair, swapped, tmp_path):
    from specdraft.training.distill import DistillError

    hard, soft = tmp_path / "hard", tmp_path / "soft"
    run_self_teacher(pair["draft"], pair["target"], _examples(), hard, SelfTeacherConfig(generate=10, dtype="float32"))
    ds = TeacherDataset(hard)
    data_ids = set()
    for i in range(len(ds)):
        data_ids.update(ds.tokens(i)["input_ids"].tolist())
    res = _distil(pair, swapped, hard, tmp_path / "out", head_support=8)
    losses = [h["loss"] for h in res.training["history"] if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0]
    # The support: the dump's ids plus at most 8 frequent ones, fewer rows than the head.
    assert len(data_ids) <= res.metrics.head_support <= len(data_ids) + 8
    assert res.metrics.head_support < ds.manifest["target"]["vocab_width"]
    run_self_teacher(pair["draft"], pair["target"], _examples(), soft,
                     SelfTeacherConfig(generate=10, dtype="float32", top_logprobs=4, token_level=True))
    with pytest.raises(DistillError, match="no leftover mass"):
        _distil(pair, swapped, soft, tmp_path / "out-soft", head_support=8)


def test_a_self_teacher_dump_mixes_with_a_target_dump_of_the_same_k(pair, swapped, tmp_path):
    from specdraft.training.dump import run_dump

    cfg = SelfTeacherConfig(generate=10, dtype="float32", top_logprobs=4, token_level=True)
    run_self_teacher(pair["draft"], pair["target"], _examples(), tmp_path / "st", cfg)
    run_dump(pair["target"], _examples(), tmp_path / "target", DumpConfig(teacher_format="topk", top_logprobs=4, generate=6,
                                                                          answer_only=True, dtype="float32"))
    assert answers_written_by(load_manifest(tmp_path / "target")) == "the target"
    mix = TeacherMix([TeacherDataset(tmp_path / "st"), TeacherDataset(tmp_path / "target")])
    assert mix.lengths == [len(PROMPTS), len(PROMPTS)]
    res = _distil(pair, swapped, [tmp_path / "st", tmp_path / "target"], tmp_path / "out")
    losses = [h["loss"] for h in res.training["history"] if "loss" in h]
    assert losses[-1] < losses[0] and res.training["dump"]["sequences_per_dump"] == [len(PROMPTS)] * 2
    run_dump(pair["target"], _examples(), tmp_path / "k8", DumpConfig(teacher_format="topk", top_logprobs=8, generate=6,
                                                                      answer_only=True, dtype="float32"))
    with pytest.raises(DumpError, match="top_logprobs differ"):
        TeacherMix([TeacherDataset(tmp_path / "st"), TeacherDataset(tmp_path / "k8")])


def test_dump_self_teacher_writes_the_drafts_dump_and_refuses_the_flags_that_do_not_apply(pair, tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    base = ["dump", "--self-teacher", pair["draft"], "--target", pair["target"], "--prompts", str(prompts),
            "--generate", "4", "--dtype", "float32"]
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "st")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    m = load_manifest(tmp_path / "st")
    assert m["teacher"]["kind"] == "draft-as-given" and m["top_k"] == 1 and m["config"]["generate"] == 4
    # An answer whose first byte is no UTF-8 keeps no text: it is dropped and counted.
    assert m["sequences"] + m["dropped"] == 3 and "trained positions: draft distribution / hard label" in r.output
    assert "answers cut before ill-formed UTF-8" in r.output
    for extra, says in ((["--teacher-format", "hidden"], "--teacher-format do(es) not apply with --self-teacher"),
                        (["--seed", "3"], "--seed do(es) not apply")):
        r = CliRunner().invoke(app, [*base, *extra, "--out", str(tmp_path / "x")], env={"COLUMNS": "400"})
        assert r.exit_code == 2 and says in r.output, r.output
    r = CliRunner().invoke(app, ["dump", "--target", pair["target"], "--prompts", str(prompts), "--token-level",
                                 "--out", str(tmp_path / "y")], env={"COLUMNS": "400"})
    assert r.exit_code == 2 and "need --self-teacher" in r.output and not (tmp_path / "y").exists()


def test_a_self_teacher_dump_answers_the_rows_run_trains_on_for_one_training_spec(pair, tmp_path):
    """The draft as given answers greedily, so ``run --train-prompts conversations:0:12`` on the self-teacher's road is
    12 distinct prompts (the embedded chats repeat their first questions) even beside a teacher-forced target dump
    setting; the self-teacher given the spec answers exactly those rows, in order."""
    from specdraft.run.pipeline import make_config, run_prompts

    spec = "conversations:0:12"
    cfg = make_config("default", target=pair["target"], draft=pair["draft"], train_prompts=[spec],
                      dump=DumpConfig(answer_only=True, dtype="float32"))
    trains = run_prompts(cfg, ("train",))["train"].examples
    assert len({json.dumps(e.prompt_messages) for e in trains}) == len(trains) == 12
    m = run_self_teacher(pair["draft"], pair["target"], spec, tmp_path / "st",
                         SelfTeacherConfig(generate=2, dtype="float32", batch_size=6))
    # The examples it was made of (its identity's data fingerprint); an answer with no text is dropped, not replaced.
    assert m["identity"]["data_fingerprint"] == sha256_json([[[e.id, e.messages, e.reference] for e in trains], []])
    ds = TeacherDataset(tmp_path / "st")
    kept = [ds.tokens(i)["id"] for i in range(len(ds))]
    assert kept == [e.id for e in trains if e.id in kept] and m["sequences"] + m["dropped"] == 12
    assert m["data"] == spec
