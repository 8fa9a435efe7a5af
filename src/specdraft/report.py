"""The main job's summary: one list of rows, rendered as the rich table, ``report.md``, ``report.json`` and plots.

:func:`summary_rows` is the single source of what a user sees after ``specdraft run``: the CLI renders it as a
rich table, :func:`render_markdown` as the Markdown table of ``report.md``. Units are in the row names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdraft.io import atomic_path, atomic_write_text
from specdraft.stats import Estimate, paired_gain_from_rows


def _fmt(v: Any, spec: str = "{:.3f}") -> str:
    return "—" if v is None else spec.format(v)


def _fmt_ci(ci: list[float] | None, spec: str = "{:.3f}") -> str:
    return "—" if not ci else f"[{spec.format(ci[0])}, {spec.format(ci[1])}]"


def acceptance_gain(report: dict[str, Any]) -> Estimate | None:
    """After − before acceptance rate on the same prompts with a paired 95% bootstrap interval
    (:func:`specdraft.stats.paired_gain_from_rows`); ``None`` when the evaluations kept no per-prompt counts."""
    b, a = report["eval_before"].get("per_prompt"), report["eval_after"].get("per_prompt")
    return paired_gain_from_rows(b, a) if b and a else None


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(measure, before distillation, after distillation)`` rows of a ``specdraft run`` report."""
    b, a = report["eval_before"], report["eval_after"]
    gain = acceptance_gain(report)
    return [
        ("acceptance rate (accepted / proposed)", _fmt(b["acceptance_rate"]), _fmt(a["acceptance_rate"])),
        ("acceptance rate 95% CI (bootstrap over prompts)", _fmt_ci(b.get("acceptance_rate_ci95")),
         _fmt_ci(a.get("acceptance_rate_ci95"))),
        ("acceptance gain (paired 95% CI)", "—",
         "—" if gain is None else f"{gain.value:+.3f} {_fmt_ci(gain.interval, '{:+.3f}')}"),
        ("mean accepted length (tokens / target pass)", _fmt(b["mean_accepted_length"], "{:.2f}"),
         _fmt(a["mean_accepted_length"], "{:.2f}")),
        ("predicted α (teacher-forced, target responses)", _fmt(b["predicted_alpha_response"]),
         _fmt(a["predicted_alpha_response"])),
        ("target alone (tokens/s)", _fmt(b["target_tokens_per_s"], "{:.2f}"), _fmt(a["target_tokens_per_s"], "{:.2f}")),
        ("speculative (tokens/s)", _fmt(b["speculative_tokens_per_s"], "{:.2f}"),
         _fmt(a["speculative_tokens_per_s"], "{:.2f}")),
        ("speed-up vs target alone", _fmt(b["speedup"], "{:.2f}x"), _fmt(a["speedup"], "{:.2f}x")),
        ("transformers assisted generation (tokens/s)", _fmt(b.get("hf_assisted_tokens_per_s"), "{:.2f}"), "—"),
        ("cost ratio c (draft step / target pass)", _fmt(b["cost_ratio_c"]), _fmt(a["cost_ratio_c"])),
        ("analytic speed-up at measured α, c", _fmt(b["analytic_speedup"], "{:.2f}x"),
         _fmt(a["analytic_speedup"], "{:.2f}x")),
        ("recommended γ", str(b["recommended_gamma"]), str(a["recommended_gamma"])),
        ("greedy divergences (beyond tolerance)", f"{b['divergences']} ({b['divergences_beyond_tolerance']})",
         f"{a['divergences']} ({a['divergences_beyond_tolerance']})"),
    ]


def slower_note(report: dict[str, Any]) -> str | None:
    """A warning when the distilled draft decoded slower than the original, else ``None``."""
    b, a = report["eval_before"], report["eval_after"]
    if (a["speedup"] or 0) >= (b["speedup"] or 0):
        return None
    return (f"the distilled draft decodes slower than the original ({a['speedup']:.2f}x vs {b['speedup']:.2f}x the "
            f"target alone on these {b['prompts']} prompt(s)); keep the original draft, or distil longer (more data, "
            "more steps, the `large` preset) before shipping this one.")


def write_pipeline_report(report: dict[str, Any], out: Path) -> None:
    """``report.json``, ``report.md`` and ``report.png`` (α per position, accepted lengths, speed), atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, a = report["eval_before"], report["eval_after"]
    curve = (report.get("distill") or {}).get("curve") or []
    fig, axes = plt.subplots(1, 4 if curve else 3, figsize=(18.5 if curve else 14, 3.6))
    g = len(b["alpha_per_position"])
    xs = list(range(1, g + 1))
    axes[0].bar([x - 0.2 for x in xs], b["alpha_per_position"], 0.4, label="before")
    axes[0].bar([x + 0.2 for x in xs], a["alpha_per_position"], 0.4, label="after")
    axes[0].set(xlabel="draft position", ylabel="P(accept | reached)", ylim=(0, 1.05), title="α per position")
    axes[0].legend()
    hb, ha = b["counts"]["accepted_hist"], a["counts"]["accepted_hist"]
    axes[1].bar([x - 0.2 for x in range(len(hb))], hb, 0.4, label="before")
    axes[1].bar([x + 0.2 for x in range(len(ha))], ha, 0.4, label="after")
    axes[1].set(xlabel="drafts accepted per round", ylabel="rounds", title="accepted length")
    axes[1].legend()
    labels = ["target alone", "speculative (before)", "speculative (after)"]
    vals = [b["target_tokens_per_s"], b["speculative_tokens_per_s"], a["speculative_tokens_per_s"]]
    if b.get("hf_assisted_tokens_per_s"):
        labels.append("HF assisted")
        vals.append(b["hf_assisted_tokens_per_s"])
    axes[2].bar(range(len(vals)), vals, color=["#999", "#4C72B0", "#55A868", "#C44E52"][: len(vals)])
    axes[2].set_xticks(range(len(vals)), labels, rotation=15, fontsize=8)
    axes[2].set(ylabel="tokens/s", title="decoding speed")
    if curve:
        _plot_curve(axes[3], curve, b, a)
    fig.tight_layout()
    with atomic_path(out / "report.png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    gain = acceptance_gain(report)
    payload = report | {"acceptance_gain": gain.to_dict() if gain else None}
    atomic_write_text(out / "report.json", json.dumps(payload, indent=2, default=str))
    atomic_write_text(out / "report.md", render_markdown(report))


def _plot_curve(ax, curve: list[dict[str, Any]], b: dict[str, Any], a: dict[str, Any]) -> None:
    """Held-out teacher-forced α by step (predicted) beside the acceptance measured by decoding before and after
    (with its 95% interval when kept): does the cheap curve foretell the measured gain?"""
    steps = [p["step"] for p in curve]
    ax.plot(steps, [p["eval_alpha"] for p in curve], marker="o", ms=3, label="held-out α (teacher-forced)")
    for x, ev, name, color in ((0, b, "before", "#4C72B0"), (steps[-1], a, "after", "#55A868")):
        ci = ev.get("acceptance_rate_ci95")
        err = [[ev["acceptance_rate"] - ci[0]], [ci[1] - ev["acceptance_rate"]]] if ci else None
        ax.errorbar([x], [ev["acceptance_rate"]], yerr=err, fmt="s", color=color, capsize=3,
                    label=f"measured acceptance ({name})")
    ax.set(xlabel="optimizer step", ylabel="probability", ylim=(0, 1.05), title="learning curve")
    ax.legend(fontsize=7)


def render_markdown(r: dict[str, Any]) -> str:
    """``report.md``: the summary rows, the distillation, the exported speculator and its vLLM command, timings."""
    b, dist, exp, cfg = r["eval_before"], r["distill"], r["export"], r["config"]
    lines = [
        f"# specdraft run — {cfg['target']} ← {cfg['draft']}",
        "",
        (f"{r['date']}, {r['versions']['machine']}, torch {r['versions']['torch']}, transformers "
         f"{r['versions']['transformers']}. Command: `{r['command']}`. Total {r['total_seconds'] / 60:.1f} min."),
        "",
        (f"Evaluation on {b['prompts']} held-out prompt(s) ({', '.join(cfg['eval_prompts'])}), "
         f"γ = {cfg['eval']['num_speculative_tokens']}, greedy, {cfg['eval']['max_new_tokens']} new tokens each."),
        "",
        *([] if not (sw := r.get("vocab_swap")) else [
            (f"The draft speaks another tokenizer: *before* decodes it through a vocabulary mapping "
             f"({sw['target_coverage']:.1%} of the target vocabulary reachable); it was then re-indexed into the "
             f"target's tokenizer ({sw['copied']:,} rows copied from a twin, {sw['from_pieces']:,} set to the mean "
             f"of their draft pieces, {sw['initialised'] - sw['from_pieces']:,} to the mean row) and distilled, so "
             "*after* decodes without a mapping."), ""]),
        "| measure | before distillation | after distillation |",
        "| --- | ---: | ---: |",
        *[f"| {k} | {v1} | {v2} |" for k, v1, v2 in summary_rows(r)],
        "",
        (f"Distillation: {dist['steps']} steps on {dist['train_sequences']} sequences "
         f"({dist['trainable_parameters'] / 1e6:.1f} M trainable parameters), loss "
         f"`{cfg['distill']['loss']}`; held-out α (teacher-forced) "
         f"{_fmt(dist['eval_before'].get('eval_alpha'))} → {_fmt(dist['eval_after'].get('eval_alpha'))}, held-out loss "
         f"{_fmt(dist['eval_before'].get('eval_loss'), '{:.4f}')} → {_fmt(dist['eval_after'].get('eval_loss'), '{:.4f}')}."),
        "",
        *([] if (note := slower_note(r)) is None else [f"**Note:** {note}", ""]),
        (f"Exported speculator: `{exp['path']}` (γ = {exp['num_speculative_tokens']}, weights "
         f"{exp.get('dtype', 'keep')}). Serve it with vLLM (tested with vLLM {exp.get('vllm_tested_version', '?')}):"),
        "",
        "```bash",
        exp["vllm_command"],
        "```",
        "",
        *([] if not exp.get("vllm_one_path") else [
            f"or, with specdraft installed next to vLLM (its plugin): `{exp['vllm_one_path']}`.", ""]),
        *[f"Note: {n}" for n in exp.get("vllm_notes", [])],
        *([""] if exp.get("vllm_notes") else []),
        "| stage | seconds | |",
        "| --- | ---: | --- |",
        *[f"| {k} | {v['seconds']:.1f} | {'skipped (done earlier)' if v['skipped'] else ''} |"
          for k, v in r["timings"].items()],
        "",
        "![before vs after](report.png)",
        "",
    ]
    if r.get("overlap"):
        lines.insert(4, f"**Warning**: {len(r['overlap'])} evaluation prompts also occur in training.\n")
    return "\n".join(lines)
