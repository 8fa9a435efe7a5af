"""Loss memory benchmark: ``tvd_deploy`` forward + backward on logits [1, 2048, 151936] at top_k = 20.

specdraft's ``tvd_deploy`` (``torch.topk`` + nucleus over the k kept values; TVD over the two top-k
supports, so no vocabulary-sized float tensor is kept for backward) against a
full-vocabulary-sort implementation (sort all V logits with their int64 indices, cumulative sum, scatter
back), each in its own subprocess, interleaved, the same inputs. Peak memory above the inputs:

* CUDA: ``torch.cuda.max_memory_allocated`` minus the bytes allocated after the inputs were created;
* CPU: peak RSS (``ru_maxrss``) of the child minus its RSS after the inputs were created.

    python bench/bench_loss_memory.py [--seq 2048 --vocab 151936 --top-k 20 --top-p 0.95 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def full_sort_tvd_deploy(d_logits, t_logits, temperature, top_k, top_p):
    """Reference: the straightforward full-vocabulary sort path (what the memory-efficient one replaces)."""
    import torch

    def filt(x):
        x = x.float() / temperature
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)  # [.., V] values + [.., V] int64 indices
        ranks = torch.arange(x.shape[-1], device=x.device)
        sorted_x = sorted_x.masked_fill(ranks >= top_k, float("-inf"))
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        sorted_x = sorted_x.masked_fill(mass_before >= top_p, float("-inf"))
        return torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x).softmax(-1)

    return 0.5 * (filt(t_logits) - filt(d_logits)).abs().sum(-1)


def child(impl: str, seq: int, vocab: int, top_k: int, top_p: float, device: str) -> dict:
    import torch

    from specdraft.core.losses import masked_mean, tvd_deploy

    torch.manual_seed(0)
    d = torch.randn(1, seq, vocab, device=device, requires_grad=True)
    # A teacher close to the draft (overlapping top-k supports), as after some distillation.
    t = d.detach() + 0.5 * torch.randn(1, seq, vocab, device=device)
    mask = torch.ones(1, seq, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_now()
    t0 = time.perf_counter()
    if impl == "specdraft":
        per_pos = tvd_deploy(d, None, teacher_logits=t, temperature=1.0, top_k=top_k, top_p=top_p)
    else:
        per_pos = full_sort_tvd_deploy(d, t, 1.0, top_k, top_p)
    loss = masked_mean(per_pos, mask)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"impl": impl, "peak_bytes": peak, "seconds": time.perf_counter() - t0, "loss": float(loss)}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT.parent / "src"))
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.child:
        print(json.dumps(child(args.child, args.seq, args.vocab, args.top_k, args.top_p, device)))
        return {}
    runs = []
    for _ in range(args.repeats):
        for impl in ("specdraft", "full_sort"):  # interleaved
            cmd = [sys.executable, __file__, "--child", impl, "--seq", str(args.seq), "--vocab", str(args.vocab),
                   "--top-k", str(args.top_k), "--top-p", str(args.top_p), "--device", device]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(runs[-1], flush=True)
    peak = {impl: min(r["peak_bytes"] for r in runs if r["impl"] == impl) for impl in ("specdraft", "full_sort")}
    losses = {impl: runs[[r["impl"] for r in runs].index(impl)]["loss"] for impl in peak}
    result = {
        "command": " ".join(["bench/bench_loss_memory.py"] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "shape": [1, args.seq, args.vocab], "top_k": args.top_k, "top_p": args.top_p,
        "peak_bytes": peak,
        "ratio": peak["specdraft"] / peak["full_sort"],
        "loss": losses,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"loss-memory-{'cuda' if device == 'cuda' else 'cpu'}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return result


if __name__ == "__main__":
    main()
