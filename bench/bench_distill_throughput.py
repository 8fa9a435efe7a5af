"""Distillation throughput benchmark: float32 training against the fast path, and the two
ways of making teacher signal.

1. **step** — trained tokens per minute of one full distillation step, the step ``run_distill`` takes:
   :class:`specdraft.training.distill_trainer.DistillModel` forward (draft forward + teacher + loss), backward, gradient clipping
   at ``max_grad_norm``, and the optimizer the Trainer builds (``Trainer.get_optimizer_cls_and_kwargs``: AdamW),
   on the same fixed batches, contenders interleaved batch by batch within each repeat (median over repeats):

   * ``float32_hidden`` — precision float32, hidden-state teacher (today's default);
   * ``bf16_hidden``    — precision bf16-autocast, hidden-state teacher;
   * ``bf16_topk``      — precision bf16-autocast, the dump's ``topk`` teacher (``--top-k`` 64): the fast path.

2. **curve** — the loss of a short run, :func:`specdraft.training.distill.train` itself (run_distill's Trainer, cosine
   schedule, same seed, the same fixed batches in the same order) for ``--steps`` steps, per contender. Reported:
   the per-step loss, max and mean |Δ| against float32 step by step, the final losses, and the noise of the float32
   curve = std of its step-to-step changes / √2 (the scatter of one step around a smooth trend: the batches
   differ step to step); ``within_noise`` is max |Δ| ≤ that noise. The topk contender's logged loss is against
   p̂ (the top-k teacher, leftover spread), so its Δ also holds the top-k approximation (per position at most the
   leftover mass, reported); the bf16_hidden one holds only autocast's rounding. Every trained draft is then also
   scored against the exact teacher (hidden states through the head, float32) on all the batches:
   ``exact_final_loss``, the like-for-like comparison of what the runs learned; ``exact_within_noise`` is its
   difference to float32's ≤ the noise above (the goal's "equal quality").

3. **dump** — teacher tokens per minute: ``run_dump --generate N`` (the target writes its answers, batch
   ``--dump-batch`` 8) against ``run_dump`` of those very answers as existing text (teacher-forced scoring: one
   prefill per batch), so both score the same answers (decoded and re-encoded: counts may differ by a few
   tokens; each is divided by its own). Tokens per minute = answer (trained) tokens / ``work_seconds`` (model
   loading excluded). Interleaved: generate, forced; then forced, generate; …

Batches for 1 and 2: the ``--text`` conversations through the chat template, concatenated and cut into
``--batches`` × ``--batch`` windows of ``--seq`` tokens (every prediction trained but the last). Their teacher
signal comes from one target forward per batch through :func:`specdraft.training.dump.teacher_items` — the code a dump
writes its shards with, in its storage dtypes — so no dump on disk is needed.

    python bench/bench_distill_throughput.py [--seq 256 --batch 2 --batches 4 --repeats 3 --steps 20]
    python bench/bench_distill_throughput.py --quick          # tiny sizes: a smoke run, its own result file
    python bench/bench_distill_throughput.py --parts step     # only part 1 (also: curve, dump)
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import get_args

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from specdraft.core.config import DumpFormat, LossName, ModelDtype
from specdraft.core.embedded import DEFAULT_DRAFT, DEFAULT_TARGET

#: name → (DistillConfig.precision, teacher format); the first is the reference, the last the fast path.
CONTENDERS = {"float32_hidden": ("float32", "hidden"), "bf16_hidden": ("bf16-autocast", "hidden"),
              "bf16_topk": ("bf16-autocast", "topk")}
REFERENCE, FAST = "float32_hidden", "bf16_topk"
PARTS = ("step", "curve", "dump")

#: Sizes of a full run and of --quick (flags given explicitly win over both).
FULL = {"seq": 256, "batch": 2, "batches": 4, "repeats": 3, "steps": 20, "generate": 64, "dump_batch": 8,
        "text": "sharegpt:0:32", "prompts": "sharegpt:0:16", "name": "distill-throughput"}
QUICK = {"seq": 32, "batch": 2, "batches": 2, "repeats": 2, "steps": 4, "generate": 8, "dump_batch": 2,
         "text": "mt-bench:0:8", "prompts": "mt-bench:0:4", "name": "distill-throughput-quick"}


class BenchError(ValueError):
    """Input the benchmark cannot run on (printed as one ``error:`` line, exit 2)."""


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET, help="Target (p): embedded name or checkpoint directory.")
    ap.add_argument("--draft", default=DEFAULT_DRAFT, help="Draft (q), sharing the target's tokenizer.")
    ap.add_argument("--quick", action="store_true", help="Tiny sizes (a smoke run); writes NAME-quick.json.")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--text", help="Conversations cut into the fixed batches (name:offset:limit:stride).")
    ap.add_argument("--prompts", help="Prompts of the dump part (name:offset:limit:stride).")
    ap.add_argument("--seq", type=_positive, help="Tokens per training row.")
    ap.add_argument("--batch", type=_positive, help="Rows per training step.")
    ap.add_argument("--batches", type=_positive, help="Fixed batches (cycled by the curve's steps).")
    ap.add_argument("--repeats", type=_positive, help="Repeats of parts 1 and 3 (medians reported).")
    ap.add_argument("--steps", type=_positive, help="Optimizer steps of each curve (at least 2).")
    ap.add_argument("--loss", default="tvd", choices=get_args(LossName))
    ap.add_argument("--lr", type=float, default=1e-5, help="Peak learning rate of the curve (and the step's AdamW).")
    ap.add_argument("--top-k", type=_positive, default=64, help="Log-probs kept per position by the topk teacher.")
    ap.add_argument("--generate", type=_positive, help="Answer tokens the target writes per prompt (dump part).")
    ap.add_argument("--dump-batch", type=_positive, help="Sequences per target forward pass in the dump part.")
    ap.add_argument("--dump-format", default="topk", choices=get_args(DumpFormat), help="Format of the dump part.")
    ap.add_argument("--dtype", default="bfloat16", choices=get_args(ModelDtype), help="Target weights (teacher, dump).")
    ap.add_argument("--threads", type=_positive, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.set_defaults(**(QUICK if "--quick" in argv else FULL))
    args = ap.parse_args(argv)
    args.argv = argv
    return args


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be wrong before a model loads. Raises :class:`BenchError` naming the flag."""
    from specdraft.data.prompts import PromptSpecError, parse_source
    from specdraft.models.loading import resolve

    if args.seq < 2:
        raise BenchError(f"--seq {args.seq}: a row needs at least 2 tokens (one trained prediction)")
    if "curve" in args.parts and args.steps < 2:
        raise BenchError(f"--steps {args.steps}: a curve needs at least 2 steps (its noise is a step-to-step change)")
    if not args.lr > 0 or not math.isfinite(args.lr):
        raise BenchError(f"--lr {args.lr}: must be a positive number")
    for flag, spec in (("--text", args.text), ("--prompts", args.prompts)):
        try:
            parse_source(spec, flag)
        except PromptSpecError as exc:  # names the flag, the bad part and the grammar
            raise BenchError(str(exc)) from exc
    for flag, ref in (("--target", args.target), ("--draft", args.draft)):
        try:
            resolve(ref)
        except Exception as exc:  # ModelResolutionError names the path and what to do
            raise BenchError(f"{flag} {ref}: {exc}") from exc


def fixed_rows(tokenizer, spec: str, n_rows: int, seq: int) -> list:
    """``n_rows`` :class:`specdraft.data.sources.TokenSequence` windows of ``seq`` tokens cut from the concatenated
    conversations of ``spec`` (every prediction trained but the window's last)."""
    from specdraft.data.prompts import load_prompts as load_sources
    from specdraft.data.sources import TokenSequence, build_sequences

    stream: list[int] = []
    for s in build_sequences(tokenizer, load_sources([spec])):
        stream.extend(s.ids)
    need = n_rows * seq
    if len(stream) < need:
        raise BenchError(f"--text {spec} gives {len(stream)} tokens; --batches × --batch × --seq needs {need}: "
                         "raise the source's limit or lower the sizes")
    return [TokenSequence(f"window-{i}", stream[i * seq:(i + 1) * seq], [True] * (seq - 1) + [False])
            for i in range(n_rows)]


def teacher_signal(args: argparse.Namespace, rows: list) -> dict:
    """The target's signal for ``rows`` in both formats (one forward per batch and format) plus its head."""
    import torch

    from specdraft.core.config import DumpConfig
    from specdraft.models.loading import load_model
    from specdraft.training.teacher import Teacher, real_vocab_size, teacher_items

    target, tok = load_model(args.target, dtype=args.dtype, device="cpu")
    teacher = Teacher(target, real_vocab_size(tok))
    items = {}
    for fmt in ("hidden", "topk"):
        cfg = DumpConfig(teacher_format=fmt, top_logprobs=args.top_k, dtype=args.dtype)
        items[fmt] = [it for i in range(0, len(rows), args.batch)
                      for it in teacher_items(teacher, rows[i:i + args.batch], cfg)]
    bias = teacher.bias.detach().clone() if teacher.bias is not None else None
    out = {"items": items, "head": teacher.weight.detach().clone(), "bias": bias, "ops": list(teacher.ops),
           "width": teacher.width, "real_vocab": teacher.real_vocab}
    del teacher, target
    gc.collect()
    torch.set_num_threads(args.threads)
    return out


def distill_config(args: argparse.Namespace, precision: str):
    from specdraft.core.config import DistillConfig

    # save_steps past the run: a checkpoint (draft + AdamW state) would be timed and written for nothing.
    return DistillConfig(loss=args.loss, lr=args.lr, precision=precision, batch_size=args.batch,
                         max_steps=args.steps, save_steps=args.steps + 1, logging_steps=1, seed=0)


def bench_step(args: argparse.Namespace, sig: dict) -> dict:
    """Part 1: seconds of one optimizer step per contender and batch, interleaved; trained tokens per minute."""
    import torch
    from transformers import Trainer, TrainingArguments

    from specdraft.models.loading import load_model
    from specdraft.training.distill import select_trainable
    from specdraft.training.distill_data import collate
    from specdraft.training.distill_trainer import DistillModel, TeacherHead, trained_mask

    torch.manual_seed(0)
    draft, _ = load_model(args.draft, dtype="float32", device="cpu")
    draft, _ = select_trainable(draft, distill_config(args, "float32"))
    models = {}
    for name, (precision, fmt) in CONTENDERS.items():
        cfg = distill_config(args, precision)
        hidden = fmt == "hidden"
        models[name] = DistillModel(draft, TeacherHead(sig["head"] if hidden else None, sig["real_vocab"], sig["bias"] if hidden else None, width=sig["width"], logit_ops=sig["ops"]), cfg, autocast=precision == "bf16-autocast").train()
    params = [p for p in draft.parameters() if p.requires_grad]
    with tempfile.TemporaryDirectory(prefix="specdraft-bench-") as tmp:
        targs = TrainingArguments(output_dir=tmp, use_cpu=True, report_to="none", learning_rate=args.lr,
                                  weight_decay=cfg.weight_decay)
    opt_cls, opt_kw = Trainer.get_optimizer_cls_and_kwargs(targs, draft)
    opt = opt_cls(params, **opt_kw)
    batches = {fmt: [collate(sig["items"][fmt][i:i + args.batch]) for i in range(0, len(sig["items"][fmt]),
                                                                                  args.batch)]
               for fmt in ("hidden", "topk")}

    def step(name: str, b: int) -> tuple[float, int, float]:
        batch = batches[CONTENDERS[name][1]][b]
        n = trained_mask(batch["input_ids"], batch.get("attention_mask"), batch.get("loss_mask")).sum()
        t0 = time.perf_counter()
        out = models[name](**batch, num_items_in_batch=n)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, int(n), float(out["loss"].detach())

    for name in CONTENDERS:  # warm-up: first-call kernel creation, AdamW state allocation
        step(name, 0)
    seconds = {n: [] for n in CONTENDERS}
    tokens = {n: 0 for n in CONTENDERS}
    names = list(CONTENDERS)
    for r in range(args.repeats):
        spent = {n: 0.0 for n in CONTENDERS}
        for b in range(len(batches["hidden"])):
            order = names[(r + b) % len(names):] + names[:(r + b) % len(names)]  # who goes first rotates
            for name in order:
                s, n, _ = step(name, b)
                spent[name] += s
                if r == 0:
                    tokens[name] += n
        for name in CONTENDERS:
            seconds[name].append(spent[name])
        print(f"step repeat {r + 1}/{args.repeats}: " + ", ".join(f"{n} {v:.2f} s" for n, v in spent.items()),
              flush=True)
    tpm = {n: tokens[n] / statistics.median(seconds[n]) * 60 for n in CONTENDERS}
    return {"trained_tokens_per_repeat": tokens, "tokens_per_minute": tpm,
            "speedup_vs_float32": {n: tpm[n] / tpm[REFERENCE] for n in CONTENDERS},
            "seconds": seconds, "optimizer": opt_cls.__name__}


def curve_noise(losses: list[float]) -> float:
    """Std of the step-to-step changes / √2: the scatter of one step around a smooth trend (0 for < 3 steps)."""
    diffs = [b - a for a, b in itertools.pairwise(losses)]
    return statistics.stdev(diffs) / math.sqrt(2) if len(diffs) >= 2 else 0.0


def bench_curve(args: argparse.Namespace, sig: dict) -> dict:
    """Part 2: :func:`specdraft.training.distill.train` for ``--steps`` steps per contender; per-step losses compared."""
    from specdraft.models.loading import load_model
    from specdraft.training.distill import train
    from specdraft.training.distill_trainer import TeacherHead

    losses, seconds, resolved, exact = {}, {}, {}, {}
    for name, (precision, fmt) in CONTENDERS.items():
        draft, _ = load_model(args.draft, dtype="float32", device="cpu")
        hidden = fmt == "hidden"
        with tempfile.TemporaryDirectory(prefix="specdraft-bench-curve-") as tmp:
            res = train(draft, TeacherHead(sig["head"] if hidden else None, sig["real_vocab"], sig["bias"] if hidden else None, width=sig["width"], logit_ops=sig["ops"]), sig["items"][fmt], None, distill_config(args, precision), tmp, resume=False)
        losses[name] = [float(h["loss"]) for h in res.history if "loss" in h]
        seconds[name], resolved[name] = res.seconds, res.precision
        exact[name] = exact_loss(args, sig, res.draft)
        print(f"curve {name}: final loss {losses[name][-1]:.5f}, against the exact teacher {exact[name]:.5f}, in "
              f"{seconds[name]:.1f} s", flush=True)
        del res, draft
        gc.collect()
    ref = losses[REFERENCE]
    noise = curve_noise(ref)
    delta = {n: [abs(a - b) for a, b in zip(v, ref)] for n, v in losses.items() if n != REFERENCE}
    return {"steps": len(ref), "loss": losses, "final_loss": {n: v[-1] for n, v in losses.items()},
            "max_abs_delta": {n: max(d) for n, d in delta.items()},
            "mean_abs_delta": {n: sum(d) / len(d) for n, d in delta.items()},
            "noise": noise, "within_noise": {n: max(d) <= noise for n, d in delta.items()},
            "exact_final_loss": exact,
            "exact_final_delta": {n: abs(v - exact[REFERENCE]) for n, v in exact.items() if n != REFERENCE},
            "exact_within_noise": {n: abs(v - exact[REFERENCE]) <= noise for n, v in exact.items() if n != REFERENCE},
            "topk_leftover_mass": leftover_mass(sig), "precision": resolved, "seconds": seconds}


def exact_loss(args: argparse.Namespace, sig: dict, draft) -> float:
    """The trained draft's loss against the exact teacher (hidden states through the head), in float32, over all
    the fixed batches (token-weighted): what a topk-trained draft is judged by, since its logged loss is against
    p̂, the top-k teacher with the leftover spread."""
    import torch

    from specdraft.training.distill_data import collate
    from specdraft.training.distill_trainer import DistillModel, TeacherHead

    model = DistillModel(draft, TeacherHead(sig["head"], sig["real_vocab"], sig["bias"], width=sig["width"], logit_ops=sig["ops"]), distill_config(args, "float32")).eval()
    rows = sig["items"]["hidden"]
    total = n = 0.0
    with torch.no_grad():
        for i in range(0, len(rows), args.batch):
            out = model(**collate(rows[i:i + args.batch]))
            total += float(out["loss"]) * float(out["tokens"])
            n += float(out["tokens"])
    return total / n


def leftover_mass(sig: dict) -> dict:
    """Mean and max over trained positions of the teacher mass outside the top-k, Σ_{x∉top-k} p(x): the bound on
    |TVD(p̂, q) − TVD(p, q)| per position (specdraft.training.dump's leftover rule)."""
    import torch

    mass = torch.cat([it["leftover_logmass"][it["loss_mask"]].float().exp() for it in sig["items"]["topk"]])
    return {"mean": float(mass.mean()), "max": float(mass.max())}


def load_prompts(spec: str) -> list:
    """The prompt messages of ``spec``'s examples (their replies dropped: the target writes its own)."""
    from specdraft.data.prompts import load_prompts as load_sources
    from specdraft.data.sources import Example

    return [Example(e.id, e.prompt_messages) for e in load_sources([spec])]


def bench_dump(args: argparse.Namespace, prompts: list, work: Path) -> dict:
    """Part 3: answer tokens per minute of ``run_dump --generate`` against teacher-forced ``run_dump`` of the same
    answers, interleaved (the forced run's text is the first generated run's answers)."""
    from specdraft.core.config import DumpConfig
    from specdraft.data.sources import Example
    from specdraft.models.dump_reader import TeacherDataset
    from specdraft.models.loading import load_tokenizer
    from specdraft.training.dump import run_dump

    common = {"teacher_format": args.dump_format, "top_logprobs": args.top_k, "answer_only": True, "batch_size": args.dump_batch,
              "dtype": args.dtype}
    cfgs = {"generated": DumpConfig(generate=args.generate, **common), "teacher_forced": DumpConfig(**common)}
    tok = load_tokenizer(args.target)
    forced: list = []
    skipped = 0
    runs = {k: [] for k in cfgs}

    def one(kind: str, r: int) -> None:
        nonlocal forced, skipped
        out = work / f"{kind}-{r}"
        man = run_dump(args.target, prompts if kind == "generated" else forced, out, cfgs[kind],
                       command="bench/bench_distill_throughput.py")
        this = man["this_run"]
        runs[kind].append({"work_seconds": this["work_seconds"], "answer_tokens": man["trained_tokens"],
                           "tokens": man["tokens"], "sequences": man["sequences"],
                           "generated_tokens": this["generated_tokens"]})
        print(f"dump {kind} {r + 1}/{args.repeats}: {man['trained_tokens']} answer tokens in "
              f"{this['work_seconds']:.1f} s", flush=True)
        if kind == "generated" and not forced:  # the answers become the existing text of the forced runs
            ds, by_id = TeacherDataset(out), {e.id: e for e in prompts}
            for i in range(len(ds)):
                t = ds.tokens(i)
                ids, mask = t["input_ids"], t["loss_mask"].bool()
                text = tok.decode(ids[1:][mask[:-1]].tolist(), skip_special_tokens=True)
                if not text.strip():
                    skipped += 1  # an answer of special tokens only: nothing to teacher-force
                    continue
                ex = by_id[t["id"]]
                forced.append(Example(ex.id, ex.prompt_messages + [{"role": "assistant", "content": text}]))
            if not forced:
                raise BenchError(f"the target wrote no non-empty answer to --prompts {args.prompts}")

    for r in range(args.repeats):
        for kind in (("generated", "teacher_forced") if r % 2 == 0 else ("teacher_forced", "generated")):
            one(kind, r)
    tpm = {k: statistics.median(x["answer_tokens"] / x["work_seconds"] * 60 for x in v) for k, v in runs.items()}
    return {"tokens_per_minute": tpm, "speedup": tpm["teacher_forced"] / tpm["generated"],
            "answer_tokens": {k: v[0]["answer_tokens"] for k, v in runs.items()},
            "sequences": {k: v[0]["sequences"] for k, v in runs.items()}, "skipped_empty_answers": skipped,
            "runs": runs}


def table(result: dict) -> str:
    """The printed summary: one line per measured figure."""
    lines = []
    if st := result.get("step"):
        lines += ["step (trained tokens / min)      tokens/min   vs float32",
                  *(f"  {n:<30} {v:>10.1f}   {st['speedup_vs_float32'][n]:.2f}x"
                    for n, v in st["tokens_per_minute"].items())]
    if cv := result.get("curve"):
        lines += [(f"curve ({cv['steps']} steps)                  final loss   max |Δ| vs float32 (noise "
                   f"{cv['noise']:.5f})"),
                  *(f"  {n:<30} {v:>10.5f}   " + (f"{cv['max_abs_delta'][n]:.5f}"
                                                  + (" within noise" if cv["within_noise"][n] else " OVER noise")
                                                  if n in cv["max_abs_delta"] else "—")
                    for n, v in cv["final_loss"].items())]
        lines += ["  against the exact teacher after training: " + ", ".join(
                  f"{n} {v:.5f}" + (("" if cv["exact_within_noise"][n] else " OVER noise")
                                    if n in cv["exact_within_noise"] else "")
                  for n, v in cv["exact_final_loss"].items())
                  + f"; top-k leftover mass mean {cv['topk_leftover_mass']['mean']:.4f}"]
    if dp := result.get("dump"):
        lines += ["dump (answer tokens / min)       tokens/min   answer tokens",
                  *(f"  {n:<30} {v:>10.1f}   {dp['answer_tokens'][n]}" for n, v in dp["tokens_per_minute"].items()),
                  f"  teacher-forced / generated: {dp['speedup']:.2f}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run the parts asked for and write ``--out/NAME.json``; bad input: one ``error:`` line, exit 2."""
    from specdraft.data.sources import DataError

    args = parse_args(argv)
    try:
        check_args(args)
        import torch

        from specdraft.core.io import atomic_write_text, versions
        from specdraft.decoding.calibration import machine_line
        from specdraft.models.loading import load_tokenizer
        from specdraft.models.tokenizer_view import tokenizer_fingerprint

        torch.set_num_threads(args.threads)
        tok = load_tokenizer(args.target)
        if tokenizer_fingerprint(tok) != tokenizer_fingerprint(load_tokenizer(args.draft)):
            raise BenchError(f"--draft {args.draft} has another tokenizer than --target {args.target}: distillation "
                             "needs one vocabulary (vocab-swap the draft first: specdraft.models.vocab.vocab_swap)")
        rows = fixed_rows(tok, args.text, args.batches * args.batch, args.seq) if {"step", "curve"} & set(
            args.parts) else []
        prompts = load_prompts(args.prompts) if "dump" in args.parts else []
    except (BenchError, DataError) as exc:  # DataError: a source that is not installed or gives nothing
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    result: dict = {
        "command": " ".join(["bench/bench_distill_throughput.py", *args.argv]),
        "date": time.strftime("%Y-%m-%d"), "machine": machine_line(), "torch": torch.__version__,
        "versions": versions(), "target": args.target, "draft": args.draft, "quick": args.quick,
        "settings": {k: getattr(args, k) for k in ("parts", "text", "prompts", "seq", "batch", "batches", "repeats",
                                                    "steps", "loss", "lr", "top_k", "generate", "dump_batch",
                                                    "dump_format", "dtype", "threads")},
        "contenders": {n: {"precision": p, "teacher": f} for n, (p, f) in CONTENDERS.items()},
        "reference": REFERENCE, "fast_path": FAST, "phase_seconds": {},
    }
    t0 = time.perf_counter()
    if rows:
        sig = teacher_signal(args, rows)
        result["phase_seconds"]["teacher_signal"] = time.perf_counter() - t0
        for part, fn in (("step", bench_step), ("curve", bench_curve)):
            if part in args.parts:
                t0 = time.perf_counter()
                result[part] = fn(args, sig)
                result["phase_seconds"][part] = time.perf_counter() - t0
        del sig
        gc.collect()
    if "dump" in args.parts:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="specdraft-bench-dump-") as work:
            result["dump"] = bench_dump(args, prompts, Path(work))
        result["phase_seconds"]["dump"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / f"{args.name}.json", json.dumps(result, indent=2))
    print(table(result))
    print(f"wrote {args.out / (args.name + '.json')}")
    return result


if __name__ == "__main__":
    main()
