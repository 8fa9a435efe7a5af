"""The speed model (measured t(k) and d) and the adaptive γ policy: outputs stay the target's, a hopeless draft
drafts little, a good one drafts γ."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdraft.core.acceptance import expected_speedup
from specdraft.core.config import SamplingConfig
from specdraft.core.stats import chi2_goodness_of_fit
from specdraft.decoding.calibration import measure_speed_model
from specdraft.decoding.decode import speculative_generate, target_generate, verify_sampled
from specdraft.decoding.speed import AdaptiveGamma, SpeedModel
from specdraft.models.tokens import left_pad
from specdraft.testing import exact_two_token_law, perturbed, tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32]]


def test_flat_target_costs_reduce_to_leviathans_theorem():
    speed = SpeedModel(target_s=[0.1] * 9, draft_s=0.03)
    assert speed.cost_ratio == pytest.approx(0.3)
    for alpha in (0.2, 0.7, 0.95):
        for k in range(9):
            assert speed.speedup(alpha, k) == pytest.approx(expected_speedup(alpha, k, 0.3))
    assert speed.speedup(0.5, 0) == 1.0


def test_best_gamma_counts_the_cost_of_verifying_more_tokens():
    flat = SpeedModel(target_s=[0.1] * 9, draft_s=0.01)
    rising = SpeedModel(target_s=[0.1 * (1 + 0.15 * k) for k in range(9)], draft_s=0.01)
    # Wider verification passes cost more, so the best γ is shorter and the predicted gain smaller.
    assert rising.best_gamma(0.8)[0] < flat.best_gamma(0.8)[0]
    assert rising.best_gamma(0.8)[1] < flat.best_gamma(0.8)[1]
    # No k gains when the draft is expensive and rarely right: draft nothing.
    assert SpeedModel(target_s=[0.1] * 9, draft_s=0.05).best_gamma(0.3) == (0, 1.0)
    with pytest.raises(ValueError, match="k must be"):
        flat.round_seconds(9)


def test_prediction_includes_prefill():
    speed = SpeedModel(target_s=[0.1] * 9, draft_s=0.02, target_prefill_s=1.0, draft_prefill_s=0.5)
    steady = speed.speedup(0.8, 4)
    # With no tokens, only prefill counts (the draft's prefill makes it slower); with many, the steady state.
    assert speed.predict(0.8, 4, new_tokens=0) == pytest.approx(1.0 / 1.5)
    assert speed.predict(0.8, 4, new_tokens=1e7) == pytest.approx(steady, rel=1e-4)
    assert SpeedModel.from_dict(speed.to_dict()) == speed


def test_adaptive_policy_backs_off_a_hopeless_row_and_keeps_a_good_one():
    speed = SpeedModel(target_s=[0.1] * 7, draft_s=0.01)
    policy = AdaptiveGamma(speed, gamma=5, batch=2, prior_alpha=0.8)
    assert policy.plan() == [5, 5]
    drafted = [0, 0]
    for _ in range(200):
        ks = policy.plan()
        for j, k in enumerate(ks):
            drafted[j] += k
            # Row 0 always accepts everything, row 1 nothing.
            policy.record(j, k, k if j == 0 else 0)
    assert policy.plan()[0] == 5 and drafted[0] == 5 * 200
    # Row 1 stops drafting after a few rounds and only probes, ever more rarely (wait doubles up to 32).
    assert drafted[1] < 5 * 3 + 12 and policy.wait[1] == 32
    policy.select([1])
    assert len(policy.a) == 1 and policy.wait == [32]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("qwen2", 128, seed=0, layers=3)
    return target, perturbed(target, 0.04)


def test_measured_speed_model_has_a_cost_per_width(pair):
    target, draft = pair
    speed = measure_speed_model(target, draft, PROMPTS[2], max_gamma=3, repeats=1)
    assert len(speed.target_s) == 4 and all(t > 0 for t in speed.target_s)
    assert speed.draft_s > 0 and speed.target_prefill_s > 0 and speed.context == len(PROMPTS[2])


@pytest.mark.parametrize("draft_cost", [0.001, 0.05], ids=["cheap-draft", "costly-draft"])
def test_adaptive_gamma_greedy_equals_target_only_batched_and_solo(pair, draft_cost):
    target, draft = pair
    speed = SpeedModel(target_s=[0.01] * 6, draft_s=draft_cost)
    ids, mask = left_pad(PROMPTS, 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=25, eos_token_id=[])
    spec, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=5, max_new_tokens=25,
                                        eos_token_id=[], speed_model=speed)
    assert spec == base
    for i, p in enumerate(PROMPTS):
        solo, _ = speculative_generate(target, draft, *left_pad([p], 0), num_speculative_tokens=5, max_new_tokens=25,
                                       eos_token_id=[], speed_model=speed)
        assert solo[0] == base[i]
    assert counts.emitted == 25 * len(PROMPTS)


def test_hopeless_draft_ends_up_drafting_little_and_stays_lossless():
    target = tiny_model("llama", 128, seed=0, layers=3)
    hopeless = tiny_model("llama", 128, seed=99, layers=1)  # unrelated: acceptance near 1/128
    speed = SpeedModel(target_s=[0.01] * 6, draft_s=0.004)  # c = 0.4 (the embedded pair's bf16 figure)
    ids, mask = left_pad([PROMPTS[0]], 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=120, eos_token_id=[])
    fixed, fc = speculative_generate(target, hopeless, ids, mask, num_speculative_tokens=5, max_new_tokens=120,
                                     eos_token_id=[])
    adaptive, ac = speculative_generate(target, hopeless, ids, mask, num_speculative_tokens=5, max_new_tokens=120,
                                        eos_token_id=[], speed_model=speed)
    assert adaptive == fixed == base
    # Fixed γ drafts 5 per round; the adaptive row stops after a few rounds and only probes now and then.
    assert sum(fc.proposed) > 4 * fc.rounds
    assert sum(ac.proposed) < 0.2 * ac.rounds and ac.draft_calls < 0.3 * fc.draft_calls


def test_verify_sampled_with_fewer_proposals_per_row_is_exact():
    """Rows that proposed n_b < γ drafts: the first emitted token still follows p_1 exactly, whatever q is."""
    V, B, gamma = 6, 24000, 3
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)[None].expand(B, -1, -1)
    q = torch.softmax(torch.randn(gamma, V, generator=g) * 1.5, -1)[None].expand(B, -1, -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, gamma)
    n_prop = torch.arange(B) % (gamma + 1)  # 0, 1, 2, 3 proposals in turn
    n, nxt = verify_sampled(drafts, q, p, g, n_prop)
    assert (n <= n_prop).all()
    first = torch.where(n > 0, drafts[:, 0], nxt)
    law = p[0, 0].double().numpy()
    for k in range(gamma + 1):
        rows = n_prop == k
        pvalue, outside = chi2_goodness_of_fit([[t] for t in first[rows].tolist()], law / law.sum())
        assert outside == 0 and pvalue > 1e-3, f"{k} proposals: p={pvalue:.2e}"
    # A row that proposed nothing emits the target's own sample, as the target alone would.
    assert (n[n_prop == 0] == 0).all()


def test_adaptive_sampled_output_follows_target_law():
    V, N = 12, 6000
    sampling = SamplingConfig(temperature=1.0)
    target = tiny_model("llama", V + 5, seed=0, layers=2, hidden=16)
    draft = perturbed(target, 0.08, seed=5)
    law = exact_two_token_law(target, [5, 6, 7], sampling)
    speed = SpeedModel(target_s=[0.01] * 4, draft_s=0.002)
    out, _ = speculative_generate(target, draft, torch.tensor([[5, 6, 7]] * N), None, num_speculative_tokens=3,
                                  sampling=sampling, max_new_tokens=2, eos_token_id=[],
                                  generator=torch.Generator().manual_seed(11), speed_model=speed)
    pvalue, outside = chi2_goodness_of_fit(out, law)
    assert outside == 0 and pvalue > 1e-3 and np.isfinite(pvalue)


def test_target_costs_are_the_line_through_the_timings():
    # A pass costs a fixed part plus a part per token; one noisy timing (t(1) here) must not set the baseline alone.
    timings = {k: 0.140 + 0.002 * k for k in range(1, 10)} | {1: 0.155}
    speed = SpeedModel.from_measurements(timings, 0.016, context=190)
    assert speed.target_s_measured[0] == 0.155 and len(speed.target_s) == 9
    slope = speed.target_s[1] - speed.target_s[0]
    assert all(abs((b - a) - slope) < 1e-12 for a, b in zip(speed.target_s, speed.target_s[1:]))
    assert 0.0 < slope < 0.002 and abs(speed.target_s[0] - 0.142) < (0.155 - 0.142) / 2  # pulled to the line
    # A falling line (noise) is clipped to a flat one: verifying more tokens never costs less.
    flat = SpeedModel.from_measurements({1: 0.15, 2: 0.14, 3: 0.13}, 0.01)
    assert flat.target_s == [0.14, 0.14, 0.14]
    assert SpeedModel.from_dict(speed.to_dict()) == speed


def test_llama_cpp_speed_model_from_llama_bench_prices_a_compute_bound_verification():
    from specdraft.decoding.llama_cpp_price import (
        llama_bench_speed_model,
        llama_cpp_command,
        llama_cpp_engine,
        llama_cpp_plan,
    )

    # The embedded pair's Q4_K_M GGUFs on a 2-core machine: tg 11.65 / 26.0 tok/s, pp4 32.0, pp8 34.7.
    target = [{"n_prompt": 0, "n_gen": 32, "avg_ts": 11.65}, {"n_prompt": 4, "n_gen": 0, "avg_ts": 32.0},
              {"n_prompt": 8, "n_gen": 0, "avg_ts": 34.7}]
    draft = [{"n_prompt": 0, "n_gen": 32, "avg_ts": 26.0}]
    speed = llama_bench_speed_model(target, draft)
    assert speed.draft_s == pytest.approx(1 / 26.0) and speed.max_gamma == 7
    assert speed.target_s_measured[3] == pytest.approx(4 / 32.0) and speed.target_s_measured[7] == pytest.approx(8 / 34.7)
    assert speed.cost_ratio == pytest.approx((1 / 26.0) / speed.target_s[0])
    plan = llama_cpp_plan(speed, 0.95)
    # By hand: S(α, n) = E(α, n) t(1) / (n d + t(n+1)) on the fitted line; the best n is where it peaks.
    by_hand = {n: (1 - 0.95 ** (n + 1)) / 0.05 * speed.target_s[0] / (n * speed.draft_s + speed.target_s[n])
               for n in range(8)}
    assert plan.n_max == max(by_hand, key=by_hand.get) and plan.predicted_speedup == pytest.approx(by_hand[plan.n_max])
    assert plan.by_n[0] == pytest.approx(1.0)
    # A costly verification and a poor draft: drafting cannot win, the command serves the target alone.
    assert llama_cpp_plan(speed, 0.3).n_max == 0
    assert llama_cpp_command("t.gguf", "d.gguf", 0) == f"llama-completion -m t.gguf -t 2 # for {llama_cpp_engine()}"
    assert "-md d.gguf --spec-draft-n-max 3" in llama_cpp_command("t.gguf", "d.gguf", 3, server=True)
    # A plain -md draft drafts only with an explicit --spec-type (llama.cpp infers one for MTP/DFlash GGUFs only).
    assert "--spec-type draft-simple" in llama_cpp_command("t.gguf", "d.gguf", 3, server=True)
    with pytest.raises(ValueError, match="pp test"):
        llama_bench_speed_model(target[:1], draft)
    with pytest.raises(ValueError, match="no tg test"):
        llama_bench_speed_model(target, [])


def llama_bench_json(tg_ts: float, pp: dict[int, float] | None = None) -> list[dict]:
    """Made-up ``llama-bench -o json`` tests: one tg test at ``tg_ts`` tokens/s, a pp test per ``{width: seconds}``."""
    return [{"n_prompt": 0, "n_gen": 32, "avg_ts": tg_ts}] + [
        {"n_prompt": k, "n_gen": 0, "avg_ts": k / s} for k, s in (pp or {}).items()]


def test_rank_llama_cpp_lets_a_cheaper_draft_with_a_lower_alpha_win():
    """llama.cpp's CPU verification is compute-bound (t(k) grows with k): the draft step weighs as much as α. A 10x
    cheaper draft at α 0.75 beats one at α 0.9, each at its own --spec-draft-n-max."""
    from specdraft.decoding.llama_cpp_price import rank_llama_cpp

    t = {k: 0.1 + 0.02 * (k - 1) for k in range(2, 6)}  # exactly a line: the fit is the measurement
    target = llama_bench_json(10.0, t)  # t(1) = 100 ms
    drafts = {"big": llama_bench_json(20.0), "small": llama_bench_json(200.0), "poor": llama_bench_json(20.0)}
    rows = rank_llama_cpp({"big": 0.9, "small": 0.75, "poor": 0.2}, target, drafts)
    assert [r.draft for r in rows] == ["small", "big", "poor"]
    by = {r.draft: r for r in rows}

    def by_hand(alpha: float, d: float, n: int) -> float:  # S = E(α, n) t(1) / (n d + t(n+1)), t(1) = 0.1
        return (1 - alpha ** (n + 1)) / (1 - alpha) * 0.1 / (n * d + (0.1 if n == 0 else t[n + 1]))

    # small: S = 1.40, 1.542, 1.5625, 1.525 for n = 1..4 → n_max 3; big: 1.118, 1.129, 1.109, 1.078 → n_max 2.
    assert by["small"].n_max == 3 and by["small"].predicted_speedup == pytest.approx(by_hand(0.75, 0.005, 3))
    assert by["small"].predicted_speedup == pytest.approx(1.5625)
    assert by["big"].n_max == 2 and by["big"].predicted_speedup == pytest.approx(by_hand(0.9, 0.05, 2))
    assert by["big"].by_n[4] == pytest.approx(by_hand(0.9, 0.05, 4))
    # A poor draft predicts no gain at any n: llama.cpp should serve the target alone.
    assert by["poor"].n_max == 0 and by["poor"].predicted_speedup == pytest.approx(1.0)
    assert by["small"].draft_step_ms == pytest.approx(5.0) and by["small"].target_step_ms == pytest.approx(100)
    assert by["small"].cost_ratio_c == pytest.approx(0.05)
    # rank.json's rows keep their keys, in order.
    assert list(by["small"].to_dict()) == ["draft", "alpha", "n_max", "n_min", "p_min", "engine", "predicted_speedup",
                                           "by_n", "draft_step_ms", "target_step_ms", "cost_ratio_c", "speed_model",
                                           "best_n", "band", "raw_speedup", "note"]
    # max_n caps the choice (n_max 1 for both), and the ranking follows.
    capped = {r.draft: r for r in rank_llama_cpp({"big": 0.9, "small": 0.75}, target, drafts, max_n=1)}
    assert capped["small"].n_max == 1 and capped["small"].predicted_speedup == pytest.approx(1.4)
    with pytest.raises(ValueError, match="no llama-bench results for draft other"):
        rank_llama_cpp({"other": 0.9}, target, drafts)


def _engine_runs(overhead: float, factor: float, plain_factor: float, d: dict[str, float], alpha: dict[str, float],
                 configs=(("fast", 2), ("fast", 4), ("slow", 2), ("slow", 4))) -> list:
    """Made-up llama.cpp runs whose seconds follow a known calibration exactly (t(1) = 100 ms, +20 ms per verified
    token, as :data:`PP_LINE`): per configuration (draft, n_max) two prompts of R rounds drafting n each, accepting
    E(α, n) − 1 per round (rounded to whole tokens)."""
    from specdraft.core.acceptance import expected_tokens_per_pass
    from specdraft.decoding.llama_cpp_price import EngineRun

    t1, slope = 0.1, 0.02
    runs = [EngineRun("plain", None, 0, 100, 100 * plain_factor * t1) for _ in range(2)]
    for name, n in configs:
        for rounds in (20, 30):
            accepted = round(rounds * (expected_tokens_per_pass(alpha[name], n) - 1))
            priced = rounds * n * d[name] + rounds * t1 + rounds * n * slope
            runs.append(EngineRun(f"{name}, n_max {n}", name, n, rounds + accepted,
                                  rounds * overhead * t1 + factor * priced, drafted=rounds * n, accepted=accepted))
    return runs


PP_LINE = {k: 0.1 + 0.02 * (k - 1) for k in range(2, 6)}  # t(1) = 100 ms, +20 ms per verified token


def test_a_calibration_fitted_to_measured_runs_recovers_the_round_cost_and_states_a_left_out_error():
    """llama-bench's pricing over-predicts llama.cpp (1.20x predicted, 0.96x measured): the calibration fitted to
    measured runs prices a round as the engine ran it, and says how well it predicts a configuration it never saw."""
    from specdraft.decoding.llama_cpp_price import LlamaCppCalibration, fit_llama_cpp_calibration

    target = llama_bench_json(10.0, PP_LINE)
    drafts = {"fast": llama_bench_json(200.0), "slow": llama_bench_json(20.0), "mid": llama_bench_json(50.0)}
    steps, alpha = {"fast": 1 / 200, "slow": 1 / 20, "mid": 1 / 50}, {"fast": 0.6, "slow": 0.9, "mid": 0.8}
    runs = _engine_runs(0.4, 1.3, 1.05, steps, alpha)
    cal = fit_llama_cpp_calibration(runs, target, drafts, {"said": "made-up runs"})
    assert (cal.overhead, cal.round_factor, cal.plain_factor) == (pytest.approx(0.4), pytest.approx(1.3),
                                                                  pytest.approx(1.05))
    assert cal.n_range == (2, 4) and list(cal.loo_errors) == ["fast, n_max 2", "fast, n_max 4", "slow, n_max 2",
                                                              "slow, n_max 4"]
    # Accepted counts are whole tokens, so the α a configuration's acceptance implies is a little off the α that made
    # it: the left-out errors are small, not zero, and the band's half-width is the largest of them.
    assert 0 < cal.error < 0.02 and cal.error == max(abs(e) for e in cal.loo_errors.values())
    assert cal.band(1.5) == (pytest.approx(1.5 / (1 + cal.error)), pytest.approx(1.5 / (1 - cal.error)))
    assert LlamaCppCalibration.from_dict(cal.to_dict()) == cal
    assert cal.describe().startswith("made-up runs; leave-one-out error ±") and cal.describe().endswith("n_max 2–4")
    # What the fit needs: the target alone, three configurations (two parameters and one left out), two n_max values.
    with pytest.raises(ValueError, match="no run of the target alone"):
        fit_llama_cpp_calibration([r for r in runs if r.draft], target, drafts)
    with pytest.raises(ValueError, match="2 speculative configuration"):
        fit_llama_cpp_calibration([r for r in runs if r.draft != "slow"], target, drafts)
    alike = {"a": 1 / 200, "b": 1 / 200, "c": 1 / 200}  # three drafts of one step cost, one n_max: one priced round
    one_n = _engine_runs(0.4, 1.3, 1.05, alike, dict.fromkeys(alike, 0.7), configs=(("a", 3), ("b", 3), ("c", 3)))
    with pytest.raises(ValueError, match="priced alike.*at least two --spec-draft-n-max values"):
        fit_llama_cpp_calibration(one_n, target, dict.fromkeys(alike, drafts["fast"]))


def test_a_calibrated_plan_is_served_only_where_its_error_band_lies_above_one():
    """A plan whose interval the calibration cannot back is never served: outside the n_max it measured, or with a
    band reaching below 1x, llama.cpp serves the target alone, where llama-bench's pricing alone would draft."""
    from specdraft.decoding.llama_cpp_price import (
        LlamaCppCalibration,
        llama_bench_speed_model,
        llama_cpp_plan,
        rank_llama_cpp,
    )

    target = llama_bench_json(10.0, PP_LINE)
    cal = LlamaCppCalibration(overhead=0.0, round_factor=1.2, plain_factor=1.0, n_range=(2, 3),
                              loo_errors={"a": 0.05, "b": -0.1, "c": 0.02})
    speed = llama_bench_speed_model(target, llama_bench_json(200.0))  # d = 5 ms

    def by_hand(alpha: float, n: int) -> float:  # S = E(α, n) t(1) / (1.2 (n d + t(n+1)))
        return (1 - alpha ** (n + 1)) / (1 - alpha) * 0.1 / (1.2 * (n * 0.005 + PP_LINE[n + 1]))

    good = llama_cpp_plan(speed, 0.75, calibration=cal)  # S(2) = 1.285, S(3) = 1.302: band [1.18, 1.45]
    assert good.by_n == {2: pytest.approx(by_hand(0.75, 2)), 3: pytest.approx(by_hand(0.75, 3))}
    assert (good.n_max, good.best_n, good.predicted_speedup) == (3, 3, pytest.approx(by_hand(0.75, 3)))
    assert good.band == (pytest.approx(by_hand(0.75, 3) / 1.1), pytest.approx(by_hand(0.75, 3) / 0.9))
    assert good.raw_speedup == pytest.approx(speed.speedup(0.75, 3)) and "n_max 3: 1.30x" in good.note
    # α 0.6: 1.09x at n 2, but its band [0.99, 1.21] reaches below 1x — llama-bench alone would draft 2 at 1.31x.
    marginal = llama_cpp_plan(speed, 0.6, calibration=cal)
    assert (marginal.best_n, marginal.predicted_speedup) == (2, pytest.approx(by_hand(0.6, 2)))
    assert marginal.band[0] < 1 < marginal.band[1] and marginal.n_max == 0
    assert marginal.note.endswith("the band reaches below 1x, serve the target alone")
    assert llama_cpp_plan(speed, 0.6).n_max == 2 and llama_cpp_plan(speed, 0.6).predicted_speedup > 1.3
    # Only the n_max the calibration measured: with at most one draft per round, nothing it backs.
    capped = llama_cpp_plan(speed, 0.75, max_n=1, calibration=cal)
    assert (capped.n_max, capped.band) == (0, None) and "no n_max the calibration measured (2–3)" in capped.note
    # A ranking under the calibration: best first by the calibrated forecast, each row with its band and raw figure.
    rows = rank_llama_cpp({"marginal": 0.6, "good": 0.75}, target, {"marginal": llama_bench_json(200.0),
                                                                     "good": llama_bench_json(200.0)}, calibration=cal)
    assert [(r.draft, r.n_max) for r in rows] == [("good", 3), ("marginal", 0)]
    assert rows[1].to_dict()["band"] == list(marginal.band) and rows[0].calibration is cal
