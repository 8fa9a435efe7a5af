# Target greedy answers to the default preset's held-out sets and train prompts (decoded with the 0.5B same-tokenizer draft).
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "src"))
from specdraft.core.config import EvalConfig, SamplingConfig
from specdraft.data.prompts import load_prompts
from specdraft.data.sources import encode_prompts
from specdraft.measuring.evaluate import acceptance_eval
from specdraft.models.loading import load_model

torch.set_num_threads(2)
W = os.environ.get("SWAP_ROUTES_WORK", "runs/swap-routes")
os.makedirs(W, exist_ok=True)
target, tok = load_model("qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
draft, _ = load_model("qwen2.5-coder-0.5b-instruct", dtype="bfloat16")
cfg = EvalConfig(num_speculative_tokens=5, max_new_tokens=64)
for name, spec in [("code", ["humaneval:100:16:4"]), ("chat", ["mt-bench:0:27:3"]), ("train", ["humaneval:0:48"])]:
    ex = load_prompts(spec, unique=(name == "train"))
    ids = encode_prompts(tok, ex)
    t0 = time.time()
    r = acceptance_eval(target, draft, tok, ids, [e.id for e in ex], cfg, SamplingConfig())
    Path(f"{W}/answers-{name}.json").write_text(json.dumps({"prompts": [e.id for e in ex], "prompt_ids": ids, "answers": r["answers"]}))
    print(name, len(ex), "prompts", time.time() - t0, "s", r["acceptance_rate"], flush=True)
