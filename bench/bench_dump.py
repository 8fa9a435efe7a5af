"""Teacher-dump benchmark: tokens/s of ``specdraft dump`` (forward + capture + shard writing + hashing) against
a bare target forward over the same batches; bytes per token of the ``hidden`` and ``topk`` formats.

Sequences: HumanEval prompts with their canonical solutions through the chat template (no generation, so the
timing is the teacher pass alone). ``run_dump``'s ``work_seconds`` excludes model loading; the bare loop reuses
one loaded target. Interleaved: bare, hidden, bare, topk.

    python bench/bench_dump.py [--num-examples 24 --batch-size 8 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from specdraft.core.config import DumpConfig
from specdraft.core.embedded import DEFAULT_TARGET
from specdraft.data.sources import build_sequences, load_examples
from specdraft.models.dump_reader import pad_collate
from specdraft.models.loading import load_model
from specdraft.training.dump import run_dump


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--num-examples", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    examples = load_examples("humaneval", limit=args.num_examples)
    target, tok = load_model(args.target, dtype=args.dtype, device="cpu")
    seqs = build_sequences(tok, examples, max_length=args.max_length)
    tokens = sum(len(s.ids) for s in seqs)

    def bare() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(0, len(seqs), args.batch_size):
                batch = pad_collate([{"input_ids": torch.tensor(s.ids)} for s in seqs[i:i + args.batch_size]])
                target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return time.perf_counter() - t0

    results: dict = {"bare": [], "hidden": [], "topk": []}
    bytes_per_token = {}
    work = Path(tempfile.mkdtemp(prefix="specdraft-bench-dump-"))
    try:
        for fmt in ("hidden", "topk"):
            results["bare"].append(bare())
            cfg = DumpConfig(teacher_format=fmt, max_length=args.max_length, batch_size=args.batch_size, dtype=args.dtype)
            man = run_dump(args.target, examples, work / fmt, cfg, command="bench/bench_dump.py")
            results[fmt].append(man["this_run"]["work_seconds"])
            bytes_per_token[fmt] = man["bytes_per_token"]
            assert man["tokens"] == tokens, (man["tokens"], tokens)
            print(fmt, {k: v[-1] for k, v in results.items() if v}, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bare_s = min(results["bare"])
    tps = {"bare_forward": tokens / bare_s, "dump_hidden": tokens / results["hidden"][0],
           "dump_topk": tokens / results["topk"][0]}
    result = {
        "command": " ".join(["bench/bench_dump.py"] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__, "dtype": args.dtype, "sequences": len(seqs), "tokens": tokens,
        "tokens_per_s": tps,
        "overhead": {"hidden": tps["bare_forward"] / tps["dump_hidden"] - 1,
                     "topk": tps["bare_forward"] / tps["dump_topk"] - 1},
        "bytes_per_token": bytes_per_token,
        "seconds": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dump.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
