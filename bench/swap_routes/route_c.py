"""Route c: which loss trains the re-indexed (swapped) draft best, at one budget.

The target's top-k teacher over its own answers to the training prompts is computed once and cached; each loss
then trains a fresh swapped draft with the same optimiser, steps and batches, and greedy acceptance is replayed on
the held-out code and chat answers, paired per prompt against the untrained swap.

    SWAP_ROUTES_WORK=DIR python bench/swap_routes/route_c.py --losses tvd ce nla lk_hybrid --steps 40
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch
from lib import *

from specdraft.core.losses import LOSSES, masked_mean, sum_min
from specdraft.models.loading import load_model

ap = argparse.ArgumentParser()
ap.add_argument("--losses", nargs="+", default=["tvd", "ce", "nla", "lk_hybrid"])
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--lr", type=float, default=3e-4, help="body learning rate")
ap.add_argument("--row-lr", type=float, default=1e-3, help="embedding / head learning rate")
ap.add_argument("--k", type=int, default=32, help="teacher top-k kept")
ap.add_argument("--name", default="c")
a = ap.parse_args()
torch.set_num_threads(2)
torch.manual_seed(0)


def teacher(k):
    """{ids: [prompt + answer], start: len(prompt), topk_ids, topk_probs}: the target's p at each answer position."""
    cache = Path(f"{W}/teacher-train-k{k}.pt")
    if cache.exists():
        return torch.load(cache)
    P, A = answers("train")
    target, _ = load_model(TARGET, dtype="bfloat16")
    out = []
    t0 = time.time()
    with torch.inference_mode():
        for p, ans in zip(P, A):
            ids = torch.tensor([p + ans])
            logits = target(ids).logits[0, len(p) - 1: len(p) - 1 + len(ans)].float()
            probs = torch.softmax(logits, -1)
            v, i = probs.topk(k, -1)
            out.append({"ids": p + ans, "start": len(p), "topk_ids": i, "topk_probs": v})
    print(f"teacher: {len(out)} answers in {time.time() - t0:.0f}s", flush=True)
    del target
    torch.save(out, cache)
    return out


def dense(topk_ids, topk_probs, width):
    p = torch.zeros(topk_ids.shape[0], width)
    p.scatter_(1, topk_ids, topk_probs / topk_probs.sum(-1, keepdim=True))
    return p


def train(model, data, loss_name, steps, batch, lr, row_lr, log):
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    rows = {id(emb), id(head)}
    groups = [{"params": [p for p in model.parameters() if id(p) not in rows], "lr": lr},
              {"params": list({id(t): t for t in (emb, head)}.values()), "lr": row_lr}]
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    loss_fn = LOSSES[loss_name]
    rng = random.Random(0)
    model.train()
    for step in range(steps):
        idx = rng.sample(range(len(data)), batch)
        opt.zero_grad()
        total, alpha = 0.0, 0.0
        for j in idx:  # one sequence at a time: no padding, the gradient summed over the batch
            d = data[j]
            ids = torch.tensor([d["ids"]])
            n = len(d["topk_ids"])
            h = model.model(ids).last_hidden_state[0, d["start"] - 1: d["start"] - 1 + n]
            logits = model.lm_head(h).float()
            p = dense(d["topk_ids"], d["topk_probs"], logits.shape[-1])
            per = loss_fn(logits[None], p[None])
            loss = masked_mean(per, torch.ones_like(per, dtype=torch.bool)) / batch
            loss.backward()
            total += float(loss)
            with torch.no_grad():
                alpha += float(sum_min(p, torch.softmax(logits, -1)).mean()) / batch
        opt.step()
        if step % 5 == 0 or step == steps - 1:
            log(f"{loss_name} step {step}: loss {total:.4f} α(train) {alpha:.4f}")
    model.eval()
    return model


data = teacher(a.k)
base_model, ttok, _ = swapped()
sets = [n for n in ("code", "chat") if Path(f"{W}/answers-{n}.json").exists()]
baseline = {}
for s in sets:
    r, rows = acceptance(base_model, s)
    baseline[s] = {"acceptance": r, "rows": rows}
    print(f"swap as is: {s} {r:.4f}", flush=True)
del base_model
res = {"args": vars(a), "baseline": baseline, "routes": {}}
for loss_name in a.losses:
    m, _, _ = swapped()
    m = untie(m)
    t0, c0 = time.time(), time.process_time()
    train(m, data, loss_name, a.steps, a.batch, a.lr, a.row_lr, log=lambda s: print(s, flush=True))
    wall, cpu = time.time() - t0, time.process_time() - c0
    out = {"train_wall_s": wall, "train_cpu_s": cpu}
    for s in sets:
        r, rows = acceptance(m, s)
        gain, ci = paired(baseline[s]["rows"], rows)
        out[s] = {"acceptance": r, "rows": rows, "gain": gain, "gain_ci95": ci}
        print(f"{loss_name}: {s} {r:.4f} gain {gain:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]", flush=True)
    res["routes"][loss_name] = out
    Path(f"{W}/route-{a.name}.json").write_text(json.dumps(res))
    del m
