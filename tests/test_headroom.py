"""Headroom forecast: the split of 1 − α by hand, and on tiny pairs whose drafts are built to disagree where the
target is sure, where it is unsure, or nowhere (a copy)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from specdraft.core.config import HeadroomConfig, SamplingConfig
from specdraft.measuring.headroom import (
    HeadroomCounts,
    counts_from_positions,
    forecast_headroom,
    position_headroom,
    verdict,
)
from specdraft.testing import patch_everywhere, tiny_model

VOCAB = 64
SURE = 0.3  # a tiny random target is rarely above 0.5; at 0.3 about a quarter of its positions are sure


def test_split_by_hand():
    big = 6.0
    # Position 0: target sure of id 1 (p ≈ 0.99), draft says id 2.  Position 1: target sure, draft agrees exactly.
    # Position 2: target unsure between 0 and 1 (p ≈ 0.55, 0.45), draft picks 1 while the target's argmax is 0.
    t = torch.tensor([[0.0, big, 0.0, 0.0], [big, 0.0, 0.0, 0.0], [1.2, 1.0, -1e4, -1e4]])
    d = torch.tensor([[0.0, 0.0, big, 0.0], [big, 0.0, 0.0, 0.0], [0.0, 1.0, -1e4, -1e4]])
    is_sure, agree, alpha = position_headroom(t, d, sure=0.5)
    assert is_sure.tolist() == [True, True, True]  # max p ≈ 0.55 ≥ 0.5
    is_sure, agree, alpha = position_headroom(t, d, sure=0.6)
    assert is_sure.tolist() == [True, True, False] and agree.tolist() == [False, True, False]
    p, q = t.softmax(-1), d.softmax(-1)
    torch.testing.assert_close(alpha, torch.minimum(p, q).sum(-1).double())
    c = counts_from_positions(is_sure, agree, alpha)
    assert (c.positions, c.sure, c.agree, c.agree_sure) == (3, 2, 1, 1)
    assert c.greedy_learnable == pytest.approx(1 / 3) and c.greedy_uncertain == pytest.approx(1 / 3)
    assert 1 - c.greedy == pytest.approx(c.greedy_learnable + c.greedy_uncertain)
    assert 1 - c.sampled == pytest.approx(c.sampled_learnable + c.sampled_uncertain)
    a = alpha.tolist()
    assert c.sampled_learnable == pytest.approx(((1 - a[0]) + (1 - a[1])) / 3)
    assert c.to_dict()["greedy_ceiling"] == pytest.approx(2 / 3)  # sure positions fixed, the unsure one left as is
    assert (c + c).to_dict()["greedy_learnable"] == pytest.approx(1 / 3) and (c + c).positions == 6
    # The serving filter changes α (top-k 1 makes it argmax agreement), not sureness.
    _, _, a1 = position_headroom(t, d, sure=0.6, serving=SamplingConfig(temperature=1.0, top_k=1))
    assert a1.tolist() == [0.0, 1.0, 0.0]
    assert verdict(c).startswith("distillation can add about +0.33")
    assert verdict(HeadroomCounts(10, 5, 9, 5, 9.0, 5.0)).startswith("little to learn")


class _Built(nn.Module):
    """A draft built from the target's own logits: a copy, except that at the chosen positions (where the target
    is sure, or unsure) the target's top two logits are exchanged, so the draft's argmax is the target's second."""

    def __init__(self, target, where: str):
        super().__init__()
        self.target, self.where = target, where

    def forward(self, **kw):
        logits = self.target(**kw).logits.clone()  # [B, S, V]
        if self.where != "nowhere":
            sure = logits.softmax(-1).max(-1).values >= SURE
            pick = sure if self.where == "sure" else ~sure
            top = logits.topk(2, dim=-1)
            first = torch.gather(logits, -1, top.indices[..., :1])
            second = torch.gather(logits, -1, top.indices[..., 1:])
            swapped = logits.scatter(-1, top.indices[..., :1], second).scatter(-1, top.indices[..., 1:], first)
            logits = torch.where(pick[..., None], swapped, logits)
        return type("Out", (), {"logits": logits})()

    def parameters(self, recurse: bool = True):
        return self.target.parameters(recurse)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", VOCAB, seed=0, layers=2)


def _data(n: int = 6, length: int = 20):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(5, VOCAB, (length + i,), generator=g).tolist() for i in range(n)]
    masks = [[j >= 4 for j in range(len(s) - 1)] + [False] for s in seqs]  # the "reply": positions from 4 on
    return seqs, masks


def _sure_share(target, seqs, masks) -> float:
    n = sure = 0
    with torch.no_grad():
        for s, m in zip(seqs, masks):
            p = target(input_ids=torch.tensor([s])).logits[0].softmax(-1)[torch.tensor(m)]
            n, sure = n + len(p), sure + int((p.max(-1).values >= SURE).sum())
    return sure / n


def test_a_draft_that_disagrees_only_where_the_target_is_sure_has_headroom(target):
    seqs, masks = _data()
    share = _sure_share(target, seqs, masks)
    assert 0.1 < share < 0.9  # both kinds of position occur
    cfg = HeadroomConfig(sure=SURE, batch_size=4)  # batches of 4 with left padding: also checks the alignment
    res = forecast_headroom(target, _Built(target, "sure"), seqs, masks, cfg, real_vocab=VOCAB).to_dict()
    assert res["positions"] == sum(map(sum, masks))
    # Every sure position is a disagreement, every other one an agreement: the gap is all learnable.
    assert res["gain"] == pytest.approx(share) and res["greedy_uncertain"] == 0.0
    assert res["greedy"] == pytest.approx(1 - share) and res["greedy_ceiling"] == pytest.approx(1.0)
    assert res["sampled_learnable"] > 0 and res["sampled_uncertain"] == pytest.approx(0.0, abs=1e-6)
    assert res["gain_ci95"][0] > 0 and res["gain_ci95"][0] <= res["gain"] <= res["gain_ci95"][1]
    assert res["verdict"].startswith(f"distillation can add about +{share:.2f}")
    assert sum(r["positions"] for r in res["per_sequence"]) == res["positions"] and len(res["per_sequence"]) == 6
    json.dumps(res)  # the result is a report: plain JSON


def test_a_copy_of_the_target_has_none(target):
    seqs, masks = _data()
    res = forecast_headroom(target, _Built(target, "nowhere"), seqs, masks, HeadroomConfig(sure=SURE),
                            real_vocab=VOCAB).to_dict()
    assert res["gain"] == 0.0 and res["greedy"] == 1.0 and res["sampled"] == pytest.approx(1.0, abs=1e-5)
    assert res["sampled_learnable"] == pytest.approx(0.0, abs=1e-5)
    assert res["verdict"].startswith("little to learn: the draft already agrees where the target is sure")


def test_disagreeing_only_where_the_target_is_unsure_is_not_headroom(target):
    seqs, masks = _data()
    share = _sure_share(target, seqs, masks)
    res = forecast_headroom(target, _Built(target, "unsure"), seqs, masks, HeadroomConfig(sure=SURE),
                            real_vocab=VOCAB).to_dict()
    assert res["gain"] == 0.0 and res["greedy_uncertain"] == pytest.approx(1 - share)
    assert res["verdict"].startswith("little to learn")


def test_a_real_tiny_draft_splits_its_gap_exactly(target):
    # A separately initialised draft: whatever it gets wrong, learnable + uncertain is exactly its gap.
    seqs, masks = _data()
    draft = tiny_model("llama", VOCAB, seed=3, layers=1)
    res = forecast_headroom(target, draft, seqs, masks, HeadroomConfig(sure=SURE), real_vocab=VOCAB).to_dict()
    assert 1 - res["greedy"] == pytest.approx(res["greedy_learnable"] + res["greedy_uncertain"])
    assert 1 - res["sampled"] == pytest.approx(res["sampled_learnable"] + res["sampled_uncertain"])
    assert res["greedy_learnable"] > 0 and res["greedy_uncertain"] > 0
    with pytest.raises(ValueError, match="mask 0 has length"):
        forecast_headroom(target, draft, seqs[:1], [masks[0][:-1]], real_vocab=VOCAB)
    with pytest.raises(ValueError, match="no masked position"):
        forecast_headroom(target, draft, seqs[:1], [[False] * len(seqs[0])], real_vocab=VOCAB)


# ------------------------------------------------------------------------------------------ the command


def test_a_sequence_past_the_drafts_window_is_refused_before_any_pass():
    """A GPT-2 draft of 16 absolute positions and a 20-token sequence: named with both lengths before a forward
    pass (was an IndexError inside the draft's position table)."""
    target = tiny_model("llama", VOCAB, seed=0, layers=1)
    draft = tiny_model("gpt2", VOCAB, seed=1, layers=1, n_positions=16)
    seqs = [list(range(5, 15)), list(range(5, 25))]
    masks = [[1] * (len(s) - 1) + [0] for s in seqs]
    with pytest.raises(ValueError, match=r"sequence 'long' \(20 tokens\) exceeds the draft's context window \(16\)"
                       ) as err:
        forecast_headroom(target, draft, seqs, masks, names=["short", "long"])
    assert type(err.value).__name__ == "ContextWindowError"
    assert forecast_headroom(target, draft, seqs[:1], masks[:1]).counts.positions == 9  # within the window: scored


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    from specdraft.testing import save_tiny_pair, tiny_words

    root = tmp_path_factory.mktemp("pair")
    tdir, ddir = save_tiny_pair(root, VOCAB)
    words = [w for w in tiny_words(VOCAB - 5) if w.isalpha() and w not in ("user", "assistant")]
    rows = [{"messages": [{"role": "user", "content": " ".join(words[i:i + 4])},
                          {"role": "assistant", "content": " ".join(words[i + 4:i + 12])}]} for i in range(5)]
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["messages"][0]["content"]}) + "\n" for r in rows))
    return {"target": tdir, "draft": ddir, "data": str(data), "prompts": str(prompts)}


def test_headroom_command(saved_pair, tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    out = tmp_path / "h.json"
    r = CliRunner().invoke(app, ["headroom", "--target", saved_pair["target"], "--draft", saved_pair["draft"],
                                 "--prompts", saved_pair["data"], "--sure", "0.3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["sequences"] == 5 and res["positions"] == 5 * 9  # 8 reply words + the end of turn, per sequence
    assert res["verdict"].split(" (")[0] in r.output.replace("\n", " ")
    assert 1 - res["greedy"] == pytest.approx(res["greedy_learnable"] + res["greedy_uncertain"])
    # The target against itself: nothing to learn.
    r = CliRunner().invoke(app, ["headroom", "--target", saved_pair["target"], "--draft", saved_pair["target"],
                                 "--prompts", saved_pair["data"], "--out", str(out), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert "little to learn" in r.output and json.loads(out.read_text())["gain"] == 0.0
    # Prompts without replies: the target answers them with --generate.
    r = CliRunner().invoke(app, ["headroom", "--target", saved_pair["target"], "--draft", saved_pair["draft"],
                                 "--prompts", saved_pair["prompts"], "--generate", "4", "--out", str(out),
                                 "--overwrite"])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["positions"] == 5 * 4  # tiny random targets do not stop early


def test_headroom_command_bad_input_is_one_line_and_exit_2(saved_pair, tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app
    from specdraft.testing import tiny_tokenizer

    base = ["headroom", "--target", saved_pair["target"], "--draft", saved_pair["draft"]]
    r = CliRunner().invoke(app, [*base, "--prompts", saved_pair["data"], "--sure", "0"])
    assert r.exit_code == 2 and "--sure" in r.output
    r = CliRunner().invoke(app, [*base, "--prompts", saved_pair["prompts"]])
    assert r.exit_code == 2 and "--generate N" in r.output
    other = tmp_path / "other"
    tiny_model("llama", VOCAB, seed=4, layers=1).save_pretrained(other)
    tiny_tokenizer(VOCAB, swap=(10, 11)).save_pretrained(other)
    r = CliRunner().invoke(app, ["headroom", "--target", saved_pair["target"], "--draft", str(other),
                                 "--prompts", saved_pair["data"]])
    assert r.exit_code == 2 and "vocab-swap" in r.output


def test_answers_that_cannot_fit_the_drafts_window_are_refused_before_the_target_writes_them(saved_pair, tmp_path,
                                                                                              monkeypatch):
    """--generate N: prompt + N (cut to --max-length) must fit both windows; a draft of 16 positions is named before
    the target answers a prompt (one error line, exit 2), not after every answer is written."""
    import shutil

    from typer.testing import CliRunner

    from specdraft.cli import app

    short = tmp_path / "short-draft"
    shutil.copytree(saved_pair["draft"], short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 16}))
    patch_everywhere(monkeypatch, "specdraft.decoding.responses", "generate_responses", lambda *a, **k: pytest.fail("the target answered"))
    r = CliRunner().invoke(app, ["headroom", "--target", saved_pair["target"], "--draft", str(short),
                                 "--prompts", saved_pair["prompts"], "--generate", "12", "--out", str(tmp_path / "h.json")])
    assert r.exit_code == 2, r.output
    assert re.search(r"sequence '[^']+' \(\d+ tokens\) exceeds the draft's context window \(16\)",
                     " ".join(r.output.split()))
