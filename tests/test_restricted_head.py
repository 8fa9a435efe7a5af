"""The restricted head: soft_ce over a support of ids equals the full-head loss with the other rows masked, and
differs from the unmasked full-head loss by exactly the draft's log-mass outside the support."""

from __future__ import annotations

import pytest
import torch

from specdraft.core.config import DistillConfig
from specdraft.core.losses import soft_ce_topk
from specdraft.models.restricted_head import (
    RestrictedHeadError,
    positions_in_support,
    restricted_logits,
    restricted_soft_ce,
    support_ids,
)
from specdraft.testing import tiny_model
from specdraft.training.distill import DistillError
from specdraft.training.distill_trainer import DistillModel, TeacherHead

V = 96


def _batch(seed=0, b=2, s=7, k=3, hard=True):
    """Token ids, a top-k teacher with no tail (hard labels: the next token; else mass on k distinct ids), a mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, s), generator=g)
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    others = (nxt.unsqueeze(-1) + torch.arange(1, k).view(1, 1, -1) * 7) % V  # distinct from the label
    topk_ids = torch.cat([nxt.unsqueeze(-1), others], dim=-1)
    if hard:
        lp = torch.full((b, s, k), float("-inf"))
        lp[..., 0] = 0.0
    else:
        lp = torch.randn(b, s, k, generator=g).log_softmax(-1)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[:, :2] = False  # prompt positions
    mask[:, -1] = False
    return ids, topk_ids, lp, mask


def _support(ids, topk_ids, lp, extra=(5, 6, 40)):
    held = set(ids.flatten().tolist()) | set(topk_ids[lp.isfinite()].tolist()) | set(extra)
    return support_ids(held, width=V)


@pytest.mark.parametrize("hard", [True, False], ids=["hard-labels", "zero-tail-top-k"])
def test_restricted_ce_equals_the_full_head_ce_with_the_rows_outside_the_support_masked(hard):
    model = tiny_model(vocab_size=V, seed=3).float()
    ids, topk_ids, lp, mask = _batch(hard=hard)
    support = _support(ids, topk_ids, lp)
    assert 0 < support.numel() < V  # a real restriction: some rows are outside

    logits_s = restricted_logits(model, support, ids, None)
    ce_s, _ = restricted_soft_ce(logits_s, topk_ids, lp.exp(), support, V, mask)
    loss_s = ce_s[mask].mean()
    grad_s = torch.autograd.grad(loss_s, model.get_output_embeddings().weight)[0]

    full = model(input_ids=ids).logits.float()
    outside = torch.ones(V, dtype=torch.bool)
    outside[support] = False
    masked = full.masked_fill(outside, float("-inf"))
    ce_full = soft_ce_topk(masked, topk_ids, lp.exp(), tail=torch.zeros(mask.shape))
    loss_full = ce_full[mask].mean()
    grad_full = torch.autograd.grad(loss_full, model.get_output_embeddings().weight)[0]

    assert torch.allclose(logits_s, full[..., support], atol=1e-5)
    assert torch.allclose(loss_s, loss_full, atol=1e-5)
    assert torch.allclose(grad_s, grad_full, atol=1e-6)
    assert grad_s[outside].abs().max() == 0  # the masked rows get no gradient
    assert grad_s[support].abs().max() > 0


def test_against_the_unmasked_head_the_restricted_ce_is_lower_by_the_drafts_log_mass_outside_the_support():
    model = tiny_model(vocab_size=V, seed=4).float()
    ids, topk_ids, lp, mask = _batch(seed=1, hard=False)
    support = _support(ids, topk_ids, lp)
    with torch.no_grad():
        full = model(input_ids=ids).logits.float()
        ce_s, tvd_s = restricted_soft_ce(restricted_logits(model, support, ids, None), topk_ids, lp.exp(), support,
                                         V, mask)
    ce_full = soft_ce_topk(full, topk_ids, lp.exp(), tail=torch.zeros(mask.shape))
    log_mass_s = full.log_softmax(-1)[..., support].logsumexp(-1)  # log q(S) < 0
    assert (log_mass_s < 0).all()
    assert torch.allclose(ce_full, ce_s - log_mass_s, atol=1e-5)
    # TVD over q_S: ½ Σ |p − q_S| computed densely on the support.
    q_s = restricted_logits(model, support, ids, None).detach().softmax(-1)
    p_s = torch.zeros_like(q_s).scatter_add_(-1, positions_in_support(topk_ids, support, V), lp.exp())
    assert torch.allclose(tvd_s, 0.5 * (p_s - q_s).abs().sum(-1), atol=1e-5)


def test_the_distill_model_with_a_full_support_scores_what_the_full_head_does():
    """Support = every id: the restricted path (decoder → rows) equals the draft's own forward and the top-k path."""
    ids, topk_ids, lp, mask = _batch(seed=2, hard=True)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask, "topk_ids": topk_ids,
             "topk_logprobs": lp, "leftover_logmass": torch.full(mask.shape, float("-inf"))}
    outs = []
    for support in (None, torch.arange(V)):
        cfg = DistillConfig(loss="soft_ce", head_support=None if support is None else 0)
        m = DistillModel(tiny_model(vocab_size=V, seed=5).float(), TeacherHead(None, V, width=V), cfg, support=support)
        with torch.no_grad():
            outs.append(m(**batch))
    for field in ("loss", "train_acc", "tvd", "alpha"):
        assert torch.allclose(getattr(outs[0], field), getattr(outs[1], field), atol=1e-5), field


def test_mass_outside_the_support_or_a_tail_is_refused_not_trained():
    model = tiny_model(vocab_size=V, seed=6).float()
    ids, topk_ids, lp, mask = _batch(seed=3, hard=False)
    support = support_ids(ids.flatten().tolist(), width=V)  # the soft slots' other ids are missing
    with pytest.raises(RestrictedHeadError, match="outside the restricted head's support"):
        restricted_soft_ce(restricted_logits(model, support, ids, None), topk_ids, lp.exp(), support, V, mask)
    cfg = DistillConfig(loss="soft_ce", head_support=0)
    m = DistillModel(model, TeacherHead(None, V, width=V), cfg, support=torch.arange(V))
    tail = torch.full(mask.shape, -3.0)  # a top-k teacher with mass past its stored ids
    with pytest.raises(DistillError, match="no leftover mass"):
        m(input_ids=ids, loss_mask=mask, topk_ids=topk_ids, topk_logprobs=lp, leftover_logmass=tail)
    with pytest.raises(ValueError, match="head-support restricts soft_ce"):
        DistillConfig(loss="tvd", head_support=0)
    with pytest.raises(RestrictedHeadError, match="outside the head's 96 rows"):
        support_ids([3, 200], width=V)


def test_the_support_is_the_data_plus_the_first_n_of_the_ranking():
    s = support_ids([9, 3, 3], ranked=[50, 3, 7, 8], frequent=2, width=V)
    assert s.tolist() == [3, 9, 50]


def test_held_out_metrics_through_a_restricted_head_are_the_full_heads_and_the_mass_outside_is_logged(tmp_path):
    """Training through a restricted head, the held-out α, TVD and top-1 agreement are the full head's — α is the
    draft's own q(label), not q_S(label) = q(label) / q(S) — and the draft's mass outside the support is logged
    beside them (eval_outside_mass), each equal to its value computed independently from the trained draft."""
    from specdraft.training.distill import train
    from specdraft.training.distill_trainer import TeacherHead

    g = torch.Generator().manual_seed(4)
    rows = []
    for n in (11, 9, 12, 10, 8, 13):
        ids = torch.randint(0, 24, (n,), generator=g)  # a few ids: the support below leaves most of V out
        mask = torch.ones(n, dtype=torch.bool)
        mask[-1] = False
        nxt = torch.cat([ids[1:], ids[:1]])
        rows.append({"input_ids": ids, "loss_mask": mask, "topk_ids": nxt.view(-1, 1),
                     "topk_logprobs": torch.zeros(n, 1), "leftover_logmass": torch.full((n,), float("-inf"))})
    support = support_ids(torch.cat([r["input_ids"] for r in rows]).tolist(), width=V)
    cfg = DistillConfig(loss="soft_ce", head_support=0, lr=5e-3, max_steps=2, batch_size=2, scheduler="constant",
                        save_steps=100)
    res = train(tiny_model(vocab_size=V, seed=5).float(), TeacherHead(None, V, width=V), rows[:4], rows[4:], cfg, tmp_path, support=support)
    draft, held = res.draft, rows[4:]
    with torch.no_grad():
        q = [draft(input_ids=r["input_ids"][None]).logits[0].float().softmax(-1)[r["loss_mask"]] for r in held]
    labels = [r["topk_ids"][r["loss_mask"], 0] for r in held]
    q_label = torch.cat([qi.gather(-1, li[:, None])[:, 0] for qi, li in zip(q, labels)])
    outside = torch.cat([1 - qi[:, support].sum(-1) for qi in q])
    agree = torch.cat([(qi.argmax(-1) == li).float() for qi, li in zip(q, labels)])
    after = res.eval_after
    assert float(outside.mean()) > 0.2  # q_S and q differ here: the test can tell the two α apart
    assert after["eval_alpha"] == pytest.approx(float(q_label.mean()), abs=1e-5)
    assert after["eval_tvd"] == pytest.approx(1 - float(q_label.mean()), abs=1e-5)
    assert after["eval_acc"] == pytest.approx(float(agree.mean()), abs=1e-6)
    assert after["eval_outside_mass"] == pytest.approx(float(outside.mean()), abs=1e-5)
    assert "eval_outside_mass" in res.eval_before
    from specdraft.training.distill import alpha_definition

    assert "eval_outside_mass the draft's mass outside the restricted head's support" in alpha_definition(cfg, "topk")
