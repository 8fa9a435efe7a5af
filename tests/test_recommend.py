"""What to ship where: the per-engine recommendation follows what measured fastest, and distillation is judged
against the draft the user already had."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _row(i: int, tokens: int, seconds: dict[str, float]) -> dict:
    return {"id": f"p{i}"} | {k: [tokens, s] for k, s in seconds.items()}


def _speed(original: float, distilled: float, hf: float = 1.2, busy: bool = False) -> dict:
    """A speed stage where each draft decodes 64 tokens per prompt at ``speedup`` × the target alone's rate (1 s per
    8 tokens), with a little per-prompt spread so the paired intervals have width."""
    rows = []
    for i in range(6):
        t = 8.0 * (1 + 0.05 * (i % 3))
        rows.append(_row(i, 64, {"target": t, "speculative:original": t / original * (1 + 0.02 * (i % 2)),
                                 "speculative:distilled": t / distilled * (1 + 0.01 * (i % 3)),
                                 "hf_assisted:original": t / hf}))

    def contender(speedup: float) -> dict:
        return {"tokens_per_s": 8 * speedup, "tokens_per_s_ci95": None, "speedup": speedup, "speedup_ci95": [speedup - 0.1, speedup + 0.1],
                "matches_target": "6/6"}

    return {"prompts": 6, "max_new_tokens": 64, "rows": rows, "busy_machine": busy,
            "contenders": {"target": {"tokens_per_s": 8.0, "tokens_per_s_ci95": None}, "speculative:original": contender(original),
                           "speculative:distilled": contender(distilled), "hf_assisted:original": contender(hf)},
            "draft_configuration": {"original": {"label": "int4 (30/30 layers)"},
                                    "distilled": {"label": "int4 (30/30 layers) + head 8,192"}}}


def _eval(alpha_hits: int, proposed: int = 50) -> dict:
    rows = [{"id": f"e{i}", "accepted": alpha_hits + i % 3, "proposed": proposed, "reached": 60 - i % 2,
             "answer_tokens": 64} for i in range(12)]
    acc = sum(r["accepted"] for r in rows)
    return {"prompts": 12, "rows": rows, "acceptance_rate": acc / sum(r["proposed"] for r in rows),
            "alpha": acc / sum(r["reached"] for r in rows), "drafted": 600}


def report(original: float, distilled: float, mapped: bool = True, before_hits: int = 40, after_hits: int = 30,
           plan: dict | None = None, busy: bool = False) -> dict:
    """A run's report.json payload with the figures that decide the recommendation."""
    return {"config": {"target": "T", "draft": "D", "eval": {"num_speculative_tokens": 5, "gamma_policy": "adaptive",
                                                             "draft_quantization": None, "draft_head_tokens": None}},
            "check": {"verdict": "mismatch" if mapped else "identical"},
            "eval_before": {"sets": {"held_out": _eval(before_hits)}},
            "vocab_swap": {"sets": {"held_out": _eval(15)}, "target_coverage": 0.8} if mapped else None,
            "eval_after": {"sets": {"held_out": _eval(after_hits)}},
            "dump": {"teacher": "draft-as-given" if mapped else "target", "sequences": 272},
            "speed": _speed(original, distilled, busy=busy),
            "export": {"path": "out/export/speculator", "vllm_command": "vllm serve T --speculative-config X",
                       "as_given": {"path": "out/export/speculator-as-given", "vllm_command": "vllm serve T GIVEN"},
                       **({"llama_cpp": plan} if plan else {})}}


def test_the_draft_as_given_leads_every_engine_it_measured_fastest_in():
    from specdraft.measuring.recommend import engine_choices

    choices = engine_choices(report(original=1.98, distilled=1.93))
    assert [c.engine for c in choices] == ["specdraft", "vllm", "transformers"]
    first = choices[0]
    assert (first.which, first.draft, first.speedup) == ("original", "D as given", 1.98)
    assert first.command == ("specdraft generate --target T --draft out/export/speculator-as-given --map-vocab "
                             "--gamma 5 --gamma-policy adaptive PROMPT")
    assert "int4 (30/30 layers)" in first.basis and first.others == ["D re-indexed + distilled: 1.93x"]
    vllm = choices[1]
    assert (vllm.which, vllm.command, vllm.path) == ("original", "vllm serve T GIVEN", "out/export/speculator-as-given")
    assert "not in vLLM" in vllm.basis and "dense export" in vllm.basis  # the row says what was timed
    assert first.alpha == pytest.approx(report(1.98, 1.93)["eval_before"]["sets"]["held_out"]["alpha"])


def test_the_distilled_draft_leads_where_it_measured_fastest():
    from specdraft.measuring.recommend import engine_choices

    choices = engine_choices(report(original=1.40, distilled=1.75))
    first = choices[0]
    assert (first.engine, first.which, first.speedup) == ("specdraft", "distilled", 1.75)
    assert "--map-vocab" not in first.command and "--draft out/export/speculator " in first.command
    assert next(c for c in choices if c.engine == "vllm").command == "vllm serve T --speculative-config X"


def test_no_draft_is_served_where_none_beat_the_target_alone_and_never_a_slower_one():
    from specdraft.measuring.recommend import engine_choices, pick_fastest

    assert pick_fastest({"original": 0.9, "distilled": 0.95}) is None
    assert pick_fastest({"original": 1.2, "distilled": 1.19}) == "original"
    assert pick_fastest({"original": None, "distilled": 1.01}) == "distilled"
    choices = engine_choices(report(original=0.9, distilled=0.95))
    dec = next(c for c in choices if c.engine == "specdraft")
    assert (dec.which, dec.draft, dec.speedup) == (None, "none: serve the target alone", 1.0)
    assert dec.others == ["D as given: 0.90x", "D re-indexed + distilled: 0.95x"]


def test_the_llama_cpp_row_is_the_forecast_and_the_target_alone_when_its_band_reaches_1x():
    from specdraft.measuring.recommend import engine_choices

    plan = {"which": "distilled", "gguf": "out/export/draft-q8_0.gguf", "n_max": 0, "best_n": 3,
            "predicted_speedup": 0.80, "band": [0.75, 0.86], "basis": "forecast, not timed by this run: …",
            "command": "llama-completion -m TARGET.gguf -t 2"}
    choices = engine_choices(report(original=1.98, distilled=1.93, plan=plan))
    assert choices[-1].engine == "llama.cpp"  # 1x, after every measured speed-up above it
    row = choices[-1]
    assert (row.draft, row.speedup, row.command) == ("none: serve the target alone", 1.0, plan["command"])
    assert row.others == ["D re-indexed + distilled (GGUF out/export/draft-q8_0.gguf): forecast 0.80x at n_max 3"]
    served = dict(plan, n_max=3, predicted_speedup=1.15, band=[1.07, 1.24], command="llama-speculative-simple …")
    row = next(c for c in engine_choices(report(1.0, 0.9, plan=served)) if c.engine == "llama.cpp")
    assert (row.which, row.speedup, row.speedup_ci95) == ("distilled", 1.15, [1.07, 1.24])


def test_distillation_is_judged_against_the_draft_as_given_with_its_teacher_named():
    from specdraft.measuring.recommend import distillation_verdict

    r = report(original=1.98, distilled=1.93, before_hits=40, after_hits=30)
    v = distillation_verdict(r)
    b, a = r["eval_before"]["sets"]["held_out"], r["eval_after"]["sets"]["held_out"]
    assert v.alpha_gain.value == pytest.approx(a["alpha"] - b["alpha"]) and v.alpha_gain.high < 0
    assert v.speed_ratio.value == pytest.approx(1.93 / 1.98, rel=0.03) and v.speed_ratio.high < 1
    assert v.answer.startswith("no, against the draft as given: acceptance per reached position")
    assert v.teacher.startswith("D as given (the self-teacher: its own greedy answers to 272 training prompts")
    assert v.swap == {"as_given": b["acceptance_rate"], "re_indexed": r["vocab_swap"]["sets"]["held_out"][
        "acceptance_rate"], "distilled": a["acceptance_rate"]}
    won = distillation_verdict(report(original=1.4, distilled=1.75, before_hits=30, after_hits=40, mapped=False))
    assert won.answer.startswith("yes, against the draft as given") and won.swap is None
    assert won.teacher.startswith("the target (T: its answers to 272 training prompts")


def test_the_page_and_report_md_open_with_the_table_fastest_first():
    from specdraft.measuring.report import questions_and_answers

    r = report(original=1.98, distilled=1.93)
    said = dict(questions_and_answers(r))
    assert said["Can I ship it?"].startswith("yes — the fastest: D as given in specdraft's decoder, 1.98x [1.88, "
                                             "2.08] the target alone")
    assert "with D as given" in said["How much faster will it be?"]
    agree = said["Can the draft agree more?"]
    assert agree.startswith("did distillation pay? no, against the draft as given") and "teacher: D as given" in agree
    assert "the vocabulary swap cost" in agree and "distillation won back" in agree


def test_the_export_directory_names_what_to_serve_per_engine(tmp_path):
    from specdraft.measuring.recommend import write_export_manifest

    choices = write_export_manifest(report(original=1.98, distilled=1.93), tmp_path / "export")
    text = (tmp_path / "export" / "README.md").read_text()
    table = [x for x in text.splitlines() if x.startswith("| ")][1:]  # the header's rule starts with "| -"
    table = [x for x in table if not x.startswith("| -")]
    assert table[0].startswith("| specdraft's decoder | D as given | 1.98x [1.88, 2.08] |")
    assert json.loads((tmp_path / "export" / "recommendation.json").read_text())[0]["which"] == "original"
    assert len(table) == len(choices) == 3


def test_the_run_prices_llama_cpp_from_the_packaged_timings_of_its_own_pair_only():
    from specdraft.serving.llama_cpp import packaged_bench, run_plan

    bench = packaged_bench()
    size = max(r["model_size"] for r in bench["drafts"]["smollm2-swapped-q8"]["llama_bench"])
    low = run_plan("qwen2.5-coder-1.5b-instruct", "/d.gguf", size, 0.66, "distilled")
    assert low["n_max"] == 0 and low["best_n"] == 3 and low["predicted_speedup"] < 1
    assert low["command"].startswith("llama-completion -m ") and "serve the target alone" in low["basis"]
    high = run_plan("qwen2.5-coder-1.5b-instruct", "/d.gguf", size, 0.99, "distilled")
    assert high["n_max"] >= 3 and high["band"][0] > 1
    assert high["command"].startswith("llama-speculative-simple -m ") and f"--spec-draft-n-max {high['n_max']}" in \
        high["command"] and "-md /d.gguf" in high["command"]
    other = run_plan("another-target", "/d.gguf", size, 0.99, "distilled", draft_ref="out/export/speculator")
    assert other["predicted_speedup"] is None and other["basis"].startswith("not priced: no llama-bench timings")
    # The command that prices it names the GGUFs rank cannot find itself: the draft's, and this target's.
    assert ("specdraft rank --engine llama.cpp --target another-target out/export/speculator --draft-gguf "
            "out/export/speculator=/d.gguf --target-gguf TARGET.gguf") in other["basis"]
    assert run_plan("qwen2.5-coder-1.5b-instruct", "/d.gguf", size * 3, 0.99, "distilled")["predicted_speedup"] is None
    # A draft 1.5x the timed one's bytes is priced from its timings scaled by the bytes: slower, so a lower forecast.
    big = run_plan("qwen2.5-coder-1.5b-instruct", "/d.gguf", int(size * 1.5), 0.99, "distilled")
    assert big["predicted_speedup"] < high["predicted_speedup"] and "1.50x its size" in big["basis"]


def test_the_packaged_llama_bench_timings_are_the_committed_benchs():
    from specdraft.serving.llama_cpp import packaged_bench

    bench = packaged_bench()
    result = json.loads((ROOT / bench["source"]).read_text())
    keep = lambda rows: [{k: r[k] for k in ("n_prompt", "n_gen", "avg_ts", "n_threads")} for r in rows]
    assert keep(bench["target"]["llama_bench"]) == keep(result["llama_bench"]["target"])
    for label, d in bench["drafts"].items():
        assert keep(d["llama_bench"]) == keep(result["llama_bench"][label])


def test_the_first_lines_time_scales_with_the_machines_measured_rate():
    from specdraft.run.pipeline import PRESET_TIMING, first_line, make_config

    cfg = make_config("default")
    minutes, ref = PRESET_TIMING["default"]
    slow = first_line(cfg, "runs/x", host_gb_s=ref / 2)
    assert f"~{2 * minutes:.0f} min on this machine" in slow
    assert f"~{minutes:.0f} min on this machine" in first_line(cfg, "runs/x", host_gb_s=ref)
