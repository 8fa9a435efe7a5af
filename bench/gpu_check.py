"""GPU check (run on a CUDA machine): the decoding invariants, evaluation and distillation on CUDA tensors.

Tiny models built here (no weights needed): greedy speculative == target-only (batched and solo) in float32
and bfloat16 (a bf16 divergence is reported with the target's top-2 margin), the sampled law (χ²) with a CUDA
generator, ``run_eval`` end to end, and a distillation step whose frozen teacher head follows ``.to()``.

    python bench/gpu_check.py --out results/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from specdraft.core.config import DistillConfig, EvalConfig, SamplingConfig
from specdraft.core.sampling import filtered_probs
from specdraft.core.stats import chi2_goodness_of_fit
from specdraft.decoding.decode import speculative_generate, target_generate
from specdraft.measuring.evaluate import run_eval, top2_margin
from specdraft.models.tokens import left_pad
from specdraft.testing import perturbed, tiny_model, tiny_tokenizer
from specdraft.training.distill_data import collate
from specdraft.training.distill_trainer import DistillModel, TeacherHead

DEV = "cuda"
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32]]


def greedy_check(dtype: torch.dtype) -> dict:
    target = tiny_model("qwen2", 128, seed=0, layers=3).to(DEV, dtype)
    draft = perturbed(tiny_model("qwen2", 128, seed=0, layers=3), 0.04).to(DEV, dtype)
    ids, mask = left_pad(PROMPTS, 0, DEV)
    base, _ = target_generate(target, ids, mask, max_new_tokens=29, eos_token_id=[])
    out = {"dtype": str(dtype), "gammas": {}}
    for gamma in (1, 4, 7):
        spec, c = speculative_generate(target, draft, ids, mask, num_speculative_tokens=gamma, max_new_tokens=29,
                                       eos_token_id=[])
        rows = []
        for i, p in enumerate(PROMPTS):
            if spec[i] != base[i]:
                pos = next(j for j, (a, b) in enumerate(zip(spec[i], base[i])) if a != b)
                rows.append({"row": i, "position": pos, "margin": top2_margin(target, p + base[i][:pos])})
        solo_equal = all(
            speculative_generate(target, draft, *left_pad([p], 0, DEV), num_speculative_tokens=gamma,
                                 max_new_tokens=29, eos_token_id=[])[0][0] == base[i] for i, p in enumerate(PROMPTS))
        out["gammas"][gamma] = {"batched_equal": spec == base, "solo_equal": solo_equal, "divergences": rows,
                                "acceptance_rate": c.acceptance_rate}
    return out


def chi2_check() -> dict:
    V, N = 12, 6000
    sampling = SamplingConfig(temperature=0.7, top_k=6, top_p=0.9)
    target = tiny_model("llama", V + 5, seed=0, layers=2, hidden=16).to(DEV)
    draft = perturbed(tiny_model("llama", V + 5, seed=0, layers=2, hidden=16), 0.08, seed=5).to(DEV)
    with torch.no_grad():
        ids = torch.tensor([[5, 6, 7]], device=DEV)
        p1 = filtered_probs(target(ids).logits[0, -1], 0.7, 6, 0.9)
        ext = torch.cat([ids.repeat(p1.shape[0], 1), torch.arange(p1.shape[0], device=DEV)[:, None]], 1)
        p2 = filtered_probs(target(ext).logits[:, -1], 0.7, 6, 0.9)
    law = (p1[:, None].double() * p2.double()).cpu().numpy()
    law /= law.sum()
    g = torch.Generator(device=DEV).manual_seed(1234)
    out, counts = speculative_generate(target, draft, torch.tensor([[5, 6, 7]] * N, device=DEV), None,
                                       num_speculative_tokens=3, sampling=sampling, max_new_tokens=2,
                                       eos_token_id=[], generator=g)
    pvalue, outside = chi2_goodness_of_fit(out, law)
    return {"pvalue": pvalue, "acceptance_rate": counts.acceptance_rate, "outside_support": outside}


def eval_and_distill_check() -> dict:
    tok = tiny_tokenizer(128)
    target = tiny_model("llama", 128, seed=0, layers=3).to(DEV)
    draft = perturbed(tiny_model("llama", 128, seed=0, layers=3), 0.03).to(DEV)
    res = run_eval(target, draft, tok, [[5, 6, 7, 8], [9, 10, 11]],
                   config=EvalConfig(num_speculative_tokens=3, max_new_tokens=12, compare_hf=True))
    s = res.summary()
    sampled = run_eval(target, draft, tok, [[5, 6, 7, 8]], config=EvalConfig(
                       num_speculative_tokens=3, max_new_tokens=12, sampling=SamplingConfig(temperature=0.8, top_p=0.9)))
    m = DistillModel(perturbed(target, 0.1).cpu(), TeacherHead(target.lm_head.weight.detach().cpu(), 128), DistillConfig(loss="tvd_deploy", top_k=5)).to(DEV)
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    with torch.no_grad():
        h = target(ids[None].to(DEV), output_hidden_states=True).hidden_states[-1][0].cpu()
    batch = {k: v.to(DEV) for k, v in collate([{"input_ids": ids, "loss_mask": torch.ones(6, dtype=torch.bool),
                                                  "hidden": h}]).items()}
    out = m(**batch)
    out["loss"].backward()
    grads = [p.grad for p in m.draft.parameters() if p.grad is not None]
    return {"eval_lossless": s["lossless"], "hf_matches": s["hf_assisted_matches_target"],
            "sampled_eval_tokens": sampled.spec_tokens, "head_device": str(m.head_weight.device),
            "distill_loss": float(out["loss"]), "grads_on_cuda": all(g.device.type == DEV for g in grads) and bool(grads)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "gpu_check.json")
    ap.add_argument("--device", default="cuda", help="cpu for a dry run of this script")
    ap.add_argument("--only", default=None, help="run only this check")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "torch": torch.__version__,
              "transformers": __import__("transformers").__version__}
    for name, fn in (("greedy_fp32", lambda: greedy_check(torch.float32)),
                     ("greedy_bf16", lambda: greedy_check(torch.bfloat16)),
                     ("chi2", chi2_check), ("eval_distill", eval_and_distill_check)):
        if args.only and name != args.only:
            continue
        try:
            result[name] = fn()
        except Exception as exc:  # noqa: BLE001 - report every check, even after a failure
            import traceback

            result[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        print(name, json.dumps(result[name])[:600], flush=True)
    result["seconds"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
