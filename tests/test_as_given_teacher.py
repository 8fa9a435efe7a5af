"""The target's teacher dump for a draft as given: carried labels, the sequences the text drafter reads, resume,
refusals, and distillation of the draft in its own vocabulary."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdraft.core.config import AsGivenTeacherConfig, DistillConfig
from specdraft.core.io import sha256_json
from specdraft.data.sources import encode_answer, encode_prompts, render_prompt
from specdraft.decoding.responses import answer_stop_ids, generate_from_ids
from specdraft.models.dump_reader import DumpError, TeacherDataset, load_manifest
from specdraft.models.vocab import build_vocab_mapping
from specdraft.testing import TINY_PROMPTS, tiny_bpe_tokenizer, tiny_examples, tiny_model
from specdraft.training.as_given_teacher import (
    aligned_pairs,
    carry_topk,
    first_piece_ids,
    run_as_given_teacher,
)
from specdraft.training.self_teacher import decode_text, well_formed_prefix

PROMPTS, _examples = TINY_PROMPTS, tiny_examples


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and a draft as given, each with its own BPE tokenizer (saved, so references resolve)."""
    root = tmp_path_factory.mktemp("pair")
    t_tok, d_tok = tiny_bpe_tokenizer(300), tiny_bpe_tokenizer(360, seed=1)
    target = tiny_model("llama", 300, seed=0, layers=1)
    draft = tiny_model("llama", 360, seed=1, layers=2)
    for name, model, tok in (("target", target, t_tok), ("draft", draft, d_tok)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "t_tok": t_tok, "d_tok": d_tok,
            "t_model": target, "d_model": draft, "root": root}


def test_a_position_whose_every_stored_token_has_a_twin_gains_no_leftover_and_the_rest_is_leftover_never_renormalised():
    p = torch.tensor([[0.5, 0.3, 0.15], [0.6, 0.2, 0.1], [0.7, 0.2, 0.05]])
    lp, left = p.log(), torch.log(1 - p.sum(-1))
    ids = torch.tensor([[0, 1, 3], [3, 1, 2], [2, 4, 0]])
    carry_to = torch.tensor([10, 11, -1, 13, -1])  # target 2 and 4 have no twin
    c_lp, c_ids, c_left = carry_topk(lp, ids, left, carry_to, 3)
    # Row 0: every stored id has a twin: the same masses on the twins, the leftover the target's own.
    assert c_ids[0].tolist() == [10, 11, 13]
    assert torch.allclose(c_lp[0].exp(), p[0]) and math.isclose(float(c_left[0]), float(left[0]), rel_tol=1e-6)
    # Row 1: target 2 (0.1) has no twin: its mass joins the leftover (0.1 + 0.1), the twins keep theirs.
    assert c_ids[1, :2].tolist() == [13, 11] and torch.allclose(c_lp[1, :2].exp(), torch.tensor([0.6, 0.2]))
    assert math.isclose(float(c_left[1].exp()), 0.2, rel_tol=1e-5) and torch.isneginf(c_lp[1, 2])
    # Row 2: most of the mass has no twin: 0.05 stays on twin 10, the rest is stated, not renormalised away.
    assert c_ids[2, 0] == 10 and math.isclose(float(c_lp[2, 0].exp()), 0.05, rel_tol=1e-5)
    assert math.isclose(float(c_left[2].exp()), 0.95, rel_tol=1e-5)
    # Every row still holds the target's whole mass, and an empty slot never repeats a stored id.
    total = torch.where(torch.isfinite(c_lp), c_lp.exp(), torch.zeros_like(c_lp)).sum(-1) + c_left.exp()
    assert torch.allclose(total, torch.ones(3), atol=1e-5)
    for r in range(3):
        assert len(set(c_ids[r].tolist())) == 3


def test_target_tokens_carried_to_one_draft_token_add_up():
    lp = torch.tensor([[0.5, 0.3, 0.2]]).log()
    c_lp, c_ids, c_left = carry_topk(lp, torch.tensor([[0, 1, 2]]), torch.tensor([float("-inf")]),
                                     torch.tensor([7, 7, 8]), 2)
    assert c_ids[0].tolist() == [7, 8] and torch.allclose(c_lp[0].exp(), torch.tensor([0.8, 0.2]))
    assert torch.isneginf(c_left[0])


def test_first_piece_keeps_twins_and_gives_a_twinless_token_the_first_draft_token_of_its_text(pair):
    mapping = build_vocab_mapping(pair["target"], pair["draft"])
    twins = mapping.target_to_draft.long()
    fp = first_piece_ids(pair["t_tok"], pair["d_tok"], twins)
    assert bool((fp[twins >= 0] == twins[twins >= 0]).all())
    moved = [y for y in range(len(twins)) if twins[y] < 0 and fp[y] >= 0]
    assert moved, "the tiny pair has twin-less target tokens that the draft spells in pieces"
    for y in moved[:20]:
        text = pair["t_tok"].convert_tokens_to_string([pair["t_tok"].convert_ids_to_tokens(y)])
        assert int(fp[y]) == pair["d_tok"](text, add_special_tokens=False)["input_ids"][0]


def test_aligned_pairs_are_the_draft_positions_whose_context_ends_at_a_target_boundary():
    # text "ab cd": prompt "P" (1 char), answer "ab cd"; draft tokens P|ab| c|d, target tokens P|a|b c|d.
    offsets = [(0, 1), (1, 3), (3, 5), (5, 6)]
    bounds = [0, 1, 4, 5]  # the target's answer ids a | b c | d end at 1, 4, 5 characters of the answer
    trained, aligned = aligned_pairs(offsets, 1, bounds, 1, None, 3)
    assert trained == [0, 1, 2]  # every draft token of the answer is predicted
    # Position 0 (context "P") meets the target's last prompt position; position 1 (context "Pab") falls inside the
    # target's "b c"; position 2 (context "Pab c") meets the target's boundary after "b c" (target position 2).
    assert aligned == {0: 0, 2: 2}


def _reference_ids(pair, examples, budget):
    """The target sequences the dump must score, by hand: the draft answers the target's prompt as the text drafter
    reads it, its text encoded after the target's prompt, the end-of-turn token where it stopped."""
    mapping = build_vocab_mapping(pair["target"], pair["draft"])
    t_prompts = encode_prompts(pair["t_tok"], examples)
    written = generate_from_ids(pair["d_model"], pair["d_tok"], mapping.reencode_batch_for_draft(t_prompts), budget)
    stops = set(answer_stop_ids(pair["d_model"], pair["d_tok"]))
    out = []
    for ex, tp, r in zip(examples, t_prompts, written, strict=True):
        ended = bool(r) and r[-1] in stops
        text, _ = well_formed_prefix(decode_text(pair["d_tok"], r[:-1] if ended else r))
        out.append(tp + encode_answer(pair["t_tok"], render_prompt(pair["t_tok"], ex), text) + ([3] if ended else []))
    return mapping, out


def test_the_dump_holds_the_draft_tokens_the_text_drafter_reads_and_the_targets_carried_scores(pair, tmp_path):
    examples = _examples()
    cfg = AsGivenTeacherConfig(generate=10, dtype="float32", batch_size=4, top_logprobs=5, carry="twins")
    m = run_as_given_teacher(pair["target"], pair["draft"], examples, tmp_path / "d", cfg)
    assert m["tokenizer_fingerprint"] != load_manifest(tmp_path / "d")["teacher"]["rendering"]
    ds = TeacherDataset(tmp_path / "d", draft_tokenizer=pair["d_tok"])  # the draft's own tokenizer passes
    mapping, refs = _reference_ids(pair, examples, 10)
    assert len(ds) == len(refs) and m["signal"]["aligned_positions"] > 0
    carried = 0
    for i, t_ids in enumerate(refs):
        item = ds[i]
        # What MappedDrafter.propose feeds the draft for this context (VocabMapping.reencode_batch_for_draft).
        assert item["input_ids"].tolist() == mapping.reencode_batch_for_draft([t_ids])[0]
        with torch.no_grad():
            logp = pair["t_model"](torch.tensor([t_ids])).logits[0].float().log_softmax(-1)
        for d in item["loss_mask"].nonzero().flatten().tolist():
            ids = item["topk_ids"][d].long()
            finite = torch.isfinite(item["topk_logprobs"][d])
            # The stored draft ids are twins of target tokens; their mass is the target's at one of its positions.
            src = [int((mapping.target_to_draft == x).nonzero()[0]) for x in ids[finite].tolist()]
            matches = [j for j in range(len(t_ids) - 1)
                       if torch.allclose(logp[j, src], item["topk_logprobs"][d][finite], atol=1e-4)]
            assert matches, f"sequence {i} position {d}: the stored label is no target distribution"
            total = float(item["topk_logprobs"][d][finite].exp().sum() + item["leftover_logmass"][d].exp())
            assert math.isclose(total, 1.0, abs_tol=1e-4)
            carried += 1
    assert carried == m["signal"]["trained_positions"] == m["trained_tokens"]


def test_hard_labels_everywhere_need_no_target_scores(pair, tmp_path):
    cfg = AsGivenTeacherConfig(generate=10, dtype="float32", batch_size=4, top_logprobs=2, carry="none")
    m = run_as_given_teacher(pair["target"], pair["draft"], _examples(), tmp_path / "h", cfg)
    ds = TeacherDataset(tmp_path / "h", draft_tokenizer=pair["d_tok"])
    for i in range(len(ds)):
        item = ds[i]
        at = item["loss_mask"].nonzero().flatten()
        assert item["topk_ids"][at, 0].tolist() == item["input_ids"][at + 1].tolist()
        assert bool((item["topk_logprobs"][at, 0] == 0).all()) and bool(torch.isneginf(item["leftover_logmass"][at]).all())
    assert m["signal"]["aligned_positions"] == 0 and m["signal"]["trained_positions"] == m["signal"]["answer_positions"]


def test_a_killed_dump_resumes_to_the_uninterrupted_one_and_refusals_name_what_is_wrong(pair, tmp_path):
    examples = _examples()
    cfg = AsGivenTeacherConfig(generate=6, dtype="float32", batch_size=2, top_logprobs=3, shard_size_mb=0.0001)
    out, calls = tmp_path / "k", []

    def kill_after_two_batches(done, total, tokens):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_as_given_teacher(pair["target"], pair["draft"], examples, out, cfg, progress=kill_after_two_batches)
    m = run_as_given_teacher(pair["target"], pair["draft"], examples, out, cfg)
    assert (m["this_run"]["shards_skipped"], m["this_run"]["shards_written"]) == (2, 1)
    fresh = run_as_given_teacher(pair["target"], pair["draft"], examples, tmp_path / "fresh", cfg)
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in fresh["shards"]]
    with pytest.raises(DumpError, match="settings"):  # another carry rule into the same directory
        run_as_given_teacher(pair["target"], pair["draft"], examples, out, cfg.model_copy(update={"carry": "twins"}))
    with pytest.raises(DumpError, match="has the target's tokenizer"):
        run_as_given_teacher(pair["target"], pair["target"], examples, tmp_path / "same", cfg)
    with pytest.raises(DumpError, match="below the draft's real vocabulary"):
        run_as_given_teacher(pair["target"], pair["draft"], examples, tmp_path / "k2", cfg.model_copy(update={"top_logprobs": 400}))
    with pytest.raises(DumpError, match="no prompts"):
        run_as_given_teacher(pair["target"], pair["draft"], [], tmp_path / "none", cfg)
    assert not (tmp_path / "same").exists() and not (tmp_path / "k2").exists()


def test_a_work_cache_reuses_the_written_answers_and_scores_and_gives_the_same_dump(pair, tmp_path):
    cfg = AsGivenTeacherConfig(generate=8, dtype="float32", batch_size=3, top_logprobs=4)
    a = run_as_given_teacher(pair["target"], pair["draft"], _examples(), tmp_path / "a", cfg, cache=tmp_path / "c")
    answers = json.loads((tmp_path / "c" / "answers-draft-8.json").read_text())
    assert sorted(answers) == sorted(e.id for e in _examples())
    b = run_as_given_teacher(pair["target"], pair["draft"], _examples(), tmp_path / "b", cfg, cache=tmp_path / "c")
    assert b["this_run"]["generated_tokens"] == 0  # nothing written again
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]


def test_run_distill_trains_the_draft_as_given_on_it_and_exports_it_drafting_through_text(pair, tmp_path):
    from specdraft.training.distill import run_distill

    cfg = AsGivenTeacherConfig(generate=10, dtype="float32", batch_size=6, top_logprobs=5)
    run_as_given_teacher(pair["target"], pair["draft"], _examples(), tmp_path / "d", cfg)
    dcfg = DistillConfig(loss="tvd", lr=3e-3, max_steps=3, batch_size=3, held_out_fraction=0.0, save_steps=100,
                         scheduler="constant")
    res = run_distill(pair["target"], pair["draft"], tmp_path / "d", tmp_path / "out", dcfg, num_speculative_tokens=3)
    assert res.metrics.moved_fraction > 0
    losses = [h["loss"] for h in res.training["history"] if "loss" in h]
    assert losses and losses[-1] < losses[0]
    spec = json.loads((res.speculator / "config.json").read_text())
    assert spec["speculators_config"]["proposal_methods"][0]["proposal_type"] == "text"
    assert spec["vocab_size"] == 360  # its own vocabulary, head untouched in shape
    with pytest.raises(DumpError, match="tokenizer"):  # a draft of the target's tokenizer cannot train on it
        run_distill(pair["target"], pair["target"], tmp_path / "d", tmp_path / "out2", dcfg)


def test_dump_for_draft_writes_the_dump_in_the_drafts_ids_and_refuses_what_does_not_apply(pair, tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    base = ["dump", "--for-draft", pair["draft"], "--target", pair["target"], "--prompts", str(prompts),
            "--generate", "4", "--dtype", "float32", "--top-logprobs", "3"]
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "d")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    m = load_manifest(tmp_path / "d")
    assert m["teacher"]["kind"] == "target-for-draft-as-given" and m["top_k"] == 3 and m["config"]["generate"] == 4
    assert "carried from the target" in r.output
    TeacherDataset(tmp_path / "d", draft_tokenizer=pair["d_tok"])  # the draft's tokenizer reads it
    for extra, says in ((["--teacher-format", "hidden"], "--teacher-format do(es) not apply with --for-draft"),
                        (["--self-teacher", pair["draft"]], "two different teachers")):
        r = CliRunner().invoke(app, [*base, *extra, "--out", str(tmp_path / "x")], env={"COLUMNS": "400"})
        assert r.exit_code == 2 and says in r.output, r.output
        assert not (tmp_path / "x").exists()
    r = CliRunner().invoke(app, [*base[:2], pair["target"], *base[3:], "--out", str(tmp_path / "y")],
                           env={"COLUMNS": "400"})
    assert r.exit_code == 2 and "--for-draft" in r.output and not (tmp_path / "y").exists()


def test_the_dump_for_a_draft_as_given_answers_the_rows_run_trains_on_for_one_training_spec(pair, tmp_path):
    """Its answers are greedy, so it reads ``conversations:0:12`` as ``run --train-prompts`` does for a greedy teacher:
    12 distinct prompts (the embedded chats repeat their first questions), the same rows in the same order."""
    from specdraft.run.pipeline import make_config, run_prompts

    spec = "conversations:0:12"
    trains = run_prompts(make_config("tiny", target=pair["target"], draft=pair["draft"], train_prompts=[spec]),
                         ("train",))["train"].examples
    assert len({json.dumps(e.prompt_messages) for e in trains}) == len(trains) == 12
    cfg = AsGivenTeacherConfig(generate=2, dtype="float32", batch_size=6, top_logprobs=3, carry="none", unaligned="hard")
    m = run_as_given_teacher(pair["target"], pair["draft"], spec, tmp_path / "d", cfg)
    # The examples it was made of (its identity's data fingerprint); an answer with no text is dropped, not replaced.
    assert m["identity"]["data_fingerprint"] == sha256_json([[e.id, e.messages, e.reference] for e in trains])
    ds = TeacherDataset(tmp_path / "d", draft_tokenizer=pair["d_tok"])
    kept = [ds.tokens(i)["id"] for i in range(len(ds))]
    assert kept == [e.id for e in trains if e.id in kept] and m["sequences"] + m["dropped"] == 12
    assert m["data"] == spec
