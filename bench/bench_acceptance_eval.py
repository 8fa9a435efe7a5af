"""How long the pipeline's acceptance evaluation takes on answers already written (``eval_after``, and the replay half
of ``eval_before``): :func:`specdraft.measuring.evaluate.acceptance_eval` with ``answers`` (one teacher-forced pass per model,
heads over the answers' positions only) against the method it replaced (a full-position pass of the draft for
the greedy replay, :func:`specdraft.testing.replay_greedy`, then full-position passes of both models for α,
:func:`~specdraft.decoding.replay.predicted_alpha`). Both count the same rounds; the counts are compared.

The answers are a finished run's (``RUN/eval_before/report.json``: the target's greedy answers per held-out set), so
nothing is decoded. Contenders interleaved per set, ``--repeats`` times; wall seconds, median.

    python bench/bench_acceptance_eval.py --run runs/default-r3 [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a finished `specdraft run --out` directory")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "acceptance-eval.json")
    args = ap.parse_args()
    report = args.run / "eval_before" / "report.json"
    if not report.is_file():
        sys.exit(f"error: {report} not found: give --run a directory a finished `specdraft run` wrote")

    import torch

    from specdraft import testing
    from specdraft.core.config import EvalConfig, SamplingConfig
    from specdraft.data.prompts import load_prompts
    from specdraft.data.sources import encode_prompts
    from specdraft.decoding import replay
    from specdraft.decoding.calibration import machine_line
    from specdraft.measuring import evaluate as ev
    from specdraft.models.loading import load_model

    torch.set_num_threads(args.threads)
    sets = json.loads(report.read_text())
    before = json.loads((args.run / "eval_before" / "stage.json").read_text())
    run_cfg = json.loads((args.run / "report.json").read_text())["config"]
    target, tok = load_model(run_cfg["target"], dtype=run_cfg["eval"]["dtype"])
    draft, _ = load_model(before["result"]["draft"], dtype=run_cfg["eval"]["dtype"])
    config = EvalConfig(**{k: run_cfg["eval"][k] for k in ("num_speculative_tokens", "max_new_tokens")})
    flat = run_cfg["distill"]  # a run config written with the flat keys, or with its serving filter as one field
    serving = SamplingConfig(**(flat.get("serving") or {k: flat[k] for k in ("temperature", "top_k", "top_p")}))
    eos, real_vocab = ev.eos_ids(target), len(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    # The old cost: the head over every position (then the counted tail is kept, as the old code selected it).
    full = lambda model, ids, attn, pos, keep: model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -keep:]

    def old(prompts, answers):
        with mock.patch.object(replay, "tail_logits", full):
            counts = testing.replay_greedy(draft, prompts, answers, config.num_speculative_tokens,
                                           config.max_new_tokens, eos, real_vocab=real_vocab, pad_id=pad)
            seqs = [list(p) + list(a) for p, a in zip(prompts, answers)]
            masks = [[0] * (len(p) - 1) + [1] * len(a) + [0] for p, a in zip(prompts, answers)]
            replay.predicted_alpha(target, draft, seqs, masks, sampling=serving, real_vocab=real_vocab, pad_id=pad)
        return [sum(c.accepted) for c in counts]

    def new(prompts, answers):
        res = ev.acceptance_eval(target, draft, tok, prompts, [str(i) for i in range(len(prompts))], config, serving,
                                 answers=answers)
        return [r["accepted"] for r in res.rows]

    out = {"command": "python bench/bench_acceptance_eval.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": machine_line(), "run": str(args.run), "repeats": args.repeats, "sets": {}}
    for name, s in sets.items():
        examples = load_prompts(s["sources"])
        prompts = encode_prompts(tok, examples)
        answers = s["answers"]
        secs = {"two_pass_full_heads": [], "one_pass_answer_heads": []}
        counts = {}
        for _ in range(args.repeats):
            for label, fn in (("two_pass_full_heads", old), ("one_pass_answer_heads", new)):
                t0 = time.perf_counter()
                counts[label] = fn(prompts, answers)
                secs[label].append(time.perf_counter() - t0)
                print(f"{name} {label}: {secs[label][-1]:.1f} s", flush=True)
        med = {k: statistics.median(v) for k, v in secs.items()}
        same = sum(a == b for a, b in zip(counts["two_pass_full_heads"], counts["one_pass_answer_heads"]))
        out["sets"][name] = {"prompts": len(prompts), "answer_tokens": sum(map(len, answers)), "seconds": secs,
                             "median_seconds": med,
                             "speedup": med["two_pass_full_heads"] / med["one_pass_answer_heads"],
                             "same_accepted_counts": f"{same}/{len(prompts)}"}
        print(json.dumps({name: out["sets"][name]}), flush=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
