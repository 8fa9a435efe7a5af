"""Bootstrap intervals over prompts on hand-made counts whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from specdraft.stats import paired_difference_ci, paired_gain_from_rows, ratio_ci

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


def test_equal_ratios_give_a_zero_width_interval_and_one_prompt_says_nothing():
    est = ratio_ci([1, 2, 3], [2, 4, 6])
    assert est.interval == [0.5, 0.5]
    assert ratio_ci([3], [4]).interval == [0.75, 0.75]
    assert ratio_ci([0, 0], [0, 0]).value == 0.0  # nothing proposed: 0, as AcceptanceCounts says


def test_interval_width_matches_the_binomial_spread_and_is_deterministic():
    rng = np.random.default_rng(1)
    proposed = np.full(200, 20)
    accepted = rng.binomial(20, 0.7, size=200)
    est = ratio_ci(accepted, proposed, seed=3)
    assert est.low < 0.7 < est.high
    # Independent drafts: standard error sqrt(0.7·0.3 / 4000) ≈ 0.0072, so the 95% width is ≈ 0.028.
    assert 0.022 < est.high - est.low < 0.035
    assert ratio_ci(accepted, proposed, seed=3) == est
    assert ratio_ci(accepted, proposed, seed=4).interval != est.interval


def test_identical_before_and_after_gain_is_zero_with_interval_zero():
    est = paired_difference_ci(ACCEPTED, PROPOSED, ACCEPTED, PROPOSED)
    assert est.value == 0.0 and est.interval == [0.0, 0.0]


def test_constant_shift_is_recovered_exactly():
    """After accepts 0.1 × proposed more drafts on every prompt: every replicate's gain is 0.1."""
    after = [a + p // 10 for a, p in zip(ACCEPTED, PROPOSED)]
    est = paired_difference_ci(ACCEPTED, PROPOSED, after, PROPOSED)
    assert est.value == pytest.approx(0.1)
    assert est.low == pytest.approx(0.1) and est.high == pytest.approx(0.1)


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
    assert est is not None and est.interval == pytest.approx([0.1, 0.1])
    assert paired_gain_from_rows([{"id": "p0", "acceptance_rate": 0.5}], after[:1]) is None  # counts not kept
    with pytest.raises(ValueError, match="not the same prompts"):
        paired_gain_from_rows(before, after[1:])


def test_paired_ratio_ci_is_a_ratio_of_summed_rates():
    from specdraft.stats import paired_ratio_ci

    tok_a, sec_a = [64, 64, 30, 64], [8.0, 10.0, 5.0, 9.0]
    tok_b, sec_b = [64, 64, 30, 64], [12.0, 13.0, 6.0, 15.0]
    est = paired_ratio_ci(tok_a, sec_a, tok_b, sec_b, n_boot=2000)
    assert est.value == pytest.approx((222 / 32.0) / (222 / 46.0))  # ratio of Σtokens/Σseconds, not of means
    assert est.low <= est.value <= est.high and est.prompts == 4
    same = paired_ratio_ci(tok_a, sec_a, tok_a, sec_a, n_boot=500)
    assert same.value == pytest.approx(1.0) and same.low == pytest.approx(1.0) and same.high == pytest.approx(1.0)
    with pytest.raises(ValueError, match="one entry per prompt"):
        paired_ratio_ci([1, 2], [1, 1], [1], [1])
