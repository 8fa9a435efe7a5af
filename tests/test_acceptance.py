"""Acceptance accounting and the analytic model."""

from __future__ import annotations

import pytest

from specdraft.core.acceptance import AcceptanceCounts, best_gamma, expected_speedup, expected_tokens_per_pass


def test_rates_from_counts():
    c = AcceptanceCounts(4)
    c.record_round(0)
    assert c.acceptance_rate == 0.0
    c2 = AcceptanceCounts(4)
    c2.record_round(2)
    assert c2.acceptance_rate == 0.5
    rows = AcceptanceCounts(4)
    for n in (0, 2, 4):
        rows.record_round(n)
    assert rows.acceptance_rate == 0.5
    assert rows.accepted_hist == [1, 0, 1, 0, 1]
    # tokens per target pass: (0+1 + 2+1 + 4+1) / 3
    assert rows.mean_accepted_length == pytest.approx(9 / 3)
    # conditional α per position: position 0 reached 3×, accepted 2×; position 2 reached 2× (n=2 stops there)
    assert rows.reached == [3, 2, 2, 1]
    assert rows.alpha_per_position == [2 / 3, 1.0, 0.5, 1.0]


def test_merge_sums_counts_and_rederives():
    a, b = AcceptanceCounts(3), AcceptanceCounts(3)
    a.record_round(3)
    b.record_round(0)
    b.record_round(1)
    m = a.merge(b)
    assert m.rounds == 3 and m.accepted == [2, 1, 1] and m.proposed == [3, 3, 3]
    assert m.acceptance_rate == pytest.approx(4 / 9)
    assert AcceptanceCounts.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError, match="γ"):
        a.merge(AcceptanceCounts(2))


def test_record_round_rejects_impossible_counts():
    with pytest.raises(ValueError):
        AcceptanceCounts(2).record_round(3)


def test_analytic_model_limits_and_best_gamma():
    assert expected_tokens_per_pass(0.0, 5) == 1.0
    assert expected_tokens_per_pass(1.0, 5) == 6.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # Theorem 3.8 at c = 0 equals the tokens per pass; at α = 0 the draft is pure cost.
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx(expected_tokens_per_pass(0.8, 4))
    assert expected_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)
    # The reference point: α ≈ 0.88, c ≈ 0.35 → about 1.64x at γ ≈ 4.
    g, s = best_gamma(0.88, 0.35)
    assert g in (3, 4, 5)
    assert s == pytest.approx(1.64, abs=0.05)
    assert all(expected_speedup(0.88, g, 0.35) >= expected_speedup(0.88, k, 0.35) for k in range(1, 17))


def test_alpha_is_accepted_over_reached():
    c = AcceptanceCounts(4)
    for n in (0, 2, 4):
        c.record_round(n)
    # reached = [3, 2, 2, 1] (a round stops at its first rejection); accepted = [2, 2, 1, 1]
    assert c.alpha == pytest.approx(6 / 8)
    assert c.alpha > c.acceptance_rate  # drafts after a rejection were never tested
    # With geometric rounds of a true α, the estimate recovers it and the analytic tokens/pass matches.
    import random

    rng = random.Random(0)
    g = AcceptanceCounts(5)
    for _ in range(20000):
        n = 0
        while n < 5 and rng.random() < 0.8:
            n += 1
        g.record_round(n)
    assert g.alpha == pytest.approx(0.8, abs=0.01)
    assert g.mean_accepted_length == pytest.approx(expected_tokens_per_pass(0.8, 5), rel=0.02)


def test_acceptance_rate_of_no_proposals_is_undefined_and_prints_as_a_dash():
    """0 proposals give no rate: None (JSON null), shown as "—", never a 0.0 that reads as 'all rejected'."""
    from specdraft.cli import generate_summary

    empty = AcceptanceCounts(3)
    assert empty.acceptance_rate is None
    assert empty.to_dict()["derived"]["acceptance_rate"] is None
    from specdraft.core.acceptance import format_rate

    assert format_rate(empty.acceptance_rate) == "—" and format_rate(0.25) == "0.250"
    assert "(acceptance rate —)" in generate_summary(empty, 8, True)
    rejected = AcceptanceCounts(3)
    rejected.record_round(0)
    assert rejected.acceptance_rate == 0.0  # proposed and all rejected is a real 0
