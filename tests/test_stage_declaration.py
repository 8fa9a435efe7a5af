"""A stage of the main job is one declaration: its inputs form its cache key, and the walk, the resume, report.json
and report.md all read it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specdraft.core.config import EvalConfig
from specdraft.data.sources import Example
from specdraft.models.loading import resolve_ref
from specdraft.run.pipeline import PIPELINE, STAGES, make_config, model_identity, run_pipeline
from specdraft.run.runner import PipelineError, Stage, computed, config, extends, stage_key, upstream
from specdraft.testing import save_tiny_pair


def _examples(words, prefix):
    return [Example(f"{prefix}-{w}", [{"role": "user", "content": f"a b {w}"}]) for w in words]


def test_a_stages_key_inputs_are_read_from_its_declaration():
    job = SimpleNamespace(cfg=SimpleNamespace(eval=EvalConfig(num_speculative_tokens=4), seed=7, gguf=None),
                          inputs={"first": {"a": 1}})
    stage = Stage("second", (extends("first"), upstream("first"), config("gamma", "eval.num_speculative_tokens"),
                             config("eval"), config("gguf", when=lambda j: j.cfg.gguf is not None),
                             computed("seed_twice", lambda j: 2 * j.cfg.seed)), run=lambda job, d: {})
    got = stage.key_inputs(job)
    assert got == {"a": 1, "first": {"a": 1}, "gamma": 4, "eval": EvalConfig(num_speculative_tokens=4).model_dump(),
                   "seed_twice": 14}
    assert [s.name for s in PIPELINE] + ["report"] == list(STAGES)


def test_a_toy_stage_added_by_one_declaration_runs_resumes_by_its_key_and_reports_its_section(tmp_path):
    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    cfg = make_config("tiny", target=tdir, draft=ddir, speed_prompts=0)
    train, ev, out = _examples("cdefghij", "t"), _examples("klm", "e"), tmp_path / "run"
    knob, runs = {"min_len": 2}, []

    def count_long_answers(job, d):
        runs.append(knob["min_len"])
        answers = job.results["eval_before"]["sets"]["held_out"]["answers"]
        return {"long_answers": sum(len(a) >= knob["min_len"] for a in answers)}

    # The whole of adding a stage: its declaration, appended to a copy of the list.
    toy = Stage("toy", (upstream("eval_before"), computed("min_len", lambda job: knob["min_len"])), count_long_answers,
                section=lambda r: [f"Toy: {r['toy']['long_answers']} long answers.", ""])
    stages = PIPELINE + (toy,)

    report = run_pipeline(cfg, out, eval_examples=ev, train_examples=train, stages=stages)
    answers = report["eval_before"]["sets"]["held_out"]["answers"]
    assert runs == [2] and report["toy"] == {"long_answers": sum(len(a) >= 2 for a in answers)} == {"long_answers": 3}
    assert f"Toy: {report['toy']['long_answers']} long answers." in (out / "report.md").read_text()
    assert json.loads((out / "report.json").read_text())["toy"] == report["toy"]
    marker = json.loads((out / "toy" / "stage.json").read_text())
    assert marker["inputs"] == {"eval_before": marker["inputs"]["eval_before"], "min_len": 2}
    # The existing stages' keys are those the pipeline composed by hand (a run already on disk keeps resuming).
    check = json.loads((out / "check" / "stage.json").read_text())
    ids = model_identity("target", resolve_ref(tdir)) | model_identity("draft", resolve_ref(ddir))
    assert check["key"] == stage_key({"target": tdir, "draft": ddir, **ids, "vocab_swap": False})
    before = json.loads((out / "eval_before" / "stage.json").read_text())["inputs"]
    distill = json.loads((out / "distill" / "stage.json").read_text())["inputs"]
    assert json.loads((out / "eval_after" / "stage.json").read_text())["key"] == stage_key(before | {"distill": distill})

    logs: list[str] = []  # the same inputs: skipped, its recorded result reported
    again = run_pipeline(cfg, out, log=logs.append, eval_examples=ev, train_examples=train, stages=stages)
    assert runs == [2] and again["toy"] == report["toy"] and again["timings"]["toy"]["skipped"]
    assert "[toy] done earlier with the same inputs — skipped" in logs

    knob["min_len"] = 100  # a changed input: refused by name, then rerun alone with overwrite
    with pytest.raises(PipelineError, match=r"finished 'toy' stage made from other inputs \(min_len: 2 → 100\)"):
        run_pipeline(cfg, out, eval_examples=ev, train_examples=train, stages=stages)
    redone = run_pipeline(cfg, out, eval_examples=ev, train_examples=train, stages=stages, overwrite=True)
    assert runs == [2, 100] and redone["toy"] == {"long_answers": 0}
    assert [k for k, v in redone["timings"].items() if not v["skipped"]] == ["toy", "report"]
    assert "Toy: 0 long answers." in (out / "report.md").read_text()
