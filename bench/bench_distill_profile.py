"""Where a distillation step's time goes: the default preset's step on the re-indexed draft (its route: loss,
head untied, AdamW with the rows in their own group, precision), on the main job's own teacher dump.

1. **phases** — for every position scored and for the trained columns only (``DistillModel``'s
   ``trained_columns_only``, the default), interleaved step by step: wall seconds per optimizer step (``gradient_accumulation_steps`` micro-batches of
   ``batch_size`` dump sequences, as the Trainer feeds them): forward (draft forward, the teacher's p from its
   hidden states through the target head, the loss), backward, and clipping + AdamW; median over ``--repeats``
   after one warm-up step.
2. **operators** — one profiled step (``torch.profiler``, CPU, input shapes recorded), self CPU time summed by
   kind: matmuls as wide as the vocabulary (the draft's head and the teacher's, forward and backward), other
   vocabulary-wide work (softmax, the loss, the logit alignment), the body's matmuls, attention, the embedding,
   the optimizer's foreach kernels, the rest.
3. **what the CPU implies** — the step's matmul FLOPs (6 × weights × tokens for the trained draft, 2 × V × H for
   the teacher head) over a measured bf16 matmul rate on this machine; and the share of positions trained
   (``loss_mask``): every position is computed through both heads, only the answer positions are trained.

Needs a work directory with ``dump/`` and ``vocab_swap/model`` (``bench/bench_distill_curve.py --work`` or a
``specdraft run --out``). Writes ``bench/results/distill-step-profile.json``.

    python bench/bench_distill_profile.py --work runs/bench-distill-curve [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

#: Every position through both heads (as before), and only the columns some row trains (the default).
VARIANTS = ("all_positions", "trained_columns")
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_weight_int4pack_mm"}


def kind(name: str, shapes, widths: set[int]) -> str:
    """The operator kind of a profiler row (``name``, its input shapes)."""
    wide = any(isinstance(s, (list, tuple)) and any(d in widths for d in s) for s in (shapes or []))
    if name in MATMULS:
        return "vocab-wide matmul (heads)" if wide else "body matmul"
    if "_foreach" in name or "Optimizer" in name or "adam" in name.lower():
        return "optimizer (AdamW, clipping)"
    if wide:
        return "vocab-wide elementwise (softmax, loss, alignment)"
    if "scaled_dot_product" in name or "attention" in name or "flash" in name:
        return "attention"
    if "embedding" in name:
        return "embedding"
    return "other"


def bf16_matmul_tflops(n: int = 2048, reps: int = 6) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="a directory holding dump/ and vocab_swap/model")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args(argv)
    from transformers import TrainingArguments

    from specdraft.models.dump_reader import TeacherDataset
    from specdraft.models.loading import load_model
    from specdraft.run import pipeline as pl
    from specdraft.training.distill import resolve_precision, select_trainable
    from specdraft.training.distill_data import collate
    from specdraft.training.distill_trainer import DistillModel, DistillTrainer, TeacherHead, trained_mask
    from specdraft.training.head_warmup import untie_head

    dump_dir, draft_dir = args.work / "dump", args.work / "vocab_swap" / "model"
    for p in (dump_dir / "manifest.json", draft_dir / "config.json"):
        if not p.is_file():
            ap.error(f"{p} is missing: give a --work that bench/bench_distill_curve.py or specdraft run filled")
    command = "python " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    cfg = pl.make_config(args.preset).distill
    ds = TeacherDataset(dump_dir)
    head = ds.head()
    real_vocab = int(ds.manifest["target"]["real_vocab"])
    width = int(ds.manifest["target"]["vocab_width"])
    draft, _ = load_model(str(draft_dir), dtype=cfg.dtype, device="cpu")
    if cfg.untie_head:
        untie_head(draft)
    draft, n_trainable = select_trainable(draft, cfg)
    precision, _ = resolve_precision(cfg.precision, "cpu")
    teacher = TeacherHead.of_dump(ds)
    models = {key: DistillModel(draft, teacher, cfg, autocast=precision == "bf16-autocast",
                                trained_columns_only=key == "trained_columns").train() for key in VARIANTS}
    model = models["all_positions"]
    with tempfile.TemporaryDirectory(prefix="specdraft-profile-") as tmp:
        targs = TrainingArguments(output_dir=tmp, use_cpu=True, report_to="none", learning_rate=cfg.lr,
                                  weight_decay=cfg.weight_decay, max_steps=1)
        trainer = DistillTrainer(model=model, args=targs)
        opt = trainer.create_optimizer()
    params = [p for p in draft.parameters() if p.requires_grad]
    per_step = cfg.batch_size * cfg.gradient_accumulation_steps
    steps = [[collate([ds[(s * per_step + m * cfg.batch_size + i) % len(ds)] for i in range(cfg.batch_size)])
              for m in range(cfg.gradient_accumulation_steps)] for s in range(args.repeats + 1)]

    def step(micro: list[dict], model=model) -> dict:
        n = sum(trained_mask(b["input_ids"], b.get("attention_mask"), b.get("loss_mask")).sum() for b in micro)
        t = {"forward": 0.0, "backward": 0.0}
        for b in micro:
            t0 = time.perf_counter()
            out = model(**b, num_items_in_batch=n)
            t1 = time.perf_counter()
            out["loss"].backward()
            t["forward"] += t1 - t0
            t["backward"] += time.perf_counter() - t1
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t["optimizer"] = time.perf_counter() - t0
        return t

    for m in models.values():
        step(steps[0], m)  # warm-up: kernels, AdamW state
    phases = {key: defaultdict(list) for key in VARIANTS}
    for r, s in enumerate(steps[1:]):
        for key in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):  # who goes first alternates
            for k, v in step(s, models[key]).items():
                phases[key][k].append(v)
            print(f"step {r + 1} {key}:", {k: f"{v[-1]:.2f} s" for k, v in phases[key].items()}, flush=True)
    variants = {}
    for key in VARIANTS:
        median = {k: statistics.median(v) for k, v in phases[key].items()}
        variants[key] = {"seconds_median": median, "seconds_total": sum(median.values()), "seconds": phases[key]}

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(steps[1])
    widths = {width, real_vocab}
    by_kind: dict[str, float] = defaultdict(float)
    top = []
    for ev in prof.key_averages(group_by_input_shape=True):
        us = ev.self_cpu_time_total
        by_kind[kind(ev.key, ev.input_shapes, widths)] += us
        top.append((us, ev.key, str(ev.input_shapes)[:120], ev.count))
    prof_total = sum(by_kind.values())
    top.sort(reverse=True)

    # FLOPs of the step's matmuls: every position goes through both heads.
    positions = sum(int(b["attention_mask"].sum()) for b in steps[1])
    trained = sum(int(trained_mask(b["input_ids"], b.get("attention_mask"), b.get("loss_mask")).sum()) for b in steps[1])
    emb_w, head_w = draft.get_input_embeddings().weight, draft.get_output_embeddings().weight
    body = sum(p.numel() for p in draft.parameters()) - emb_w.numel() - (head_w.numel() if head_w is not emb_w else 0)
    t_h = head["lm_head.weight"]
    flops = 6 * (body + head_w.numel()) * positions + 2 * t_h.shape[0] * t_h.shape[1] * positions
    tflops = bf16_matmul_tflops()
    result = {
        "command": command, "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
        f"{torch.get_num_threads()} threads", "torch": torch.__version__, "preset": args.preset,
        "route": {k: cfg.model_dump()[k] for k in ("loss", "train", "lr", "row_lr", "untie_head", "batch_size",
                                                   "gradient_accumulation_steps", "precision")},
        "precision": precision, "trainable_parameters": n_trainable, "vocab_width": width,
        "draft_head": list(head_w.shape), "teacher_head": list(t_h.shape),
        "step": {"positions": positions, "trained_positions": trained, "trained_share": trained / positions,
                 "repeats": args.repeats},
        "variants": {k: v | {"trained_tokens_per_minute": trained / v["seconds_total"] * 60}
                     for k, v in variants.items()},
        "speedup": variants["all_positions"]["seconds_total"] / variants["trained_columns"]["seconds_total"],
        "operators_ms": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "operators_share": {k: v / prof_total for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_operators": [{"ms": us / 1e3, "op": k, "shapes": s, "calls": c} for us, k, s, c in top[:15]],
        "matmul_tflop_per_step": flops / 1e12, "bf16_matmul_tflops_measured": tflops,
        "implied_seconds": flops / 1e12 / tflops,
        "slowdown_vs_implied": variants["all_positions"]["seconds_total"] / (flops / 1e12 / tflops),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "distill-step-profile.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    print(json.dumps({k: result[k] for k in ("step", "speedup", "operators_share", "implied_seconds",
                                             "slowdown_vs_implied")},
                     indent=1))
    return result


if __name__ == "__main__":
    main()
