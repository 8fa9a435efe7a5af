"""Run every benchmark (one after another, never in parallel: they share the CPU) and write docs/benchmarks.md
from the JSON results in bench/results/.

    python bench/run_all.py                 # all benchmarks, then the table
    python bench/run_all.py --render-only   # only rebuild docs/benchmarks.md from bench/results/*.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
RESULTS = ROOT / "results"
DOC = ROOT.parent / "docs" / "benchmarks.md"

RUNS = [
    ["bench_decode.py", "--mode", "greedy", "--num-prompts", "16", "--max-new-tokens", "128"],
    ["bench_decode.py", "--mode", "sampled", "--num-prompts", "8", "--max-new-tokens", "128", "--temperature", "0.7",
     "--top-p", "0.95"],
    ["bench_decode.py", "--mode", "greedy", "--draft", "smollm2-135m-instruct", "--map-vocab", "--gamma", "3",
     "--num-prompts", "8", "--max-new-tokens", "128"],
    ["bench_draft_kernels.py", "--repeats", "5"],
    ["bench_decode.py", "--num-prompts", "16", "--max-new-tokens", "128", "--gamma", "8", "--variants", "int4+head",
     "--adaptive-gamma", "int4+head", "--name", "goal16"],
    ["bench_decode.py", "--mode", "sampled", "--num-prompts", "16", "--max-new-tokens", "128", "--temperature", "0.7",
     "--top-p", "0.95", "--gamma", "8", "--variants", "int4+head", "--adaptive-gamma", "int4+head", "--name", "goal8"],
    ["bench_decode.py", "--mode", "greedy", "--prompts", "mt-bench", "--num-prompts", "8", "--max-new-tokens", "64",
     "--gamma", "5", "--variants", "int4+head", "--adaptive-gamma", "plain", "int4+head", "--no-hf", "--name",
     "mtbench-adaptive"],
    ["bench_decode.py", "--mode", "greedy", "--num-prompts", "8", "--max-new-tokens", "64", "--gamma", "5",
     "--variants", "int8", "int4", "head", "int8+head", "int4+head", "--adaptive-gamma", "int4+head", "--name",
     "ablation"],
    ["bench_loss_memory.py", "--seq", "2048", "--top-k", "20", "--repeats", "2"],
    ["bench_dump.py", "--num-examples", "24"],
    ["bench_distill.py", "--loss", "tvd"],
    ["bench_distill_throughput.py"],
    ["bench_distill_gain.py", "--train", "mt-bench:1:20:3", "mt-bench:2:20:3", "--on-policy-fraction", "0", "0.5"],
]


def _load(name: str) -> dict | None:
    p = RESULTS / name
    return json.loads(p.read_text()) if p.is_file() else None


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def render() -> str:
    lines = ["# Benchmarks", "",
             ("Produced by `make bench` (= `python bench/run_all.py`); each section names the exact command. "
             "Ratios are measured side by side in one run, contenders interleaved prompt by prompt."), ""]
    for mode, target in (("greedy", 1.25), ("sampled", 1.15)):
        r = _load(f"decode-{mode}.json")
        if not r:
            continue
        a = r["args"]
        lines += [f"## Decoding — {mode}", "",
                  f"`{r['command']}` — {r['date']}, {r['machine']}, torch {r['versions']['torch']}, transformers "
                  f"{r['versions']['transformers']}. Embedded pair (Qwen2.5-Coder 1.5B target ← 0.5B draft), "
                  f"{a['dtype']}, batch 1, {a['num_prompts']} HumanEval prompts (ids {a['prompt_offset']}–"
                  f"{a['prompt_offset'] + a['num_prompts'] - 1}, chat template) × {a['max_new_tokens']} new tokens"
                  + ("" if mode == "greedy" else f", temperature {a['temperature']}, top_p {a['top_p']}") + ".", "",
                  ("" if mode == "greedy" else "Sampled outputs are random draws and are not expected to equal "
                   "the target-alone draw; that they follow the target's law is what the χ² tests check."),
                  "",
                  "| contender | tokens/s | vs target alone | vs HF assisted | output = target alone |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        hf = r.get("speedup_vs_hf_assisted") or {}
        new_format = "alpha" in r  # α = accepted / reached; older results stored accepted / proposed only
        main = "specdraft" if new_format else "specdraft_fixed_gamma"
        labels = {"target": "target alone (specdraft loop, no draft)",
                  main: f"specdraft, γ = {a['gamma'] if new_format else 5}",
                  ("specdraft_adaptive" if new_format else "specdraft"):
                      "specdraft, γ ≤ 10, draft confidence threshold 0.4",
                  "hf_assisted": "transformers `generate(assistant_model=…)`"}
        for n, tps in r["tokens_per_s"].items():
            lines.append(f"| {labels.get(n, n)} | {tps:.2f} | {r['speedup_vs_target'][n]:.2f}x | "
                         f"{hf.get(n, float('nan')):.2f}x | {r['identical_to_target'][n]} |")
        lines.append("")
        if new_format:
            lines.append(
                f"Acceptance rate (accepted / proposed) {r['acceptance_rate']:.3f}; α (accepted / reached, the "
                f"per-token probability of the analytic model) {r['alpha']:.3f}; mean accepted length "
                f"{r['mean_accepted_length']:.2f} tokens per target pass; c = {r['cost_ratio_c']:.3f} (draft step / "
                f"target pass). Analytic speed-up (Leviathan et al. 2023, Thm 3.8) at γ = {a['gamma']}: "
                f"{r['analytic_speedup']:.2f}x; measured {r['speedup_vs_target']['specdraft']:.2f}x = "
                f"{r['share_of_bound']:.0%} of it. Best γ at this α, c: {r['best_gamma']} "
                f"({r['analytic_speedup_best_gamma']:.2f}x).")
        else:
            lines.append(f"Acceptance rate (accepted / proposed) at γ = 5: {r['acceptance_rate_fixed_gamma5']:.3f}; "
                         f"c = {r['cost_ratio_c']:.3f}. (This run predates the α = accepted / reached estimate, so no "
                         "analytic bound is quoted for it.)")
        lines.append("")
        if hf:
            ok = hf[main] >= target
            lines.append(f"Target ≥ {target:.2f}x transformers assisted generation: {_mark(ok)} ({hf[main]:.2f}x).")
        if mode == "greedy" and new_format:
            lines.append(f"Target ≥ 90% of the analytic bound at the measured α and c: "
                         f"{_mark(r['share_of_bound'] >= 0.9)} ({r['share_of_bound']:.0%}).")
        lines.append("")
    r = _load("decode-greedy-smollm2-135m-instruct.json")
    if r:
        a, m = r["args"], r["vocab_mapping"]
        labels = {"target": "target alone (specdraft loop, no draft)", "specdraft": f"specdraft, γ = {a['gamma']}",
                  "hf_assisted": "transformers universal assisted generation (`tokenizer`, `assistant_tokenizer`)"}
        hf = r.get("speedup_vs_hf_assisted") or {}
        lines += ["## Decoding — greedy, a draft of another tokenizer", "",
                  (f"`{r['command']}` — {r['date']}, {r['machine']}, torch {r['versions']['torch']}, transformers "
                   f"{r['versions']['transformers']}. Qwen2.5-Coder-1.5B-Instruct target ← SmolLM2-135M-Instruct "
                   f"draft (another BPE of 49,152 tokens) through a vocabulary mapping of {m['n_mapped']:,} "
                   f"string-identical tokens ({m['target_coverage']:.1%} of the target vocabulary reachable, "
                   f"{m['draft_coverage']:.1%} of the draft's mapped); the draft re-reads the context as text each "
                   f"round. {a['dtype']}, batch 1, {a['num_prompts']} HumanEval prompts (ids {a['prompt_offset']}–"
                   f"{a['prompt_offset'] + a['num_prompts'] - 1}) × {a['max_new_tokens']} new tokens."), "",
                  "| contender | tokens/s | vs target alone | vs HF assisted | output = target alone |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for n, tps in r["tokens_per_s"].items():
            lines.append(f"| {labels.get(n, n)} | {tps:.2f} | {r['speedup_vs_target'][n]:.2f}x | "
                         f"{hf.get(n, float('nan')):.2f}x | {r['identical_to_target'][n]} |")
        rt = _load("decode-greedy-smollm2-135m-instruct-tokens.json")
        if rt:
            hft = rt.get("speedup_vs_hf_assisted") or {}
            lines += ["", (f"Token mode (`--mapped-proposals tokens`: proposals restricted to tokens with a target "
                           f"twin), a separate run of the same prompts (`{rt['command']}`, {rt['date']}): "
                           f"{rt['tokens_per_s']['specdraft']:.2f} tok/s = {rt['speedup_vs_target']['specdraft']:.2f}x "
                           f"target alone, {hft.get('specdraft', float('nan')):.2f}x HF; acceptance rate "
                           f"{rt['acceptance_rate']:.3f}, α {rt['alpha']:.3f}, outputs identical "
                           f"{rt['identical_to_target']['specdraft']}.")]
        lines += ["", (f"Acceptance rate {r['acceptance_rate']:.3f}; α (accepted / reached) {r['alpha']:.3f}; "
                       f"{r['mean_accepted_length']:.2f} tokens per target pass; c = {r['cost_ratio_c']:.3f}. "
                       f"Analytic speed-up at γ = {a['gamma']}: {r['analytic_speedup']:.2f}x, measured "
                       f"{r['speedup_vs_target']['specdraft']:.2f}x = {r['share_of_bound']:.0%} of it; best γ "
                       f"{r['best_gamma']} ({r['analytic_speedup_best_gamma']:.2f}x)."), ""]
    lines += render_cheap_draft()
    for name in ("loss-memory-cpu.json", "loss-memory-cuda.json"):
        r = _load(name)
        if not r:
            continue
        gb = {k: v / 1e9 for k, v in r["peak_bytes"].items()}
        lines += [f"## Loss memory — {r['device']}", "",
                  (f"`{r['command']}` — {r['date']}, torch {r['torch']}. `tvd_deploy` forward + backward on logits "
                  f"{r['shape']} at top_k = {r['top_k']}, top_p = {r['top_p']}; peak memory above the inputs."), "",
                  "| implementation | peak (GB) | loss |", "| --- | ---: | ---: |",
                  f"| specdraft (top-k supports) | {gb['specdraft']:.2f} | {r['loss']['specdraft']:.6f} |",
                  f"| full-vocabulary sort | {gb['full_sort']:.2f} | {r['loss']['full_sort']:.6f} |", "",
                  f"Ratio {r['ratio']:.2f}; target ≤ 0.5x: {_mark(r['ratio'] <= 0.5)}.", ""]
    r = _load("dump.json")
    if r:
        t = r["tokens_per_s"]
        lines += ["## Teacher dump", "",
                  (f"`{r['command']}` — {r['date']}, {r['machine']}, {r['dtype']}, {r['sequences']} sequences, "
                  f"{r['tokens']} tokens."), "",
                  "| run | tokens/s | overhead vs bare forward | bytes/token |", "| --- | ---: | ---: | ---: |",
                  f"| bare target forward | {t['bare_forward']:.1f} | — | — |",
                  (f"| `specdraft dump --format hidden` | {t['dump_hidden']:.1f} | {r['overhead']['hidden']:.1%} | "
                  f"{r['bytes_per_token']['hidden']:.0f} |"),
                  (f"| `specdraft dump --format topk` | {t['dump_topk']:.1f} | {r['overhead']['topk']:.1%} | "
                  f"{r['bytes_per_token']['topk']:.0f} |"), "",
                  (f"Target overhead ≤ 10%: hidden {_mark(r['overhead']['hidden'] <= 0.10)}, topk "
                  f"{_mark(r['overhead']['topk'] <= 0.10)}."), ""]
    for loss in ("tvd", "tvd_deploy", "soft_ce"):
        r = _load(f"distill-{loss}.json")
        if not r:
            continue
        t = r["tokens_per_s"]
        lines += [f"## Distillation step — {loss}", "",
                  (f"`{r['command']}` — {r['date']}, {r['machine']}, batch {r['batch']} × {r['seq']} tokens, "
                  "draft in float32, AdamW, all parameters."), "",
                  "| step | tokens/s |", "| --- | ---: |",
                  f"| plain causal-LM fine-tuning | {t['plain']:.1f} |",
                  f"| specdraft distillation ({loss}, hidden teacher) | {t['distill']:.1f} |", "",
                  f"Loss overhead {r['overhead']:.1%}; target ≤ 15%: {_mark(r['overhead'] <= 0.15)}.", ""]
    lines += _render_main_job()
    lines += _render_distill_throughput()
    lines += _render_distill_gain()
    lines += _render_distill_curve("distill-curve.json", "the embedded pair")
    lines += _render_distill_curve("distill-curve-smollm2.json", "SmolLM2-135M vocab-swapped into the target's tokenizer")
    lines += _render_distill_curve("distill-samefamily-sharegpt.json", "the embedded pair on ShareGPT-scale data "
                                   "(issue 21, item 6; forecast +0.08 [+0.062, +0.094])",
                                   data="ShareGPT first turns, teacher-forced (their existing replies scored by the "
                                   "target)")
    lines += _render_distill_routes()
    lines += _render_headroom_calibration()
    return "\n".join(lines)


def _ci(ci, spec="{:+.3f}") -> str:
    return f"[{spec.format(ci[0])}, {spec.format(ci[1])}]" if ci else ""


def _render_distill_curve(name: str, what: str, data: str = "target-written answers") -> list[str]:
    """The learning curve in measured acceptance (held-out chat and code, replayed every K steps); ``data`` names
    what the training sequences are."""
    r = _load(name)
    if not r or not r["runs"] or not r["runs"][0].get("acceptance_curve"):
        return []
    run = r["runs"][0]
    st, cur = run["settings"], run["acceptance_curve"]
    b = r["before"]
    lines = [f"## Distillation — a learning curve in measured acceptance, {what}", "",
             (f"`{r['command']}` — {r['date']}, {r['machine']}, torch {r['torch']}. Training: {r['dump_sequences']} "
              f"{data} ({r['dump_tokens']:,} tokens, prompts disjoint from the held-out sets), "
              f"`{st['loss']}`, train = {st['train']}, lr {st['lr']}, {st['batch_size']} × "
              f"{st['gradient_accumulation_steps']} sequences per step, {st['scheduler']}. Every "
              f"{r['settings']['curve_every']} steps a bfloat16 copy of the draft is replayed on the same held-out "
              f"target answers as the final evaluation (chat: {b['chat']['prompts']} MT-Bench prompts, "
              f"{b['chat']['drafted']:,} drafted tokens; code: {b['code']['prompts']} HumanEval prompts); gains are "
              "paired per prompt, 95% bootstrap intervals."), "",
             "| step | sequences seen | chat acceptance | chat gain, paired 95% CI | code acceptance | code gain |",
             "| ---: | ---: | ---: | --- | ---: | --- |",
             f"| 0 | 0 | {b['chat']['acceptance_rate']:.3f} | — | {b['code']['acceptance_rate']:.3f} | — |"]
    per_step = st["batch_size"] * st["gradient_accumulation_steps"]
    cell = lambda v: f"{v['acceptance']:.3f} | {v['gain']:+.3f} {_ci(v['gain_ci95'])}" if v else "— | —"
    for p in cur:
        lines.append(f"| {p['step']} | {p['step'] * per_step} | {cell(p['chat'])} | {cell(p.get('code'))} |")
    d = run["distill"]
    lines += ["", (f"{d['train_sequences']} training sequences ({d['steps'] * per_step / d['train_sequences']:.1f} "
                   f"epochs); teacher-forced α on the {d['eval_before'].get('eval_tokens', 0):.0f} held-out tokens of "
                   f"the training split {d['eval_before'].get('eval_alpha', float('nan')):.3f} → "
                   f"{d['eval_after'].get('eval_alpha', float('nan')):.3f}. Training minutes (curve replays "
                   f"included): {run['minutes']:.1f}.")]
    sampled = "; ".join(f"{n} {v['alpha_tf_before']:.3f} → {v['alpha_tf_after']:.3f}, paired gain "
                        f"{v['alpha_tf_after'] - v['alpha_tf_before']:+.3f} {_ci(v['alpha_tf_gain_ci95'])}"
                        for n, v in run["sets"].items() if v.get("alpha_tf_gain_ci95"))
    if sampled:
        lines += ["", ("Sampled acceptance after the last step (α = Σ min(p̃, q̃) at the serving settings, temperature "
                       f"{r['settings']['temperature']}, teacher-forced over the same held-out answers; the bootstrap "
                       f"is paired per prompt): {sampled}.")]
    return lines + [""]


def _render_main_job(name: str = "run-default.json") -> list[str]:
    """Issue 22: the main job as ``make run`` runs it, every stage's figure (bench/run_summary.py's result)."""
    from specdraft.report import SET_LABELS

    r = _load(name)
    if not r:
        return []
    lines = [f"## The main job — `specdraft run`, preset {r['preset']}", "",
             (f"`{r['command']}` — {r['date']}, {r['machine']}, torch {r['torch']}. {r['target']} ← {r['draft']}"
              + (" (another tokenizer: evaluated as given through a vocabulary mapping, then re-indexed into the "
                 "target's and distilled)" if r["vocab_swap"] else "") + f". {r.get('note', '')}"), "",
             ("| set | prompts | as given (mapped) | before distillation | after | gain, paired 95% CI | "
              "speed-up original | speed-up distilled | vs HF assisted (orig. / dist.) | outputs = target |"),
             "| --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- |"]
    for n, v in r["sets"].items():
        sp = v.get("speed") or {}
        o, d = sp.get("original", {}), sp.get("distilled", {})
        sx = lambda c: f"{c['speedup']:.2f}x {_ci(c['speedup_ci95'], '{:.2f}')}" if c else "—"
        lines.append(f"| {SET_LABELS.get(n, n)} ({', '.join(v['sources'] or [])}) | {v['prompts']} | "
                     f"{'—' if v['as_given_mapped'] is None else format(v['as_given_mapped'], '.3f')} | "
                     f"{v['before']:.3f} | {v['after']:.3f} | {v['gain']:+.3f} {_ci(v['gain_ci95'])} | {sx(o)} | "
                     f"{sx(d)} | {o.get('vs_hf') or float('nan'):.2f}x / {d.get('vs_hf') or float('nan'):.2f}x | "
                     f"{o.get('matches_target', '—')} / {d.get('matches_target', '—')} |")
    divs = [f"{x['prompt_id']} token {x['position']} ({x['contender'].split(':', 1)[-1]}, top-2 margin "
            f"{x['margin']:.4f})" for v in r["sets"].values() for x in (v.get("speed") or {}).get("divergences", [])]
    sp0 = next(iter(r["sets"].values())).get("speed") or {}
    conf = "; ".join(f"{k}: {v}" for k, v in (r.get("configuration") or {}).items())
    lines += ["", (f"Acceptance: greedy at fixed γ, replayed on the target's greedy answers to every prompt of the set "
                   f"(before and after on the same answers, paired per prompt). Speed: "
                   f"{sp0.get('prompts')} prompts × {sp0.get('max_new_tokens')} tokens per set, interleaved, "
                   f"adaptive γ, draft preparation {conf}. Forecast before training {r['forecast']:+.3f} "
                   f"{_ci(r['forecast_ci95'])}. Divergences from the target alone: "
                   + ("; ".join(divs) if divs else "none") + " (each a bf16 near-tie within the 0.5 tolerance). "
                   f"Distillation {r['distill']['steps']} steps on {r['distill']['train_sequences']} sequences."),
              "", (f"Wall clock {r['wall_seconds'] / 60:.1f} min, peak RSS {r['peak_rss_gb']:.1f} GB; stages (s): "
                   + ", ".join(f"{k} {v:.0f}" for k, v in r["stages"].items()) + "."
                   if "wall_seconds" in r else ""), ""]
    return lines


def _render_headroom_calibration() -> list[str]:
    """Issue 21 item 4: the headroom forecast beside the gains measured after distillation, per pair, and its error."""
    r = _load("headroom-calibration.json")
    if not r:
        return []
    lines = ["## Headroom forecast against measured gains (issue 21)", "", r["what"] + ".", "",
             "| pair | forecast (95% CI) | measured chat | measured code | error (forecast − measured) chat / code |",
             "| --- | --- | --- | --- | --- |"]
    for p in r["pairs"]:
        m = p["measured"]
        lines.append(f"| {p['pair']} | {p['forecast']:+.3f} {_ci(p['forecast_ci95'])} | {m['chat']:+.3f} "
                     f"{_ci(m['chat_ci95'])} | {m['code']:+.3f} {_ci(m['code_ci95'])} | {p['error']['chat']:+.3f} / "
                     f"{p['error']['code']:+.3f} |")
    lines += ["", "Sources: " + "; ".join(f"{p['pair']}: forecast {p['forecast_source']}, measured {p['measured_source']}"
                                         for p in r["pairs"]) + ".", "",
              ("The forecast orders the pairs rightly (the swapped draft has far more to learn) but it is a ceiling "
               "of what the draft could fix where the target is sure, not what a 20-minute CPU budget fixes: it "
               "overestimated the measured gains (mean of chat and code) by "
               + "; ".join(f"{(p['error']['chat'] + p['error']['code']) / 2:+.2f} on {p['pair']}" for p in r["pairs"])
               + "."), ""]
    return lines


def _render_distill_routes() -> list[str]:
    """Issue 21's demonstration: SmolLM2-135M vocab-swapped, distilled on mixed data; every route tried, its figures
    and command (``bench/distill_routes.py`` collects them into distill-gain-smollm2.json)."""
    r = _load("distill-gain-smollm2.json")
    if not r:
        return []
    first = r["routes"][0]
    fig = lambda s: (f"{s['acceptance_before']:.3f} → {s['acceptance_after']:.3f}, {s['gain']:+.3f} "
                     f"{_ci(s['gain_ci95'])}") if s else "—"
    lines = ["## Distillation where a gap exists — SmolLM2-135M vocab-swapped, mixed data (issue 21)", "",
             (f"{first['date']}, {first['machine']}; {r['note']} Held-out chat: {first['sets']['chat']['prompts']} "
              f"MT-Bench prompts (mt-bench:0:27:3), held-out code: {first['sets']['code']['prompts']} HumanEval "
              "problems (humaneval:100:16:4); the target's greedy answers decoded once, every draft replayed on them "
              "(exact greedy counts), gains paired per prompt with 95% bootstrap intervals. Minutes = this run's "
              "dumps (a dump reused from `--work` counts 0 here; its own minutes are in the route's file) + training "
              "(held-out replays of the curve included). Goal: " + r["goal"] + "."), "",
             ("| route | data (sequences) | minutes (dump + train) | chat greedy acceptance, gain | code greedy "
              "acceptance, gain |"), "| --- | --- | ---: | --- | --- |"]
    for rt in r["routes"]:
        data = ", ".join(f"{k} {v['sequences']}" + (f" ×{v['weight']}" if v.get("weight", 1) != 1 else "")
                         for k, v in (rt["dumps"] or {}).items())
        lines.append(f"| {rt['label']} | {data} | {rt['dump_minutes']:.1f} + {rt['train_minutes']:.1f} | "
                     f"{fig(rt['sets']['chat'])} | {fig(rt['sets'].get('code'))} |")
    per_min = lambda rt, k: (f"{rt['sets'][k]['gain'] / rt['minutes']:+.4f}" if rt["sets"].get(k) and rt["minutes"]
                             else "—")
    lines += ["", ("Gain per minute of dump + training (issue 21 item 2's measure of a mix), chat / code: "
                   + "; ".join(f"{rt['label'].split(':')[0]} {per_min(rt, 'chat')} / {per_min(rt, 'code')}"
                               + (" (its dump reused, not counted)" if not rt["dump_minutes"] else "")
                               for rt in r["routes"]) + ".")]
    lines += ["", "Commands:", ""] + [f"- {rt['label']}: `{rt['command']}`" for rt in r["routes"]]
    code = r.get("code")
    lines += ["", (f"Headline ({r['headline_route']}): chat {fig({**r, 'acceptance_before': r['acceptance_before']})}"
                   f"; code {fig(code)}; {r['minutes']:.1f} minutes; goal {_mark(r['goal_met'])}. Distance left on "
                   f"code to the {r['mapped_code_acceptance']} the same SmolLM2 reaches through the vocabulary "
                   f"mapping: {r['code_distance_to_mapped']:.3f}.")]
    if r.get("curve"):
        lines += ["", "Learning curve of the headline route (held-out greedy acceptance, replayed during training):",
                  "", "| step | chat acceptance | chat gain | code acceptance | code gain |",
                  "| ---: | ---: | --- | ---: | --- |"]
        cell = lambda v: f"{v['acceptance']:.3f} | {v['gain']:+.3f} {_ci(v['gain_ci95'])}" if v else "— | —"
        lines += [f"| {p['step']} | {cell(p['chat'])} | {cell(p.get('code'))} |" for p in r["curve"]]
    return lines + [""]


def _render_distill_throughput(name: str = "distill-throughput.json") -> list[str]:
    """Issue 21 item 3: trained tokens per minute of a distillation step, float32 against bf16 autocast and the
    topk teacher; the loss of a short run on each; teacher tokens per minute, teacher-forced against generated."""
    r = _load(name)
    if not r:
        return []
    s, words = r["settings"], {"float32": "float32", "bf16-autocast": "bf16 autocast"}
    label = lambda n: (f"{words[r['contenders'][n]['precision']]}, {r['contenders'][n]['teacher']} teacher"
                       + (f" (top {s['top_k']})" if r["contenders"][n]["teacher"] == "topk" else ""))
    fast, ref = r["fast_path"], r["reference"]
    lines = ["## Distillation throughput — float32 against the fast path (issue 21)", "",
             (f"`{r['command']}` — {r['date']}, {r['machine']}, torch {r['torch']}. Target {r['target']} ← draft "
              f"{r['draft']}; {s['batches']} fixed batches of {s['batch']} × {s['seq']} tokens cut from `{s['text']}` "
              f"(chat template), loss `{s['loss']}`, all draft parameters, float32 master weights; teacher signal "
              f"from the target in {s['dtype']} through the dump's own code.")]
    st = r.get("step")
    if st:
        lines += ["", (f"Training step = `DistillModel` forward (draft + teacher + loss), backward, clipping and the "
                       f"Trainer's optimizer ({st['optimizer']}); contenders interleaved batch by batch, median of "
                       f"{s['repeats']} repeats."), "",
                  "| training step | trained tokens / min | vs float32 |", "| --- | ---: | ---: |"]
        lines += [f"| {label(n)} | {v:,.0f} | {st['speedup_vs_float32'][n]:.2f}x |"
                  for n, v in st["tokens_per_minute"].items()]
    cv = r.get("curve")
    if cv:
        lines += ["", (f"Loss of a {cv['steps']}-step run (`specdraft.distill.train`, lr {s['lr']}, cosine, seed 0, the "
                       "same batches in the same order). |Δ| is against float32 step by step; noise = the float32 "
                       f"curve's step-to-step scatter ({cv['noise']:.4f}). The topk run's logged loss is against the "
                       "top-k teacher; the last column scores every trained draft against the exact teacher."), "",
                  ("| run | final loss | max abs Δ | mean abs Δ | within noise | loss vs exact teacher after | "
                   "its Δ within noise |"),
                  "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
        for n, v in cv["final_loss"].items():
            d = (f"{cv['max_abs_delta'][n]:.4f} | {cv['mean_abs_delta'][n]:.4f} | {cv['within_noise'][n]}"
                 if n in cv["max_abs_delta"] else "— | — | —")
            lines.append(f"| {label(n)} | {v:.4f} | {d} | {cv['exact_final_loss'][n]:.4f} | "
                         f"{cv['exact_within_noise'].get(n, '—')} |")
        lm = cv["topk_leftover_mass"]
        lines += ["", (f"Teacher mass outside the top {s['top_k']} (the per-position bound on the topk loss's error): "
                       f"mean {lm['mean']:.4f}, max {lm['max']:.4f}.")]
    if st and cv:
        x = st["speedup_vs_float32"][fast]
        same = cv["exact_within_noise"][fast]
        lines += ["", (f"Issue 21's goal, training throughput ×3 at equal quality ({label(fast)} against "
                       f"{label(ref)}; quality = the loss against the exact teacher after the run, within the float32 "
                       f"curve's noise): {_mark(x >= 3 and same)} ({x:.2f}x; equal quality {same}).")]
    dp = r.get("dump")
    if dp:
        t = dp["tokens_per_minute"]
        lines += ["", (f"Teacher signal (`run_dump`, format {s['dump_format']}, batch {s['dump_batch']}, target in "
                       f"{s['dtype']}): the target answers `{s['prompts']}` with up to {s['generate']} tokens "
                       "(`--generate`), and the same answers are then scored as existing text (teacher-forced: one "
                       f"prefill per batch); median of {s['repeats']} interleaved repeats, loading excluded."), "",
                  "| teacher signal | answer tokens | answer tokens / min |", "| --- | ---: | ---: |",
                  (f"| target-written (`--generate {s['generate']}`) | {dp['answer_tokens']['generated']:,} | "
                   f"{t['generated']:,.0f} |"),
                  (f"| teacher-forced existing text | {dp['answer_tokens']['teacher_forced']:,} | "
                   f"{t['teacher_forced']:,.0f} |"), "",
                  f"Teacher-forced / target-written: {dp['speedup']:.1f}x answer tokens per minute."]
    if st and dp:
        # Minutes per 1,000 trained answer tokens of the whole road (teacher signal once, then E epochs of training).
        tt, tm = dp["tokens_per_minute"], st["tokens_per_minute"]
        road = lambda teacher, train, epochs: 1000 / tt[teacher] + epochs * 1000 / tm[train]
        rows = [(e, road("generated", ref, e), road("teacher_forced", fast, e)) for e in (1, 3)]
        lines += ["", ("Both together, minutes per 1,000 trained answer tokens (teacher signal once, then E epochs): "
                       "round 2's road (target-written answers, " + label(ref) + ") against the fast one "
                       "(teacher-forced existing text, " + label(fast) + "): "
                       + "; ".join(f"E = {e}: {a:.2f} → {b:.2f} min, {a / b:.2f}x" for e, a, b in rows) + ".")]
    return lines + [""]


def _render_distill_gain() -> list[str]:
    """Distillation gain: λ = 0 against the on-policy λ, same budget, same held-out prompts and target answers."""
    r = _load("distill-gain.json")
    if not r:
        return []
    st = r["settings"]
    lines = ["## Distillation gain — dump-only vs on-policy", "",
             (f"`{r['command']}` — {r['date']}, {r['machine']}, torch {r['torch']}. Embedded pair, trained on "
              f"{r['dump_sequences']} target-written sequences ({', '.join(st['train'])}; {r['dump_tokens']:,} "
              "tokens" + (f", dump {r['dump_minutes']:.1f} min" if r["dump_minutes"] else ", dump reused from --work")
              + f"), loss `{st['loss']}`, last {st['layers']} layers, lr "
              f"{st['lr']}, {st['steps']} steps × {st['batch_size']} sequences; on-policy answers sampled at "
              f"temperature {st['temperature']}, regenerated every {st['on_policy_every']} steps. Greedy acceptance "
              f"(accepted / proposed), γ = {st['gamma']}, {st['max_new_tokens']} new tokens per held-out prompt: "
              "every prompt decoded once with the original draft (the target's answers), the distilled draft "
              "replayed on the same answers, so the gain is paired prompt by prompt (95% bootstrap interval over "
              "prompts). α_tf: Σ min(p, q) at the serving settings, teacher-forced on the same answers."), "",
             ("| λ (on-policy share) | set | prompts | drafted tokens | acceptance before → after | gain, paired 95% "
              "CI | α_tf before → after | minutes (distil) |"),
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in r["runs"]:
        for name, v in run["sets"].items():
            lines.append(f"| {run['on_policy_fraction']} | {name} | {v['prompts']} | {v['drafted_before']:,} | "
                         f"{v['acceptance_before']:.3f} → {v['acceptance_after']:.3f} | {v['gain']:+.3f} "
                         f"{_ci(v['gain_ci95'])} | {v['alpha_tf_before']:.3f} → {v['alpha_tf_after']:.3f} | "
                         f"{run['minutes']:.1f} |")
    lo = r["gain_ci95"][0]
    lines.append("")
    for run in r["runs"]:
        onp = run["distill"].get("on_policy")
        if onp:
            lines.append(f"λ = {run['on_policy_fraction']}: {onp['sequences']} sequences written by the draft "
                         f"({onp['generated_tokens']:,} tokens in {onp['generate_seconds']:.0f} s) and scored by the target "
                         f"({onp['teacher_tokens']:,} tokens in {onp['teacher_seconds']:.0f} s), at steps "
                         f"{onp['refresh_steps']}; these seconds are inside its minutes.")
    lines += [("Minutes are wall time on a machine shared with other jobs, whose load differed between runs; "
               "compare the runs by their equal steps and sequences, not by minutes."), ""]
    lines += [(f"Headline (λ = {r['on_policy_fraction']}, chat): {r['acceptance_before']:.3f} → "
               f"{r['acceptance_after']:.3f}, gain {r['gain']:+.3f} {_ci(r['gain_ci95'])}. Target gain ≥ +0.05 "
               f"with the interval above 0: {_mark(r['gain'] >= 0.05 and lo > 0)}."), ""]
    return lines


ABLATION_LABELS = {"specdraft": "bf16 draft (as loaded)", "specdraft_int8": "int8 weight-only",
                   "specdraft_int4": "int4 weight-only (groups of 32)", "specdraft_head": "trimmed head (32,768 rows)",
                   "specdraft_int8_head": "int8 + trimmed head", "specdraft_int4_head": "int4 + trimmed head"}


def _ablation_label(name: str, gamma: int = 5) -> str:
    base = name.removesuffix("_adaptive_gamma")
    return ABLATION_LABELS.get(base, base) + (f", adaptive γ ≤ {gamma}" if name.endswith("_adaptive_gamma")
                                              else f", γ = {gamma}")


def render_cheap_draft() -> list[str]:
    """The draft-kernel table and the decoding ablation of the draft options (issue 15)."""
    lines: list[str] = []
    k = _load("draft-kernels.json")
    if k:
        ms, agree = k["draft_step_ms_median"], k["top1_agreement_with_target"]
        base = ms[next(iter(ms))]
        lines += ["## A cheaper draft step — kernels", "",
                  (f"`{k['command']}` — {k['date']}, {k['machine']}, torch {k['versions']['torch']}. One-token steps of "
                   f"{k['draft']} after a {k['context_tokens']}-token prefill (batch 1, the decode loop's cache code), "
                   "candidates interleaved within each of 5 rounds, median of the rounds; top-1 agreement with the "
                   f"target {k['target']}, {k['agreement_positions']} (4 held-out prompts)."), "",
                  "| draft | step (ms) | vs bf16 | top-1 agreement with the target |", "| --- | ---: | ---: | ---: |"]
        for n, v in ms.items():
            a = agree.get(n)
            lines.append(f"| {n} | {v:.1f} | {v / base:.2f}x | {'—' if a is None else f'{a:.3f}'} |")
        lines += ["", ("The machine was shared (other jobs held 1–2 of its 2 cores): absolute times are noisy, the "
                       "ratios within a round less so. Chosen: weight-only int8 (`--draft-quantization int8`, the "
                       "conservative choice) and int4 (`int4`, fastest at equal agreement here). fbgemm's dynamic "
                       "int8 is as fast as int4 but also rounds the activations, which costs agreement, and torch "
                       "2.13 deprecates it (`torch.ao.quantization is deprecated and will be removed`, and its "
                       "quantised-tensor constructors)."), ""]
    c = _load("draft-compile.json")
    if c:
        ms = c["draft_step_ms_median"]
        lines += ["## A cheaper draft step — static KV cache and `torch.compile` (issue 15, item 3)", "",
                  (f"`{c['command']}` — {c['date']}, {c['machine']}, torch {c['versions']['torch']}, transformers "
                   f"{c['versions']['transformers']}. One-token steps of {c['draft']} after a {c['context_tokens']}-"
                   f"token prefill, batch 1, {c['steps']} steps per timing, variants interleaved in each of "
                   f"{c['rounds']} rounds, median."), "",
                  "| draft | step (ms) | vs eager, dynamic cache | compile (s) |", "| --- | ---: | ---: | ---: |"]
        for n, v in ms.items():
            base = ms[n.split(":")[0] + ": eager, dynamic cache"]
            comp = c["compile_seconds"].get(n)
            lines.append(f"| {n} | {v:.1f} | {v / base:.2f}x | {'—' if comp is None else f'{comp:.0f}'} |")
        chk = "; ".join(f"{d}: compiled vs eager argmax {v['compiled_vs_eager_static_argmax_equal']}, max |Δlogit| "
                        f"{v['compiled_vs_eager_static_max_abs_logit_diff']:.3f}" for d, v in c["checks"].items())
        lines += ["", (f"{chk}. Not adopted: on the cheapest draft (int4 + head) the compiled static-cache step is "
                       "within a few percent of the eager one — the int4 and int8 matmuls are already single "
                       "kernels, and at one token per step the time plausibly goes to reading weights, which compiling does "
                       "not change — while "
                       "compiling costs ~20 s per process (more on a cold inductor cache), longer than a short "
                       "decode. The decode loop keeps its eager dynamic cache (whose `crop` rolls back rejected "
                       "drafts)."), ""]
    titles = {"goal16": "A cheaper draft — issue 15's goal set (16 prompts × 128 tokens)",
              "goal8": "A cheaper draft — sampled (temperature 0.7, top-p 0.95)",
              "ablation": "A cheaper draft — decoding ablation (older run: OpenMP forced passive, γ = 5)",
              "mtbench-adaptive": "A poor pairing — adaptive γ on MT-Bench (never slower than the target alone)"}
    for name, title in titles.items():
        r = _load(f"decode-greedy-{name}.json") or _load(f"decode-sampled-{name}.json")
        lines += _ablation_section(r, title)
        if r and name == "mtbench-adaptive":
            diffs = [f"{p['id']} ({_ablation_label(n, r['args']['gamma'])}: token "
                     f"{v['first_difference']['position']}, margin {v['first_difference']['target_top2_margin']})"
                     for p in r["per_prompt"] for n, v in p.items()
                     if isinstance(v, dict) and v.get("first_difference")]
            worst = min(x["speedup_vs_target"] for x in r["ablation"].values())
            lines += [(f"Slowest contender: {worst:.2f}x the target alone. "
                       + (("Outputs that differ from the target alone, with the target's top-2 logit margin at the "
                           "first difference: " + "; ".join(diffs) + ". Margins below the bf16 rounding tolerance "
                           "`specdraft eval` uses (0.5) are near-ties that a multi-token verification pass rounds "
                           "differently from a one-token step, not losses; the fp32 tests on tiny models hold the "
                           "output equal token for token.") if diffs else "Outputs identical to the target alone.")),
                      ""]
        if r and name == "goal16":
            diffs = [f"{p['id']} ({_ablation_label(n, r['args']['gamma'])}: first difference at token "
                     f"{v['first_difference']['position']}, target top-2 logit margin "
                     f"{v['first_difference']['target_top2_margin']})"
                     for p in r["per_prompt"] for n, v in p.items()
                     if isinstance(v, dict) and v.get("first_difference")]
            lines += [(("Outputs that differ from the target alone: " + "; ".join(diffs) + " — an exact bfloat16 tie "
                        "in the target's own logits (margin 0.0: a 9-token verification pass and a one-token step "
                        "round the two candidates differently; the brief's one exception), not a verification error. "
                        ) if diffs else "")
                      + ("What changed since the 2.09x of the previous round (same prompts, γ = 5): (1) the benchmark "
                         "no longer forces `OMP_WAIT_POLICY=PASSIVE` — with sleeping OpenMP threads each of a draft "
                         "step's ~200 small operations paid a thread wake-up (int4 + head step 29.5 → ~18 ms; libgomp's "
                         "default, which users get, spins briefly and is as fast as ACTIVE); (2) prepared drafts run "
                         "one-token attention as grouped matrix products instead of sdpa (18.7 → 16.2 ms per step at "
                         "300 cached tokens) and read the prompt with their dense weights (prefill 427 → ~200 ms on "
                         "171 tokens); (3) γ = 8, the speed model's choice at this c and α. The sampled path also lost "
                         "its two vocabulary-wide costs: top-p takes the top 1,024 logits instead of sorting 151,936 "
                         "(exact; 10.9 → 0.8 ms per row) and draws by inverse CDF instead of `torch.multinomial` "
                         "(2.3 → 0.16 ms)."), ""]
        if r and name == "ablation":
            ab, sm = r["ablation"], r["speed_models"]
            plain, best = ab["specdraft"], ab.get("specdraft_int4_head")
            t = sm["plain"]["target_s"]
            drift = max(abs(x["cost_ratio_c_speed_model"] / x["cost_ratio_c"] - 1) for x in ab.values())
            if best:
                lines += [(
                    "What stood in the way of 2.5x in this older run: (1) the trimmed head costs acceptance — its 32,768 tokens are "
                    "counted over the embedded training prompts only (500 short chats + 100 HumanEval stubs), and "
                    f"acceptance fell {plain['acceptance_rate']:.3f} → {ab['specdraft_head']['acceptance_rate']:.3f} "
                    "(α " f"{plain['alpha']:.3f} → {ab['specdraft_head']['alpha']:.3f}); frequencies from target-written "
                    "answers (a teacher dump) should keep more of the tokens the target emits; (2) verifying 6 tokens "
                    f"costs the target t(6)/t(1) = {t[5] / t[0]:.2f} of a one-token pass, which the analytic model "
                    f"ignores; (3) the draft step is still {best['draft_step_ms']:.0f} ms (c = "
                    f"{best['cost_ratio_c']:.3f}) in this run, with OpenMP forced passive (see the goal-set sections above "
                    f"for what changed). The speed model recommends γ = {best['best_gamma_speed_model']} for the int4 + head draft "
                    f"at this α (γ = 5 was run). Prediction errors come mostly from the calibration: d is measured "
                    f"once before decoding, and on this shared machine the calibrated c differed from the one "
                    f"measured during the run by up to {drift:.0%}."), ""]
    return lines


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def _mode_words(a: dict) -> str:
    if a.get("mode", "greedy") == "greedy":
        return "greedy"
    return (f"sampled at temperature {a['temperature']}, top-p {a['top_p']} (output = target counts equal token "
            "sequences, which sampling does not promise: exactness is the χ² tests' job)")


def _speedup_ci(r: dict, name: str, base: str) -> str:
    """``" [low, high]"``: the paired 95% bootstrap interval over prompts of tokens/s of ``name`` over ``base``
    (:func:`specdraft.stats.paired_ratio_ci` on the per-prompt tokens and seconds), or ``""`` without them."""
    from specdraft.stats import paired_ratio_ci

    rows = [p for p in r.get("per_prompt", []) if name in p and base in p]
    if len(rows) < 2 or len(rows) != len(r.get("per_prompt", [])):
        return ""
    est = paired_ratio_ci([p[name]["tokens"] for p in rows], [p[name]["seconds"] for p in rows],
                          [p[base]["tokens"] for p in rows], [p[base]["seconds"] for p in rows])
    return f" [{est.interval[0]:.2f}, {est.interval[1]:.2f}]"


def _ablation_section(r: dict | None, title: str) -> list[str]:
    lines: list[str] = []
    if r:
        a, ab, hf = r["args"], r["ablation"], r.get("speedup_vs_hf_assisted") or {}
        lines += [f"## {title}", "",
                  (f"`{r['command']}` — {r['date']}, {r['machine']}, torch {r['versions']['torch']}, transformers "
                   f"{r['versions']['transformers']}. Embedded pair, {a['dtype']}, batch 1, {a['num_prompts']} "
                   f"{a['prompts']} prompts (ids {a['prompt_offset']}–{a['prompt_offset'] + a['num_prompts'] - 1}) × "
                   f"{a['max_new_tokens']} new tokens, {_mode_words(a)}, contenders interleaved prompt by prompt. c = draft "
                   "step / target pass measured in the run; predicted = the speed model (measured t(k) and d, "
                   "`specdraft.speed`) at the contender's measured α, prefill included."), "",
                  ("| draft | tokens/s | vs target alone [95% CI] | vs HF assisted [95% CI] | c | acceptance | α | "
                   "predicted | prediction error | output = target |"),
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
                  (f"| target alone | {r['tokens_per_s']['target']:.2f} | 1.00x | "
                   f"{_x(hf.get('target'))} | — | — | — | — | — | — |")]
        for n, x in ab.items():
            pred = "—" if x["predicted_speedup"] is None else f"{x['predicted_speedup']:.2f}x"
            err = "—" if x["prediction_error"] is None else f"{x['prediction_error']:+.1%}"
            lines.append(f"| {_ablation_label(n, a['gamma'])} | {r['tokens_per_s'][n]:.2f} | {x['speedup_vs_target']:.2f}x"
                         f"{_speedup_ci(r, n, 'target')} | {_x(hf.get(n))}"
                         f"{_speedup_ci(r, n, 'hf_assisted') if n in hf else ''} | {x['cost_ratio_c']:.3f} | {x['acceptance_rate']:.3f} | "
                         f"{x['alpha']:.3f} | {pred} | {err} | {x['identical_to_target']} |")
        if "hf_assisted" in r["tokens_per_s"]:
            lines.append(f"| transformers `generate(assistant_model=…)`, bf16 draft | {r['tokens_per_s']['hf_assisted']:.2f} "
                         f"| {r['speedup_vs_target']['hf_assisted']:.2f}x | 1.00x | — | — | — | — | — | "
                         f"{r['identical_to_target']['hf_assisted']} |")
        best = max(ab, key=lambda n: ab[n]["speedup_vs_target"])
        x = ab[best]
        if "hf_assisted" in hf and a.get("mode", "greedy") != "greedy":
            lines += ["", (f"Issue 15's sampled goal, best contender ({_ablation_label(best, a['gamma'])}): ≥ 1.5x transformers "
                           f"assisted generation {_mark(hf[best] >= 1.5)} ({hf[best]:.3f}x; {x['speedup_vs_target']:.2f}x "
                           "the target alone).")]
        elif "hf_assisted" in hf:
            lines += ["", (f"Issue 15's goals, best contender ({_ablation_label(best, a['gamma'])}): ≥ 2.5x the target alone "
                           f"{_mark(x['speedup_vs_target'] >= 2.5)} ({x['speedup_vs_target']:.2f}x); ≥ 1.5x transformers "
                           f"assisted generation {_mark(hf[best] >= 1.5)} ({hf[best]:.3f}x); outputs identical to the "
                           f"target alone {x['identical_to_target']}.")]
        errs = [abs(x["prediction_error"]) for x in ab.values() if x["prediction_error"] is not None]
        if errs:
            lines += ["", (f"Prediction within ±5% of measured: {_mark(max(errs) <= 0.05)} (largest error "
                          f"{max(errs):.1%}, mean {sum(errs) / len(errs):.1%}).")]
        lines.append("")
    return lines


README = ROOT.parent / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def _cheapest_row(r: dict, mode: str, goal: str, met) -> str:
    """A README row for the fastest speculative contender of a decode result, with its prediction error; ``met(sv,
    hf)`` judges the speed-ups (the prediction must also be within ±5%)."""
    sv, hf = r["speedup_vs_target"], r.get("speedup_vs_hf_assisted") or {}
    best = max((k for k in sv if k.startswith("specdraft")), key=lambda k: sv[k])
    e = r["ablation"].get(best, {}).get("prediction_error")
    same = f"; identical {r['identical_to_target'][best]}" if mode == "greedy" else ""
    ok = met(sv[best], hf.get(best, 0.0)) and e is not None and abs(e) <= 0.05
    return (f"| decoding, {mode}, cheapest draft ({_ablation_label(best, r['args']['gamma'])}), "
            f"{r['args']['num_prompts']} HumanEval prompts × {r['args']['max_new_tokens']} tokens | "
            f"{sv[best]:.2f}x target alone, {hf.get(best, float('nan')):.2f}x HF assisted{same}"
            + (f"; predicted speed-up off by {e:+.1%}" if e is not None else "") + f" | {goal}: {_mark(ok)} |")


def render_readme_table() -> str:
    """The compact headline table for the README (the full tables live in docs/benchmarks.md)."""
    rows = ["| benchmark | result | target |", "| --- | --- | --- |"]
    for mode, target in (("greedy", 1.25), ("sampled", 1.15)):
        r = _load(f"decode-{mode}.json")
        if not r:
            continue
        t, sv, hf = r["tokens_per_s"], r["speedup_vs_target"], r.get("speedup_vs_hf_assisted") or {}
        main = "specdraft" if "alpha" in r else "specdraft_fixed_gamma"
        rows.append(f"| decoding, {mode}, {r['args']['num_prompts']} HumanEval prompts × {r['args']['max_new_tokens']} "
                    f"tokens | γ = 5: {t[main]:.2f} tok/s = {sv[main]:.2f}x target alone, "
                    f"{hf.get(main, float('nan')):.2f}x HF assisted; "
                    + (f"outputs identical to target alone {r['identical_to_target'][main]}" if mode == "greedy" else
                       "sampled output follows the target's law (χ² tests, not token equality)")
                    + f" | ≥ {target:.2f}x HF assisted: {_mark(hf.get(main, 0) >= target)} |")
        if mode == "greedy" and "alpha" in r:
            rows.append(f"| share of the analytic bound (α = {r['alpha']:.3f}, c = {r['cost_ratio_c']:.3f}, "
                        f"γ = {r['args']['gamma']}) | {r['share_of_bound']:.0%} | ≥ 90%: "
                        f"{_mark(r['share_of_bound'] >= 0.9)} |")
    for name in ("decode-greedy-goal16.json", "decode-greedy-ablation.json"):
        r = _load(name)
        if r:
            break
    if r:  # the cheapest lossless draft (issue 15's goals: 2.5x target, 1.5x HF, prediction ±5%; sampled: 1.5x HF)
        rows.append(_cheapest_row(r, "greedy", "≥ 2.5x target, ≥ 1.5x HF, ±5%",
                                  lambda sv, hf: sv >= 2.5 and hf >= 1.5))
    r = _load("decode-sampled-goal8.json")
    if r:
        rows.append(_cheapest_row(r, f"sampled (T {r['args']['temperature']}, top-p {r['args']['top_p']})",
                                  "≥ 1.5x HF, ±5%", lambda sv, hf: hf >= 1.5))
    r = _load("decode-greedy-smollm2-135m-instruct.json")
    if r:
        t, sv, hf = r["tokens_per_s"], r["speedup_vs_target"], r.get("speedup_vs_hf_assisted") or {}
        rows.append(f"| decoding, greedy, a draft of another tokenizer (SmolLM2-135M ← mapping), "
                    f"{r['args']['num_prompts']} prompts × {r['args']['max_new_tokens']} tokens | γ = {r['args']['gamma']}: "
                    f"{t['specdraft']:.2f} tok/s = {sv['specdraft']:.2f}x target alone, "
                    f"{hf.get('specdraft', float('nan')):.2f}x HF universal assisted; acceptance rate "
                    f"{r['acceptance_rate']:.3f}; outputs identical {r['identical_to_target']['specdraft']} | lossless |")
    for name in ("loss-memory-cuda.json", "loss-memory-cpu.json"):
        r = _load(name)
        if r:
            rows.append(f"| tvd_deploy memory, logits {r['shape']}, top_k {r['top_k']} ({r['device']}) | "
                        f"{r['peak_bytes']['specdraft'] / 1e9:.2f} GB vs {r['peak_bytes']['full_sort'] / 1e9:.2f} GB "
                        f"full sort = {r['ratio']:.2f}x | ≤ 0.5x: {_mark(r['ratio'] <= 0.5)} |")
    r = _load("dump.json")
    if r:
        rows.append(f"| teacher dump overhead vs bare forward | hidden {r['overhead']['hidden']:.1%}, topk "
                    f"{r['overhead']['topk']:.1%}; {r['bytes_per_token']['hidden']:.0f} / "
                    f"{r['bytes_per_token']['topk']:.0f} bytes per token | ≤ 10%: "
                    f"{_mark(max(r['overhead'].values()) <= 0.10)} |")
    r = _load("distill-gain.json")
    if r:
        rows.append(f"| held-out chat acceptance after distillation (λ = {r['on_policy_fraction']}, "
                    f"{r['minutes']:.0f} min) | {r['acceptance_before']:.3f} → {r['acceptance_after']:.3f}, gain "
                    f"{r['gain']:+.3f} {_ci(r['gain_ci95'])} | ≥ +0.05, interval > 0: "
                    f"{_mark(r['gain'] >= 0.05 and r['gain_ci95'][0] > 0)} |")
    r = _load("run-default.json")
    if r and "wall_seconds" in r:
        h = r["sets"]["held_out"]
        d = h["speed"]["distilled"]
        rows.append(f"| `specdraft run` (default preset: {r['draft']}, another tokenizer, the whole road), held-out "
                    f"{', '.join(h['sources'])} | distillation gain {h['gain']:+.3f} {_ci(h['gain_ci95'])}; distilled "
                    f"{d['speedup']:.2f}x target alone on the same set; {r['wall_seconds'] / 60:.1f} min, "
                    f"{r['peak_rss_gb']:.1f} GB | gain interval > 0 and speed-up > 1: "
                    f"{_mark(h['gain_ci95'][0] > 0 and d['speedup_ci95'][0] > 1)}; ≤ 20 min: "
                    f"{_mark(r['wall_seconds'] <= 1200)} |")
    r = _load("distill-tvd.json")
    if r:
        rows.append(f"| distillation step overhead vs plain fine-tuning (tvd) | {r['overhead']:.1%} | ≤ 15%: "
                    f"{_mark(r['overhead'] <= 0.15)} |")
    return "\n".join(rows)


def update_readme() -> None:
    text = README.read_text()
    if START in text and END in text:
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        README.write_text(f"{head}{START}\n{render_readme_table()}\n{END}{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    if not args.render_only:
        for run in RUNS:
            print("$ python bench/" + " ".join(run), flush=True)
            subprocess.run([sys.executable, str(ROOT / run[0]), *run[1:]], check=True)
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render())
    update_readme()
    print(f"wrote {DOC} and the README table")


if __name__ == "__main__":
    main()
