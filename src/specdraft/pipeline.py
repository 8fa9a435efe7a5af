"""The main job, ``specdraft run``: from two checkpoints to a shipped, measured speculator.

Stages, each a library call writing into ``OUT/<stage>/`` and finished by a ``stage.json`` holding the key of
its inputs (a re-run skips a stage whose key matches, so a killed run continues where it stopped):

1. ``check``       tokenizer compatibility (:func:`specdraft.check.check_compatible`)
2. ``eval_before`` predicted α + target-only vs speculative decoding on held-out prompts (+ transformers'
                   assisted generation) (:func:`specdraft.evaluate.run_eval`)
3. ``dump``        the target's teacher signal on the training prompts, responses written by the target
                   itself (:func:`specdraft.dump.run_dump`)
4. ``distill``     the draft trained against the dump (:func:`specdraft.distill.run_distill`)
5. ``eval_after``  the same evaluation with the distilled draft
6. ``export``      the distilled draft as an independent speculator + the vLLM command
7. ``report``      ``report.md``, ``report.json`` and plots

Evaluation prompts never enter training: overlaps between the two prompt sets are counted and warned about
(or refused with ``refuse_overlap``).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdraft.distill import DistillConfig
from specdraft.io import atomic_directory, atomic_write_text
from specdraft.models import DEFAULT_DRAFT, DEFAULT_TARGET

STAGES = ("check", "eval_before", "vocab_swap", "dump", "distill", "eval_after", "export", "report")
PresetName = Literal["default", "ci", "tiny", "large"]


class PipelineError(RuntimeError):
    """A stage failed; the message names the stage and the command that resumes."""


class EvalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(description="Prompt sources as name[:offset[:limit]] (held out from training).")
    max_new_tokens: int = Field(64, ge=1)
    num_speculative_tokens: int = Field(5, ge=1, description="γ for both evaluations.")
    compare_hf: bool = Field(True, description="Time transformers' assisted generation in the first evaluation.")
    dtype: str = Field("bfloat16", description="Decoding dtype.")


class DumpSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(description="Training prompt sources as name[:offset[:limit]].")
    generate: int = Field(48, ge=1, description="Response tokens the target writes per training prompt.")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy responses.")
    max_length: int = Field(512, ge=8)
    batch_size: int = Field(8, ge=1)
    dtype: str = Field("bfloat16", description="Target dtype while dumping.")
    format: Literal["hidden", "topk"] = "hidden"


class PipelineConfig(BaseModel):
    """Everything ``specdraft run`` does; a preset fills it, flags override single fields."""

    model_config = ConfigDict(extra="forbid")

    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    preset: PresetName = "default"
    eval: EvalSettings
    dump: DumpSettings
    distill: DistillConfig
    refuse_overlap: bool = Field(False, description="Refuse (instead of warn) when train and eval prompts overlap.")
    vocab_swap: bool = Field(False, description="A draft of another tokenizer: evaluate it through a vocabulary "
                             "mapping, then re-index it into the target's tokenizer (vocab_swap stage) and distil that.")
    needs: str = Field("", description="What the preset needs (hardware, time).")


PRESETS: dict[str, dict[str, Any]] = {
    # 2-core CPU, models cached: about 10–15 minutes in all.
    "default": {
        "eval": {"prompts": ["humaneval:100:4", "mt-bench:0:2"], "max_new_tokens": 64, "num_speculative_tokens": 5},
        "dump": {"prompts": ["humaneval:0:16", "conversations:0:16"], "generate": 48, "max_length": 512, "batch_size": 8},
        "distill": {"loss": "tvd", "train": "last_layers", "train_last_layers": 4, "lr": 3e-5, "max_steps": 30, "batch_size": 2,
                     "held_out_fraction": 0.125, "scheduler": "cosine", "warmup_ratio": 0.1, "save_steps": 10,
                     "num_speculative_tokens": 5},
        "needs": "2 CPU cores, ~14 GB RAM, ~2 GB disk; 10–20 min with the models cached",
    },
    # The smallest run that exercises every stage on real weights (CI).
    "ci": {
        "eval": {"prompts": ["humaneval:100:1"], "max_new_tokens": 12, "num_speculative_tokens": 4, "compare_hf": False},
        "dump": {"prompts": ["humaneval:0:3"], "generate": 12, "max_length": 256, "batch_size": 3},
        "distill": {"loss": "tvd", "train": "last_layers", "train_last_layers": 1, "lr": 3e-5, "max_steps": 2, "batch_size": 1,
                     "held_out_fraction": 0.34, "save_steps": 1, "num_speculative_tokens": 4},
        "needs": "2 CPU cores, ~14 GB RAM, a few minutes",
    },
    # Tiny random models (tests).
    "tiny": {
        "eval": {"prompts": [], "max_new_tokens": 8, "num_speculative_tokens": 3, "compare_hf": False, "dtype": "float32"},
        "dump": {"prompts": [], "generate": 6, "max_length": 64, "batch_size": 4, "dtype": "float32"},
        "distill": {"loss": "tvd", "lr": 1e-3, "max_steps": 3, "batch_size": 2, "held_out_fraction": 0.25, "save_steps": 1,
                     "num_speculative_tokens": 3},
        "needs": "seconds",
    },
    # A real distillation: one modern GPU (≥ 24 GB), a few hours.
    "large": {
        "eval": {"prompts": ["humaneval:100:64", "mt-bench:0:80"], "max_new_tokens": 256, "num_speculative_tokens": 5},
        "dump": {"prompts": ["humaneval:0:100", "conversations:0:500"], "generate": 512, "max_length": 2048,
                  "batch_size": 16},
        "distill": {"loss": "tvd", "train": "all", "lr": 2e-5, "max_steps": 3000, "batch_size": 8, "gradient_accumulation_steps": 4,
                     "held_out_fraction": 0.05, "scheduler": "cosine", "warmup_ratio": 0.03, "eval_steps": 250, "save_steps": 250,
                     "dtype": "bfloat16", "num_speculative_tokens": 5},
        "needs": "1 CUDA GPU with ≥ 24 GB, ~3 hours, ~200 GB disk for the hidden-state dump",
    },
}


def make_config(preset: str = "default", **overrides: Any) -> PipelineConfig:
    """A :class:`PipelineConfig` from a preset plus overrides (``eval_prompts``, ``train_prompts`` replace the
    prompt lists; other keys are top-level fields)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    base = json.loads(json.dumps(PRESETS[preset]))
    if (ep := overrides.pop("eval_prompts", None)) is not None:
        base["eval"]["prompts"] = list(ep)
    if (tp := overrides.pop("train_prompts", None)) is not None:
        base["dump"]["prompts"] = list(tp)
    base.update({k: v for k, v in overrides.items() if v is not None})
    return PipelineConfig(preset=preset, **base)


def parse_source(spec: str) -> tuple[str, int, int | None]:
    """``name[:offset[:limit]]`` → (source, offset, limit). A path may contain ':' only when no offset is given
    after it (an existing file wins)."""
    if Path(spec).exists():
        return spec, 0, None
    parts = spec.rsplit(":", 2)
    nums = []
    while len(parts) > 1 and parts[-1].isdigit():
        nums.insert(0, int(parts.pop()))
    name = ":".join(parts)
    offset = nums[0] if nums else 0
    limit = nums[1] if len(nums) > 1 else None
    return name, offset, limit


def load_sources(specs: list[str]):
    from specdraft.data import load_examples

    out = []
    for spec in specs:
        name, offset, limit = parse_source(spec)
        out.extend(load_examples(name, limit=limit, offset=offset))
    return out


def prompt_overlap(train, evaluation) -> list[str]:
    """Ids of evaluation examples whose prompt messages also occur in the training examples."""
    key = lambda e: json.dumps(e.prompt_messages, sort_keys=True)
    train_keys = {key(e) for e in train}
    return [e.id for e in evaluation if key(e) in train_keys]


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Runner:
    """Runs stages with skip-if-done, timing and clear failure messages."""

    def __init__(self, out: Path, command: str, log: Callable[[str], None] = print):
        self.out = out
        self.command = command
        self.log = log
        self.timings: dict[str, dict[str, Any]] = {}

    def stage(self, name: str, inputs: Any, fn: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        d = self.out / name
        marker = d / "stage.json"
        key = _key(inputs)
        if marker.is_file():
            saved = json.loads(marker.read_text())
            if saved.get("key") == key:
                self.timings[name] = {"seconds": saved.get("seconds", 0.0), "skipped": True}
                self.log(f"[{name}] done earlier with the same inputs — skipped")
                return saved["result"]
        d.mkdir(parents=True, exist_ok=True)
        self.log(f"[{name}] running…")
        t0 = time.time()
        try:
            result = fn(d)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            raise PipelineError(f"stage '{name}' failed: {type(exc).__name__}: {exc}\n"
                                f"Fix the cause, then resume with: {self.command}") from exc
        seconds = time.time() - t0
        atomic_write_text(marker, json.dumps({"key": key, "inputs": inputs, "seconds": seconds, "result": result},
                                             indent=2, default=str))
        self.timings[name] = {"seconds": seconds, "skipped": False}
        self.log(f"[{name}] finished in {seconds:.1f} s")
        return result


def estimate_dump_bytes(cfg: PipelineConfig, n_prompts: int, avg_prompt_tokens: int, hidden_size: int) -> int:
    """Upper estimate of the dump size in bytes: tokens × (hidden bf16 or top-k) + ids and mask."""
    tokens = n_prompts * min(cfg.dump.max_length, avg_prompt_tokens + cfg.dump.generate)
    per_token = (hidden_size * 2 if cfg.dump.format == "hidden" else cfg.distill.top_k * 6 + 4 + 256) + 5
    return tokens * per_token


def run_pipeline(cfg: PipelineConfig, out: str | Path, command: str | None = None,
                 log: Callable[[str], None] = print, eval_examples=None, train_examples=None) -> dict[str, Any]:
    """Run every stage (skipping those already done with the same inputs) and write the report.

    Args:
        cfg: the pipeline config (see :data:`PRESETS`).
        out: the run directory.
        command: how to resume (shown on failure); default ``sys.argv``.
        eval_examples / train_examples: explicit example lists (override the prompt sources).

    Returns:
        The ``report.json`` payload.

    Raises:
        PipelineError: a stage failed (names it and the resume command), overlap refused, too little disk.
    """
    from specdraft.check import check_compatible
    from specdraft.models import resolve
    from specdraft.vocab import build_vocab_mapping

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    command = command or " ".join(["specdraft"] + sys.argv[1:])
    runner = Runner(out, command, log)
    t_all = time.time()

    # ---- checks before any long work ------------------------------------------------------------------
    evals = eval_examples if eval_examples is not None else load_sources(cfg.eval.prompts)
    trains = train_examples if train_examples is not None else load_sources(cfg.dump.prompts)
    if not evals or not trains:
        raise PipelineError("the pipeline needs evaluation and training prompts (preset prompt lists are empty)")
    overlap = prompt_overlap(trains, evals)
    if overlap:
        msg = f"{len(overlap)} evaluation prompt(s) also occur in the training prompts (e.g. {overlap[:3]})"
        if cfg.refuse_overlap:
            raise PipelineError(msg + "; choose disjoint sources or drop --refuse-overlap")
        log(f"warning: {msg}; their acceptance after distillation is not a held-out figure")
    tpath, dpath = resolve(cfg.target), resolve(cfg.draft)
    from transformers import AutoConfig

    hidden = getattr(AutoConfig.from_pretrained(tpath), "hidden_size", 4096)
    need = estimate_dump_bytes(cfg, len(trains), 200, hidden)
    free = shutil.disk_usage(out).free
    if need > 0.9 * free:
        raise PipelineError(f"the teacher dump needs about {need / 1e9:.1f} GB but {out} has {free / 1e9:.1f} GB "
                            "free; free disk, pick another --out, or use a smaller preset / --format topk")
    fingerprint = {"target": cfg.target, "draft": cfg.draft}

    # ---- 1. check ---------------------------------------------------------------------------------------
    def do_check(d: Path) -> dict[str, Any]:
        rep = check_compatible(tpath, dpath)
        atomic_write_text(d / "report.json", json.dumps(rep.to_dict(), indent=2, default=str))
        if rep.verdict == "mismatch" and not cfg.vocab_swap:
            hint = (" The overlap is usable: pass --vocab-swap to evaluate it through a vocabulary mapping and "
                    "distil it re-indexed into the target's tokenizer." if rep.mapping and rep.mapping["usable"] else "")
            raise ValueError(f"tokenizers differ: {rep.summary()} (see {d / 'report.json'}; specdraft check).{hint}")
        if rep.verdict == "mismatch":
            build_vocab_mapping(tpath, dpath)  # no usable overlap → CompatibilityError, before any weights
        return {"verdict": rep.verdict, "real_vocab": rep.real_vocab, "mapping": rep.mapping}

    check = runner.stage("check", fingerprint | {"vocab_swap": cfg.vocab_swap}, do_check)
    mapped = check["verdict"] == "mismatch"

    # ---- 2./5. evaluation ---------------------------------------------------------------------------------
    def evaluate_with(draft_ref: str, compare_hf: bool, map_vocab: bool = False) -> Callable[[Path], dict[str, Any]]:
        def run(d: Path) -> dict[str, Any]:
            from specdraft.data import encode_prompts
            from specdraft.evaluate import run_eval, write_report
            from specdraft.models import load_model

            target, tok = load_model(tpath, dtype=cfg.eval.dtype)
            draft, _ = load_model(draft_ref, dtype=cfg.eval.dtype)
            ids = encode_prompts(tok, evals)
            mapping = build_vocab_mapping(tpath, draft_ref) if map_vocab else None
            res = run_eval(target, draft, tok, ids, [e.id for e in evals],
                           num_speculative_tokens=cfg.eval.num_speculative_tokens,
                           max_new_tokens=cfg.eval.max_new_tokens, compare_hf=compare_hf, vocab_mapping=mapping,
                           config={"target": cfg.target, "draft": str(draft_ref)})
            write_report(res, d, title=d.name)
            del target, draft  # free both models before the next stage loads its own
            gc.collect()
            return res.summary() | {"counts": res.spec_counts.to_dict()}

        return run

    eval_inputs = fingerprint | {"eval": cfg.eval.model_dump(), "prompts": [e.id for e in evals]}
    before = runner.stage("eval_before", eval_inputs, evaluate_with(dpath, cfg.eval.compare_hf, mapped))
    if not before["lossless"]:
        raise PipelineError(f"greedy speculative decoding diverged beyond rounding tolerance before distillation "
                            f"(see {out / 'eval_before' / 'report.json'}); this is a bug, please report it")

    # ---- 2b. vocabulary swap (a draft of another tokenizer) -----------------------------------------------
    swap = None
    train_draft = dpath
    if mapped:
        def do_swap(d: Path) -> dict[str, Any]:
            from specdraft.vocab import save_vocab_swap

            report = save_vocab_swap(dpath, tpath, d / "model", dtype=cfg.distill.dtype, overwrite=True)
            return report.to_dict() | {"path": str(d / "model")}

        swap = runner.stage("vocab_swap", fingerprint | {"dtype": cfg.distill.dtype}, do_swap)
        train_draft = swap["path"]

    # ---- 3. dump ------------------------------------------------------------------------------------------
    dump_inputs = {"target": cfg.target, "dump": cfg.dump.model_dump(), "prompts": [e.id for e in trains]}

    def do_dump(d: Path) -> dict[str, Any]:
        from specdraft.dump import DumpConfig, run_dump

        dc = DumpConfig(format=cfg.dump.format, max_length=cfg.dump.max_length, answer_only=True,
                        generate=cfg.dump.generate, temperature=cfg.dump.temperature,
                        batch_size=cfg.dump.batch_size, dtype=cfg.dump.dtype)
        man = run_dump(tpath, trains, d, dc, command=command)
        run = man.get("this_run", {})
        return {"sequences": man.get("sequences"), "tokens": man.get("tokens"), "bytes": man.get("bytes"),
                "tokens_per_s": run.get("tokens_per_s"), "generate_tokens_per_s": run.get("generate_tokens_per_s")}

    dump = runner.stage("dump", dump_inputs, do_dump)

    # ---- 4. distill ---------------------------------------------------------------------------------------
    distill_inputs = {"dump": dump_inputs, "draft": cfg.draft, "distill": cfg.distill.model_dump(),
                      "vocab_swap": mapped}

    def do_distill(d: Path) -> dict[str, Any]:
        from specdraft.distill import run_distill

        res = run_distill(cfg.target, train_draft, out / "dump", d, cfg.distill)
        return {"speculator": str(res["speculator"]), **res["metrics"]}

    distilled = runner.stage("distill", distill_inputs, do_distill)
    spec_dir = distilled["speculator"]

    # ---- 5. evaluation after ------------------------------------------------------------------------------
    after = runner.stage("eval_after", eval_inputs | {"distill": distill_inputs},
                         evaluate_with(spec_dir, False))

    # ---- 6. export ----------------------------------------------------------------------------------------
    def do_export(d: Path) -> dict[str, Any]:
        from specdraft.speculator import load_speculator_config, vllm_serve_command

        dest = d / "speculator"
        with atomic_directory(dest) as tmp:
            shutil.copytree(spec_dir, tmp, dirs_exist_ok=True)
        conf = load_speculator_config(str(dest))
        return {"path": str(dest.resolve()), "vllm_command": vllm_serve_command(cfg.target, dest.resolve(),
                                                                               conf.num_speculative_tokens),
                "num_speculative_tokens": conf.num_speculative_tokens}

    export = runner.stage("export", distill_inputs, do_export)

    # ---- 7. report ----------------------------------------------------------------------------------------
    report = {"config": cfg.model_dump(), "command": command, "check": check, "eval_before": before,
              "vocab_swap": swap, "dump": dump, "distill": distilled, "eval_after": after, "export": export,
              "overlap": overlap, "timings": runner.timings, "total_seconds": time.time() - t_all,
              "date": time.strftime("%Y-%m-%d %H:%M"), "versions": _versions()}
    write_pipeline_report(report, out)
    runner.timings["report"] = {"seconds": 0.0, "skipped": False}
    return report


def _versions() -> dict[str, str]:
    import platform

    import torch
    import transformers

    import specdraft

    return {"specdraft": specdraft.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "machine": f"{platform.machine()} ({os.cpu_count()} cpus)"}


def write_pipeline_report(report: dict[str, Any], out: Path) -> None:
    """``report.json``, ``report.md`` and the comparison plots (before vs after), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specdraft.io import atomic_path

    b, a = report["eval_before"], report["eval_after"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
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
    fig.tight_layout()
    with atomic_path(out / "report.png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    atomic_write_text(out / "report.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(out / "report.md", render_markdown(report))


def render_markdown(r: dict[str, Any]) -> str:
    b, a, dist, exp = r["eval_before"], r["eval_after"], r["distill"], r["export"]
    f = lambda v, s="{:.3f}": "—" if v is None else s.format(v)
    rows = [
        ("acceptance rate (accepted / proposed)", f(b["acceptance_rate"]), f(a["acceptance_rate"])),
        ("mean accepted length (tokens / target pass)", f(b["mean_accepted_length"], "{:.2f}"),
         f(a["mean_accepted_length"], "{:.2f}")),
        ("predicted α (teacher-forced, target responses)", f(b["predicted_alpha_response"]),
         f(a["predicted_alpha_response"])),
        ("target alone (tokens/s)", f(b["target_tokens_per_s"], "{:.2f}"), f(a["target_tokens_per_s"], "{:.2f}")),
        ("speculative (tokens/s)", f(b["speculative_tokens_per_s"], "{:.2f}"),
         f(a["speculative_tokens_per_s"], "{:.2f}")),
        ("speed-up vs target alone", f(b["speedup"], "{:.2f}x"), f(a["speedup"], "{:.2f}x")),
        ("transformers assisted generation (tokens/s)", f(b.get("hf_assisted_tokens_per_s"), "{:.2f}"), "—"),
        ("cost ratio c", f(b["cost_ratio_c"]), f(a["cost_ratio_c"])),
        ("analytic speed-up at measured α, c", f(b["analytic_speedup"], "{:.2f}x"), f(a["analytic_speedup"], "{:.2f}x")),
        ("recommended γ", str(b["recommended_gamma"]), str(a["recommended_gamma"])),
        ("greedy divergences (beyond tolerance)", f"{b['divergences']} ({b['divergences_beyond_tolerance']})",
         f"{a['divergences']} ({a['divergences_beyond_tolerance']})"),
    ]
    lines = [
        f"# specdraft run — {r['config']['target']} ← {r['config']['draft']}",
        "",
        (f"{r['date']}, {r['versions']['machine']}, torch {r['versions']['torch']}, transformers "
        f"{r['versions']['transformers']}. Command: `{r['command']}`. Total {r['total_seconds'] / 60:.1f} min."),
        "",
        (f"Evaluation on {b['prompts']} held-out prompt(s) ({', '.join(r['config']['eval']['prompts'])}), "
        f"γ = {r['config']['eval']['num_speculative_tokens']}, greedy, {r['config']['eval']['max_new_tokens']} "
        "new tokens each."),
        "",
        *([] if not (sw := r.get("vocab_swap")) else [
            (f"The draft speaks another tokenizer: *before* decodes it through a vocabulary mapping "
             f"({sw['target_coverage']:.1%} of the target vocabulary reachable); it was then re-indexed into the "
             f"target's tokenizer ({sw['copied']:,} rows copied from a twin, {sw['from_pieces']:,} set to the mean "
             f"of their draft pieces, {sw['initialised'] - sw['from_pieces']:,} to the mean row) and distilled, so "
             "*after* decodes without a mapping."), ""]),
        "| measure | before distillation | after distillation |",
        "| --- | ---: | ---: |",
        *[f"| {k} | {v1} | {v2} |" for k, v1, v2 in rows],
        "",
        (f"Distillation: {dist['steps']} steps on {dist['train_sequences']} sequences "
        f"({dist['trainable_parameters'] / 1e6:.1f} M trainable parameters), loss "
        f"`{r['config']['distill']['loss']}`; held-out α (teacher-forced) "
        f"{f(dist['eval_before'].get('eval_alpha'))} → {f(dist['eval_after'].get('eval_alpha'))}, held-out loss "
        f"{f(dist['eval_before'].get('eval_loss'), '{:.4f}')} → {f(dist['eval_after'].get('eval_loss'), '{:.4f}')}."),
        "",
        *([] if (a["speedup"] or 0) >= (b["speedup"] or 0) else [
            (f"**Note:** the distilled draft decodes slower than the original ({a['speedup']:.2f}x vs "
             f"{b['speedup']:.2f}x the target alone on these {b['prompts']} prompt(s)); keep the original draft, or "
             "distil longer (more data, more steps, the `large` preset) before shipping this one."), ""]),
        f"Exported speculator: `{exp['path']}` (γ = {exp['num_speculative_tokens']}). Serve it with:",
        "",
        "```bash",
        exp["vllm_command"],
        "```",
        "",
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
