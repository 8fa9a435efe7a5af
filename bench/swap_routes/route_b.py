import argparse
import json
import time
from pathlib import Path

import torch
from features import corpus, features, train_head
from lib import *
from routes import seg_init

ap = argparse.ArgumentParser()
ap.add_argument("--input", default="mean"); ap.add_argument("--output", default="first")
ap.add_argument("--sharegpt", type=int, default=600); ap.add_argument("--stdlib", type=int, default=120000)
ap.add_argument("--steps", type=int, default=200); ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--bs", type=int, default=2048); ap.add_argument("--no-answers", action="store_true")
ap.add_argument("--name", default="b"); ap.add_argument("--save", default="")
a = ap.parse_args()
torch.set_num_threads(2)
T0 = time.time()
m, ttok, rep = swapped()
m, mapping = seg_init(m, ttok, a.input, a.output)
seqs = corpus(ttok, a.sharegpt, a.stdlib, train_answers=not a.no_answers)
t0 = time.time(); H, Y = features(m, seqs); tf = time.time() - t0
print(f"features: {len(Y)} positions from {len(seqs)} sequences in {tf:.0f}s", flush=True)
t0 = time.time(); train_head(m, H, Y, a.steps, a.bs, a.lr, log=lambda s: print(s, flush=True)); th = time.time() - t0
res = {"args": vars(a), "positions": len(Y), "features_s": tf, "head_s": th, "total_s": time.time() - T0}
for name in [n for n in ("code", "chat") if os.path.exists(f"{W}/answers-{n}.json")]:
    r, rows = acceptance(m, name); res[name] = {"acceptance": r, "rows": rows}
    print(name, round(r, 4), flush=True)
Path(f"{W}/route-{a.name}.json").write_text(json.dumps(res))
if a.save:
    m.save_pretrained(a.save); ttok.save_pretrained(a.save)
