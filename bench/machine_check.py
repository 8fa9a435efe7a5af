"""What this machine gives a decoder now: memory bandwidth, bf16/fp32 matrix-vector throughput, steal time.

Every tokens/s figure in this project rests on the machine it was measured on, and machines "like this one" differ
from day to day (the same 2-core VM kind has run the 1.5B bfloat16 target alone anywhere from 3 to 7.4 tok/s;
bench/results/machine.json holds the last measurement). One batch-1 decoding step reads every weight once, so it is bounded by how fast the
weights stream from memory; this measures that bound with the shapes of the embedded target (Qwen2.5-Coder-1.5B:
an MLP projection of 8,960 × 1,536) and prints it beside the target's measured one-token step.

    python bench/machine_check.py [--threads 2] [--target-step]

Writes ``bench/results/machine.json``: ``copy_gb_s`` (numpy copy, read + write bytes / s), ``gemv_gb_s``
(weight bytes / s of a [1, 1536] × [1536, 8960] product per dtype, torch's default CPU path: oneDNN for bfloat16),
``steal_share`` (share of CPU time the hypervisor gave to others while timing, from ``/proc/stat``) and, with
``--target-step``, the embedded target's one-token decode step in bfloat16 (tok/s, at a 200-token context).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))


def _cpu_times() -> list[int]:
    with open("/proc/stat") as fh:
        return [int(x) for x in fh.readline().split()[1:]]


def _steal(before: list[int], after: list[int]) -> float:
    d = [b - a for a, b in zip(before, after)]
    return d[7] / max(1, sum(d)) if len(d) > 7 else 0.0


def copy_bandwidth(nbytes: int = 400_000_000, reps: int = 8) -> float:
    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    np.copyto(b, a)
    t = time.perf_counter()
    for _ in range(reps):
        np.copyto(b, a)
    return 2 * a.nbytes * reps / (time.perf_counter() - t) / 1e9


def gemv_bandwidth(dtype: torch.dtype, reps: int = 300) -> float:
    from specdraft.decoding.calibration import gemv_gb_s

    return gemv_gb_s(str(dtype).removeprefix("torch."), reps=reps // 3, rounds=3)


def target_step(tokens: int = 32) -> float:
    from specdraft.core.embedded import DEFAULT_TARGET
    from specdraft.models.loading import load_model

    model, _ = load_model(DEFAULT_TARGET, dtype="bfloat16")
    ids = torch.randint(100, 1000, (1, 200))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(tokens):
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return tokens / (time.perf_counter() - t)


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-step", action="store_true", help="also time the embedded target's one-token step")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "machine.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s0 = _cpu_times()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {args.threads} threads",
              "torch": torch.__version__, "copy_gb_s": copy_bandwidth(),
              "gemv_gb_s": {"float32": gemv_bandwidth(torch.float32), "bfloat16": gemv_bandwidth(torch.bfloat16)}}
    if args.target_step:
        result["target_bf16_tok_s"] = target_step()
    result["steal_share"] = _steal(s0, _cpu_times())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
