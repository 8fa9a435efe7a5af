"""Route: the draft as given teaches its re-indexed copy (specdraft.training.self_teacher), with no target compute, then
optionally the target's own dump after it — a learning curve of held-out acceptance against CPU-minutes.

The stages before training are ``bench_distill_curve.py``'s (the default preset's check → ``eval_before``: the
target's answers to held-out code ``humaneval:100:16:4`` and chat ``mt-bench:0:14:6`` → ``vocab_swap``: the
re-indexed draft, step 0), cached in ``--work``. Then:

1. **self-teacher dump** (stage ``self_teacher``): SmolLM2-135M-Instruct as given answers ``--train-prompts`` (never
   the held-out sets: HumanEval 100+ and MT-Bench's held-out rows are refused) greedily, ``--generate`` tokens, its
   answers re-encoded in the target's tokenizer; ``--token-level`` adds its mapped distribution where twins and
   boundaries align, ``--text`` plain text files.
2. **phase 1**: the re-indexed draft distilled on it (soft_ce, which on hard labels is the cross-entropy; head
   untied; body lr 3e-4, rows lr 1e-3; 8 sequences a step; cosine over ``--steps``), replayed every ``--every``
   steps on the held-out answers (:class:`bench_distill_curve.CurveCallback`: acceptance and the paired gain over
   the re-indexed draft per set).
3. **phase 2** (``--target-steps N`` > 0): the preset's target dump (the existing route's teacher), and the phase-1
   draft distilled on it for N more steps under the preset's route, its points continuing the curve (steps and
   minutes added after phase 1's).

CPU-minutes of a point = the teacher signals' minutes so far (self-teacher dump; + the target dump in phase 2) +
training minutes to the step (replays left out). Writes ``bench/results/<--result-name>.json``.

    python bench/swap_routes/self_teacher.py --steps 60 --every 10 [--target-steps 20] [--token-level]
    python bench/swap_routes/self_teacher.py --smoke        # 2 prompts per set, 2 steps: does it run end to end
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))

import bench_distill_curve as curve

from specdraft.run import pipeline as pl

#: Training prompts of the self-teacher by default: code (HumanEval's training split) and chat (the embedded
#: conversations and ShareGPT's training rows); the evaluation sets stay held out.
TRAIN_PROMPTS = ["humaneval:0:100", "conversations", "sharegpt:0:300"]
#: Phase 1's route (the brief's: CE on hard labels, untied head, body and rows at their own rates, 8 sequences a step).
ROUTE = {"loss": "soft_ce", "untie_head": True, "lr": 3e-4, "row_lr": 1e-3, "batch_size": 2,
         "gradient_accumulation_steps": 4, "scheduler": "cosine", "warmup_ratio": 0.1, "train": "all"}


def self_teacher_stage(cfg, plan, examples, args, command):
    """The self-teacher dump as a pipeline stage (cached in ``work/self_teacher``): its manifest's counts."""
    from specdraft.core.config import SelfTeacherConfig
    from specdraft.training.self_teacher import run_self_teacher

    st_cfg = SelfTeacherConfig(generate=args.generate, top_logprobs=args.top_k, token_level=args.token_level,
                               max_length=args.max_length, batch_size=args.batch_size, dtype="bfloat16")

    def run(d: Path) -> dict:
        m = run_self_teacher(plan.draft.path, plan.target.path, examples, d / "dump", st_cfg, texts=args.text,
                             command=command)
        return {"sequences": m["sequences"], "tokens": m["tokens"], "trained_tokens": m["trained_tokens"],
                "signal": m["signal"], "generated_tokens": m["this_run"]["generated_tokens"],
                "dump": str(d / "dump"), "config": st_cfg.model_dump()}

    return run, st_cfg


def distil(cfg, draft_path, dump_dir, out, overrides, steps, cb):
    from specdraft.training.distill import run_distill

    dcfg = type(cfg.distill).model_validate(cfg.distill.model_dump() | overrides
                                            | {"max_steps": steps, "save_steps": steps + 1})
    res = run_distill(cfg.target, draft_path, dump_dir, out, dcfg, resume=False,
                      num_speculative_tokens=cfg.eval.num_speculative_tokens, callbacks=[cb.callback])
    return res, dcfg


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="phase 1's optimizer steps (one cosine schedule)")
    ap.add_argument("--every", type=int, default=10, help="steps between curve points")
    ap.add_argument("--target-steps", type=int, default=0, help="phase 2: steps on the preset's target dump (0: none)")
    ap.add_argument("--train-prompts", action="append", default=None, metavar="SOURCE",
                    help=f"the self-teacher's prompts (repeatable; default {' '.join(TRAIN_PROMPTS)})")
    ap.add_argument("--text", action="append", default=[], metavar="FILE", help="plain text file (repeatable)")
    ap.add_argument("--generate", type=int, default=256, help="tokens per answer of the draft as given")
    ap.add_argument("--top-k", type=int, default=1, help="slots per position (1: hard labels)")
    ap.add_argument("--token-level", action="store_true", help="the draft's distribution where it is exact")
    ap.add_argument("--max-length", type=int, default=768, help="tokens kept per sequence")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts the draft answers per batch")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a field of phase 1's route (VALUE read as JSON, else a string)")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-self-teacher"), help="stage cache (resumable)")
    ap.add_argument("--result-name", default="swap-self-teacher")
    ap.add_argument("--out", type=Path, default=BENCH / "results")
    ap.add_argument("--smoke", action="store_true",
                    help="2 held-out prompts per set, 2 training prompts, 16-token answers, 2 steps: a run-through, "
                         "no figure (its result goes to --work, never to bench/results)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.target_steps < 0:
        ap.error("--steps and --every must be ≥ 1, --target-steps ≥ 0")
    overrides = curve.route_overrides(ROUTE, args.set)
    command = "python " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    smoke = {}
    if args.smoke:
        smoke = {"eval_prompts": ["humaneval:100:2"], "ood_prompts": ["mt-bench:0:2:6"],
                 "train_prompts": ["humaneval:0:2"], "eval": {"max_new_tokens": 16, "num_speculative_tokens": 5},
                 "dump": pl._DUMP | {"generate": 8, "max_length": 256, "batch_size": 2}}
        args.train_prompts, args.generate, args.steps, args.every = ["humaneval:0:2", "conversations:0:1"], 16, 2, 1
        args.out = args.work
    cfg = pl.make_config("default", **smoke)
    train_specs = args.train_prompts or TRAIN_PROMPTS
    work = args.work
    examples, stages = curve.prepare_training(cfg, work, command, train_specs, "the self-teacher")
    runner, plan, before, swap = (stages[k] for k in ("runner", "plan", "before", "swap"))
    fn, st_cfg = self_teacher_stage(cfg, plan, examples, args, command)
    st_inputs = {"draft": cfg.draft, "target": cfg.target, "self_teacher": st_cfg.model_dump(),
                 "prompts": [e.id for e in examples], "texts": [str(t) for t in args.text]}
    st = runner.stage("self_teacher", st_inputs, fn)
    st_minutes = json.loads((work / "self_teacher" / "stage.json").read_text())["seconds"] / 60

    tok, prompt_ids, baseline, eos = curve.replay_setup(cfg, plan, before, swap)
    # Step 0 is the callback's own replay of the untied re-indexed draft (gains paired against it); the pipeline's
    # vocab_swap figure stays in "sets" as re_indexed.
    points = []
    cb1 = curve.CurveCallback(args.every, tok, prompt_ids, baseline, cfg.eval.num_speculative_tokens,
                              cfg.eval.max_new_tokens, eos, work / "curve-phase1.json", st_minutes,
                              measure_start=True)
    gc.collect()
    t0 = time.time()
    res1, dcfg1 = distil(cfg, swap["path"], st["dump"], work / "distill-self", overrides, args.steps, cb1)
    points += [p | {"phase": 1} for p in cb1.points]
    phase2 = None
    if args.target_steps:
        td = curve.target_dump(cfg, work, command, runner, plan)
        offset = st_minutes + (cb1.points[-1]["train_minutes"] if cb1.points else 0.0) + td["dump_seconds"] / 60
        cb2 = curve.CurveCallback(args.every, tok, prompt_ids, baseline, cfg.eval.num_speculative_tokens,
                                  cfg.eval.max_new_tokens, eos, work / "curve-phase2.json", offset)
        res2, dcfg2 = distil(cfg, str(res1.speculator), work / "dump", work / "distill-target",
                             {}, args.target_steps, cb2)
        points += [p | {"phase": 2, "step": p["step"] + args.steps} for p in cb2.points]
        phase2 = {"steps": args.target_steps, "dump": {"sequences": td["dump"]["sequences"],
                                                       "tokens": td["dump"]["tokens"],
                                                       "minutes": td["dump_seconds"] / 60},
                  "route": {k: dcfg2.model_dump()[k] for k in ("loss", "lr", "row_lr", "batch_size",
                                                               "gradient_accumulation_steps", "scheduler")},
                  "train_sequences": res2.metrics.train_sequences}
    best = max(points[1:] or points, key=lambda p: p["sets"]["held_out"]["acceptance"])
    result = {
        "command": command, "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
        "pair": {"target": cfg.target, "draft": cfg.draft}, "smoke": args.smoke,
        "self_teacher": {"train_prompts": train_specs, "texts": [str(t) for t in args.text],
                         "config": st["config"], "sequences": st["sequences"], "tokens": st["tokens"],
                         "trained_tokens": st["trained_tokens"], "signal": st["signal"], "minutes": st_minutes},
        "route": {k: dcfg1.model_dump()[k] for k in ("loss", "train", "lr", "row_lr", "untie_head", "batch_size",
                                                      "gradient_accumulation_steps", "scheduler", "warmup_ratio",
                                                      "precision", "held_out_fraction", "head_support")},
        "head_rows": res1.metrics.head_support,
        "steps": args.steps, "every": args.every, "phase2": phase2,
        "sets": {n: {"sources": cfg.eval_prompts if n == "held_out" else cfg.ood_prompts,
                     "prompts": len(plan.sets[n]), "as_given_mapped": before["sets"][n]["acceptance_rate"],
                     "re_indexed": swap["sets"][n]["acceptance_rate"]} for n in plan.sets},
        "train_sequences": res1.metrics.train_sequences, "wall_minutes": (time.time() - t0) / 60,
        "replay_minutes": cb1.replay_seconds / 60, "points": points,
        "best": {"step": best["step"], "cpu_minutes": best["cpu_minutes"], "held_out": best["sets"]["held_out"]},
        "x_axis": "CPU-minutes = the teacher signals' minutes so far + training minutes to the step (replays left out)",
    }
    path = curve.write_result(args.out, args.result_name, result)
    print(json.dumps({"result": str(path), "best": result["best"], "wall_minutes": result["wall_minutes"]}))
    return result


if __name__ == "__main__":
    main()
