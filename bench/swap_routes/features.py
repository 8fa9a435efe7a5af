import glob
import json
import random
import sysconfig
import time
from pathlib import Path

import torch
from lib import *

from specdraft.data.sources import encode_conversation, load_examples


def corpus(ttok, n_sharegpt=600, n_stdlib_tokens=120_000, chunk=256, seed=0, train_answers=True):
    """[(ids, mask)] Qwen-tokenised sequences: ShareGPT first turns (assistant tokens), stdlib sources, target answers."""
    seqs = []
    for ex in load_examples("sharegpt", limit=n_sharegpt, offset=0):
        ids, mask = encode_conversation(ttok, ex.messages, ex.id)
        ids, mask = ids[:384], mask[:384]
        if any(mask[:-1]):
            seqs.append((ids, mask))
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))
    random.Random(seed).shuffle(files)
    got = 0
    for f in files:
        if got >= n_stdlib_tokens: break
        ids = ttok(Path(f).read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        for s in range(0, min(len(ids), 4 * chunk), chunk):  # at most 4 chunks per file: variety
            c = ids[s:s + chunk]
            if len(c) < 32: continue
            seqs.append((c, [True] * (len(c) - 1) + [False])); got += len(c)
    if train_answers:
        d = json.loads(Path(f"{W}/answers-train.json").read_text())
        for p, a in zip(d["prompt_ids"], d["answers"]):
            seqs.append((p + a, [False] * (len(p) - 1) + [True] * len(a) + [False]))
    return seqs

@torch.no_grad()
def features(model, seqs, bs=8):
    """Final hidden states (after the final norm) at trained positions and the next target token."""
    body = model.model
    H, Y = [], []
    model.to(torch.bfloat16)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))  # length buckets: little padding
    for s in range(0, len(order), bs):
        chunk = [seqs[i] for i in order[s:s + bs]]
        L = max(len(c[0]) for c in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long); att = torch.zeros_like(ids); msk = torch.zeros(len(chunk), L, dtype=torch.bool)
        lab = torch.zeros_like(ids)
        for i, (x, m) in enumerate(chunk):
            ids[i, :len(x)] = torch.tensor(x); att[i, :len(x)] = 1; msk[i, :len(x)] = torch.tensor(m)
            lab[i, :len(x) - 1] = torch.tensor(x[1:])
        h = body(input_ids=ids, attention_mask=att).last_hidden_state  # [b, L, H]
        H.append(h[msk]); Y.append(lab[msk])
    model.to(torch.float32)
    return torch.cat(H), torch.cat(Y)

def train_head(model, H, Y, steps=200, bs=2048, lr=1e-3, wd=0.0, seed=0, log=None, real=151665):
    head = model.get_output_embeddings()
    Wt = head.weight.detach().float().clone().requires_grad_()
    opt = torch.optim.AdamW([Wt], lr=lr, weight_decay=wd, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / max(1, steps // 10)) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    g = torch.Generator().manual_seed(seed)
    n = len(Y); t0 = time.time()
    for step in range(steps):
        idx = torch.randint(0, n, (bs,), generator=g)
        h, y = H[idx], Y[idx]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = h @ Wt.t()
        logits = logits.float()[:, :real]
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()
        if log and (step % 25 == 0 or step == steps - 1):
            acc = (logits.argmax(-1) == y).float().mean().item()
            log(f"step {step} loss {loss.item():.3f} acc {acc:.3f} {time.time() - t0:.0f}s")
    with torch.no_grad():
        head.weight.copy_(Wt.to(head.weight.dtype))
    return model
