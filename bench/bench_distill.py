"""Distillation step benchmark: a specdraft training step (draft forward + teacher head + loss + backward +
AdamW) against a plain causal-LM fine-tuning step of the same draft on the same tokens (cross-entropy on the
next token), interleaved, same batch. Target: loss overhead ≤ 15%.

The teacher signal is a ``hidden`` dump row (post-norm target hidden states, bf16), made here by one target
forward pass over the batch so that the benchmark needs no dump on disk.

    python bench/bench_distill.py [--seq 256 --batch 2 --repeats 3 --loss tvd]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from specdraft.core.config import DistillConfig
from specdraft.core.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdraft.models.loading import load_model
from specdraft.training.distill_trainer import DistillModel, TeacherHead


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loss", default="tvd", choices=["soft_ce", "tvd", "tvd_deploy"])
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    target, tok = load_model(DEFAULT_TARGET, dtype="bfloat16", device="cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (args.batch, args.seq), generator=g)
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1].to(torch.bfloat16)
    head = target.get_output_embeddings().weight.detach().clone()
    real_vocab = len(tok)
    del target

    draft, _ = load_model(DEFAULT_DRAFT, dtype="float32", device="cpu")
    cfg = DistillConfig(loss=args.loss, top_k=args.top_k if args.loss == "tvd_deploy" else 0)
    model = DistillModel(draft, TeacherHead(head, real_vocab), cfg)
    model.train()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-6)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, -1] = False

    def distill_step() -> float:
        out = model(input_ids=ids, loss_mask=mask, hidden=hidden)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out["loss"])

    def plain_step() -> float:
        out = draft(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss)

    distill_step(), plain_step()  # warm-up
    times = {"distill": [], "plain": []}
    for _ in range(args.repeats):
        for name, fn in (("plain", plain_step), ("distill", distill_step)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            print(name, round(times[name][-1], 2), flush=True)
    tokens = args.batch * args.seq
    best = {k: min(v) for k, v in times.items()}
    result = {
        "command": " ".join(["bench/bench_distill.py"] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "loss": args.loss, "batch": args.batch, "seq": args.seq,
        "tokens_per_s": {k: tokens / v for k, v in best.items()},
        "overhead": best["distill"] / best["plain"] - 1.0,
        "seconds": times,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"distill-{args.loss}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=2))
    return result


if __name__ == "__main__":
    main()
