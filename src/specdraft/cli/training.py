"""The training commands: ``headroom`` (what could distillation add?), ``dump`` (the target's teacher signal on
disk), ``distill`` (train the draft against it), ``vocab-swap`` (a draft of another tokenizer re-indexed into the
target's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from specdraft.cli.errors import check_out, err_console, fail, refuse_retired
from specdraft.cli.options import (
    HELD_OUT_NOTE,
    TRAINING_NOTE,
    KeepCheckpointsOpt,
    SpeculatorGammaOpt,
    config_option,
    draft_option,
    dtype_option,
    out_option,
    overwrite_option,
    prompts_option,
    read_prompts,
    retired_option,
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
from specdraft.core.config import (
    SERVING_HELP,
    AsGivenTeacherConfig,
    DistillConfig,
    DumpConfig,
    DumpFormat,
    EvalConfig,
    HeadroomConfig,
    HiddenDtype,
    LossName,
    ModelDtype,
    Precision,
    SamplingConfig,
    Scheduler,
    SelfTeacherConfig,
    TrainWhat,
    speculative_tokens,
)

#: The forecast's prompts by default: held-out ShareGPT turns, their replies teacher-forced.
HEADROOM_DATA = ["sharegpt:6000:32"]


def headroom(
    target: str = target_option(),
    draft: str = draft_option(),
    prompts: list[str] = prompts_option(HEADROOM_DATA, "Prompts whose replies are teacher-forced", HELD_OUT_NOTE),
    generate: int | None = config_option(HeadroomConfig, "generate", command="headroom"),
    sure: float = config_option(HeadroomConfig, "sure"),
    min_gain: float = config_option(HeadroomConfig, "min_gain"),
    max_length: int = config_option(HeadroomConfig, "max_length", command="headroom"),
    batch_size: int = config_option(HeadroomConfig, "batch_size", command="headroom"),
    dtype: ModelDtype = dtype_option(HeadroomConfig, "headroom"),
    out: Path | None = out_option(None, "headroom"),
    overwrite: bool = overwrite_option("headroom"),
) -> None:
    """Forecast how much acceptance distillation can add.

    Before training: how much acceptance can distillation add to this pair? Splits 1 − agreement into the part
    where the target is sure and the draft is not (learnable) and where the target is unsure
    (specdraft.measuring.headroom). With --out, also writes the forecast to that JSON file."""
    from specdraft.core.io import atomic_write_text
    from specdraft.measuring.headroom import run_headroom
    config = HeadroomConfig(sure=sure, min_gain=min_gain, generate=generate, max_length=max_length,
                            batch_size=batch_size, dtype=dtype)
    check_out(out, file=True, overwrite=overwrite)
    examples = read_prompts(prompts, held_out=True).examples
    quiet_transformers()
    with console.status(f"forecasting over {len(examples)} sequences…"):
        r = run_headroom(target, draft, examples, config)
    if out is not None:
        atomic_write_text(out, json.dumps(r.to_dict() | {"command": " ".join(sys.argv)}, indent=1, default=str))
    print_headroom(r.forecast, sure, out)


#: The dump flags a self-teacher dump has no use for (it stores top-k hard labels or the draft's distribution of its
#: greedy answers, on answer positions only), refused when typed beside --self-teacher.
NOT_SELF_TEACHER = {"teacher_format": "--teacher-format", "hidden_dtype": "--hidden-dtype", "answer_only": "--answer-only",
                    "temperature": "--temperature", "seed": "--seed"}
#: The dump flags a self-teacher dump reads (:class:`specdraft.core.config.SelfTeacherConfig`'s fields), and those above.
SELF_TEACHER_FLAGS = (*NOT_SELF_TEACHER, "top_logprobs", "generate", "max_length", "truncate", "batch_size", "shard_size_mb",
                      "dtype", "token_level")


def _self_teacher_dump(ctx: typer.Context, draft: str, target: str, chosen, out: Path, texts: list[Path],
                       given: dict) -> dict:
    """``dump --self-teacher``: the library call (:func:`specdraft.training.self_teacher.run_self_teacher`) with the dump flags
    that apply; a flag typed that does not apply is one error line, and --top-logprobs / --generate left untyped take
    the self-teacher's defaults (1 slot: a hard label; 256 tokens)."""
    from specdraft.training.self_teacher import run_self_teacher

    # By name: typer's click (vendored or not) has its own ParameterSource enum.
    typed = {k for k in given if getattr(ctx.get_parameter_source(k), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")}
    if wrong := [NOT_SELF_TEACHER[k] for k in NOT_SELF_TEACHER if k in typed]:
        fail(f"{', '.join(wrong)} do(es) not apply with --self-teacher: the draft answers greedily, the dump stores "
             "top-k hard labels (or the draft's distribution, --token-level) on the answers")
    keep = {k: given[k] for k in ("max_length", "truncate", "batch_size", "shard_size_mb", "dtype", "token_level")}
    keep |= {k: given[k] for k in ("top_logprobs", "generate") if k in typed}
    config = SelfTeacherConfig(**keep)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("self-teacher"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tps]}"),
                  TimeElapsedColumn(), console=err_console) as pg:
        return run_self_teacher(draft, target, chosen, out, config, texts=texts,
                                progress=dump_progress(pg, pg.add_task("dump", total=None, tps="")))


def _check_self_teacher(target: str, draft: str, texts: list[Path]) -> None:
    """``dump --self-teacher``'s inputs, before the teacher starts: every --text file exists (before the models are
    looked for), and the draft is of another tokenizer than the target's, as vocab-swap requires (the self-teacher
    trains a re-indexed copy; a draft of the target's own tokenizer has none)."""
    from specdraft.models.vocab import CompatibilityError, refuse_same_tokenizer

    if missing := next((p for p in texts if not p.is_file()), None):
        fail(f"--text {missing}: no such file")
    try:
        refuse_same_tokenizer(resolve_with_progress(target, "--target"), resolve_with_progress(draft, "--self-teacher"),
                              f"dump the target's own distribution for it (drop --self-teacher), then distil {draft} "
                              "on that dump")
    except CompatibilityError as exc:
        fail(f"--self-teacher {draft}: {exc}")


#: The dump flags the target's dump for a draft as given reads (:class:`specdraft.core.config.AsGivenTeacherConfig`).
FOR_DRAFT_FLAGS = ("top_logprobs", "generate", "max_length", "batch_size", "shard_size_mb", "dtype", "answers", "carry",
                   "unaligned")


def _for_draft_dump(ctx: typer.Context, draft: str, target: str, chosen, out: Path, given: dict) -> dict:
    """``dump --for-draft``: :func:`specdraft.training.as_given_teacher.run_as_given_teacher` with the flags that apply; a
    typed flag that does not apply is one error line, --top-logprobs / --generate / --dtype left untyped take its
    defaults (20 slots, 192 tokens, bfloat16)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specdraft.models.vocab import CompatibilityError, refuse_same_tokenizer
    from specdraft.training.as_given_teacher import run_as_given_teacher

    typed = {k for k in given if getattr(ctx.get_parameter_source(k), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")}
    if wrong := [NOT_SELF_TEACHER[k] for k in NOT_SELF_TEACHER if k in typed]:
        fail(f"{', '.join(wrong)} do(es) not apply with --for-draft: the answers are greedy and the dump stores the "
             "target's top-k carried onto the draft's ids")
    try:
        refuse_same_tokenizer(resolve_with_progress(target, "--target"), resolve_with_progress(draft, "--for-draft"),
                              f"dump the target's own distribution for it (drop --for-draft), then distil {draft}")
    except CompatibilityError as exc:
        fail(f"--for-draft {draft}: {exc}")
    keep = {k: given[k] for k in ("max_length", "batch_size", "shard_size_mb", "answers", "carry", "unaligned")}
    keep |= {k: given[k] for k in ("top_logprobs", "generate", "dtype") if k in typed}
    config = AsGivenTeacherConfig(**keep)
    with Progress(TextColumn("dump for the draft as given"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[tps]}"), TimeElapsedColumn(), console=err_console) as pg:
        return run_as_given_teacher(target, draft, chosen, out, config,
                                    progress=dump_progress(pg, pg.add_task("dump", total=None, tps="")))


def _target_dump(target: str, chosen, out: Path, config: DumpConfig) -> dict:
    """The plain dump: :func:`specdraft.training.dump.run_dump` of the target over the prompts ``chosen`` under a progress
    bar."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from specdraft.training.dump import run_dump

    with Progress(TextColumn("dump"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tps]}"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err_console) as pg:
        return run_dump(target, chosen, out, config, progress=dump_progress(pg, pg.add_task("dump", total=None,
                                                                                                   tps="")))


def dump(
    ctx: typer.Context,
    out: Path = out_option(..., "dump"),
    target: str = target_option(),
    prompts: str = prompts_option("conversations", "Sequences to dump", TRAINING_NOTE + " A dump takes no "
                                  "stride.", strides=False),
    teacher_format: DumpFormat = config_option(DumpConfig, "teacher_format"),
    retired_format: str | None = retired_option("dump", "--format", "--teacher-format"),
    top_logprobs: int = config_option(DumpConfig, "top_logprobs", min=1),
    hidden_dtype: HiddenDtype = config_option(DumpConfig, "hidden_dtype"),
    max_length: int = config_option(DumpConfig, "max_length", command="dump"),
    truncate: bool = config_option(DumpConfig, "truncate", "--truncate/--refuse-long"),
    answer_only: bool = config_option(DumpConfig, "answer_only"),
    generate: int | None = config_option(DumpConfig, "generate", command="dump"),
    temperature: float = config_option(DumpConfig, "temperature"),
    seed: int = seed_option(DumpConfig, "dump"),
    batch_size: int = config_option(DumpConfig, "batch_size", command="dump"),
    shard_size_mb: float = config_option(DumpConfig, "shard_size_mb"),
    dtype: ModelDtype = dtype_option(DumpConfig, "dump"),
    self_teacher: Annotated[str | None, typer.Option(
        "--self-teacher", metavar="DRAFT",
        help="The teacher is this draft as given, not the target: it answers the prompts greedily in its own "
             "tokenizer (--generate N tokens, default 256) and the dump holds its answers re-encoded in --target's "
             "tokenizer, hard labels (--top-logprobs slots, default 1), to distil its re-indexed copy on "
             "(specdraft vocab-swap). --target then gives the tokenizer and chat template only: no target weights "
             "load.")] = None,
    token_level: bool = config_option(SelfTeacherConfig, "token_level"),
    text: Annotated[list[Path] | None, typer.Option(
        "--text", metavar="FILE", help="With --self-teacher: a plain text file (Python sources, say) cut into --max-length "
                       "sequences, every position a hard label (repeatable).")] = None,
    for_draft: Annotated[str | None, typer.Option(
        "--for-draft", metavar="DRAFT",
        help="Dump the target's signal for this draft as given (another tokenizer, trained in its own vocabulary): "
             "answers written by --answers, scored by the target, its top-k (--top-logprobs, default 20) carried onto "
             "the draft's tokens where both tokenizations meet (--carry); distil the draft as given on it with "
             "`specdraft distill --draft DRAFT --dump OUT`.")] = None,
    answers: Literal["draft", "target"] = config_option(AsGivenTeacherConfig, "answers"),
    carry: Literal["twins", "first_piece", "none"] = config_option(AsGivenTeacherConfig, "carry"),
    unaligned: Literal["skip", "hard"] = config_option(AsGivenTeacherConfig, "unaligned"),
) -> None:
    """Store the target's distribution over a dataset (teacher dump).

    Runs the target once over every sequence and stores its distribution in shards plus a manifest in --out (new,
    empty, or an unfinished or finished dump of the same plan: resumed / verified); a killed run resumes where it
    stopped. Runs data-parallel under accelerate launch / torchrun. With --self-teacher DRAFT the draft as given is
    the teacher of its re-indexed copy (specdraft.training.self_teacher); with --for-draft DRAFT the target teaches the draft
    as given in its own tokens (specdraft.training.as_given_teacher)."""
    import time

    refuse_retired("dump", "--format", "--teacher-format", retired_format, "export's")
    config = DumpConfig(teacher_format=teacher_format, top_logprobs=top_logprobs, hidden_dtype=hidden_dtype, max_length=max_length,
                        truncate=truncate, answer_only=answer_only, generate=generate, temperature=temperature,
                        seed=seed, batch_size=batch_size, shard_size_mb=shard_size_mb, dtype=dtype)
    quiet_transformers()
    t0 = time.time()
    check_out(out, overwrite=None)  # resumable: an unfinished or finished dump of the same plan is continued
    # The prompts every teacher dumps, read as `run --train-prompts` reads them (a teacher that answers greedily drops
    # a repeated prompt): every line checked, and what will run said, before any model loads.
    teacher = (AsGivenTeacherConfig if for_draft is not None else SelfTeacherConfig if self_teacher is not None
               else config)
    chosen = read_prompts(prompts, strides=False, unique=teacher.distinct_prompts)
    resolve_with_progress(target, "--target")
    if for_draft is not None:
        if self_teacher is not None or token_level or text:
            fail("--for-draft and --self-teacher/--token-level/--text are two different teachers: give one")
        given = {k: v for k, v in locals().items() if k in (*FOR_DRAFT_FLAGS, *NOT_SELF_TEACHER)}
        print_dump(_for_draft_dump(ctx, for_draft, target, chosen, out, given), out, time.time() - t0)
        return
    if self_teacher is not None or token_level or text:
        if self_teacher is None:
            fail("--token-level and --text need --self-teacher DRAFT (the draft as given is their teacher)")
        _check_self_teacher(target, self_teacher, text or [])
        given = {k: v for k, v in locals().items() if k in SELF_TEACHER_FLAGS}
        print_dump(_self_teacher_dump(ctx, self_teacher, target, chosen, out, text or [], given), out, time.time() - t0)
        return
    print_dump(_target_dump(target, chosen, out, config), out, time.time() - t0)


#: The serving filter: not decoding's --temperature / --top-k / --top-p (DistillConfig says why).
SERVING_TEMPERATURE, SERVING_TOP_K, SERVING_TOP_P = (
    config_option(SamplingConfig, name, f"--serving-{name.replace('_', '-')}", help=SERVING_HELP[name],
                  default=getattr(DistillConfig().serving, name)) for name in SERVING_HELP)


def distill(
    target: str = target_option(),
    draft: str = draft_option(),
    dump: Annotated[Path, typer.Option(help="Teacher dump directory written by `specdraft dump`.")] = Path("runs/dump"),
    out: Path = out_option(Path("runs/distill"), "distill"),
    loss: LossName = config_option(DistillConfig, "loss"),
    temperature: float = SERVING_TEMPERATURE,
    top_k: int = SERVING_TOP_K,
    top_p: float = SERVING_TOP_P,
    lr: float = config_option(DistillConfig, "lr"),
    row_lr: float | None = config_option(DistillConfig, "row_lr"),
    untie_head: bool = config_option(DistillConfig, "untie_head"),
    prompt_positions: bool = config_option(DistillConfig, "prompt_positions"),
    head_support: int | None = config_option(DistillConfig, "head_support"),
    max_steps: int = config_option(DistillConfig, "max_steps"),
    batch_size: int = config_option(DistillConfig, "batch_size", command="distill"),
    gradient_accumulation_steps: int = config_option(DistillConfig, "gradient_accumulation_steps"),
    warmup_ratio: float = config_option(DistillConfig, "warmup_ratio"),
    scheduler: Scheduler = config_option(DistillConfig, "scheduler"),
    seed: int = seed_option(DistillConfig, "distill"),
    dtype: Literal["float32", "bfloat16"] = dtype_option(DistillConfig, "distill"),
    precision: Precision = config_option(DistillConfig, "precision"),
    train: TrainWhat = config_option(DistillConfig, "train"),
    train_last_layers: int = config_option(DistillConfig, "train_last_layers"),
    held_out_fraction: float = config_option(DistillConfig, "held_out_fraction"),
    eval_steps: int = config_option(DistillConfig, "eval_steps"),
    save_steps: int = config_option(DistillConfig, "save_steps"),
    on_policy_fraction: float = config_option(DistillConfig, "on_policy_fraction"),
    on_policy_every: int = config_option(DistillConfig, "on_policy_every"),
    on_policy_max_new_tokens: int | None = config_option(DistillConfig, "on_policy_max_new_tokens"),
    gamma: SpeculatorGammaOpt = None,
    no_resume: Annotated[bool, typer.Option("--no-resume", help="Start over instead of resuming.")] = False,
    keep_checkpoints: KeepCheckpointsOpt = False,
) -> None:
    """Distil the draft against a teacher dump.

    Trains the draft against the target's stored distribution and exports it as an independent speculator; --out
    gets checkpoints/ (an interrupted run's rerun resumes from them; removed once training has finished unless
    --keep-checkpoints), speculator/ and training.json."""
    from specdraft.training.distill import run_distill

    cfg = DistillConfig(
        loss=loss, serving=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p), lr=lr, row_lr=row_lr,
        untie_head=untie_head, prompt_positions=prompt_positions, head_support=head_support, max_steps=max_steps,
        batch_size=batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps, warmup_ratio=warmup_ratio,
        scheduler=scheduler, seed=seed, dtype=dtype, precision=precision, train=train,
        train_last_layers=train_last_layers,
        held_out_fraction=held_out_fraction, eval_steps=eval_steps, save_steps=save_steps,
        on_policy_fraction=on_policy_fraction, on_policy_every=on_policy_every,
        on_policy_max_new_tokens=on_policy_max_new_tokens)
    check_out(out, overwrite=None)  # resumable: its checkpoints are continued unless --no-resume
    _check_dump_fits(dump, draft)
    res = run_distill(target, draft, dump, out, cfg, resume=not no_resume,
                      num_speculative_tokens=speculative_tokens(gamma), keep_checkpoints=keep_checkpoints)
    print_distill(res)


def _check_dump_fits(dump: Path, draft: str) -> None:
    """``--dump`` holds a finished dump and ``--draft`` speaks the tokenizer it was made with, each refused with the
    command that fixes it, before the draft loads (the library's refusal of the second names a Python argument)."""
    from specdraft.models.dump_reader import DumpError, load_manifest
    from specdraft.models.loading import load_tokenizer
    from specdraft.models.tokenizer_view import tokenizer_fingerprint

    if not dump.is_dir():
        fail(f"--dump {dump}: no such folder; write a teacher dump there first (specdraft dump --out {dump}), or "
             "pass --dump DIR of one")
    try:
        manifest = load_manifest(dump)
    except DumpError as exc:
        fail(f"--dump {exc}")  # its message starts with the folder
    made_with = manifest["target"]["ref"]
    if tokenizer_fingerprint(load_tokenizer(resolve_with_progress(draft, "--draft"))) != manifest["tokenizer_fingerprint"]:
        fail(f"--draft {draft}: its tokenizer is not the one the dump in {dump} was made with (target {made_with}'s); "
             f"re-index the draft into it first: specdraft vocab-swap --draft {draft} --target {made_with} --out DIR, "
             f"then specdraft distill --draft DIR --dump {dump}")


def vocab_swap(
    draft: str = draft_option(...),
    out: Path = out_option(..., "vocab-swap"),
    target: str = target_option(),
    dtype: ModelDtype = dtype_option(EvalConfig, "vocab-swap", default="float32"),
    overwrite: bool = overwrite_option("vocab-swap"),
    prompts: list[str] | None = prompts_option(None, "Conversations whose replies (in the target's tokenizer) are "
                                               "teacher-forced through the swapped draft for the swap diagnostic",
                                               " (default: none; specdraft headroom on the swapped draft runs it "
                                               "too)."),
) -> None:
    """Re-index a draft of another tokenizer into the target's.

    The draft, of another tokenizer than the target's, is written into --out (atomically): its embedding and output rows
    are copied to the target ids of their string-identical twins; a target token it lacks starts from the mean of the
    rows of the draft tokens its text encodes to (the mean of all rows for control tokens). The result is a plain HF
    checkpoint with the target's tokenizer, and as many vocabulary rows as the target (a 49k-row draft grows to 152k
    rows for Qwen); export it next (specdraft export --draft OUT --target T --out SPECULATOR) or distil it
    (specdraft run --target T --draft OUT). With --prompts, the swap diagnostic: the share of reply
    tokens without a draft twin and the swapped draft's argmax disagreements by kind (specdraft.models.segmentation)."""
    import warnings

    from specdraft.models.vocab import save_vocab_swap

    check_out(out, overwrite=overwrite)
    examples = read_prompts(prompts).examples if prompts else None
    tpath, dpath = resolve_with_progress(target, "--target"), resolve_with_progress(draft, "--draft")
    with console.status("re-indexing the draft's rows…"), warnings.catch_warnings():
        # The report below says each dropped token id once, in its own words; Python's warning would say it twice.
        warnings.filterwarnings("ignore", message="vocabulary swap:")
        report = save_vocab_swap(dpath, tpath, out, dtype=dtype, overwrite=overwrite, examples=examples)
    print_vocab_swap(report, draft, target, out)
