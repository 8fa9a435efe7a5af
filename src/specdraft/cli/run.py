"""``specdraft run``: the main job, check → evaluate → distil → export → report (:mod:`specdraft.run.pipeline`)."""

from __future__ import annotations

from pathlib import Path

from specdraft.cli.errors import check_out
from specdraft.cli.options import (
    HELD_OUT_NOTE,
    TRAINING_NOTE,
    KeepCheckpointsOpt,
    config_option,
    draft_option,
    out_option,
    overwrite_option,
    preset_option,
    prompts_option,
    target_option,
)
from specdraft.cli.render import console, library_warnings_off, resolve_with_progress
from specdraft.cli.run_page import print_run
from specdraft.core.config import (
    DraftQuantization,
    EvalConfig,
    ExportDtype,
    GammaPolicy,
    GgufType,
    PipelineConfig,
    PresetName,
)


def run(
    target: str | None = target_option(None),
    draft: str | None = draft_option(None),
    train_prompts: list[str] | None = prompts_option(None, "Training prompts", TRAINING_NOTE + " Default: the "
                                                     "preset's.", flag="--train-prompts"),
    eval_prompts: list[str] | None = prompts_option(
        None, "Held-out evaluation prompts (the headline acceptance gain)", HELD_OUT_NOTE + " Default: the preset's.",
        flag="--eval-prompts"),
    ood_prompts: list[str] | None = prompts_option(
        None, "A second held-out set, reported separately (another domain, which must not get worse)",
        HELD_OUT_NOTE + " Default: the preset's.", flag="--ood-prompts"),
    out: Path = out_option(Path("runs/default"), "run"),
    preset: PresetName = config_option(PipelineConfig, "preset"),
    refuse_overlap: bool = config_option(PipelineConfig, "refuse_overlap"),
    vocab_swap: bool | None = config_option(PipelineConfig, "vocab_swap", "--vocab-swap/--no-vocab-swap",
                                            default=None, show_default=False),
    # None: the preset's (its fields say so); a flag given overrides that one field.
    export_dtype: ExportDtype | None = config_option(PipelineConfig, "export_dtype", default=None),
    export_gguf: GgufType | None = config_option(PipelineConfig, "export_gguf"),
    draft_quantization: DraftQuantization | None = preset_option(EvalConfig, "draft_quantization"),
    draft_head_tokens: int | None = preset_option(EvalConfig, "draft_head_tokens", min=0),
    gamma_policy: GammaPolicy | None = preset_option(EvalConfig, "gamma_policy"),
    overwrite: bool = overwrite_option("run"),
    keep_checkpoints: KeepCheckpointsOpt = False,
) -> None:
    """Run the main job: check, evaluate, distil, export, report.

    check → evaluate → (vocab swap) → headroom forecast → dump → distill → evaluate again → speed → export →
    report, every stage in the run directory --out; a re-run resumes, skipping finished stages. --gamma-policy,
    --draft-quantization and --draft-head-tokens set both evaluations."""
    from specdraft.run.pipeline import PRESET_TIMING, first_line, make_config, run_pipeline, run_prompts

    cfg = make_config(preset, target=target, draft=draft, train_prompts=train_prompts, eval_prompts=eval_prompts,
                      ood_prompts=ood_prompts, refuse_overlap=refuse_overlap, vocab_swap=vocab_swap,
                      export_dtype=export_dtype, export_gguf=export_gguf,
                      eval={"draft_quantization": draft_quantization, "draft_head_tokens": draft_head_tokens,
                            "gamma_policy": gamma_policy})
    check_out(out, overwrite=None)  # resumable: finished stages are skipped, --overwrite redoes a changed one
    host = None
    if cfg.preset in PRESET_TIMING:  # the time estimate scales with this machine's measured rate
        from specdraft.decoding.calibration import gemv_gb_s

        host = gemv_gb_s()
    console.print(first_line(cfg, out, host), highlight=False, markup=False, soft_wrap=True)
    chosen = run_prompts(cfg)  # every line checked, and what will run said, before any model work
    for line in (line for s in chosen.values() for line in s.lines()):
        console.print(line, highlight=False, markup=False, emoji=False, soft_wrap=True)  # one line, as written
    for ref, flag in ((cfg.target, "--target"), (cfg.draft, "--draft")):
        resolve_with_progress(ref, flag)
    with library_warnings_off():  # the run's page is specdraft's answers, not transformers' or torch's notices
        report = run_pipeline(cfg, out, log=lambda m: console.print(m, highlight=False, markup=False),
                              overwrite=overwrite, keep_checkpoints=keep_checkpoints, train_examples=chosen["train"].examples,
                              eval_examples=chosen["eval"].examples, ood_examples=chosen["ood"].examples)
    print_run(report, out, cfg.target, cfg.draft)

