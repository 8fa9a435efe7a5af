"""The figures of one finished ``specdraft run`` as a benchmark result (bench/results/run-<name>.json), which
``bench/run_all.py --render-only`` turns into docs/benchmarks.md's "main job" section.

    /usr/bin/time -v specdraft run --out runs/default > runs/default.log 2>&1
    python bench/machine_check.py --target-step --out runs/machine.json   # the day's machine, just before
    python bench/run_summary.py --run runs/default --time-log runs/default.log --machine-check runs/machine.json \
        --name default

It reads ``report.json`` (per held-out set: greedy acceptance of the draft as given and before / after
distillation with the paired gain, the interleaved speed run against the target alone and transformers' assisted
generation; the forecast; each stage's seconds) and, from ``/usr/bin/time -v``'s log, the wall clock and peak RSS.
Nothing is re-measured here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))


def _time_log(path: Path | None) -> dict:
    """Wall clock (s) and peak RSS (GB) from a ``/usr/bin/time -v`` log; ``{}`` without one."""
    if path is None:
        return {}
    text = path.read_text(errors="replace")
    out = {}
    if m := re.search(r"Maximum resident set size \(kbytes\): (\d+)", text):
        out["peak_rss_gb"] = int(m.group(1)) * 1024 / 1e9
    if m := re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text):
        parts = [float(x) for x in m.group(1).split(":")]
        out["wall_seconds"] = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    if m := re.search(r'Command being timed: "(.+)"', text):
        out["timed_command"] = m.group(1)
    return out


def _distilled_vs_original(rows: list[dict]) -> dict | None:
    """The shipped draft's tokens/s over the draft as given, paired per prompt (rows: [tokens, seconds] each)."""
    from specdraft.decoding.speed_run import SpeedRun
    from specdraft.measuring.recommend import paired_speed_ratio

    run = SpeedRun.from_dict({"prompts": len(rows), "contenders": {}, "rows": rows})
    e = paired_speed_ratio(run, "speculative:distilled", "speculative:original")
    return None if e is None else {"ratio": e.value, "ratio_ci95": [e.low, e.high], "prompts": e.prompts}


def summarise(run: Path, time_log: Path | None = None) -> dict:
    """The run's headline figures (see the module docstring)."""
    from specdraft.measuring.report import acceptance_gain, baseline_sets, speed_sets

    r = json.loads((run / "report.json").read_text())
    timed = _time_log(time_log)
    base, after = baseline_sets(r), r["eval_after"]["sets"]
    sets = {}
    for name, b in base.items():
        g = acceptance_gain(r, name)
        mapped = r["eval_before"]["sets"][name] if r.get("vocab_swap") else None
        sets[name] = {"prompts": b["prompts"], "sources": r["eval_before"]["sets"][name].get("sources"),
                      "as_given_mapped": mapped["acceptance_rate"] if mapped else None,
                      "as_given_alpha": r["eval_before"]["sets"][name].get("alpha"),
                      "before_alpha": b.get("alpha"), "after_alpha": after[name].get("alpha"),
                      "before": b["acceptance_rate"], "after": after[name]["acceptance_rate"],
                      "gain": g.value, "gain_ci95": list(g.interval), "drafted_after": after[name]["drafted"]}
    for name, sp in speed_sets(r).items():
        c = sp.contenders
        hf = next(iter(sp.of_kind("hf_assisted").values()), None)
        sets[name]["speed"] = {
            "prompts": sp.prompts, "max_new_tokens": sp.max_new_tokens,
            "target_tokens_per_s": c["target"].tokens_per_s,
            **{who: {"speedup": s.speedup, "speedup_ci95": s.speedup_ci95,
                     "vs_hf": s.tokens_per_s / hf.tokens_per_s if hf else None, "matches_target": s.matches_target}
               for who in ("original", "distilled") if (s := sp.contender("speculative", who)) is not None},
            "distilled_vs_original": _distilled_vs_original([row.to_dict() for row in sp.rows]),
            "divergences": [{k: getattr(d, k) for k in ("prompt_id", "contender", "position", "margin")}
                            for d in sp.divergences if not d.contender.startswith("hf_assisted")]}
    h = r.get("headroom") or {}
    return {"command": timed.get("timed_command") or r["command"], "date": r["date"],
            "machine": r["versions"]["machine"], "torch": r["versions"]["torch"], "preset": r["config"]["preset"],
            "target": r["config"]["target"], "draft": r["config"]["draft"], "vocab_swap": bool(r.get("vocab_swap")),
            "forecast": h.get("gain"), "forecast_ci95": h.get("gain_ci95"), "sets": sets,
            "stages": {k: v["seconds"] for k, v in r["timings"].items() if k != "report"},
            "configuration": {k: v.get("label") for k, v in ((r["speed"] or {}).get("draft_configuration") or {}).items()},
            "distill": {k: r["distill"].get(k) for k in ("steps", "train_sequences")},
            "recommendation": r.get("recommendation"), "distillation_verdict": r.get("distillation_verdict"),
            "host": r.get("host"), "teacher": (r.get("dump") or {}).get("teacher"),
            "llama_cpp": (r.get("export") or {}).get("llama_cpp"),
            **{k: v for k, v in timed.items() if k != "timed_command"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="A finished specdraft run's --out directory.")
    ap.add_argument("--time-log", type=Path, help="The run's /usr/bin/time -v output (wall clock, peak RSS).")
    ap.add_argument("--name", required=True, help="Result name: bench/results/run-NAME.json.")
    ap.add_argument("--machine-check", type=Path,
                    help="bench/machine_check.py --target-step's result from just before the run: minutes move with "
                         "the day's machine, so the target's own bf16 step rate is stated beside the wall clock.")
    ap.add_argument("--note", default="", help="A sentence the rendered section carries (how the run was made).")
    a = ap.parse_args()
    from specdraft.core.io import atomic_write_text

    res = summarise(a.run, a.time_log) | {"note": a.note}
    if a.machine_check:
        m = json.loads(a.machine_check.read_text())
        res["machine_check"] = {k: m.get(k) for k in ("target_bf16_tok_s", "copy_gb_s", "steal_share")}
    atomic_write_text(ROOT / "results" / f"run-{a.name}.json", json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str)[:3000])


if __name__ == "__main__":
    main()
