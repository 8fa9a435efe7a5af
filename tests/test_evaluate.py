"""Evaluation: predicted α, divergence reporting, report files, and the eval CLI on a tiny pair."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from specdraft.core.config import EvalConfig, HeadroomConfig, SamplingConfig
from specdraft.decoding.replay import predicted_alpha
from specdraft.measuring.eval_report import write_eval_report
from specdraft.measuring.evaluate import run_eval
from specdraft.measuring.headroom import forecast_headroom
from specdraft.testing import perturbed, save_tiny_pair, tiny_model, tiny_tokenizer


def test_predicted_alpha_identical_models_is_one_and_differs_otherwise():
    target = tiny_model("llama", 64, seed=0, layers=2)
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    same = predicted_alpha(target, target, seqs, sampling=SamplingConfig(temperature=1.0))
    assert same["alpha"] == pytest.approx(1.0, abs=1e-5)
    assert same["positions"] == 5 + 2
    other = tiny_model("llama", 64, seed=7, layers=1)
    a = predicted_alpha(target, other, seqs, sampling=SamplingConfig(temperature=1.0))
    # Direct reference: Σ min(p, q) per position from unpadded single-sequence passes.
    ref = []
    with torch.no_grad():
        for s in seqs:
            p = target(torch.tensor([s])).logits[0, :-1].softmax(-1)
            q = other(torch.tensor([s])).logits[0, :-1].softmax(-1)
            ref += torch.minimum(p, q).sum(-1).tolist()
    assert a["alpha"] == pytest.approx(sum(ref) / len(ref), rel=1e-4)
    # Masks over answers: only the counted positions (the heads run over the batch's tail only), the draft's argmax
    # at each of them in order.
    masked = predicted_alpha(target, other, seqs, [[0, 0, 1, 1, 1, 0], [0, 1, 0]],
                             sampling=SamplingConfig(temperature=1.0))
    assert masked["positions"] == 4 and masked["per_sequence"][1][1] == 1
    assert masked["alpha"] == pytest.approx((ref[2] + ref[3] + ref[4] + ref[6]) / 4, rel=1e-4)
    with torch.no_grad():
        want = [other(torch.tensor([seqs[0]])).logits[0, 2:5].argmax(-1).tolist(),
                other(torch.tensor([seqs[1]])).logits[0, 1:2].argmax(-1).tolist()]
    assert masked["draft_top1"] == want
    greedy = predicted_alpha(target, other, seqs)
    assert greedy["alpha"] == pytest.approx(greedy["top1_agreement"])


def test_a_target_cache_gives_the_same_alpha_without_running_the_target_again(tmp_path, monkeypatch):
    target = tiny_model("llama", 64, seed=0, layers=2)
    drafts = [tiny_model("llama", 64, seed=s, layers=1) for s in (7, 8)]
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33, 34], [40, 41, 42]]
    masks = [[0, 0, 1, 1, 1, 0], [0, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1, 0], [0, 1, 0]]
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    plain = [predicted_alpha(target, d, seqs, masks, sampling=sampling, batch_size=2) for d in drafts]
    bool_masks = [[bool(x) for x in m] for m in masks]
    forecast = forecast_headroom(target, drafts[1], seqs, bool_masks, HeadroomConfig(batch_size=2), serving=sampling)
    first = predicted_alpha(target, drafts[0], seqs, masks, sampling=sampling, batch_size=2, target_cache=tmp_path)
    assert len(list(tmp_path.glob("target-logits-*.safetensors"))) == 3  # one file per batch
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("the target ran")

    monkeypatch.setattr(target, "forward", refuse)  # the target's own instance only: the drafts still run
    second = predicted_alpha(target, drafts[1], seqs, masks, sampling=sampling, batch_size=2, target_cache=tmp_path)
    assert not calls
    for got, want in ((first, plain[0]), (second, plain[1])):
        assert got["alpha_sum"] == want["alpha_sum"] and got["per_sequence"] == want["per_sequence"]
        assert got["top1_agreement"] == want["top1_agreement"] and got["draft_top1"] == want["draft_top1"]
    assert first["alpha"] != second["alpha"]  # the drafts differ: the cache holds the target's side only
    # The forecast over the same batches reads the same file (its masks are booleans, the same positions).
    cached = forecast_headroom(target, drafts[1], seqs, bool_masks, HeadroomConfig(batch_size=2), serving=sampling,
                               target_cache=tmp_path)
    assert not calls and cached == forecast
    # Other sequences (another answer, another mask) miss the cache: the target runs.
    with pytest.raises(RuntimeError, match="the target ran"):
        predicted_alpha(target, drafts[1], seqs[:1], [[0, 1, 1, 1, 1, 0]], sampling=sampling, target_cache=tmp_path)


def test_two_targets_of_one_config_do_not_read_each_others_cached_logits(tmp_path):
    """The cache of a target's logits is the target's by content: another target of the very same config (another
    seed, a fine-tune) replayed into the same directory computes its own logits, never the first one's."""
    targets = [tiny_model("llama", 64, seed=s, layers=2) for s in (0, 3)]
    draft = tiny_model("llama", 64, seed=7, layers=1)
    assert targets[0].config.to_json_string(use_diff=False) == targets[1].config.to_json_string(use_diff=False)
    seqs, masks = [[5, 6, 7, 8, 9, 10], [11, 12, 13]], [[0, 0, 1, 1, 1, 0], [0, 1, 0]]
    sampling = SamplingConfig(temperature=0.8)
    plain = [predicted_alpha(t, draft, seqs, masks, sampling=sampling) for t in targets]
    assert plain[0]["alpha_sum"] != plain[1]["alpha_sum"]
    cached = [predicted_alpha(t, draft, seqs, masks, sampling=sampling, target_cache=tmp_path) for t in targets]
    assert [c["alpha_sum"] for c in cached] == [p["alpha_sum"] for p in plain]
    assert len(list(tmp_path.glob("target-logits-*.safetensors"))) == 2  # one batch per target


def test_replay_refuses_a_sequence_past_a_models_window_before_any_pass():
    """Teacher-forced α and the greedy replay read prompt + answer in one pass: past a GPT-2 draft's 16 positions
    they name the sequence, its length and the window (was an IndexError inside the draft's position table)."""
    from specdraft.testing import replay_greedy

    target = tiny_model("llama", 64, seed=0, layers=1)
    draft = tiny_model("gpt2", 64, seed=1, layers=1, n_positions=16)
    prompts, answers = [[5, 6, 7], list(range(5, 17))], [[8, 9], [20, 21, 22, 23, 24, 25]]
    seqs = [p + a for p, a in zip(prompts, answers)]
    with pytest.raises(ValueError, match=r"sequence 1 \(18 tokens\) exceeds the draft's context window \(16\)") as err:
        predicted_alpha(target, draft, seqs)
    assert type(err.value).__name__ == "ContextWindowError"
    with pytest.raises(ValueError, match=r"sequence 1 \(18 tokens\) exceeds the draft's context window \(16\)"):
        replay_greedy(draft, prompts, answers, num_speculative_tokens=3, max_new_tokens=8)
    assert predicted_alpha(target, draft, seqs[:1])["positions"] == 4  # within the window: scored
    assert len(replay_greedy(draft, prompts[:1], answers[:1], num_speculative_tokens=3, max_new_tokens=8)) == 1


def test_run_eval_greedy_is_lossless_and_report_is_written(tmp_path):
    tok = tiny_tokenizer(128)
    target = tiny_model("llama", 128, seed=0, layers=3)
    draft = perturbed(target, 0.03)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    res = run_eval(target, draft, tok, prompts, config=EvalConfig(num_speculative_tokens=3, max_new_tokens=12, compare_hf=True))
    s = res.summary()
    assert s["lossless"] and s["divergences"] == 0
    assert s["prompts"] == 3 and res.spec_tokens == res.target_tokens
    assert 0 < s["acceptance_rate"] <= 1 and s["cost_ratio_c"] > 0
    assert s["hf_assisted_matches_target"] == "3/3"
    # Per-prompt counts add up to the totals; the bootstrap interval holds the point estimate.
    assert sum(r["accepted"] for r in res.per_prompt) == sum(res.spec_counts.accepted)
    assert sum(r["proposed"] for r in res.per_prompt) == sum(res.spec_counts.proposed)
    low, high = s["acceptance_rate_ci95"]
    assert low <= s["acceptance_rate"] <= high and s["alpha_ci95"][0] <= s["alpha"] <= s["alpha_ci95"][1]
    paths = write_eval_report(res, tmp_path)
    data = json.loads(paths["report"].read_text())
    assert data["summary"]["acceptance_rate"] == s["acceptance_rate"]
    assert data["speculative_counts"]["accepted"] == res.spec_counts.accepted
    assert paths["alpha_plot"].read_bytes()[:4] == b"\x89PNG"


def test_divergence_is_reported_with_margin(monkeypatch):
    """A draft whose proposals are wrongly accepted would diverge; the report must name it with the margin."""
    import specdraft.measuring.evaluate as ev

    tok = tiny_tokenizer(64)
    target = tiny_model("llama", 64, seed=0, layers=2)

    def broken(t, d, inp, mask, **kw):  # stands in for a buggy decoder: flips the 3rd token
        out, _c = ev.target_generate(t, inp, mask, **{k: v for k, v in kw.items() if k != "num_speculative_tokens"})
        out[0][2] = (out[0][2] + 1) % 64
        return out, ev.AcceptanceCounts(kw["num_speculative_tokens"])

    monkeypatch.setattr(ev, "speculative_generate", broken)
    res = run_eval(target, target, tok, [[5, 6, 7]], config=EvalConfig(num_speculative_tokens=2, max_new_tokens=6))
    assert len(res.divergences) == 1
    d = res.divergences[0]
    assert d.position == 2 and d.margin > d.tolerance  # a real margin: a bug, not numerics
    assert res.summary()["lossless"] is False


def test_eval_cli_on_tiny_pair(tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    tdir, ddir = save_tiny_pair(tmp_path, 96)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"a b c {w}"}) for w in "defg") + "\n")
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", f"{prompts}:0:3",
                                 "--max-new-tokens", "8", "--gamma",
                                 "3", "--dtype", "float32", "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["summary"]["prompts"] == 3 and report["summary"]["lossless"]
    bad = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--temperature", "1", "--top-p", "0"])
    assert bad.exit_code != 0 and "--top-p" in bad.output


def test_eval_and_generate_cli_with_a_draft_of_another_tokenizer(tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app
    from specdraft.models.vocab import vocab_swap
    from specdraft.testing import perturbed, tiny_bpe_tokenizer, tiny_model

    t_tok, d_tok = tiny_bpe_tokenizer(300), tiny_bpe_tokenizer(360, seed=1)
    target = tiny_model("llama", 300, seed=0, layers=3)
    draft, _ = vocab_swap(perturbed(target, 0.03), t_tok, d_tok)
    tdir, ddir = tmp_path / "target", tmp_path / "draft"
    for model, tok, d in ((target, t_tok, tdir), (draft, d_tok, ddir)):
        model.save_pretrained(d)
        tok.save_pretrained(d)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"def total({w}):"}) for w in ("items", "count")) + "\n")
    args = ["eval", "--target", str(tdir), "--draft", str(ddir), "--prompts", f"{prompts}:0:2",
            "--max-new-tokens", "10", "--gamma", "3", "--dtype", "float32", "--out",
            str(tmp_path / "out")]
    refused = CliRunner().invoke(app, [*args, "--no-map-vocab"])
    assert refused.exit_code == 1 and "--no-map-vocab" in refused.output  # refused, with the way forward named
    assert not (tmp_path / "out").exists()
    # Without the flag the pair is mapped (the default), saying so.
    r = CliRunner().invoke(app, [*args, "--compare-hf"])
    assert "decoded as given, through a vocabulary mapping" in " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "vocabulary mapping" in r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["summary"]["lossless"] and report["summary"]["divergences"] == 0
    assert report["summary"]["hf_assisted_matches_target"] == "2/2"
    assert report["config"]["vocab_mapping"]["target_width"] == 300
    assert report["config"]["mapped_proposals"] == "text"  # the greedy default, recorded as run
    g = CliRunner().invoke(app, ["generate", "hello world", "--target", str(tdir), "--draft", str(ddir),
                                 "--max-new-tokens", "6", "--dtype", "float32", "--map-vocab",
                                 "--mapped-proposals", "tokens"])
    assert g.exit_code == 0, g.output
    assert "6 tokens" in g.output
    bad = CliRunner().invoke(app, ["generate", "hi", "--target", str(tdir), "--draft", str(ddir), "--map-vocab",
                                   "--mapped-proposals", "text", "--temperature", "0.7"])
    assert bad.exit_code == 2 and "greedy decoding only" in " ".join(bad.output.split())


def test_hf_assisted_generation_ignores_the_targets_generation_config():
    """A checkpoint's repetition_penalty (or top_k, do_sample…) must not reach one contender only: with draft =
    target, transformers' assisted generation then equals the target alone, and report.json says what ran."""
    tok = tiny_tokenizer(64)
    target = tiny_model("llama", 64, seed=0, layers=2)
    target.generation_config.repetition_penalty = 1.3
    target.generation_config.top_k = 7
    target.generation_config.no_repeat_ngram_size = 2
    own = target.generation_config
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    res = run_eval(target, target, tok, prompts,
                   config=EvalConfig(num_speculative_tokens=3, max_new_tokens=16, compare_hf=True))
    s = res.summary()
    assert s["hf_assisted_matches_target"] == "2/2" and s["lossless"]
    assert target.generation_config is own and own.repetition_penalty == 1.3  # put back after the call
    hf = res.config["contenders"]["hf_assisted"]
    assert hf["repetition_penalty"] == 1.0 and hf["no_repeat_ngram_size"] == 0 and hf["do_sample"] is False
    assert hf["num_assistant_tokens"] == 3 and hf["num_assistant_tokens_schedule"] == "constant"
    assert hf["max_new_tokens"] == 16 and hf["eos_token_id"] == [4]
    ours = res.config["contenders"]["specdraft"]
    assert ours["num_speculative_tokens"] == 3 and ours["do_sample"] is False and ours["eos_token_id"] == [4]
    assert res.config["contenders"]["target"]["max_new_tokens"] == 16
    report = json.loads(json.dumps(res.to_dict()))  # the report is JSON
    assert report["machine"]["cpu_threads"] == torch.get_num_threads() >= 1
    assert report["machine"]["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "unset")
    from specdraft.decoding.calibration import machine_line

    assert f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={report['machine']['omp_wait_policy']}" in machine_line()


def test_hf_generation_config_is_complete_and_explicit():
    from specdraft.decoding.assisted import hf_generation_config

    gc = hf_generation_config(SamplingConfig(temperature=0.7, top_k=0, top_p=0.9), 8, [4], 0, 5, None)
    assert gc.do_sample is True and gc.temperature == 0.7 and gc.top_k == 0 and gc.top_p == 0.9
    assert gc.repetition_penalty == 1.0 and gc.assistant_confidence_threshold == 0.0
    for key in ("repetition_penalty", "temperature", "top_k", "top_p", "no_repeat_ngram_size", "num_beams",
                "typical_p", "epsilon_cutoff"):
        assert getattr(gc, key) is not None, key  # a None would be filled from a model's generation_config
    # The length is max_new_tokens alone (a max_length beside it warns on every call); _models_generation_config
    # stands this config in for both models', so no checkpoint's max_length / min_length can fill the None.
    assert gc.max_new_tokens == 8 and gc.max_length is None and gc.min_length is None


def test_run_eval_with_a_cheaper_draft_and_adaptive_gamma_is_lossless_and_predicts_its_speed():
    tok = tiny_tokenizer(128)
    target = tiny_model("llama", 128, seed=0, layers=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    config = EvalConfig(num_speculative_tokens=3, max_new_tokens=12, draft_quantization="int8",
                        draft_head_tokens=100, gamma_policy="adaptive")
    res = run_eval(target, target, tok, prompts, config=config)
    s = res.summary()
    assert s["lossless"] and s["divergences"] == 0 and res.spec_tokens == res.target_tokens
    # The draft options were applied to a copy (the target, passed as its own draft, is untouched) and recorded.
    opts = res.config["draft_options"]
    assert (opts["quantization"], opts["head_tokens"], opts["requested"]) == ("int8", 100, "int8")
    assert opts["head_tokens_source"].startswith("the 100 most frequent of 128 token ids, counted over the embedded "
                                                 "training prompts") and "int8" in opts["label"]
    assert s["draft_head"]["source"] == "embedded training prompts" and s["draft_head"]["path"] is None
    assert res.config["contenders"]["specdraft"]["gamma_policy"] == "adaptive"
    assert not any(type(m).__name__ == "Int8Linear" for m in target.modules())
    # The speed model was measured once (t(k) up to k = max(γ, 8) + 1) and gives a prediction to compare.
    assert len(s["speed_model"]["target_s"]) == 9 and s["speed_model"]["draft_s"] > 0
    assert s["predicted_speedup"] > 0 and s["prediction_error"] == pytest.approx(
        s["predicted_speedup"] / s["speedup"] - 1)
    assert 0 <= s["recommended_gamma"] <= 8
    json.dumps(res.to_dict())


def test_eval_names_where_the_trimmed_heads_ranking_came_from_and_its_n(tmp_path):
    """eval with --draft-head-tokens named the ranking's file path alone (report.json's config, a "head ranking:"
    line): report.json's summary and the terminal now say N, of how many ranked ids, which file and what it counted
    (as `specdraft inspect` names it)."""
    from typer.testing import CliRunner

    from specdraft.cli import app
    from specdraft.decoding.draft_model import rank_tokens, save_head_tokens

    tdir, ddir = save_tiny_pair(tmp_path, 96)
    tok = tiny_tokenizer(96)
    save_head_tokens(ddir, rank_tokens(tok, token_lists=[[60, 60, 61]]), tok, "teacher dump (3 answer tokens)")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"a b c {w}"}) for w in "de") + "\n")
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", f"{prompts}:0:2",
                                 "--max-new-tokens", "4", "--gamma", "2", "--dtype", "float32",
                                 "--draft-quantization", "none", "--draft-head-tokens", "50", "--gamma-policy", "fixed",
                                 "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    head = json.loads((tmp_path / "out" / "report.json").read_text())["summary"]["draft_head"]
    ranking = os.path.join(ddir, "head_tokens.json")
    said = f"the 50 most frequent of 96 token ids ranked in {ranking}, counted over teacher dump (3 answer tokens)"
    assert head == {"tokens": 50, "ranked": 96, "path": ranking, "counted_over": "teacher dump (3 answer tokens)",
                    "source": "saved ranking", "said": said}
    assert "trimmed draft head (FR-Spec)" in r.output and "50 of 96 tokens, saved ranking" in r.output
    assert f"head: {said}" in r.output


def test_trimmed_head_needs_a_draft_of_the_targets_tokenizer():
    from specdraft.decoding.decode import DecodeError
    from specdraft.decoding.draft_model import apply_draft_options

    target = tiny_model("llama", 64, seed=0, layers=1)
    with pytest.raises(DecodeError, match="target's tokenizer"):
        apply_draft_options(target, tiny_tokenizer(64), EvalConfig(draft_head_tokens=10), vocab_mapping=object())


def test_eval_and_generate_cli_take_the_draft_options(tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    tdir, ddir = save_tiny_pair(tmp_path, 96)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"a b c {w}"}) for w in "de") + "\n")
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", f"{prompts}:0:2",
                                 "--max-new-tokens", "6", "--gamma", "2",
                                 "--dtype", "float32", "--draft-quantization", "int8", "--draft-head-tokens", "50",
                                 "--gamma-policy", "adaptive", "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "predicted speed-up" in r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["summary"]["lossless"] and report["config"]["draft_quantization"] == "int8"
    opts = report["config"]["draft_options"]
    assert (opts["quantization"], opts["head_tokens"]) == ("int8", 50)
    assert "configuration: draft int8" in r.output and "why: as requested" in r.output
    assert "Speculative decoding (adaptive γ ≤ 2)" in r.output  # the table's title names the policy that ran
    flat = " ".join(r.output.split())  # under the table: what its predictions and the divergence count mean
    assert "Three speed predictions: analytic = Leviathan et al. (2023), Theorem 3.8" in flat
    assert "in brackets those beyond the bf16 near-tie tolerance" in flat
    # Measured now, or a hit of this session's cache (then its date and file are named).
    assert "(speed model: measured" in flat or re.search(r"\(speed model: cache, measured 20\S+: \S+\.json\)", flat)
    g = CliRunner().invoke(app, ["generate", "a b", "--target", tdir, "--draft", ddir, "--max-new-tokens", "5",
                                 "--dtype", "float32", "--draft-quantization", "int8", "--gamma-policy", "adaptive"])
    assert g.exit_code == 0, g.output
    assert "5 tokens" in g.output
    bad = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--draft-quantization", "int2"])
    assert bad.exit_code == 2 and "int2" in bad.output


@pytest.mark.parametrize("scale,gamma,max_new", [(0.03, 3, 12), (0.08, 4, 9), (0.0, 5, 10), (0.3, 2, 7)])
def test_replay_greedy_equals_decoded_counts(scale, gamma, max_new):
    """One teacher-forced draft pass over the target's greedy answer gives speculative decoding's counts exactly
    (float32: no near-tie rounding), rows ending by EOS and by the length bound alike."""
    from dataclasses import asdict

    from specdraft.decoding.decode import speculative_generate, target_generate
    from specdraft.testing import replay_greedy

    target = tiny_model("llama", 64, seed=0, layers=3)
    draft = perturbed(target, scale, seed=11)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33, 34, 35]]
    eos = [4, 17, 23]  # frequent enough that some rows end early
    answers, decoded = [], []
    for p in prompts:
        ids = torch.tensor([p])
        y, _ = target_generate(target, ids, max_new_tokens=max_new, eos_token_id=eos)
        out, c = speculative_generate(target, draft, ids, num_speculative_tokens=gamma, max_new_tokens=max_new,
                                      eos_token_id=eos)
        assert out == y
        answers.append(y[0])
        decoded.append(c)
    assert any(a[-1] in eos for a in answers) or scale  # the EOS path is exercised in at least one case
    replayed = replay_greedy(draft, prompts, answers, gamma, max_new, eos, batch_size=2)
    keys = ("proposed", "reached", "accepted", "accepted_hist", "rounds", "emitted", "bonus")
    for r, d in zip(replayed, decoded):
        assert {k: asdict(r)[k] for k in keys} == {k: asdict(d)[k] for k in keys}




def test_rank_cli_orders_drafts_by_predicted_speedup_and_confirms_the_top_one(tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    tdir, ddir = save_tiny_pair(tmp_path, 96)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"a b c {w}"}) for w in "de") + "\n")
    r = CliRunner().invoke(app, ["rank", ddir, tdir, "--target", tdir, "--prompts", f"{prompts}:0:2",
                                 "--max-new-tokens", "6", "--gamma", "2", "--dtype", "float32",
                                 "--draft-quantization", "none", "--out", str(tmp_path / "rank")])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "rank" / "rank.json").read_text())
    ranking = report["ranking"]
    assert {x["draft"] for x in ranking} == {ddir, tdir}
    assert [x["predicted_speedup"] for x in ranking] == sorted((x["predicted_speedup"] for x in ranking), reverse=True)
    # The target as its own draft: every proposal accepted.
    assert next(x for x in ranking if x["draft"] == tdir)["alpha"] == 1.0
    assert report["confirmation"]["draft"] == ranking[0]["draft"] and report["confirmation"]["lossless"]


def test_interleaved_speed_times_every_contender_on_the_same_prompts():
    from specdraft.measuring.evaluate import interleaved_speed

    tok = tiny_tokenizer(128)
    target = tiny_model("llama", 128, seed=0, layers=3)
    drafts = {"original": perturbed(target, 0.03), "distilled": perturbed(target, 0.01, seed=5)}
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    res = interleaved_speed(target, drafts, tok, prompts, ["a", "b", "c"],
                            EvalConfig(num_speculative_tokens=3, max_new_tokens=10), hf_draft="original")
    c = res.contenders
    assert set(c) == {"target", "speculative:original", "speculative:distilled", "hf_assisted:original"}
    assert res.lossless and c["speculative:distilled"].matches_target == "3/3"
    assert all(r.timings[name][0] == r.timings["target"][0] > 0 for r in res.rows for name in c)  # greedy: same tokens
    sp = c["speculative:original"]
    assert sp.speedup_ci95[0] <= sp.speedup <= sp.speedup_ci95[1]
    assert sp.speedup == pytest.approx(sp.tokens_per_s / c["target"].tokens_per_s)
    from specdraft.decoding.speed_run import SpeedRun

    saved = json.loads(json.dumps(res.to_dict()))  # as a stage writes it: read back, it writes the same JSON
    assert json.loads(json.dumps(SpeedRun.from_dict(saved).to_dict())) == saved


def test_calibration_cache_hits_only_on_the_same_pair_preparation_and_threads(tmp_path, monkeypatch):
    import specdraft.decoding.calibration as ev
    from specdraft.decoding.calibration import cached_speed_model, speed_cache_key
    from specdraft.decoding.draft_model import prepare_draft

    monkeypatch.setattr(ev, "BUSY_SHARE", 2.0)  # the test machine may be busy: caching is what is tested here
    # ... and a busy machine's timings swing several-fold between two reads, which the hit's spot check would call
    # stale (tested on its own below): the keys are what is tested here.
    real_stale_costs = ev._stale_costs
    monkeypatch.setattr(ev, "_stale_costs", lambda *a, **k: None)

    target = tiny_model("llama", 64, seed=0, layers=1)
    draft = tiny_model("llama", 64, seed=1, layers=1)
    ctx = [5, 6, 7, 8, 9]
    first, src = cached_speed_model(target, draft, ctx, max_gamma=2, repeats=1, cache_dir=tmp_path)
    assert src == "measured" and len(list(tmp_path.iterdir())) == 1
    again, src = cached_speed_model(target, draft, ctx, max_gamma=2, repeats=1, cache_dir=tmp_path)
    assert src.startswith("cache, measured 20") and src.endswith(".json") and again.target_s == first.target_s and again.draft_s == first.draft_s
    # Another preparation of the draft: another key, a new measurement.
    assert cached_speed_model(target, prepare_draft(draft, "int8"), ctx, max_gamma=2, repeats=1,
                              cache_dir=tmp_path)[1] == "measured"
    # Another thread count: a miss.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        assert cached_speed_model(target, draft, ctx, max_gamma=2, repeats=1, cache_dir=tmp_path)[1] == "measured"
    finally:
        torch.set_num_threads(threads)
    # A changed weight (e.g. a distilled draft): a miss.
    with torch.no_grad():
        next(draft.parameters()).add_(0.5)
    assert cached_speed_model(target, draft, ctx, max_gamma=2, repeats=1, cache_dir=tmp_path)[1] == "measured"
    # A foreign entry under this key's file name (another key stored in it) is never used.
    key = speed_cache_key(target, draft, 2)
    entry = next(p for p in tmp_path.iterdir() if json.loads(p.read_text())["key"]["draft"] == key["draft"])
    saved = json.loads(entry.read_text())
    saved["key"]["cpu_threads"] = 999
    saved["speed_model"]["draft_s"] = 123.0
    entry.write_text(json.dumps(saved))
    speed, src = cached_speed_model(target, draft, ctx, max_gamma=2, repeats=1, cache_dir=tmp_path)
    assert src == "measured" and speed.draft_s != 123.0
    # A hit whose costs no longer hold on this machine (a slower day: t(1) 10 s cached) is spot-checked, re-measured
    # and replaced.
    saved = json.loads(entry.read_text())
    saved["speed_model"]["target_s"] = [10.0 * (i + 1) for i in range(len(saved["speed_model"]["target_s"]))]
    entry.write_text(json.dumps(saved))
    monkeypatch.setattr(ev, "_stale_costs", real_stale_costs)  # 10 s cached: stale on any machine, busy or not
    said = []
    speed, src = cached_speed_model(target, draft, ctx, max_gamma=2, repeats=1, cache_dir=tmp_path, say=said.append)
    assert src.startswith("measured (the cached costs were stale: t(1)") and "10000.0 ms cached" in src
    # The progress says why it measures again (it said "found in the cache" and then "calibrating", unexplained).
    assert said[0].startswith("speed model: found in the calibration cache") and \
        said[1].startswith("speed model: the cached one no longer fits this machine (the cached costs were stale")
    assert speed.target_s[0] < 1.0 and json.loads(entry.read_text())["speed_model"]["target_s"][0] < 1.0
    monkeypatch.setattr(ev, "_stale_costs", lambda *a, **k: None)
    assert cached_speed_model(target, draft, ctx, max_gamma=2, repeats=1, cache_dir=tmp_path)[1].startswith("cache")


def test_rank_names_prompt_ids_past_a_drafts_width_before_timing_it(monkeypatch):
    """`rank` with a candidate of 80 rows beside a 96-id tokenizer: the calibration prompts' ids past it are named
    when it is loaded, before it is timed (was an IndexError inside the draft); ids past the target, at once."""
    from specdraft.core.sampling import TokenWidthError
    from specdraft.decoding import calibration
    from specdraft.measuring.rank import rank_drafts

    target, tok = tiny_model("llama", 96, seed=0, layers=2), tiny_tokenizer(96)
    narrow = tiny_model("llama", 80, seed=1, layers=1)
    real_pass_seconds = calibration.pass_seconds

    def timed(model, *a, **k):
        assert model is target, "the narrow draft was timed"
        return real_pass_seconds(model, *a, **k)

    monkeypatch.setattr(calibration, "pass_seconds", timed)
    prompts = [[5, 6, 85, 7], [8, 9, 10]]
    cfg = EvalConfig(max_new_tokens=3, num_speculative_tokens=2, dtype="float32")
    with pytest.raises(TokenWidthError, match=r"draft narrow cannot read or score: 85 \(its input embedding has 80"):
        rank_drafts(target, tok, prompts, [("narrow", lambda: (narrow, None))], cfg)
    with pytest.raises(TokenWidthError, match=r"target cannot read or score: 120"):
        rank_drafts(target, tok, [[5, 120]], [("narrow", lambda: (narrow, None))], cfg)


def test_load_monitor_sees_another_process_hold_the_cpu_and_a_busy_calibration_is_not_cached(tmp_path, monkeypatch):
    import subprocess
    import sys
    import time

    import specdraft.decoding.calibration as ev

    # A child process spinning for ~1.5 s while this one sleeps: others' share of the CPU is well above zero.
    with ev.LoadMonitor() as load:
        child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"])
        child.wait()
    assert load.others_share is not None and load.others_share >= 0.2 / (os.cpu_count() or 1)
    # The share itself: (busy jiffies − this process's own) / all jiffies of the interval.
    readings = iter([(100, 1000), (300, 1400)])
    monkeypatch.setattr(ev, "_cpu_jiffies", lambda: next(readings))
    with ev.LoadMonitor() as fake:
        time.sleep(0.01)
    own = fake.others_share  # this process's few jiffies are subtracted from the 200 busy ones
    assert 0.45 <= own <= 0.5 and fake.busy
    monkeypatch.undo()
    # A calibration measured on a busy machine is returned but never cached.
    monkeypatch.setattr(ev, "BUSY_SHARE", -1.0)
    target, draft = tiny_model("llama", 64, seed=0, layers=1), tiny_model("llama", 64, seed=1, layers=1)
    _, src = ev.cached_speed_model(target, draft, [5, 6, 7], max_gamma=1, repeats=1, cache_dir=tmp_path)
    assert src.startswith("measured on a busy machine") and not any(tmp_path.iterdir())


def test_certify_sampling_accepts_an_exact_pair_and_the_eval_cli_reports_its_p_value(tmp_path):
    from specdraft.measuring.certify import certify_sampling

    target = tiny_model("llama", 32, seed=0, layers=1)
    draft = perturbed(target, 0.5)  # a draft that disagrees often: the residual draws carry the law
    sampling = SamplingConfig(temperature=1.0, top_p=0.9)
    cert = certify_sampling(target, draft, [5, 6, 7], sampling, 3000, 3, batch_size=500, seed=1)
    assert cert["draws"] == 3000 and cert["outside_support"] == 0 and cert["p_value"] > 1e-3 and cert["passed"]
    assert cert["cells"] >= 5 and abs(sum(share for _, _, share in cert["top_tokens"]) -
                                      sum(p for _, p, _ in cert["top_tokens"])) < 0.05
    # The test has power: as many draws from the draft's own law q, tested against p, fail it.
    from specdraft.core.sampling import filtered_probs
    from specdraft.core.stats import chi2_goodness_of_fit

    full = SamplingConfig(temperature=1.0)
    with torch.no_grad():
        p = filtered_probs(target(torch.tensor([[5, 6, 7]])).logits[0, -1], 1.0).double().numpy()
        q = filtered_probs(draft(torch.tensor([[5, 6, 7]])).logits[0, -1], 1.0)
    draws = torch.multinomial(q, 3000, replacement=True, generator=torch.Generator().manual_seed(2)).tolist()
    assert chi2_goodness_of_fit([[t] for t in draws], p / p.sum())[0] < 1e-3
    assert certify_sampling(target, draft, [5, 6, 7], full, 3000, 3, batch_size=500, seed=1)["passed"]
    with pytest.raises(ValueError, match="sampled"):
        certify_sampling(target, draft, [5, 6, 7], SamplingConfig(), 10, 3)
    with pytest.raises(Exception, match="certify"):
        EvalConfig(certify=10)  # greedy: refused, not ignored
    from typer.testing import CliRunner

    from specdraft.cli import app

    tdir, ddir = save_tiny_pair(tmp_path, 96)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b c"}) + "\n")
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", f"{prompts}:0:1",
                                 "--max-new-tokens", "4", "--dtype", "float32", "--temperature", "1",
                                 "--certify", "400", "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "sampling certificate: 400 first-token draws" in r.output and "passed" in r.output
    saved = json.loads((tmp_path / "out" / "report.json").read_text())["summary"]["sampling_certificate"]
    assert saved["draws"] == 400 and 0 <= saved["p_value"] <= 1


#: The draws of docs/cli.md's certified eval (``--certify 2000``): the count a negative control must fail at.
CLI_CERTIFY_DRAWS = 2000


def test_certify_sampling_exercises_speculation_and_fails_a_broken_verifier_at_the_clis_draw_count(
        tmp_path, monkeypatch):
    """The certificate runs the product's own decode loop with its verifier broken two ways — every draft accepted;
    acceptance and residual computed from the draft's unfiltered q while it drew from the filtered one — and fails
    both at the CLI's draw count; the real verifier passes, and every draw went through a proposal."""
    from specdraft.decoding import decode, drafters
    from specdraft.measuring.certify import certify_sampling

    target = tiny_model("llama", 32, seed=0, layers=1)
    draft = perturbed(target, 0.1)  # accepts about half its proposals: both the accept and the residual path run
    sampling = SamplingConfig(temperature=1.0, top_k=5, top_p=0.9)  # filtering changes q: the raw-q bug shows
    real_verify = decode.verify_sampled

    def always_accept(draft_tokens, q, p, generator=None, n_proposed=None, u=None):
        # p replaced by q at the drafted positions: u·q < q for every u < 1, so every draft is accepted.
        return real_verify(draft_tokens, q, torch.cat([q, p[:, q.shape[1]:]], dim=1), generator, n_proposed, u)

    def unfiltered_q(logits, q, s):
        return (logits.float() / s.temperature).softmax(-1)

    def certify():
        return certify_sampling(target, draft, [5, 6, 7], sampling, CLI_CERTIFY_DRAWS, 3, batch_size=500, seed=0)

    good = certify()
    assert good["passed"] and good["valid"] and good["invalid_reason"] is None
    # Every first token was a proposal; about half were rejected and drawn from the residual; each accepted one
    # was followed by a bonus draw.
    assert good["proposals"] == CLI_CERTIFY_DRAWS and good["target_draws"] == 0
    assert good["accepted"] + good["rejections"] == CLI_CERTIFY_DRAWS
    assert 0.2 * CLI_CERTIFY_DRAWS < good["rejections"] < 0.8 * CLI_CERTIFY_DRAWS
    assert good["bonus_draws"] == good["accepted"]
    monkeypatch.setattr(decode, "verify_sampled", always_accept)
    broken = certify()
    assert broken["accepted"] == CLI_CERTIFY_DRAWS and broken["rejections"] == 0
    assert not broken["passed"] and not broken["valid"] and "no proposal was rejected" in broken["invalid_reason"]
    assert broken["p_value"] < 1e-3  # and the law is wrong, not only the evidence missing
    monkeypatch.undo()
    monkeypatch.setattr(drafters, "_verification_q", unfiltered_q)
    raw = certify()
    assert raw["valid"] and raw["rejections"] > 0 and raw["p_value"] < 1e-3 and not raw["passed"]
    monkeypatch.undo()

    # The eval CLI at that draw count with the always-accepting verifier: the certificate line says why, exit 2.
    from typer.testing import CliRunner

    from specdraft.cli import app

    tdir, ddir = save_tiny_pair(tmp_path, 96)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b c"}) + "\n")
    monkeypatch.setattr(decode, "verify_sampled", always_accept)
    r = CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", f"{prompts}:0:1",
                                 "--max-new-tokens", "2", "--dtype", "float32", "--temperature", "1",
                                 "--gamma-policy", "fixed", "--certify", str(CLI_CERTIFY_DRAWS),
                                 "--out", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert f"({CLI_CERTIFY_DRAWS} proposed by the draft: {CLI_CERTIFY_DRAWS} accepted, 0 rejected" in out
    assert "NOT VALID: no proposal was rejected" in out


def test_a_certificate_without_rejections_is_not_valid_and_says_why():
    """A draft equal to the target accepts every proposal: the χ² passes, but the residual path never ran, so the
    certificate is marked not valid (it could not tell a broken verifier from a good one)."""
    from specdraft.measuring.certify import certify_sampling

    target = tiny_model("llama", 32, seed=0, layers=1)
    cert = certify_sampling(target, target, [5, 6, 7], SamplingConfig(temperature=1.0), 300, 2, batch_size=300)
    assert cert["proposals"] == 300 and cert["rejections"] == 0 and cert["p_value"] >= 1e-3
    assert not cert["valid"] and not cert["passed"]
    assert "residual draw never ran" in cert["invalid_reason"] and "--certify" in cert["invalid_reason"]


# The transformers notices specdraft's own assisted-generation calls caused (one per drafting round).
OWN_NOTICES = ("seem to have been set", "generation-related arguments", "generation_config")


@pytest.fixture
def transformers_records():
    """Every record transformers logs at WARNING or above while the test runs (its loggers do not propagate to
    pytest's caplog), with warning_once's memory cleared so that a notice shown earlier in the session counts."""
    import logging

    import transformers

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    root = logging.getLogger("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    logging.Logger.warning_once.cache_clear()
    root.addHandler(handler)
    yield records
    root.removeHandler(handler)
    transformers.logging.set_verbosity(verbosity)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_compare_hf_emits_no_transformers_warnings_of_its_own(temperature, transformers_records, recwarn):
    """eval --compare-hf printed "Both `max_new_tokens` and `max_length` seem to have been set" once per drafting
    round and "Passing `generation_config` together with generation-related arguments is deprecated": the
    generation config now is complete (no max_length / min_length beside the *_new_tokens)."""
    import logging

    tok = tiny_tokenizer(64)
    target = tiny_model("llama", 64, seed=0, layers=2)
    draft = perturbed(target, 0.05)
    res = run_eval(target, draft, tok, [[5, 6, 7, 8], [9, 10, 11]],
                   config=EvalConfig(num_speculative_tokens=3, max_new_tokens=10, compare_hf=True,
                                     sampling=SamplingConfig(temperature=temperature), dtype="float32"))
    assert res.hf_tokens > 0  # assisted generation ran
    said = [r.getMessage() for r in transformers_records] + [str(w.message) for w in recwarn]
    assert not [m for m in said if any(n in m for n in OWN_NOTICES)], said
    # Nothing is hidden past the call, and within it only transformers' note about its own drafting call is: the
    # same text from elsewhere and any other warning still reach the user.
    log = logging.getLogger("transformers.generation.utils")
    assert log.filters == []
    from specdraft.decoding.assisted import _INTERNAL_NOTICE, _models_generation_config

    with _models_generation_config(target.generation_config, target, draft):
        log.warning(f"{_INTERNAL_NOTICE}=({{'max_new_tokens'}}) is deprecated (a caller's own call)")
        log.warning("a warning a user must see")
    assert [r.getMessage() for r in transformers_records[-2:]] == [
        f"{_INTERNAL_NOTICE}=({{'max_new_tokens'}}) is deprecated (a caller's own call)", "a warning a user must see"]


def test_acceptance_eval_decodes_with_the_draft_and_its_replayed_counts_agree_with_the_decoded_ones():
    """Without answers the draft decodes the target's greedy answers (batch 1, fixed γ); the rows hold the replayed
    counts, and on every prompt they agree with the decoded rounds (replay_check)."""
    from specdraft.measuring.evaluate import acceptance_eval

    tok = tiny_tokenizer(128)
    target = tiny_model("llama", 128, seed=0, layers=3)
    draft = perturbed(target, 0.05, seed=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    names = ["a", "b", "c"]
    config = EvalConfig(num_speculative_tokens=3, max_new_tokens=10)
    serving = SamplingConfig(temperature=1.0)
    plain = acceptance_eval(target, draft, tok, prompts, names, config, serving)
    assert plain.replay_check == "3/3" and plain.decoder_label == "the draft as given, fixed γ 3"
    assert json.loads(json.dumps(plain.to_dict()))["rows"] == plain.rows and len(plain.to_dict()) == 26  # to disk
    assert plain.decoded_tokens == sum(map(len, plain.answers))


def test_matched_proposals_are_one_figure_whatever_gamma_while_the_per_round_rates_move():
    """Replayed on one target answer, the same draft at γ 2 and γ 5: matched proposals per answer token are the
    same figure, while accepted / proposed and accepted / reached move with the rounds (which positions a bonus token
    covers, how many drafts follow a rejection) — so only the first may compare regimes."""
    import random

    from specdraft.decoding.replay import replay_answer

    y = list(range(10, 50))  # 40 answer tokens, no EOS
    rng = random.Random(0)
    top1 = [t if rng.random() < 0.7 else 0 for t in y]  # the draft's teacher-forced argmax per answer position
    by_gamma = {g: replay_answer(top1, y, g, max_new_tokens=len(y), eos=set()) for g in (2, 5)}
    want = sum(g == t for g, t in zip(top1, y)) / len(y)
    for c in by_gamma.values():
        assert (c.matched, c.match_positions) == (sum(g == t for g, t in zip(top1, y)), len(y))
        assert c.match_rate == want
        assert c.merge(c).match_rate == want  # counts first: they merge
    assert by_gamma[2].acceptance_rate != by_gamma[5].acceptance_rate
    assert by_gamma[2].alpha != by_gamma[5].alpha


def test_acceptance_eval_gives_one_matched_figure_at_two_gammas_and_the_report_leads_with_it():
    from specdraft.core.acceptance import MEASURES
    from specdraft.measuring.evaluate import acceptance_eval
    from specdraft.measuring.report import SUMMARY_LEGEND, summary_sections

    tok = tiny_tokenizer(128)
    target = tiny_model("llama", 128, seed=0, layers=3)
    draft = perturbed(target, 0.08, seed=3)
    prompts, names = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]], ["a", "b", "c"]
    serving = SamplingConfig(temperature=1.0)
    two = acceptance_eval(target, draft, tok, prompts, names, EvalConfig(num_speculative_tokens=2, max_new_tokens=16),
                          serving)
    five = acceptance_eval(target, draft, tok, prompts, names, EvalConfig(num_speculative_tokens=5, max_new_tokens=16),
                           serving, answers=two.answers)
    assert 0 < two.match_rate < 1 and five.match_rate == two.match_rate
    assert five.match_rate_ci95 == two.match_rate_ci95
    assert [r["matched"] for r in five.rows] == [r["matched"] for r in two.rows]
    assert sum(r["match_positions"] for r in two.rows) == sum(map(len, two.answers))  # every answer token
    assert five.acceptance_rate != two.acceptance_rate  # the per-proposed figure is the regime's
    # The report's comparison leads with the regime-free figure and says what each figure counts.
    sets = {"held_out": two.to_dict()}
    report = {"eval_before": {"sets": sets}, "eval_after": {"sets": {"held_out": five.to_dict()}}}
    (title, rows), = summary_sections(report)
    assert rows[0][0] == "matched / answer token" and rows[0][1] == rows[0][2]
    assert {r[0]: r[2] for r in rows}["matched gain (paired)"].startswith("+0.000")
    # Each set records the rounds it was counted in; per proposed is never paired across two of them.
    assert (two.gamma, five.gamma, two.gamma_policy, two.proposals) == (2, 5, "fixed", None)
    assert title.endswith("acceptance, fixed γ 2 before, fixed γ 5 after")
    assert {r[0]: r[2] for r in rows}["gain per proposed (paired)"] == "not paired: γ 2 vs 5"
    assert "bonus tokens never counted" in SUMMARY_LEGEND and "per answer token" in SUMMARY_LEGEND
    assert set(MEASURES) == {"matched", "per_reached", "per_proposed", "per_pass"}


def test_the_greedy_identity_count_says_when_it_tests_nothing_of_verification():
    """Greedy outputs equal to the target's certify verification only if drafts were proposed and some rejected:
    a draft equal to the target never has one rejected, and a run that proposed nothing decoded with the target."""
    from specdraft.core.acceptance import AcceptanceCounts
    from specdraft.measuring.evaluate import identity_not_tested

    target = tiny_model("llama", 64, seed=0, layers=2)
    other = tiny_model("llama", 64, seed=7, layers=1)
    cfg = EvalConfig(max_new_tokens=6, num_speculative_tokens=2, gamma_policy="fixed", dtype="float32",
                     draft_quantization="none")  # the draft as given: the target itself proposes
    same = run_eval(target, target, tiny_tokenizer(64), [[5, 6, 7], [8, 9]], config=cfg).summary()
    assert same["lossless"] and "none of" in same["identity_not_tested"] and "rejected" in same["identity_not_tested"]
    differs = run_eval(target, other, tiny_tokenizer(64), [[5, 6, 7], [8, 9]], config=cfg).summary()
    assert differs["lossless"] and differs["identity_not_tested"] is None
    idle = AcceptanceCounts(2)
    idle.record_round(0, n_proposed=0)
    assert "proposed no draft" in identity_not_tested(idle)


def test_eval_summary_leads_with_the_gamma_independent_alpha_and_names_each_rates_definition():
    """accepted / proposed moves with γ; accepted / reached does not: the summary's first figure is α, and the
    report's definitions say which rate is per reached position and which per proposed token."""
    from specdraft.core.acceptance import AcceptanceCounts
    from specdraft.measuring.evaluate import REPORT_DEFINITIONS, EvalResult

    counts = AcceptanceCounts(gamma=2, proposed=[4, 4], reached=[4, 2], accepted=[2, 1], accepted_hist=[2, 1, 1])
    s = EvalResult(config={"num_speculative_tokens": 2}, spec_counts=counts, target_counts=AcceptanceCounts(gamma=2),
                   prompts=1, machine={}).summary()
    assert s["headline_measure"] == "alpha" and list(s)[1:3] == ["headline_measure", "alpha"]
    assert s["alpha"] == pytest.approx(3 / 6) and s["acceptance_rate"] == pytest.approx(3 / 8)
    assert REPORT_DEFINITIONS["summary.alpha"].startswith("accepted / reached")
    assert REPORT_DEFINITIONS["summary.acceptance_rate"].startswith("accepted / proposed")
