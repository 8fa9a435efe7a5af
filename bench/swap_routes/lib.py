import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "src"))
from specdraft.models.loading import resolve
from specdraft.models.vocab import vocab_swap
from specdraft.testing import replay_greedy

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"
W = os.environ.get("SWAP_ROUTES_WORK", "runs/swap-routes")

def swapped():
    from transformers import AutoTokenizer
    ttok = AutoTokenizer.from_pretrained(resolve(TARGET))
    m, rep = vocab_swap(DRAFT, None, resolve(TARGET), width=151936, dtype="float32")
    return m.eval(), ttok, rep

def answers(name):
    d = json.loads(Path(f"{W}/answers-{name}.json").read_text())
    return d["prompt_ids"], d["answers"]

EOS = [151645, 151643]
def acceptance(model, name, gamma=5):
    P, A = answers(name)
    m = model.to(torch.bfloat16)
    rows = replay_greedy(m, P, A, gamma, 64, EOS, real_vocab=151665, batch_size=4)
    model.to(torch.float32)
    acc = sum(sum(r.accepted) for r in rows); prop = sum(sum(r.proposed) for r in rows)
    return acc / prop, [(sum(r.accepted), sum(r.proposed)) for r in rows]

def paired(before, after, n=2000, seed=0):
    import numpy as np
    rng = np.random.default_rng(seed)
    b = np.array(before, float); a = np.array(after, float); k = len(b)
    idx = rng.integers(0, k, (n, k))
    g = a[idx, 0].sum(1) / a[idx, 1].sum(1) - b[idx, 0].sum(1) / b[idx, 1].sum(1)
    return float(a[:, 0].sum() / a[:, 1].sum() - b[:, 0].sum() / b[:, 1].sum()), [float(np.quantile(g, .025)), float(np.quantile(g, .975))]

def untie(model):
    from torch import nn
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head.weight.data_ptr() == emb.weight.data_ptr():
        head.weight = nn.Parameter(emb.weight.detach().clone())
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False
    return model
