"""Bootstrap intervals over prompts on hand-made counts whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from specdraft.core.stats import paired_difference_ci, paired_gain_from_rows, ratio_ci, wilson_interval

ACCEPTED = [5, 12, 9, 30, 0, 18]
PROPOSED = [10, 20, 30, 40, 10, 20]


def test_ratio_is_of_summed_counts_not_a_mean_of_ratios():
    est = ratio_ci([1, 0], [1, 99])
    assert est.value == pytest.approx(0.01)  # the mean of the two per-prompt ratios would be 0.5
    assert est.prompts == 2 and est.replicates == 10_000


def test_two_prompts_interval_is_known():
    """Prompts 10/10 and 0/10: a replicate holds prompt A k times, k ~ Binomial(2, ½), ratio k/2 ∈ {0, ½, 1}
    with probabilities ¼, ½, ¼, so the 2.5% and 97.5% quantiles are 0 and 1."""
    est = ratio_ci([10, 0], [10, 10])
    assert est.value == 0.5 and est.interval == [0.0, 1.0]


def test_equal_ratios_and_one_prompt_get_the_wilson_floor_not_a_zero_width_interval():
    """Every replicate of equal per-prompt rates is the same: the bootstrap alone would print certainty."""
    est = ratio_ci([1, 2, 3], [2, 4, 6])
    assert est.value == 0.5 and est.floor == "wilson" and est.interval == list(wilson_interval(6, 12))
    assert 0.25 < est.low < 0.5 < est.high < 0.75
    one = ratio_ci([3], [4])
    assert one.thin and one.floor == "wilson" and one.low < 0.75 < one.high
    every = ratio_ci([10, 10], [10, 10])  # every drafted token accepted
    assert every.value == 1.0 and every.high == 1.0 and every.low == pytest.approx(20 / (20 + 1.959964**2))
    assert ratio_ci([0, 0], [0, 0]).value == 0.0  # nothing proposed: 0, as AcceptanceCounts says
    assert not ratio_ci(ACCEPTED * 2, PROPOSED * 2).thin and ratio_ci(ACCEPTED, PROPOSED).thin  # 12 vs 6 prompts


def test_wilson_interval_matches_its_closed_form_at_the_edges():
    z2 = 1.959963984540054**2
    assert wilson_interval(0, 10) == (0.0, pytest.approx(z2 / (10 + z2)))  # Wilson 1927 at 0/n
    low, high = wilson_interval(10, 10)
    assert high == pytest.approx(1.0) and low == pytest.approx(10 / (10 + z2))
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


def test_interval_width_matches_the_binomial_spread_and_is_deterministic():
    rng = np.random.default_rng(1)
    proposed = np.full(200, 20)
    accepted = rng.binomial(20, 0.7, size=200)
    est = ratio_ci(accepted, proposed, seed=3)
    assert est.low < 0.7 < est.high
    # Independent drafts: standard error sqrt(0.7·0.3 / 4000) ≈ 0.0072, so the 95% width is ≈ 0.028.
    assert 0.022 < est.high - est.low < 0.035
    assert ratio_ci(accepted, proposed, seed=3) == est
    # Prompts that differ more than tokens do (rates drawn per prompt): the bootstrap is wider than the Wilson
    # floor and its seed shows.
    spread = rng.binomial(20, rng.uniform(0.2, 0.9, size=200))
    a, b = ratio_ci(spread, proposed, seed=3), ratio_ci(spread, proposed, seed=4)
    assert a.floor is None and a.interval != b.interval


def test_identical_before_and_after_gain_is_zero_with_newcombes_interval_not_zero_width():
    est = paired_difference_ci(ACCEPTED, PROPOSED, ACCEPTED, PROPOSED)
    assert est.value == 0.0 and est.floor == "newcombe" and est.low < 0 < est.high
    assert est.high == pytest.approx(-est.low)  # the same rate on both sides: symmetric
    spread = paired_difference_ci([5, 9, 2], [10, 10, 10], [6, 9, 4], [10, 10, 10])
    assert spread.floor is None  # the replicates differ: the paired bootstrap's interval stands


def test_constant_shift_is_recovered_exactly():
    """After accepts 0.1 × proposed more drafts on every prompt: every replicate's gain is 0.1, so the interval is
    Newcombe's, around the exact gain."""
    after = [a + p // 10 for a, p in zip(ACCEPTED, PROPOSED)]
    est = paired_difference_ci(ACCEPTED, PROPOSED, after, PROPOSED)
    assert est.value == pytest.approx(0.1)
    assert est.floor == "newcombe" and est.low < 0.1 < est.high


def test_pairing_resolves_a_gain_that_unpaired_intervals_cannot():
    """Prompts differ a lot (rates 0.2–0.9) but each gains a little: the two one-sided intervals overlap,
    the paired interval of the gain lies above 0."""
    rng = np.random.default_rng(0)
    rates = rng.uniform(0.2, 0.9, size=40)
    proposed = np.full(40, 50)
    before = np.round(rates * 50)
    after = np.minimum(before + rng.integers(1, 5, size=40), 50)
    b, a = ratio_ci(before, proposed), ratio_ci(after, proposed)
    assert b.high > a.low  # unpaired: cannot tell
    gain = paired_difference_ci(before, proposed, after, proposed)
    assert gain.low > 0 and gain.value == pytest.approx(a.value - b.value)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="one of each per prompt"):
        ratio_ci([1, 2], [3])
    with pytest.raises(ValueError, match="no prompts"):
        ratio_ci([], [])
    with pytest.raises(ValueError, match="≥ 0"):
        ratio_ci([-1], [3])
    with pytest.raises(ValueError, match="lengths"):
        paired_difference_ci([1], [2], [1, 2], [2, 2])
    with pytest.raises(ValueError, match="level"):
        ratio_ci([1], [2], level=1.0)


def test_paired_gain_from_rows_matches_prompt_ids():
    before = [{"id": f"p{i}", "accepted": a, "proposed": p} for i, (a, p) in enumerate(zip(ACCEPTED, PROPOSED))]
    after = [dict(r, accepted=r["accepted"] + r["proposed"] // 10) for r in reversed(before)]  # other order
    est = paired_gain_from_rows(before, after)
    in_order = paired_difference_ci(ACCEPTED, PROPOSED, [a + p // 10 for a, p in zip(ACCEPTED, PROPOSED)], PROPOSED)
    assert est is not None and est.value == pytest.approx(0.1) and est.interval == pytest.approx(in_order.interval)
    assert paired_gain_from_rows([{"id": "p0", "acceptance_rate": 0.5}], after[:1]) is None  # counts not kept
    with pytest.raises(ValueError, match="not the same prompts"):
        paired_gain_from_rows(before, after[1:])


def test_paired_ratio_ci_is_a_ratio_of_summed_rates():
    from specdraft.core.stats import paired_ratio_ci

    tok_a, sec_a = [64, 64, 30, 64], [8.0, 10.0, 5.0, 9.0]
    tok_b, sec_b = [64, 64, 30, 64], [12.0, 13.0, 6.0, 15.0]
    est = paired_ratio_ci(tok_a, sec_a, tok_b, sec_b, n_boot=2000)
    assert est.value == pytest.approx((222 / 32.0) / (222 / 46.0))  # ratio of Σtokens/Σseconds, not of means
    assert est.low <= est.value <= est.high and est.prompts == 4
    same = paired_ratio_ci(tok_a, sec_a, tok_a, sec_a, n_boot=500)
    assert same.value == pytest.approx(1.0) and same.low == pytest.approx(1.0) and same.high == pytest.approx(1.0)
    with pytest.raises(ValueError, match="one entry per prompt"):
        paired_ratio_ci([1, 2], [1, 1], [1], [1])
