"""What more compute buys: the default preset's distillation route, run long, with held-out greedy acceptance
measured against CPU-minutes (teacher signal + training) on this machine.

The stages before training are the main job's own (:mod:`specdraft.run.pipeline`'s stage code, cached in ``--work``
and reused on a re-run): check → ``eval_before`` (the target's held-out answers; the draft as given, through the
vocabulary mapping) → ``vocab_swap`` (the re-indexed draft, counted by replay on those answers: step 0 of the
curve) → ``dump`` (the target's teacher signal on the preset's training prompts). Then one distillation with the
preset's route (loss, learning rates of body and rows, head untied, batch geometry), ``--steps`` optimizer steps
under one cosine schedule; every ``--every`` steps a bfloat16 copy of the draft being trained is replayed on the
held-out answers (:func:`specdraft.testing.replay_greedy`: the counts ``eval_after`` takes), per set, with the paired
gain over the re-indexed draft and its 95% bootstrap interval over prompts. The replays' seconds are left out of
the training minutes; the dump's minutes (the preset's teacher signal, made once) are added to every point.

A point at step s of this run is not the same as a run of s steps: the schedule here decays over ``--steps``.
The default preset's own budget (its steps) is marked for reference; its measured figure is the main job's.

Writes ``bench/results/<--result-name>.json`` (default ``distill-curve-default``).

    python bench/bench_distill_curve.py [--steps 100 --every 10 --work runs/bench-distill-curve]
                                        [--train-prompts humaneval:0:100 --train-prompts mt-bench:1:14:6 ...]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from specdraft.core.stats import paired_gain_from_rows
from specdraft.run import pipeline as pl


class CurveCallback:
    """A ``transformers.TrainerCallback`` (its ``callback``): at step 1 and every ``every`` steps, replays a bf16
    copy of the draft on each set's held-out answers and appends the point (step, training minutes so far with the
    replays left out, acceptance and paired gain per set) to ``path``, rewritten atomically."""

    def __init__(self, every: int, tok, prompt_ids: dict, baseline: dict, gamma: int, max_new_tokens: int,
                 eos: list[int], path: Path, dump_minutes: float, measure_start: bool = False):
        from transformers import TrainerCallback

        self.every, self.tok, self.prompt_ids, self.baseline = every, tok, prompt_ids, baseline
        # measure_start: step 0 is this callback's own replay of the draft as training receives it (untied, in the
        # replay's bf16 copy), and every later gain is paired against it, so no point differs from step 0 by how it
        # was measured rather than by training.
        self.measure_start = measure_start
        self.gamma, self.max_new_tokens, self.eos, self.path = gamma, max_new_tokens, eos, path
        self.dump_minutes, self.points, self.replay_seconds, self.t0 = dump_minutes, [], 0.0, None
        outer = self

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kw):
                outer.t0 = time.time()
                if outer.measure_start and not outer.points:
                    outer.measure(state.global_step, model.draft, rebase=True)

            def on_step_end(self, args, state, control, model=None, **kw):
                if state.global_step % outer.every == 0 or state.global_step == args.max_steps:
                    outer.measure(state.global_step, model.draft)

        self.callback = _CB()

    def counts(self, draft, rebase: bool = False) -> dict:
        from specdraft.testing import replay_greedy

        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        out = {}
        with torch.no_grad():
            for name, b in self.baseline.items():
                counts = replay_greedy(draft, self.prompt_ids[name], b["answers"], self.gamma, self.max_new_tokens,
                                       self.eos, real_vocab=len(self.tok), pad_id=pad)
                rows = [{"id": r["id"], "accepted": sum(c.accepted), "proposed": sum(c.proposed)}
                        for r, c in zip(b["rows"], counts, strict=True)]
                if rebase:
                    b["rows"] = rows
                g = paired_gain_from_rows(b["rows"], rows)
                out[name] = {"acceptance": sum(r["accepted"] for r in rows) / max(1, sum(r["proposed"] for r in rows)),
                             "gain": g.value, "gain_ci95": list(g.interval), "prompts": len(rows),
                             "proposed": sum(r["proposed"] for r in rows)}
        return out

    def measure(self, step: int, draft, rebase: bool = False) -> None:
        t = time.time()
        train_minutes = (t - self.t0 - self.replay_seconds) / 60
        was_training = draft.training
        copy_ = copy.deepcopy(draft).to(torch.bfloat16).eval()
        point = {"step": step, "train_minutes": train_minutes, "cpu_minutes": self.dump_minutes + train_minutes,
                 "sets": self.counts(copy_, rebase)}
        del copy_
        draft.train(was_training)
        gc.collect()
        point["replay_seconds"] = time.time() - t
        self.replay_seconds += point["replay_seconds"]
        self.points.append(point)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.points, indent=1))
        tmp.replace(self.path)
        print(f"[curve] step {step} · {point['cpu_minutes']:.1f} CPU-min · " + ", ".join(
            f"{n} {v['acceptance']:.3f} ({v['gain']:+.3f})" for n, v in point["sets"].items()), flush=True)


def prepare_stages(cfg, work: Path, command: str, log=print, dump: bool = True) -> dict:
    """The main job's stages before training, cached in ``work`` (:class:`specdraft.run.runner.Runner`): check →
    ``eval_before`` (the target's held-out answers) → ``vocab_swap`` (the re-indexed draft, replayed) → with ``dump``
    the target's teacher dump of the preset. Returns ``{"runner", "plan", "before", "swap", "dump", "dump_seconds"}``
    (the last two None without ``dump``)."""
    runner = pl.Runner(work, command, log)
    plan = pl._preflight(cfg, work, log, None, None)
    fingerprint = {"target": cfg.target, "draft": cfg.draft}
    serving = {k: getattr(cfg.distill, k) for k in ("temperature", "top_k", "top_p")}
    eval_inputs = fingerprint | {"eval": cfg.eval.model_dump(), "serving": serving,
                                 "prompts": {k: [e.id for e in v] for k, v in plan.sets.items()}}
    job = pl._Job(cfg, plan, work, command, log)  # the main job's stage functions, under this bench's own keys
    res = job.results
    res["check"] = runner.stage("check", fingerprint | {"vocab_swap": cfg.vocab_swap}, lambda d: pl._run_check(job, d))
    before = res["eval_before"] = runner.stage(
        "eval_before", eval_inputs, lambda d: pl._count(job, d, plan.draft.path, True, "eval_before"))
    swap = res["vocab_swap"] = runner.stage("vocab_swap", eval_inputs | {"dtype": cfg.distill.dtype},
                                            lambda d: pl._run_swap(job, d))
    out = {"runner": runner, "plan": plan, "before": before, "swap": swap, "dump": None, "dump_seconds": None}
    if dump:
        out |= target_dump(cfg, work, command, runner, plan, log)
    return out


def target_dump(cfg, work: Path, command: str, runner, plan, log=print) -> dict:
    """The preset's target dump stage (cached in ``work/dump``): ``{"dump": its result, "dump_seconds"}``."""
    dump_inputs = {"target": cfg.target, "dump": cfg.dump.model_dump(), "prompts": [e.id for e in plan.trains]}
    target_taught = cfg.model_copy(update={"self_teacher": None, "target_dump_prompts": None})
    job = pl._Job(target_taught, plan, work, command, log)
    dump = runner.stage("dump", dump_inputs, lambda d: pl._run_dump(job, d))
    return {"dump": dump, "dump_seconds": json.loads((work / "dump" / "stage.json").read_text())["seconds"]}


def replay_setup(cfg, plan, before: dict, swap: dict) -> tuple:
    """What the curve replays: ``(tokenizer, prompt ids per set, baseline per set (the re-indexed draft's rows and the
    target's answers), stop ids)`` for :class:`CurveCallback`."""
    from specdraft.data.sources import encode_prompts
    from specdraft.measuring.evaluate import eos_ids
    from specdraft.models.loading import load_model, load_tokenizer

    tok = load_tokenizer(swap["path"])
    prompt_ids = {name: encode_prompts(tok, examples) for name, examples in plan.sets.items()}
    draft0, _ = load_model(swap["path"], dtype="bfloat16")
    eos = eos_ids(draft0, tok)
    del draft0
    baseline = {name: swap["sets"][name] | {"answers": before["sets"][name]["answers"]} for name in plan.sets}
    return tok, prompt_ids, baseline, eos


def start_point(swap: dict, minutes: float) -> dict:
    """Step 0 of a curve: the re-indexed draft as swapped, at ``minutes`` (the teacher signal's)."""
    return {"step": 0, "train_minutes": 0.0, "cpu_minutes": minutes,
            "sets": {n: {"acceptance": s["acceptance_rate"], "gain": 0.0, "gain_ci95": [0.0, 0.0],
                         "prompts": len(s["rows"])} for n, s in swap["sets"].items()}}


def prepare_training(cfg, work: Path, command: str, train_specs: list[str], teacher: str) -> tuple[list, dict]:
    """The training prompts of ``train_specs`` (distinct) and :func:`prepare_stages` (no target dump) in ``work``;
    refuses (``SystemExit``, naming ``teacher``) training prompts that hold a held-out one."""
    from specdraft.data.prompts import load_prompts

    examples = load_prompts(train_specs, held_out=False, unique=True)
    work.mkdir(parents=True, exist_ok=True)
    stages = prepare_stages(cfg, work, command, dump=False)
    if overlap := pl.prompt_overlap(examples, [e for v in stages["plan"].sets.values() for e in v]):
        raise SystemExit(f"error: {teacher}'s prompts hold {len(overlap)} held-out prompt(s), e.g. {overlap[:3]}")
    return examples, stages


def route_overrides(route: dict, items: list[str]) -> dict:
    """``route`` with each ``--set FIELD=VALUE`` applied (the value read as JSON where it parses, else a string;
    ``FIELD`` alone sets None)."""
    out = dict(route)
    for item in items:
        field, sep, value = item.partition("=")
        try:
            out[field] = json.loads(value) if sep else None
        except json.JSONDecodeError:
            out[field] = value
    return out


def write_result(out: Path, name: str, result: dict) -> Path:
    """``out/<name>.json``, written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default", help="the pipeline preset whose road and route are run")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps of the long run (one cosine schedule)")
    ap.add_argument("--every", type=int, default=10, help="steps between curve points")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-distill-curve"), help="stage cache (resumable)")
    ap.add_argument("--result-name", default="distill-curve-default")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.add_argument("--prepare-only", action="store_true", help="stop after the dump (the stages are cached)")
    ap.add_argument("--train-prompts", action="append", default=None, metavar="SOURCE",
                    help="training prompt source (repeatable; default the preset's): a bigger dump, what more "
                         "compute would also buy, in its own --work")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a field of the preset's distillation settings (VALUE read as JSON, else a "
                         "string), e.g. --set row_lr=3e-3: another route on the same stages")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        ap.error("--steps and --every must be ≥ 1")
    from specdraft.training.distill import run_distill

    command = "python " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    cfg = pl.make_config(args.preset, train_prompts=args.train_prompts)
    if not cfg.vocab_swap:
        ap.error(f"preset {args.preset!r} has no vocabulary swap: this curve starts from the re-indexed draft")
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    stages = prepare_stages(cfg, work, command)
    plan, before, swap, dump, dump_seconds = (stages[k] for k in ("plan", "before", "swap", "dump", "dump_seconds"))
    if args.prepare_only:
        return {"work": str(work), "dump_minutes": dump_seconds / 60}

    tok, prompt_ids, baseline, eos = replay_setup(cfg, plan, before, swap)
    overrides = {}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep or field not in type(cfg.distill).model_fields:
            ap.error(f"--set {item!r}: give FIELD=VALUE with FIELD one of the distillation settings")
        try:
            overrides[field] = json.loads(value)
        except json.JSONDecodeError:
            overrides[field] = value
    dcfg = type(cfg.distill).model_validate(cfg.distill.model_dump() | overrides
                                            | {"max_steps": args.steps, "save_steps": args.steps + 1})
    curve_path = work / "curve.json"
    cb = CurveCallback(args.every, tok, prompt_ids, baseline, cfg.eval.num_speculative_tokens,
                       cfg.eval.max_new_tokens, eos, curve_path, dump_seconds / 60)
    start = start_point(swap, dump_seconds / 60)
    gc.collect()
    t0 = time.time()
    res = run_distill(cfg.target, swap["path"], work / "dump", work / f"distill-{args.result_name}", dcfg,
                      resume=False,
                      num_speculative_tokens=cfg.eval.num_speculative_tokens, callbacks=[cb.callback])
    wall = time.time() - t0
    points = [start] + cb.points
    best = max(cb.points, key=lambda p: p["sets"]["held_out"]["acceptance"]) if cb.points else start
    preset_steps = pl.preset_fields(args.preset)["distill"]["max_steps"]
    result = {
        "command": command, "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
        f"{torch.get_num_threads()} threads", "torch": torch.__version__, "preset": args.preset,
        "pair": {"target": cfg.target, "draft": cfg.draft}, "train_prompts": cfg.train_prompts, "route": {k: dcfg.model_dump()[k] for k in (
            "loss", "train", "lr", "row_lr", "untie_head", "batch_size", "gradient_accumulation_steps", "scheduler",
            "warmup_ratio", "precision", "held_out_fraction")}, "overrides": overrides,
        "steps": args.steps, "every": args.every, "preset_steps": preset_steps,
        "sets": {n: {"sources": cfg.eval_prompts if n == "held_out" else cfg.ood_prompts,
                     "prompts": len(plan.sets[n]), "target_answer_tokens": sum(map(len, before["sets"][n]["answers"])),
                     "as_given_mapped": before["sets"][n]["acceptance_rate"],
                     "re_indexed": swap["sets"][n]["acceptance_rate"]} for n in plan.sets},
        "dump": {"sequences": dump["sequences"], "tokens": dump["tokens"], "minutes": dump_seconds / 60},
        "train_sequences": res.metrics.train_sequences, "train_minutes": cb.points[-1]["train_minutes"]
        if cb.points else 0.0, "replay_minutes": cb.replay_seconds / 60, "wall_minutes": wall / 60,
        "points": points, "best": {"step": best["step"], "cpu_minutes": best["cpu_minutes"],
                                   "held_out": best["sets"]["held_out"]},
        "x_axis": "CPU-minutes = the dump's minutes + training minutes to the step (replays left out), 2 cores",
    }
    write_result(args.out, args.result_name, result)
    print(json.dumps({"best": result["best"], "wall_minutes": result["wall_minutes"]}))
    return result


if __name__ == "__main__":
    main()
