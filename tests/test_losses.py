"""The serving filter and the losses against direct references."""

from __future__ import annotations

import pytest
import torch

from specdraft.core.losses import LOSSES, masked_mean, soft_ce, sum_min, tvd, tvd_deploy
from specdraft.core.sampling import filter_logits, filtered_probs


def reference_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Full-sort reference, one row at a time, written straight from the definition."""
    out = []
    for row in logits.reshape(-1, logits.shape[-1]).float() / temperature:
        order = torch.argsort(row, descending=True)
        keep = torch.zeros_like(row, dtype=torch.bool)
        if top_k > 0:
            kth = row[order[min(top_k, len(row)) - 1]]
            keep |= row >= kth
        else:
            keep[:] = True
        probs = torch.where(keep, row, torch.tensor(float("-inf"))).softmax(-1)
        if top_p < 1:
            mass = 0.0
            nucleus = torch.zeros_like(keep)
            for i in order.tolist():
                if not keep[i]:
                    continue
                if mass < top_p:
                    nucleus[i] = True
                mass += probs[i].item()
            keep &= nucleus
        out.append(torch.where(keep, row, torch.tensor(float("-inf"))))
    return torch.stack(out).reshape(logits.shape)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8), (1.3, 10, 0.9),
                                                      (0.5, 3, 0.5), (1.0, 1, 0.8)])
def test_filter_matches_reference(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=g) * 3
    got = filter_logits(logits, temperature, top_k, top_p)
    want = reference_filter(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1))
    probs = filtered_probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4))
    # The argmax is always kept.
    assert bool((probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all())


def test_filter_edge_cases():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    # top_k = 1 with top_p = 0.8: only the argmax survives.
    p = filtered_probs(logits, 1.0, 1, 0.8)
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    # top_k = 0, top_p = 1: plain softmax.
    torch.testing.assert_close(filtered_probs(logits, 1.0, 0, 1.0), logits.softmax(-1))
    # Ties at the k-th value are all kept (threshold semantics).
    tied = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    p = filtered_probs(tied, 1.0, 2, 1.0)
    assert (p > 0).tolist() == [[True, True, True, True, False]]
    # top_p small keeps only the argmax.
    assert (filtered_probs(logits, 1.0, 0, 1e-6) > 0).sum().item() == 1
    for bad in ({"temperature": 0.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            filter_logits(logits, **{"temperature": 1.0, **bad})


def test_topk_path_equals_full_sort_path_without_ties():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 7, 300, generator=g) * 2
    for k in (5, 20, 299):
        fast = filter_logits(logits, 0.9, k, 0.85)
        full = reference_filter(logits, 0.9, k, 0.85)
        torch.testing.assert_close(fast.softmax(-1), full.softmax(-1))


def test_tvd_and_soft_ce_references():
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]])
    same = torch.log(torch.tensor([[[0.5, 0.5, 1e-30, 1e-30]]]))
    disjoint = torch.log(torch.tensor([[[1e-30, 1e-30, 0.5, 0.5]]]))
    assert tvd(same, p).item() == pytest.approx(0.0, abs=1e-6)
    assert tvd(disjoint, p).item() == pytest.approx(1.0, abs=1e-6)
    q_logits = torch.tensor([[[1.0, 0.0, -1.0, 2.0]]])
    q = q_logits.softmax(-1)
    assert soft_ce(q_logits, p).item() == pytest.approx(-(p * q.log()).sum().item(), rel=1e-6)
    assert 1 - tvd(q_logits, p).item() == pytest.approx(sum_min(p, q).item(), rel=1e-6)


def test_tvd_deploy_is_one_minus_filtered_overlap():
    g = torch.Generator().manual_seed(2)
    t_logits, d_logits = torch.randn(2, 3, 40, generator=g), torch.randn(2, 3, 40, generator=g)
    kw = {"temperature": 0.8, "top_k": 7, "top_p": 0.9}
    got = tvd_deploy(d_logits, None, teacher_logits=t_logits, **kw)
    overlap = sum_min(filtered_probs(t_logits, **kw), filtered_probs(d_logits, **kw))
    torch.testing.assert_close(got, 1 - overlap)
    assert set(LOSSES) == {"soft_ce", "tvd", "tvd_deploy", "ce", "nla", "lk_hybrid"}


def test_masked_mean_ignores_padding_and_nan():
    vals = torch.tensor([[1.0, 3.0, float("nan")], [2.0, float("inf"), 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = masked_mean(vals, mask)
    assert out.item() == pytest.approx(2.0)
    out.backward()
    assert torch.isfinite(vals.grad).all()


def test_sparse_tvd_deploy_equals_dense_path_and_its_gradient():
    from specdraft.core import losses

    g = torch.Generator().manual_seed(3)
    t_logits = torch.randn(2, 5, 300, generator=g) * 2
    d_logits = (t_logits + torch.randn(2, 5, 300, generator=g)).requires_grad_(True)
    kw = {"temperature": 0.9, "top_k": 20, "top_p": 0.9}
    sparse = tvd_deploy(d_logits, None, teacher_logits=t_logits, **kw)
    (g_sparse,) = torch.autograd.grad(sparse.sum(), d_logits)
    q = filtered_probs(d_logits, **kw)
    dense = 0.5 * (filtered_probs(t_logits, **kw) - q).abs().sum(-1)
    (g_dense,) = torch.autograd.grad(dense.sum(), d_logits)
    assert 0.05 < float(dense.mean().detach()) < 0.95  # overlapping but different supports
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_sparse, g_dense, atol=1e-5, rtol=1e-5)
    # A tie at the k-th value outside the top-k: the sparse path steps aside and the dense one answers.
    tied = t_logits.clone()
    kth = torch.topk(tied[0, 0], 20).values[-1]
    tied[0, 0, torch.topk(tied[0, 0], 21).indices[-1]] = kth
    assert losses._tvd_deploy_sparse(d_logits, tied, 1.0, 20, 1.0) is None
    torch.testing.assert_close(tvd_deploy(d_logits, None, teacher_logits=tied, temperature=1.0, top_k=20),
                               0.5 * (filtered_probs(tied, 1.0, 20) - filtered_probs(d_logits, 1.0, 20)).abs().sum(-1))


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(2, 60),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 70),
    top_p=st.floats(0.01, 1.0),
    scale=st.sampled_from([0.1, 1.0, 10.0]),
)
def test_filter_properties(seed, vocab, temperature, top_k, top_p, scale):
    """For any logits and settings: sums to 1, keeps the argmax, support ⊆ top-k, equals the reference."""
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    probs = filtered_probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert bool((probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all())
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[:, -1:]
        assert bool(((probs > 0) <= (logits >= kth)).all())
    torch.testing.assert_close(probs, reference_filter(logits, temperature, top_k, top_p).softmax(-1))


def test_every_loss_name_has_one_implementation():
    from typing import get_args

    from specdraft.core.config import LossName

    assert set(LOSSES) == set(get_args(LossName))  # the CLI's --loss choices and the table agree


def _float64_nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Vectorised full-sort reference in float64: kept ids as a bool mask."""
    x = logits.double() / temperature
    order = torch.argsort(x, dim=-1, descending=True)
    probs = x.softmax(-1).gather(-1, order)
    kept_sorted = (probs.cumsum(-1) - probs) < top_p
    return torch.zeros_like(kept_sorted).scatter(-1, order, kept_sorted)


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
def test_full_vocab_top_p_without_sort_matches_definition(scale, monkeypatch):
    # Flat rows (scale 0.3) keep most of the vocabulary: the top-K candidates do not reach top_p and the filter must
    # widen (K 16 → 128 → … → V); peaked rows (12) keep a few ids. Both must be the definition's nucleus exactly.
    from specdraft.core import sampling

    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 16)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3000, generator=g) * scale
    got = torch.isfinite(filter_logits(logits, 0.7, 0, 0.95))
    want = _float64_nucleus(logits, 0.7, 0.95)
    assert torch.equal(got, want)
    kept = got.sum(-1)
    assert bool((kept < 3000).all()) and bool((kept >= 1).all())
    if scale < 1:
        assert int(kept.min()) > 16 * 8  # the widening path was taken


def test_sample_follows_probs_and_never_draws_zero_mass():
    from specdraft.core.sampling import sample

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(40_000, 1)
    g = torch.Generator().manual_seed(4)
    draws = sample(probs * 3.0, g)  # rows need not sum to 1
    assert draws.shape == (40_000,) and draws.dtype == torch.int64
    freq = torch.bincount(draws, minlength=6).double() / len(draws)
    assert freq[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    sd = (probs[0] * (1 - probs[0]) / len(draws)).sqrt()
    assert bool(((freq - probs[0].double()).abs() <= 4 * sd + 1e-12).all()), freq
    # Reproducible from a seed; a one-hot row always gives its id.
    assert torch.equal(sample(probs[:5], torch.Generator().manual_seed(9)), sample(probs[:5], torch.Generator().manual_seed(9)))
    assert sample(torch.tensor([[0.0, 0.0, 1.0]])).item() == 2


def test_ce_nla_and_lk_hybrid_equal_hand_computed_values():
    # p = (0.6, 0.4, 0, 0), q = (0.1, 0.2, 0.3, 0.4): α = 0.1 + 0.2 = 0.3, TV = 0.7,
    # KL(p‖q) = 0.6 ln 6 + 0.4 ln 2 = 1.352314, λ = exp(−0.9) = 0.406570.
    p = torch.tensor([[[0.6, 0.4, 0.0, 0.0]]])
    q_logits = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]]).log()
    assert LOSSES["ce"](q_logits, p).item() == pytest.approx(2.302585, rel=1e-5)  # −ln q(argmax p) = −ln 0.1
    assert LOSSES["nla"](q_logits, p).item() == pytest.approx(1.203973, rel=1e-5)  # −ln 0.3
    assert LOSSES["lk_hybrid"](q_logits, p).item() == pytest.approx(0.965213, rel=1e-5)  # λ·1.352314 + (1 − λ)·0.7


def test_nla_gradient_is_tvds_scaled_by_one_over_alpha():
    # d(−log α) = −dα / α and d(TVD) = −dα: at low overlap nla's gradient is TVD's times 1/α (it does not vanish).
    g = torch.Generator().manual_seed(3)
    p = torch.randn(1, 2, 12, generator=g).mul(4).softmax(-1)
    logits = torch.randn(1, 2, 12, generator=g).mul(4)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    LOSSES["nla"](a, p).sum().backward()
    LOSSES["tvd"](b, p).sum().backward()
    alpha = sum_min(p, logits.softmax(-1))  # [1, 2]
    torch.testing.assert_close(a.grad, b.grad / alpha[..., None], rtol=1e-4, atol=1e-7)


def test_lk_hybrid_is_kl_at_zero_overlap_and_tvd_at_full_overlap():
    p = torch.tensor([[[1.0, 0.0, 0.0]]])
    far = torch.tensor([[[-30.0, 0.0, 0.0]]])  # α ≈ 0 → λ ≈ 1: forward KL = −log q(0)
    assert LOSSES["lk_hybrid"](far, p).item() == pytest.approx(-far.log_softmax(-1)[0, 0, 0].item(), rel=1e-4)
    near = torch.tensor([[[30.0, 0.0, 0.0]]])  # α ≈ 1: both terms ≈ 0
    assert LOSSES["lk_hybrid"](near, p).item() == pytest.approx(0.0, abs=1e-6)


def _topk_teacher(k: int, tail: bool, seed: int = 5, shape=(2, 5), width: int = 50, real: int = 45):
    """A teacher over ``real`` ids of a ``width``-wide vocabulary (padding rows past it), and its top-k signal as a
    dump stores it: ``(p [..., width], ids, probs [..., k], leftover_logmass [...])``. Without ``tail`` the teacher
    puts all its mass on k ids."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, width, generator=g) * 2
    logits[..., real:] = float("-inf")
    if not tail:
        keep = torch.topk(logits, k).indices
        logits = torch.full_like(logits, float("-inf")).scatter(-1, keep, logits.gather(-1, keep))
    p = logits.softmax(-1)
    probs, ids = torch.topk(p, k)
    if not tail:  # a dump stores −inf where nothing is left (not the rounding of 1 − Σ p_k)
        return p, ids, probs, torch.full(shape, float("-inf"))
    return p, ids, probs, (1 - probs.sum(-1)).log()


def _draft_logits(seed: int = 6, shape=(2, 5), width: int = 50, real: int = 45) -> torch.Tensor:
    x = torch.randn(*shape, width, generator=torch.Generator().manual_seed(seed)) * 2
    x[..., real:] = float("-inf")  # padding rows, as align_logits leaves them
    return x.requires_grad_(True)


@pytest.mark.parametrize("name", ["soft_ce", "tvd"])
def test_sparse_teacher_loss_equals_dense_where_the_teacher_mass_is_all_in_its_top_k(name):
    from specdraft.core.losses import TOPK_LOSSES

    p, ids, probs, leftover = _topk_teacher(k=8, tail=False)
    assert torch.isinf(leftover).all() and float(p.gather(-1, ids).sum(-1).min()) > 1 - 1e-6
    d = _draft_logits()
    sparse = TOPK_LOSSES[name](d, ids, probs, tail=leftover.exp(), real_vocab=45)
    (g_sparse,) = torch.autograd.grad(sparse.sum(), d)
    dense = LOSSES[name](d, p)
    (g_dense,) = torch.autograd.grad(dense.sum(), d)
    assert float(dense.detach().min()) > 0.05  # the draft is far from the teacher: the comparison is not of zeros
    torch.testing.assert_close(sparse, dense)
    torch.testing.assert_close(g_sparse, g_dense)
    assert torch.isfinite(g_sparse).all()


def test_sparse_soft_ce_equals_the_dense_completion_at_any_tail():
    from specdraft.core.losses import soft_ce_topk
    from specdraft.models.dump_reader import teacher_probs_from_topk

    _p, ids, probs, leftover = _topk_teacher(k=8, tail=True)
    assert float(leftover.exp().min()) > 0.05  # a real tail
    d = _draft_logits()
    dense_p = teacher_probs_from_topk(probs.log(), ids, leftover, 50, 45)
    sparse = soft_ce_topk(d, ids, probs, tail=leftover.exp(), real_vocab=45)
    (g_sparse,) = torch.autograd.grad(sparse.sum(), d)
    dense = soft_ce(d, dense_p)
    (g_dense,) = torch.autograd.grad(dense.sum(), d)
    torch.testing.assert_close(sparse, dense)
    torch.testing.assert_close(g_sparse, g_dense)


def test_sparse_tvd_is_an_upper_bound_within_the_tail():
    """0 ≤ tvd_topk − TVD(p, q) ≤ min(tail, 1 − Σ_K q) ≤ tail, for the true teacher and the uniform completion."""
    from specdraft.core.losses import tvd_topk
    from specdraft.models.dump_reader import teacher_probs_from_topk

    p_true, ids, probs, leftover = _topk_teacher(k=8, tail=True)
    tail = leftover.exp()
    d = _draft_logits()
    with torch.no_grad():
        sparse = tvd_topk(d, ids, probs, tail=tail, real_vocab=45)
        q_out = 1 - d.softmax(-1).gather(-1, ids).sum(-1)
        for p in (p_true, teacher_probs_from_topk(probs.log(), ids, leftover, 50, 45)):
            gap = sparse - tvd(d, p)
            assert float(gap.min()) >= -1e-6
            assert bool((gap <= torch.minimum(tail, q_out) + 1e-6).all())
            assert float(gap.max()) > 1e-3  # the bound is not met with equality everywhere: the tail is not exact
    assert bool((sparse <= 1 + 1e-6).all())
