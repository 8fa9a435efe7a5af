"""``specdraft run``: the main job, check → evaluate → distil → export → report (:mod:`specdraft.pipeline`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specdraft.cli.errors import check_out
from specdraft.cli.options import (
    HELD_OUT_NOTE,
    TRAINING_NOTE,
    HeadTokensOpt,
    OverwriteOpt,
    QuantOpt,
    draft_option,
    out_option,
    prompts_option,
    target_option,
)
from specdraft.cli.render import console, library_warnings_off, print_run, resolve_with_progress
from specdraft.config import ExportDtype, GammaPolicy, GgufType, PresetName


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
    out: Path = out_option(Path("runs/default"), "Run directory; a re-run resumes, skipping finished stages."),
    preset: Annotated[PresetName, typer.Option(help="default (the whole road: SmolLM2-135M, another tokenizer, "
                                                     "mapped, re-indexed, distilled; a 2-core CPU), same-family (the "
                                                     "Qwen 0.5B draft), ci (minutes), large (GPU, hours), tiny "
                                                     "(random models, tests). The run's first line says what the "
                                                     "preset needs (cores, memory, disk, time).")] = "default",
    refuse_overlap: Annotated[bool, typer.Option("--refuse-overlap",
                                                 help="Refuse when train and eval prompts overlap.")] = False,
    vocab_swap: Annotated[bool | None, typer.Option(
        "--vocab-swap/--no-vocab-swap", help="A draft of another tokenizer: evaluate it through a vocabulary "
        "mapping, re-index it into the target's tokenizer, distil that (see specdraft vocab-swap). Default: the "
        "preset's (on in the default preset).",
        show_default=False)] = None,
    export_dtype: Annotated[ExportDtype | None, typer.Option(
        help="Weights dtype of the exported speculator (keep = the training dtype). Default: the preset's "
        "(bfloat16, what vLLM serves).")] = None,
    export_gguf: Annotated[GgufType | None, typer.Option(
        help="Also write the distilled draft as a llama.cpp GGUF of this type (export/draft-TYPE.gguf), checked "
        "against the target's vocabulary as llama.cpp checks a -md draft.")] = None,
    draft_quantization: QuantOpt = None,
    draft_head_tokens: HeadTokensOpt = None,
    gamma_policy: Annotated[GammaPolicy | None, typer.Option(
        help="Both evaluations: fixed γ, or adaptive (see specdraft eval --help). Default: the preset's.")] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Run the main job: check, evaluate, distil, export, report.

    check → evaluate → (vocab swap) → headroom forecast → dump → distill → evaluate again → speed → export →
    report; a re-run resumes, skipping finished stages."""
    from specdraft.pipeline import make_config, run_pipeline, run_prompts

    cfg = make_config(preset, target=target, draft=draft, train_prompts=train_prompts, eval_prompts=eval_prompts,
                      ood_prompts=ood_prompts, refuse_overlap=refuse_overlap, vocab_swap=vocab_swap,
                      export_dtype=export_dtype, export_gguf=export_gguf,
                      eval={"draft_quantization": draft_quantization, "draft_head_tokens": draft_head_tokens,
                            "gamma_policy": gamma_policy})
    check_out(out, overwrite=None)  # resumable: finished stages are skipped, --overwrite redoes a changed one
    console.print(f"[bold]specdraft run[/] preset [cyan]{preset}[/] ({cfg.needs}) → {out}")
    chosen = run_prompts(cfg)  # every line checked, and what will run said, before any model work
    for line in (line for s in chosen.values() for line in s.lines()):
        console.print(line, highlight=False, markup=False, emoji=False, soft_wrap=True)  # one line, as written
    for ref, flag in ((cfg.target, "--target"), (cfg.draft, "--draft")):
        resolve_with_progress(ref, flag)
    with library_warnings_off():  # the run's page is specdraft's answers, not transformers' or torch's notices
        report = run_pipeline(cfg, out, log=lambda m: console.print(m, highlight=False, markup=False),
                              overwrite=overwrite, train_examples=chosen["train"].examples,
                              eval_examples=chosen["eval"].examples, ood_examples=chosen["ood"].examples)
    print_run(report, out, cfg.target, cfg.draft)

