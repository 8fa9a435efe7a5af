"""The shipped draft against the draft as given: tokens/s of speculative decoding with each, paired per prompt.

The main job's speed stage times 3 prompts × 64 tokens, too few to tell two drafts apart. Here the distilled,
re-indexed draft of a finished ``specdraft run`` (``RUN/export/speculator``: what vLLM and llama.cpp serve) and the
draft as given (through the vocabulary mapping, text proposals) decode the same held-out prompts with the target,
interleaved prompt by prompt with the target alone (:func:`specdraft.measuring.evaluate.interleaved_speed`, the run's own
evaluation settings: draft preparation, adaptive γ ≤ 5, bfloat16), greedy, outputs checked equal to the target
alone's. Writes ``bench/results/shipped-speed.json``: per contender tokens/s and speed-up over the target alone, the
distilled/as-given ratio with its paired 95% bootstrap interval, and any divergence with its margin.

With ``--as-given-distilled DIR`` the contender is instead a draft distilled *as given* (its own tokenizer,
``bench/distill_as_given.py``'s speculator), drafting through text as the draft as given does, on the default pair.

    python bench/bench_shipped_speed.py --run runs/default --prompts humaneval:100:8:8 --max-new-tokens 128
    python bench/bench_shipped_speed.py --as-given-distilled DIR --name shipped-speed-as-given
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("runs/default"), help="a finished `specdraft run` directory")
    ap.add_argument("--prompts", default="humaneval:100:8:8",
                    help="held-out prompt source (default: 8 HumanEval problems from 100, every 8th: held out "
                         "from every training set)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--as-given-distilled", type=Path, default=None,
                    help="a draft distilled as given (its speculator directory): compared with the draft as given")
    ap.add_argument("--name", default="shipped-speed")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args(argv)

    from specdraft.core.config import PipelineConfig
    from specdraft.data.prompts import load_prompts
    from specdraft.data.sources import encode_prompts
    from specdraft.measuring.evaluate import interleaved_speed
    from specdraft.models.loading import load_model, resolve_ref
    from specdraft.models.vocab import build_vocab_mapping

    if args.as_given_distilled is not None:
        from specdraft.run.pipeline import make_config

        cfg, report = make_config("default"), {"command": None}
        shipped = args.as_given_distilled
    else:
        report = json.loads((args.run / "report.json").read_text())
        cfg = PipelineConfig.model_validate(report["config"])
        if not report.get("vocab_swap"):
            ap.error(f"{args.run} is not a run of a draft of another tokenizer: there is no draft as given to compare")
        shipped = args.run / "export" / "speculator"
    evalc = cfg.eval.model_copy(update={"max_new_tokens": args.max_new_tokens})
    examples = load_prompts([args.prompts], held_out=True)
    target_ref, draft_ref = resolve_ref(cfg.target), resolve_ref(cfg.draft)
    target, tok = load_model(target_ref, dtype=evalc.dtype)
    drafts = {"original": load_model(draft_ref, dtype=evalc.dtype)[0],
              "distilled": load_model(str(shipped), dtype=evalc.dtype)[0]}
    mappings = {"original": build_vocab_mapping(target_ref.path, draft_ref.path)}
    if args.as_given_distilled is not None:  # of the draft's own tokenizer: it drafts through text too
        mappings["distilled"] = build_vocab_mapping(target_ref.path, str(shipped))
    t0 = time.time()
    run = interleaved_speed(target, drafts, tok, encode_prompts(tok, examples), [e.id for e in examples], evalc,
                            vocab_mappings=mappings)
    from run_summary import _distilled_vs_original

    d = run.to_dict()
    result = {
        "command": "python " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__, "target": cfg.target, "draft": cfg.draft, "run": report["command"],
        "shipped": (f"{shipped} (distilled as given, drafting through text)" if args.as_given_distilled is not None
                    else "the run's export/speculator (re-indexed, distilled; " + str(cfg.export_dtype) + ")"),
        "prompts": {"source": args.prompts, "count": len(examples)}, "max_new_tokens": args.max_new_tokens,
        "eval": evalc.model_dump(mode="json"), "seconds": time.time() - t0,
        "lossless": run.lossless,
        "contenders": d["contenders"],
        "distilled_vs_original": _distilled_vs_original(d["rows"]),
        "divergences": d.get("divergences"), "speed_run": d,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)
    print(json.dumps({k: result[k] for k in ("lossless", "distilled_vs_original")} | {
        n: round(c["speedup"], 3) for n, c in result["contenders"].items() if c.get("speedup")}, default=str))
    return result


if __name__ == "__main__":
    main()
