"""bench/bench_distill_throughput.py in --quick mode on a tiny pair: the result file's structure and values."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from specdraft.testing import save_tiny_pair

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_distill_throughput.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_distill_throughput", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_run_on_a_tiny_pair_writes_every_part(tmp_path):
    bench = _bench()
    target, draft = save_tiny_pair(tmp_path / "pair", vocab_size=96, target_vocab=104)
    out = tmp_path / "results"
    result = bench.main(["--quick", "--target", target, "--draft", draft, "--out", str(out), "--top-k", "8",
                         "--threads", "1"])
    on_disk = json.loads((out / "distill-throughput-quick.json").read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert on_disk["quick"] is True and on_disk["command"].startswith("bench/bench_distill_throughput.py --quick")
    assert "threads" in on_disk["machine"]
    names = list(bench.CONTENDERS)
    s = on_disk["settings"]

    step = on_disk["step"]
    assert set(step["tokens_per_minute"]) == set(names)
    assert all(_positive(v) for v in step["tokens_per_minute"].values())
    # Every row trains all its predictions but the last: batches × batch × (seq − 1) per repeat, each contender.
    assert step["trained_tokens_per_repeat"] == {n: s["batches"] * s["batch"] * (s["seq"] - 1) for n in names}
    assert step["speedup_vs_float32"][bench.REFERENCE] == pytest.approx(1.0)
    assert all(len(v) == s["repeats"] and all(_positive(x) for x in v) for v in step["seconds"].values())

    curve = on_disk["curve"]
    assert curve["steps"] == s["steps"]
    assert all(len(v) == s["steps"] and all(_positive(x) for x in v) for v in curve["loss"].values())
    assert curve["precision"] == {n: p for n, (p, _f) in bench.CONTENDERS.items()}
    assert set(curve["max_abs_delta"]) == set(names) - {bench.REFERENCE}
    for n, d in curve["max_abs_delta"].items():
        assert math.isfinite(d) and d >= 0
        assert d == pytest.approx(max(abs(a - b) for a, b in zip(curve["loss"][n], curve["loss"][bench.REFERENCE])))
    assert math.isfinite(curve["noise"]) and curve["noise"] >= 0
    # The float32 and bf16 runs train on the same batches in the same order: the bf16 curve stays close.
    assert curve["max_abs_delta"]["bf16_hidden"] < 0.05
    assert set(curve["exact_final_loss"]) == set(names) and all(_positive(v) for v in curve["exact_final_loss"].values())
    assert curve["exact_final_delta"]["bf16_hidden"] < 0.05
    assert curve["exact_within_noise"] == {n: d <= curve["noise"] for n, d in curve["exact_final_delta"].items()}
    left = curve["topk_leftover_mass"]
    assert 0 < left["mean"] <= left["max"] < 1  # top-8 of 96 ids on a random tiny target leaves mass out

    dump = on_disk["dump"]
    assert set(dump["tokens_per_minute"]) == {"generated", "teacher_forced"}
    assert all(_positive(v) for v in dump["tokens_per_minute"].values()) and _positive(dump["speedup"])
    assert all(_positive(v) for v in dump["answer_tokens"].values())
    gen = dump["runs"]["generated"]
    assert len(gen) == s["repeats"] and len(dump["runs"]["teacher_forced"]) == s["repeats"]
    # answer_only: the trained tokens of a generated dump are the target's answers, at most --generate per prompt.
    assert gen[0]["answer_tokens"] <= gen[0]["generated_tokens"] <= 4 * s["generate"]
    assert dump["sequences"]["teacher_forced"] + dump["skipped_empty_answers"] == dump["sequences"]["generated"]
    assert set(on_disk["phase_seconds"]) == {"teacher_signal", "step", "curve", "dump"}


@pytest.mark.parametrize("argv, says", [
    (["--steps", "1"], "--steps 1"),
    (["--seq", "1"], "--seq 1"),
    (["--target", "/nonexistent/model-dir"], "--target /nonexistent/model-dir"),
    (["--prompts", "no-such-source:0:4"], "no-such-source"),
    (["--text", "mt-bench:0:1", "--seq", "4096"], "--text mt-bench:0:1 gives"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, argv, says):
    bench = _bench()
    target, draft = save_tiny_pair(tmp_path / "pair")
    out = tmp_path / "results"
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--target", target, "--draft", draft, "--out", str(out), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0]
    assert not out.exists()  # nothing written


def test_run_all_renders_the_throughput_section(tmp_path, monkeypatch):
    """The docs/benchmarks.md section from a result of the shape main writes (values hand-made, so each can be found)."""
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    import run_all

    names = ["float32_hidden", "bf16_hidden", "bf16_topk"]
    r = {"command": "bench/bench_distill_throughput.py", "date": "2026-01-01", "machine": "m", "torch": "t",
         "target": "T", "draft": "D", "fast_path": "bf16_topk", "reference": "float32_hidden",
         "contenders": {n: {"precision": "float32" if n.startswith("float32") else "bf16-autocast",
                            "teacher": n.split("_")[1]} for n in names},
         "settings": {"batches": 4, "batch": 2, "seq": 256, "text": "sharegpt:0:32", "loss": "tvd", "dtype": "bfloat16",
                      "repeats": 3, "lr": 1e-5, "top_k": 64, "dump_format": "topk", "dump_batch": 8,
                      "prompts": "sharegpt:0:16", "generate": 64},
         "step": {"optimizer": "AdamW", "tokens_per_minute": dict(zip(names, [1000.0, 2500.0, 3300.0])),
                  "speedup_vs_float32": dict(zip(names, [1.0, 2.5, 3.3]))},
         "curve": {"steps": 20, "noise": 0.01, "final_loss": dict(zip(names, [0.5, 0.501, 0.49])),
                   "max_abs_delta": {"bf16_hidden": 0.002, "bf16_topk": 0.02},
                   "mean_abs_delta": {"bf16_hidden": 0.001, "bf16_topk": 0.015},
                   "within_noise": {"bf16_hidden": True, "bf16_topk": False},
                   "exact_final_loss": dict(zip(names, [0.45, 0.451, 0.452])),
                   "exact_within_noise": {"bf16_hidden": True, "bf16_topk": True},
                   "topk_leftover_mass": {"mean": 0.012, "max": 0.2}},
         "dump": {"tokens_per_minute": {"generated": 900.0, "teacher_forced": 4500.0}, "speedup": 5.0,
                  "answer_tokens": {"generated": 1024, "teacher_forced": 1020}}}
    (tmp_path / "distill-throughput.json").write_text(json.dumps(r))
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    text = "\n".join(run_all._render_distill_throughput())
    assert "| bf16 autocast, topk teacher (top 64) | 3,300 | 3.30x |" in text
    assert "| bf16 autocast, topk teacher (top 64) | 0.4900 | 0.0200 | 0.0150 | False | 0.4520 | True |" in text
    assert "×3 at equal quality" in text and ": met (3.30x; equal quality True)" in text
    assert "| teacher-forced existing text | 1,020 | 4,500 |" in text and "5.0x" in text
    assert run_all._render_distill_throughput("absent.json") == []


def test_a_draft_of_another_tokenizer_is_refused_before_any_model_loads(tmp_path, capsys):
    from specdraft.testing import tiny_tokenizer

    bench = _bench()
    target, _ = save_tiny_pair(tmp_path / "a")
    _, other = save_tiny_pair(tmp_path / "b", tokenizer=tiny_tokenizer(128, swap=(10, 11)))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--target", target, "--draft", other, "--out", str(tmp_path / "results")])
    assert exc.value.code == 2
    assert "has another tokenizer than --target" in capsys.readouterr().err
