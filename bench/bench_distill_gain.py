"""Does distillation raise acceptance on held-out prompts? Dump-only (λ = 0) against on-policy λ, same budget,
same held-out prompts, same target answers; the gain with a paired 95% bootstrap interval.

Steps, each cached in ``--work`` (reused when its inputs are the same, so λ runs share them):

1. ``answers-<set>.json``: greedy speculative decoding with the original draft writes the target's greedy answers
   to the held-out prompts (``--chat``: the domain with headroom, the headline; ``--code``: must not get worse),
   and keeps the original draft's decoded counts (:func:`specdraft.measuring.evaluate.acceptance_eval`).
2. ``dump/``: the target answers the training prompts (``--train``; answer-only hidden-state dump).
3. per λ in ``--on-policy-fraction``: :func:`specdraft.training.distill.run_distill` with the same settings but λ, then the
   distilled draft (bfloat16, as served) is replayed on the answers of step 1 (exact greedy counts), per set.

Writes ``bench/results/distill-gain.json``: the headline (the λ with the largest chat gain) under the keys
``acceptance_before``, ``acceptance_after``, ``gain``, ``gain_ci95``, ``alpha_tf_before``, ``alpha_tf_after``
(teacher-forced α, serving settings, on the chat answers), ``minutes`` (that λ's distillation, on-policy
generation and teacher passes included; a run already in ``--work`` with the same settings and dump is
evaluated again, not retrained), ``mode`` ("greedy"), ``on_policy_fraction``, ``command``; every λ's
figures for both sets under ``runs``.

    python bench/bench_distill_gain.py --on-policy-fraction 0 0.5 [--steps 30 --lr 3e-5 --layers 4]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from specdraft.core.config import DistillConfig, DumpConfig, EvalConfig, SamplingConfig
from specdraft.core.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdraft.core.stats import paired_gain_from_rows
from specdraft.data.prompts import load_prompts
from specdraft.data.sources import encode_prompts
from specdraft.measuring.evaluate import acceptance_eval, eos_ids
from specdraft.models.loading import load_model
from specdraft.training.distill import run_distill
from specdraft.training.dump import run_dump


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cached(path: Path, inputs: dict, make):
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == _key(inputs):
            return saved["result"]
    result = make()
    path.write_text(json.dumps({"key": _key(inputs), "inputs": inputs, "result": result}, default=str))
    return result


class AcceptanceCurve:
    """A TrainerCallback: every ``every`` steps, a bfloat16 copy of the draft being trained is replayed on the
    held-out answers (:func:`specdraft.testing.replay_greedy`: the same greedy counts as the final evaluation,
    without the target, which is not held in memory during training) and the paired gain per set is appended to
    ``path`` (rewritten atomically each time, so a killed run keeps its curve). Its seconds are inside the
    training minutes."""

    def __init__(self, every, tok, sets, before, eval_cfg, eos, path: Path):
        from transformers import TrainerCallback

        self.every, self.tok, self.sets, self.before, self.eos = every, tok, sets, before, eos
        self.eval_cfg, self.path, self.points = eval_cfg, path, []
        self.prompt_ids = {name: encode_prompts(tok, examples) for name, examples in sets.items()}  # once, not per point
        outer = self

        class _CB(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kw):
                if state.global_step % outer.every == 0:
                    outer.measure(state.global_step, model)

        self.callback = _CB()

    def measure(self, step: int, model) -> None:
        import copy

        from specdraft.testing import replay_greedy

        t0 = time.time()
        draft = copy.deepcopy(model.draft).to(torch.bfloat16).eval()
        point = {"step": step}
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        with torch.no_grad():
            for name, examples in self.sets.items():
                b = self.before[name]
                counts = replay_greedy(draft, self.prompt_ids[name], b["answers"],
                                       self.eval_cfg.num_speculative_tokens, self.eval_cfg.max_new_tokens, self.eos,
                                       real_vocab=len(self.tok), pad_id=pad)
                rows = [{"id": e.id, "accepted": sum(c.accepted), "proposed": sum(c.proposed)}
                        for e, c in zip(examples, counts)]
                g = paired_gain_from_rows(b["rows"], rows)
                acc = sum(r["accepted"] for r in rows) / max(1, sum(r["proposed"] for r in rows))
                point[name] = {"acceptance": acc, "gain": g.value, "gain_ci95": g.interval}
        del draft
        point["seconds"] = time.time() - t0
        self.points.append(point)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.points, indent=1))
        tmp.replace(self.path)
        print("[curve] step", step, {n: f"{v['acceptance']:.3f} ({v['gain']:+.3f})" for n, v in point.items()
                                     if isinstance(v, dict)}, f"{point['seconds']:.0f} s", flush=True)


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=DEFAULT_DRAFT, help="the draft to distil (sharing the target's tokenizer, "
                    "e.g. a `specdraft vocab-swap` output)")
    ap.add_argument("--answers-from", type=Path, default=None,
                    help="a --work directory of an earlier run: reuse its target answers to the held-out prompts "
                    "(greedy: the same for any draft) and replay this draft on them instead of decoding")
    ap.add_argument("--chat", nargs="+", default=["mt-bench:0:27:3"], help="held-out chat prompt sources")
    ap.add_argument("--code", nargs="*", default=["humaneval:100:16:4"], help="held-out code prompt sources")
    ap.add_argument("--train", nargs="*", default=["mt-bench:1:20:3", "mt-bench:2:20:3"],
                    help="training prompt sources the target answers (--generate tokens each; repeated prompts dropped "
                    "before a limit counts); the default preset's: MT-Bench questions disjoint from --chat; none: "
                    "teacher-forced data alone")
    ap.add_argument("--train-forced", nargs="*", default=[],
                    help="teacher-forced training sources (e.g. sharegpt:0:1000): their existing replies scored by the "
                    "target in one prefill each (answer-only), no generation; dumped apart and mixed with --train")
    ap.add_argument("--forced-max-length", type=int, default=384, help="tokens kept per teacher-forced sequence")
    ap.add_argument("--written-weight", type=int, default=1,
                    help="repeats per epoch of each target-written (--train) sequence in the mix")
    ap.add_argument("--epochs", type=float, default=None,
                    help="train this many passes over the (weighted) training sequences; sets --steps")
    ap.add_argument("--precision", default="auto", choices=["float32", "bf16-autocast", "auto"])
    ap.add_argument("--dump-format", default="hidden", choices=["hidden", "topk"])
    ap.add_argument("--top-k", type=int, default=64, help="log-probs kept per position (--dump-format topk)")
    ap.add_argument("--dump-batch-size", type=int, default=8)
    ap.add_argument("--held-out-fraction", type=float, default=0.125,
                    help="share of each dump kept for the teacher-forced held-out α of training")
    ap.add_argument("--generate", type=int, default=48, help="tokens the target writes per training prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per held-out answer")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--on-policy-fraction", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--on-policy-every", type=int, default=10)
    ap.add_argument("--loss", default="tvd", choices=["soft_ce", "tvd", "tvd_deploy"])
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4, help="layers trained (--train-mode last_layers)")
    ap.add_argument("--train-mode", default="last_layers", choices=["last_layers", "all"])
    ap.add_argument("--warmup-ratio", type=float, default=0.1)
    ap.add_argument("--curve-every", type=int, default=0,
                    help="every K steps, replay the held-out sets with the draft being trained (bf16 copy): the "
                    "learning curve in measured acceptance, written as training goes (curve-<run>.json in --work)")
    ap.add_argument("--result-name", default="distill-gain", help="writes <out>/<result-name>.json")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--temperature", type=float, default=1.0, help="serving temperature (on-policy sampling, α)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-distill-gain"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.add_argument("--answers-only", action="store_true",
                    help="stop after step 1 (the held-out answers and the draft's counts, cached in --work)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    command = "python bench/bench_distill_gain.py " + shlex.join(sys.argv[1:])
    eval_cfg = EvalConfig(num_speculative_tokens=args.gamma, max_new_tokens=args.max_new_tokens)
    serving = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    sets = {"chat": load_prompts(args.chat), **({"code": load_prompts(args.code)} if args.code else {})}

    # 1. the target's answers to the held-out prompts, and the original draft's counts on them
    target, tok = load_model(DEFAULT_TARGET, dtype="bfloat16")
    draft, _ = load_model(args.draft, dtype="bfloat16")
    before = {}
    for name, examples in sets.items():
        inputs = {"prompts": [e.id for e in examples], "eval": eval_cfg.model_dump(), "serving": serving.model_dump(),
                  "target": DEFAULT_TARGET, "draft": args.draft, "answers_from": str(args.answers_from)}
        given = None
        if args.answers_from:
            saved = json.loads((args.answers_from / f"answers-{name}.json").read_text())
            if saved["inputs"]["prompts"] != inputs["prompts"] or saved["inputs"]["eval"] != inputs["eval"]:
                raise SystemExit(f"{args.answers_from}: its {name} answers are for other prompts or settings")
            given = saved["result"]["answers"]
        # The default draft's file is what --answers-from reads.
        suffix = "" if args.draft == DEFAULT_DRAFT and not args.answers_from else f"-{_key(inputs)}"
        before[name] = _cached(args.work / f"answers-{name}{suffix}.json", inputs,
                               lambda ex=examples, given=given: acceptance_eval(
            target, draft, tok, encode_prompts(tok, ex), [e.id for e in ex], eval_cfg, serving, answers=given).to_dict())
        b = before[name]
        print(f"[before] {name}: acceptance {b['acceptance_rate']:.3f} on {b['prompts']} prompts, {b['drafted']} "
              f"drafted; replay = decoded on {b['replay_check']}", flush=True)

    if args.answers_only:
        return {"before": before}
    draft = None  # the original draft's counts are in `before`
    gc.collect()

    # 2. the dumps: the target answers the training prompts (--train) / scores existing replies (--train-forced)
    eos = eos_ids(target)
    target = None  # run_dump loads its own copy; two 1.5B copies would not fit beside other jobs
    gc.collect()
    fmt = {"teacher_format": args.dump_format, "top_logprobs": args.top_k}
    plans = []
    if args.train:
        plans.append(("written", load_prompts(args.train, unique=True),
                      DumpConfig(answer_only=True, dtype="bfloat16", generate=args.generate, max_length=512,
                                 batch_size=args.dump_batch_size, **fmt), args.written_weight))
    if args.train_forced:
        plans.append(("forced", load_prompts(args.train_forced, unique=True),
                      DumpConfig(answer_only=True, dtype="bfloat16", max_length=args.forced_max_length,
                                 batch_size=args.dump_batch_size, **fmt), 1))
    if not plans:
        raise SystemExit("error: no training data: give --train and/or --train-forced")
    dump_dirs, dump_weights, dumps, dump_seconds = [], [], {}, 0.0
    for kind, trains, dump_cfg, weight in plans:
        dump_dir = args.work / f"dump-{_key([[e.id for e in trains], dump_cfg.model_dump()])}"
        t0 = time.time()
        manifest = run_dump(DEFAULT_TARGET, trains, dump_dir, dump_cfg, command=command)
        seconds = manifest["this_run"]["seconds"] if manifest["this_run"]["shards_written"] else 0.0
        dump_seconds += seconds
        dumps[kind] = {"dir": dump_dir.name, "sequences": manifest["sequences"], "tokens": manifest["tokens"],
                       "trained_tokens": manifest.get("trained_tokens"), "seconds": seconds, "weight": weight,
                       "cached": not manifest["this_run"]["shards_written"]}
        dump_dirs.append(dump_dir)
        dump_weights.append(weight)
        print(f"[dump {kind}] {manifest['sequences']} sequences, {manifest['tokens']} tokens, weight {weight} "
              f"({time.time() - t0:.0f} s{', cached' if dumps[kind]['cached'] else ''})", flush=True)
    from specdraft.training.distill_data import mixed_split

    n_train = len(mixed_split([d["sequences"] for d in dumps.values()], dump_weights, args.held_out_fraction, 0)[0])
    if args.epochs:
        args.steps = max(1, math.ceil(args.epochs * n_train / (args.batch_size * args.grad_accum)))
    print(f"[train] {n_train} weighted training sequences, {args.steps} steps of {args.batch_size * args.grad_accum}",
          flush=True)
    plan_key = _key([json.loads((d / "manifest.json").read_text())["plan"] for d in dump_dirs] + dump_weights)

    # 3. per λ: distil, then replay the distilled draft on the same answers
    runs = []
    for lam in args.on_policy_fraction:
        cfg = DistillConfig(loss=args.loss, train=args.train_mode, train_last_layers=args.layers, lr=args.lr,
                            max_steps=args.steps, batch_size=args.batch_size,
                            held_out_fraction=args.held_out_fraction, precision=args.precision,
                            gradient_accumulation_steps=args.grad_accum,
                            scheduler="cosine", warmup_ratio=args.warmup_ratio, save_steps=10_000, logging_steps=5,
                            temperature=args.temperature, top_p=args.top_p, on_policy_fraction=lam,
                            on_policy_every=args.on_policy_every)
        out_dir = args.work / f"distill-{_key([cfg.model_dump(), args.draft])}-{plan_key}"
        done = out_dir / "training.json"
        if done.is_file() and json.loads(done.read_text())["config"] == cfg.model_dump():
            # Trained earlier with these very settings on this very dump: evaluate that run (its own timing).
            metrics = json.loads(done.read_text())["metrics"]
            trained, _ = load_model(str(out_dir / "speculator"), dtype="bfloat16")
        else:
            curve = AcceptanceCurve(args.curve_every, tok, sets, before, eval_cfg, eos,
                                    args.work / f"curve-{out_dir.name}.json") if args.curve_every else None
            # Training holds the draft, its gradients and optimizer state: the target waits on disk meanwhile.
            gc.collect()
            res = run_distill(DEFAULT_TARGET, args.draft, dump_dirs if len(dump_dirs) > 1 else dump_dirs[0], out_dir,
                              cfg, resume=False, num_speculative_tokens=args.gamma,
                              callbacks=[curve.callback] if curve else None, dump_weights=dump_weights)
            metrics = res.metrics.to_dict()
            trained = res.model.to(torch.bfloat16).eval()
            del res
        if target is None:
            target, _ = load_model(DEFAULT_TARGET, dtype="bfloat16")
        minutes = metrics["seconds"] / 60  # training, on-policy writing and teacher passes included
        curve_file = args.work / f"curve-{out_dir.name}.json"
        run = {"on_policy_fraction": lam, "minutes": minutes, "settings": cfg.model_dump(),
               "acceptance_curve": json.loads(curve_file.read_text()) if curve_file.is_file() else None, "distill": {
            k: metrics.get(k) for k in ("steps", "trainable_parameters", "train_sequences", "eval_before",
                                        "eval_after", "curve", "on_policy", "seconds", "precision")}, "sets": {}}
        for name, examples in sets.items():
            after = acceptance_eval(target, trained, tok, encode_prompts(tok, examples), [e.id for e in examples],
                                    eval_cfg, serving, answers=before[name]["answers"]).to_dict()
            gain = paired_gain_from_rows(before[name]["rows"], after["rows"])
            alpha_gain = paired_gain_from_rows(before[name]["rows"], after["rows"], numerator="alpha_sum",
                                               denominator="positions")
            run["sets"][name] = {
                "prompts": after["prompts"], "drafted_before": before[name]["drafted"], "drafted_after": after["drafted"],
                "acceptance_before": before[name]["acceptance_rate"], "acceptance_after": after["acceptance_rate"],
                "acceptance_before_ci95": before[name]["acceptance_rate_ci95"],
                "acceptance_after_ci95": after["acceptance_rate_ci95"], "gain": gain.value, "gain_ci95": gain.interval,
                "alpha_tf_before": before[name]["alpha_sampled"], "alpha_tf_after": after["alpha_sampled"],
                "alpha_tf_gain_ci95": alpha_gain.interval, "rows_after": after["rows"]}
            print(f"[λ={lam}] {name}: {before[name]['acceptance_rate']:.3f} → {after['acceptance_rate']:.3f}, gain "
                  f"{gain.value:+.3f} [{gain.low:+.3f}, {gain.high:+.3f}]; α_tf {before[name]['alpha_sampled']:.3f} → "
                  f"{after['alpha_sampled']:.3f} ({minutes:.1f} min)", flush=True)
        runs.append(run)
        del trained

    best = max(runs, key=lambda r: r["sets"]["chat"]["gain"])
    chat = best["sets"]["chat"]
    result = {
        "acceptance_before": chat["acceptance_before"], "acceptance_after": chat["acceptance_after"],
        "gain": chat["gain"], "gain_ci95": chat["gain_ci95"], "alpha_tf_before": chat["alpha_tf_before"],
        "alpha_tf_after": chat["alpha_tf_after"], "minutes": best["minutes"], "mode": "greedy",
        "on_policy_fraction": best["on_policy_fraction"], "command": command,
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {args.threads} threads",
        "torch": torch.__version__, "dump_minutes": dump_seconds / 60,
        "dump_sequences": sum(d["sequences"] for d in dumps.values()),
        "dump_tokens": sum(d["tokens"] for d in dumps.values()), "dumps": dumps, "settings": {k: v for k, v in vars(args).items() if k not in ("work", "out")},
        "before": {n: {k: v for k, v in b.items() if k not in ("answers", "rows")} | {"rows": b["rows"]}
                   for n, b in before.items()},
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.result_name}.json").write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
