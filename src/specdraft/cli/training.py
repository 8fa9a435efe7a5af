"""The training commands: ``headroom`` (what could distillation add?), ``dump`` (the target's teacher signal on
disk), ``distill`` (train the draft against it), ``vocab-swap`` (a draft of another tokenizer re-indexed into the
target's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from specdraft.cli.errors import check_out
from specdraft.cli.options import (
    HELD_OUT_NOTE,
    TRAINING_NOTE,
    GammaOpt,
    OverwriteOpt,
    config_option,
    draft_option,
    dtype_option,
    out_option,
    prompts_option,
    read_prompts,
    sampling_options,
    seed_option,
    target_option,
)
from specdraft.cli.render import (
    console,
    dump_progress,
    print_distill,
    print_dump,
    print_headroom,
    print_vocab_swap,
    quiet_transformers,
    resolve_with_progress,
)
from specdraft.config import (
    DistillConfig,
    DumpConfig,
    DumpFormat,
    EvalConfig,
    HeadroomConfig,
    HiddenDtype,
    LossName,
    ModelDtype,
    Precision,
    Scheduler,
    TrainWhat,
)

#: The forecast's prompts by default: held-out ShareGPT turns, their replies teacher-forced.
HEADROOM_DATA = ["sharegpt:6000:32"]


def headroom(
    target: str = target_option(),
    draft: str = draft_option(),
    prompts: list[str] = prompts_option(HEADROOM_DATA, "Prompts whose replies are teacher-forced", HELD_OUT_NOTE),
    generate: Annotated[int | None, typer.Option(help="The target answers each prompt with up to N greedy tokens and "
                                                    "the forecast runs on its answers (what decoding verifies); "
                                                    "default: the existing replies (one prefill each).")] = None,
    sure: Annotated[float, typer.Option(help="The target is sure at a position when max p >= this.")] = 0.5,
    min_gain: Annotated[float, typer.Option(help="A forecast gain below this reads 'little to learn'.")] = 0.02,
    max_length: Annotated[int, typer.Option(help="Tokens kept per sequence.")] = 1024,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 4,
    dtype: ModelDtype = dtype_option(HeadroomConfig),
    out: Path | None = out_option(None, "Write the forecast to this JSON file."),
    overwrite: OverwriteOpt = False,
) -> None:
    """Forecast how much acceptance distillation can add.

    Before training: how much acceptance can distillation add to this pair? Splits 1 − agreement into the part
    where the target is sure and the draft is not (learnable) and where the target is unsure
    (specdraft.headroom)."""
    from specdraft.headroom import run_headroom
    from specdraft.io import atomic_write_text

    config = HeadroomConfig(sure=sure, min_gain=min_gain, generate=generate, max_length=max_length,
                            batch_size=batch_size, dtype=dtype)
    examples = read_prompts(prompts, held_out=True).examples
    check_out(out, file=True, overwrite=overwrite)
    quiet_transformers()
    with console.status(f"forecasting over {len(examples)} sequences…"):
        r = run_headroom(target, draft, examples, config)
    if out is not None:
        atomic_write_text(out, json.dumps(r | {"command": " ".join(sys.argv)}, indent=1, default=str))
    print_headroom(r, sure, out)


def dump(
    out: Path = out_option(..., "Output directory: new, empty, or an unfinished or finished dump of the same plan "
                           "(resumed / verified)."),
    target: str = target_option(),
    prompts: str = prompts_option("conversations", "Sequences to dump", TRAINING_NOTE + " A dump keeps every "
                                  "example of its range (no stride).", strides=False),
    format: Annotated[DumpFormat, typer.Option("--format", help="hidden: final hidden states after the final "
                                               "norm (exact); topk: top-k log-probs + leftover mass.")] = "hidden",
    top_k: Annotated[int, typer.Option(help="Log-probs kept per position (--format topk).")] = 64,
    hidden_dtype: Annotated[HiddenDtype, typer.Option(help="Storage dtype of hidden states.")] = "bfloat16",
    max_length: Annotated[int, typer.Option(help="Tokens kept per sequence.")] = 2048,
    truncate: Annotated[bool, typer.Option("--truncate/--refuse-long", help="Cut sequences longer than "
                                           "--max-length and count them, or refuse them.")] = True,
    answer_only: Annotated[bool, typer.Option("--answer-only", help="Train only predictions of assistant "
                                              "(or generated) tokens.")] = False,
    generate: Annotated[int | None, typer.Option(help="The target answers each prompt itself with up to N "
                                                    "tokens (on-policy data).")] = None,
    temperature: float = config_option(DumpConfig, "temperature", "--temperature"),
    seed: int = seed_option(DumpConfig),
    batch_size: Annotated[int, typer.Option(help="Sequences per target forward pass.")] = 8,
    shard_size_mb: Annotated[float, typer.Option(help="Shard size bound, MB.")] = 256.0,
    dtype: ModelDtype = dtype_option(DumpConfig),
) -> None:
    """Store the target's distribution over a dataset (teacher dump).

    Runs the target once over every sequence and stores its distribution in shards plus a manifest; a killed run
    resumes where it stopped. Runs data-parallel under accelerate launch / torchrun."""
    import time

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from specdraft.cli.errors import err_console
    from specdraft.dump import run_dump
    from specdraft.prompts import parse_source

    source = parse_source(prompts, strides=False)
    config = DumpConfig(format=format, top_k=top_k, hidden_dtype=hidden_dtype, max_length=max_length,
                        truncate=truncate, answer_only=answer_only, generate=generate, temperature=temperature,
                        seed=seed, num_examples=source.limit, offset=source.offset, batch_size=batch_size,
                        shard_size_mb=shard_size_mb, dtype=dtype)
    quiet_transformers()
    t0 = time.time()
    read_prompts(prompts, strides=False)  # every line checked, and what will run said, before any model loads
    check_out(out, overwrite=None)  # resumable: an unfinished or finished dump of the same plan is continued
    resolve_with_progress(target, "--target")
    with Progress(TextColumn("dump"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tps]}"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err_console) as pg:
        m = run_dump(target, source.name, out, config, progress=dump_progress(pg, pg.add_task("dump", total=None,
                                                                                                tps="")))
    print_dump(m, out, time.time() - t0)


TEMPERATURE, TOP_K, TOP_P = sampling_options(DistillConfig)


def distill(
    target: str = target_option(),
    draft: str = draft_option(),
    dump: Annotated[Path, typer.Option(help="Teacher dump directory written by `specdraft dump`.")] = Path("runs/dump"),
    out: Path = out_option(Path("runs/distill"), "Output: checkpoints/, speculator/, training.json."),
    loss: LossName = config_option(DistillConfig, "loss", "--loss"),
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 1e-5,
    row_lr: float | None = config_option(DistillConfig, "row_lr", "--row-lr"),
    untie_head: bool = config_option(DistillConfig, "untie_head", "--untie-head"),
    prompt_positions: bool = config_option(DistillConfig, "prompt_positions", "--prompt-positions"),
    max_steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 100,
    batch_size: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = 1,
    gradient_accumulation_steps: Annotated[int, typer.Option(help="Micro-batches per step.")] = 1,
    warmup_ratio: Annotated[float, typer.Option(help="Share of steps warming up.")] = 0.0,
    scheduler: Annotated[Scheduler, typer.Option(help="Learning-rate schedule.")] = "cosine",
    seed: int = seed_option(DistillConfig),
    dtype: Literal["float32", "bfloat16"] = dtype_option(DistillConfig),
    precision: Annotated[Precision, typer.Option(
        help="float32; bf16-autocast: the draft's forward in bfloat16 (torch.autocast), float32 master weights, "
        "teacher and loss; auto: bf16-autocast on a CPU with AMX-bf16/avx512_bf16 or a bf16 CUDA GPU.")] = "float32",
    train: Annotated[TrainWhat, typer.Option(help="All parameters, the last N layers (+ final norm), or LoRA.")]
        = "all",
    train_last_layers: Annotated[int, typer.Option(help="N for --train last_layers.")] = 2,
    held_out_fraction: Annotated[float, typer.Option(help="Share of sequences held out for α.")] = 0.1,
    eval_steps: Annotated[int, typer.Option(help="Held-out evaluation every N steps; 0 = end only.")] = 0,
    save_steps: Annotated[int, typer.Option(help="Checkpoint every N steps (resume point).")] = 50,
    on_policy_fraction: Annotated[float, typer.Option(
        help="λ: share of training sequences the draft writes itself from the training prompts (sampled at "
        "--temperature/--top-k/--top-p), scored by the target; 0 = the dump only.")] = 0.0,
    on_policy_every: Annotated[int, typer.Option(help="Regenerate the draft-written sequences every N steps.")] = 10,
    on_policy_max_new_tokens: Annotated[int | None, typer.Option(
        help="Length bound of the draft's answers (default: the dump's --generate, else 128).")] = None,
    gamma: GammaOpt = None,
    no_resume: Annotated[bool, typer.Option("--no-resume", help="Start over instead of resuming.")] = False,
) -> None:
    """Distil the draft against a teacher dump.

    Trains the draft against the target's stored distribution and exports it as an independent speculator."""
    from specdraft.config import speculative_tokens
    from specdraft.distill import run_distill

    cfg = DistillConfig(
        loss=loss, temperature=temperature, top_k=top_k, top_p=top_p, lr=lr, row_lr=row_lr,
        untie_head=untie_head, prompt_positions=prompt_positions, max_steps=max_steps, batch_size=batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps, warmup_ratio=warmup_ratio,
        scheduler=scheduler, seed=seed, dtype=dtype, precision=precision, train=train,
        train_last_layers=train_last_layers,
        held_out_fraction=held_out_fraction, eval_steps=eval_steps, save_steps=save_steps,
        on_policy_fraction=on_policy_fraction, on_policy_every=on_policy_every,
        on_policy_max_new_tokens=on_policy_max_new_tokens)
    check_out(out, overwrite=None)  # resumable: its checkpoints are continued unless --no-resume
    res = run_distill(target, draft, dump, out, cfg, resume=not no_resume,
                      num_speculative_tokens=speculative_tokens(gamma))
    print_distill(res)


def vocab_swap(
    draft: str = draft_option(..., " Here a draft of another tokenizer than the target's."),
    out: Path = out_option(..., "Directory for the swapped draft (written atomically)."),
    target: str = target_option(),
    dtype: ModelDtype = dtype_option(EvalConfig, " The swapped draft is written in it.", default="float32"),
    overwrite: OverwriteOpt = False,
    prompts: list[str] | None = prompts_option(None, "Conversations whose replies (in the target's tokenizer) are "
                                               "teacher-forced through the swapped draft for the swap diagnostic",
                                               " (default: none; specdraft headroom on the swapped draft runs it "
                                               "too)."),
) -> None:
    """Re-index a draft of another tokenizer into the target's.

    Its embedding and output rows are copied to
    the target ids of their string-identical twins; a target token it lacks starts from the mean of the rows of
    the draft tokens its text encodes to (the mean of all rows for control tokens). The result is a plain HF
    checkpoint with the target's tokenizer, and as many vocabulary rows as the target (a 49k-row draft grows
    to 152k rows for Qwen); distil it next (specdraft run --draft OUT). With --prompts, the swap diagnostic: the
    share of reply tokens without a draft twin and the swapped draft's argmax disagreements by kind
    (specdraft.segmentation)."""
    from specdraft.vocab import save_vocab_swap

    examples = read_prompts(prompts).examples if prompts else None
    check_out(out, overwrite=overwrite)
    tpath, dpath = resolve_with_progress(target, "--target"), resolve_with_progress(draft, "--draft")
    with console.status("re-indexing the draft's rows…"):
        report = save_vocab_swap(dpath, tpath, out, dtype=dtype, overwrite=overwrite, examples=examples)
    print_vocab_swap(report, draft, target, out)
