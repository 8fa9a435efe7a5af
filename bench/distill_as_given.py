"""Distilling the draft as given: the target's signal carried onto the draft's own tokens, a learning curve of the
draft's acceptance through text (as the main job counts it) against CPU-minutes.

The stages before training are ``bench_distill_curve.py``'s (the default preset's check → ``eval_before``: the
target's greedy answers to held-out code ``humaneval:100:16:4`` and chat ``mt-bench:0:14:6``), cached in ``--work``.
Then:

1. **teacher dump** (stage ``teacher-<name>``, :func:`specdraft.training.as_given_teacher.run_as_given_teacher`): the answers
   to ``--train-prompts`` (never the held-out sets) written by ``--answers`` (the draft as given: on-policy; the
   target: its greedy answers), scored by the target, carried onto draft ids (``--carry``), ``--unaligned`` positions
   hard-labelled or skipped. ``--also-dump`` adds another such dump (its name) to the training mix.
2. **distillation** of the draft as given on it (``--loss``, ``--lr``; 8 sequences a step; cosine over ``--steps``),
   replayed every ``--every`` steps on the target's held-out answers through the draft's text proposals at γ 5
   (:func:`specdraft.decoding.replay.replay_mapped`, as ``eval_before`` counts it): acceptance (accepted/proposed), α per
   reached position, and the gain paired per prompt against step 0 (the draft as given, replayed by this callback).

CPU-minutes of a point = the dump's minutes + training minutes to the step (replays left out).
Writes ``bench/results/<--result-name>.json`` (``--smoke``: ``--work``).

    python bench/distill_as_given.py --answers draft --carry first_piece --steps 60 --every 15
    python bench/distill_as_given.py --smoke
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

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))

import bench_distill_curve as curve

from specdraft.run import pipeline as pl

TRAIN_PROMPTS = ["humaneval:0:100", "conversations", "sharegpt:0:120"]
ROUTE = {"loss": "tvd", "lr": 5e-5, "batch_size": 2, "gradient_accumulation_steps": 4, "scheduler": "cosine",
         "warmup_ratio": 0.1, "train": "all", "untie_head": False, "head_support": None, "row_lr": None,
         "on_policy_fraction": 0.0}


class MappedCurve:
    """A ``transformers.TrainerCallback`` (``callback``): at the start and every ``every`` steps, a bf16 copy of the
    draft as given is replayed through text proposals on each set's held-out target answers."""

    def __init__(self, every, mapping, prompt_ids, answers, gamma, max_new, eos, width, real, path, dump_minutes):
        from transformers import TrainerCallback

        self.every, self.mapping, self.prompt_ids, self.answers = every, mapping, prompt_ids, answers
        self.gamma, self.max_new, self.eos, self.width, self.real = gamma, max_new, eos, width, real
        self.path, self.dump_minutes = path, dump_minutes
        self.points, self.base, self.replay_seconds, self.t0 = [], None, 0.0, None
        outer = self

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kw):
                outer.t0 = time.time()
                if not outer.points:
                    outer.measure(0, model.draft)

            def on_step_end(self, args, state, control, model=None, **kw):
                if state.global_step % outer.every == 0 or state.global_step == args.max_steps:
                    outer.measure(state.global_step, model.draft)

        self.callback = _CB()

    def rows(self, draft) -> dict:
        from specdraft.decoding.replay import replay_mapped

        out = {}
        for name, prompts in self.prompt_ids.items():
            counts = replay_mapped(draft, self.mapping, prompts, self.answers[name], self.gamma, self.max_new,
                                   set(self.eos), self.width, self.real, "text")
            out[name] = [{"id": k, "accepted": sum(c.accepted), "proposed": sum(c.proposed),
                          "reached": sum(c.reached)} for k, c in enumerate(counts)]
        return out

    def measure(self, step: int, draft) -> None:
        from specdraft.core.stats import paired_gain_from_rows

        t = time.time()
        train_minutes = (t - self.t0 - self.replay_seconds) / 60
        was = draft.training
        c = copy.deepcopy(draft).to(torch.bfloat16).eval()
        with torch.no_grad():
            rows = self.rows(c)
        del c
        draft.train(was)
        gc.collect()
        if self.base is None:
            self.base = rows
        sets = {}
        for name, r in rows.items():
            acc, prop, reach = (sum(x[k] for x in r) for k in ("accepted", "proposed", "reached"))
            g = paired_gain_from_rows(self.base[name], r)
            g2 = paired_gain_from_rows(self.base[name], r, denominator="reached")
            sets[name] = {"acceptance": acc / max(1, prop), "alpha_per_reached": acc / max(1, reach),
                          "gain": g.value, "gain_ci95": list(g.interval),
                          "gain_per_reached": g2.value, "gain_per_reached_ci95": list(g2.interval),
                          "prompts": len(r), "proposed": prop, "rows": r}
        point = {"step": step, "train_minutes": train_minutes, "cpu_minutes": self.dump_minutes + train_minutes,
                 "replay_seconds": time.time() - t, "sets": sets}
        self.replay_seconds += point["replay_seconds"]
        self.points.append(point)
        curve.write_result(self.path.parent, self.path.stem, {"points": self.points})
        print(json.dumps({"step": step, **{n: round(s["acceptance"], 4) for n, s in sets.items()},
                          "gain": {n: [round(s["gain"], 4), [round(x, 4) for x in s["gain_ci95"]]]
                                   for n, s in sets.items()}}), flush=True)


def teacher_stage(cfg, plan, examples, tcfg, command, work: Path, runner, name: str) -> tuple[dict, float]:
    from specdraft.training.as_given_teacher import run_as_given_teacher

    def run(d: Path) -> dict:
        m = run_as_given_teacher(plan.target.path, plan.draft.path, examples, d / "dump", tcfg, command=command,
                                 cache=work / "teacher-cache")
        return {"sequences": m["sequences"], "tokens": m["tokens"], "trained_tokens": m["trained_tokens"],
                "signal": m["signal"], "dump": str(d / "dump"), "config": tcfg.model_dump()}

    inputs = {"draft": cfg.draft, "target": cfg.target, "teacher": tcfg.model_dump(),
              "prompts": [e.id for e in examples]}
    res = runner.stage(f"teacher-{name}", inputs, run)
    minutes = json.loads((work / f"teacher-{name}" / "stage.json").read_text())["seconds"] / 60
    return res, minutes


def main(argv: list[str] | None = None) -> dict:
    from specdraft.core.config import AsGivenTeacherConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", choices=["draft", "target"], default="draft")
    ap.add_argument("--carry", choices=["twins", "first_piece", "none"], default="first_piece")
    ap.add_argument("--unaligned", choices=["skip", "hard"], default="skip")
    ap.add_argument("--train-prompts", action="append", default=None, metavar="SOURCE")
    ap.add_argument("--generate", type=int, default=192)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--also-dump", action="append", default=[], metavar="NAME",
                    help="another teacher stage of --work (its name) mixed into training")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=15)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a route field")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-as-given"))
    ap.add_argument("--result-name", default=None)
    ap.add_argument("--out", type=Path, default=BENCH / "results")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    overrides = curve.route_overrides(ROUTE, args.set)
    command = "python " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    smoke = {}
    if args.smoke:
        smoke = {"eval_prompts": ["humaneval:100:2"], "ood_prompts": ["mt-bench:0:2:6"],
                 "train_prompts": ["humaneval:0:2"], "eval": {"max_new_tokens": 16, "num_speculative_tokens": 5}}
        args.train_prompts, args.generate, args.steps, args.every = ["humaneval:0:4"], 16, 2, 1
        args.out = args.work
    name = f"{args.answers}-{args.carry}-{args.unaligned}-k{args.top_k}-g{args.generate}"
    result_name = args.result_name or f"distill-as-given-{name}"
    cfg = pl.make_config("default", **smoke)
    train_specs = args.train_prompts or TRAIN_PROMPTS
    work = args.work
    examples, stages = curve.prepare_training(cfg, work, command, train_specs, "the teacher")
    runner, plan, before = stages["runner"], stages["plan"], stages["before"]
    tcfg = AsGivenTeacherConfig(answers=args.answers, carry=args.carry, unaligned=args.unaligned,
                                generate=args.generate, top_k=args.top_k)
    dumps, minutes = [], 0.0
    res, m = teacher_stage(cfg, plan, examples, tcfg, command, work, runner, name)
    dumps.append(res)
    minutes += m
    for other in args.also_dump:
        st = json.loads((work / f"teacher-{other}" / "stage.json").read_text())
        dumps.append(st["result"])  # the runner keeps a stage's result in its stage.json
        minutes += st["seconds"] / 60

    from specdraft.data.sources import encode_prompts
    from specdraft.models.loading import load_tokenizer
    from specdraft.models.vocab import build_vocab_mapping
    from specdraft.training.distill import run_distill

    ttok = load_tokenizer(plan.target.path)
    mapping = build_vocab_mapping(plan.target.path, plan.draft.path)
    prompt_ids = {n: encode_prompts(ttok, ex) for n, ex in plan.sets.items()}
    answers = {n: before["sets"][n]["answers"] for n in plan.sets}
    from transformers import AutoConfig

    width = int(AutoConfig.from_pretrained(plan.target.path).vocab_size)
    eos = eos_ids_of(plan.target.path, ttok)
    cb = MappedCurve(args.every, mapping, prompt_ids, answers, cfg.eval.num_speculative_tokens,
                     cfg.eval.max_new_tokens, eos, width, len(ttok), work / f"curve-{result_name}.json", minutes)
    dcfg = type(cfg.distill).model_validate(cfg.distill.model_dump() | overrides
                                            | {"max_steps": args.steps, "save_steps": args.steps + 1})
    gc.collect()
    t0 = time.time()
    res = run_distill(cfg.target, plan.draft.path, [d["dump"] for d in dumps], work / f"distill-{result_name}", dcfg,
                      resume=False, num_speculative_tokens=cfg.eval.num_speculative_tokens, callbacks=[cb.callback])
    best = max(cb.points[1:] or cb.points, key=lambda p: p["sets"]["held_out"]["acceptance"])
    result = {
        "command": command, "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
        "pair": {"target": cfg.target, "draft": cfg.draft}, "smoke": args.smoke,
        "teacher": {"train_prompts": train_specs, "dumps": [{k: d[k] for k in ("sequences", "tokens", "trained_tokens",
                                                                                "signal", "config")} for d in dumps],
                    "minutes": minutes},
        "route": {k: dcfg.model_dump()[k] for k in ("loss", "train", "lr", "untie_head", "batch_size",
                                                     "gradient_accumulation_steps", "scheduler", "warmup_ratio",
                                                     "precision", "held_out_fraction", "head_support")},
        "steps": args.steps, "every": args.every,
        "sets": {n: {"sources": cfg.eval_prompts if n == "held_out" else cfg.ood_prompts, "prompts": len(plan.sets[n]),
                     "as_given_eval_before": before["sets"][n]["acceptance_rate"]} for n in plan.sets},
        "train_sequences": res.metrics.train_sequences, "wall_minutes": (time.time() - t0) / 60,
        "replay_minutes": cb.replay_seconds / 60, "points": cb.points,
        "best": {"step": best["step"], "cpu_minutes": best["cpu_minutes"],
                 **{n: {k: v for k, v in s.items() if k != "rows"} for n, s in best["sets"].items()}},
        "speculator": str(res.speculator),
        "x_axis": "CPU-minutes = the teacher dumps' minutes + training minutes to the step (replays left out)",
    }
    path = curve.write_result(args.out, result_name, result)
    print(json.dumps({"result": str(path), "best": result["best"], "wall_minutes": result["wall_minutes"]}))
    return result


def eos_ids_of(target_path, ttok):
    from specdraft.measuring.evaluate import eos_ids
    from specdraft.models.loading import load_model

    m, _ = load_model(target_path, dtype="bfloat16")
    out = eos_ids(m, ttok)
    del m
    return out


if __name__ == "__main__":
    main()
