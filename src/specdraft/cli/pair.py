"""The pair's commands: ``check`` (can they work together?), ``eval`` (how much faster?), ``generate`` (one
answer), ``rank`` (which draft?). Each parses its flags, calls the library and renders."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from specdraft.cli.errors import check_out, fail, refuse_retired
from specdraft.cli.options import (
    HELD_OUT_NOTE,
    GammaOpt,
    MapVocabOpt,
    config_option,
    draft_option,
    dtype_option,
    out_option,
    overwrite_option,
    prompts_option,
    read_prompts,
    retired_option,
    sampling_options,
    seed_option,
    target_option,
)
from specdraft.cli.render import (
    TextStream,
    console,
    decode_progress,
    print_check,
    print_configuration,
    print_confirmation,
    print_eval,
    print_generation_end,
    print_llama_cpp_ranking,
    print_notes,
    print_ranking,
    resolve_with_progress,
    status_line,
    status_lines,
)
from specdraft.core.config import (
    DraftQuantization,
    EvalConfig,
    GammaPolicy,
    HeadroomConfig,
    ModelDtype,
    ProposalMode,
    RankEngine,
    SamplingConfig,
)
from specdraft.core.embedded import DEFAULT_DRAFT, DEFAULT_TARGET

TEMPERATURE, TOP_K, TOP_P = sampling_options(SamplingConfig)


def pair_line(command: str, target: str, draft: str) -> str:
    """A pair command's first line: which pair it runs, and where that is the embedded pair while ``run``'s default
    preset uses another draft, that it is not run's pair."""
    line = f"specdraft {command}: target {target} ← draft {draft}"
    if (target, draft) == (DEFAULT_TARGET, DEFAULT_DRAFT):
        from specdraft.run.pipeline import preset_fields

        run_draft = preset_fields("default").get("draft", DEFAULT_DRAFT)
        line += " (the embedded pair" + (f"; `run`'s default preset uses {run_draft})" if run_draft != draft else ")")
    return line


def _load_pair(target: str, draft: str, dtype: str, map_vocab: bool | None, mapped_proposals, sampling,
               named: bool = False):
    """:func:`specdraft.measuring.pair.load_pair` with an embedded model's cache built under a progress bar, a spinner while
    the models load, and the pair's notes printed (and the pair named, unless the command's first line did)."""
    from specdraft.measuring.pair import load_pair

    resolve_with_progress(target, "--target"), resolve_with_progress(draft, "--draft")
    with console.status("loading models…"):
        pair = load_pair(target, draft, dtype, map_vocab, mapped_proposals, sampling)
    # eval and generate default to the embedded same-family pair, run to the preset's: each names what it runs.
    if not named:
        console.print(f"pair: target {escape(target)} ← draft {escape(draft)}", highlight=False, soft_wrap=True)
    print_notes(pair.notes)
    return pair


# Positional models: a hint, not click's bare refusal.
def check(
    ctx: typer.Context,
    target: str = target_option(),
    draft: str = draft_option(),
    prompt: Annotated[str, typer.Option(help="Prompt for the greedy continuation of each model.")] =
        "Write a Python function that returns the n-th Fibonacci number.",
    max_new_tokens: int = config_option(EvalConfig, "max_new_tokens", default=16, min=1, command="check"),
    out: Path | None = out_option(None, "check"),
    retired_json: str | None = retired_option("check", "--json", "--out"),
    dtype: ModelDtype = dtype_option(HeadroomConfig, "check"),
    overwrite: bool = overwrite_option("check"),
) -> None:
    """Check that a target and a draft can work together.

    Compares their tokenizers over the whole vocabulary. When they agree, loads both models and prints their facts
    and a short greedy continuation from each. On a tokenizer mismatch it stops after the comparison (no model
    loads, no continuation) with what a vocabulary mapping would cover and exit 1."""
    from specdraft.models.check import run_check

    if refs := ctx.args:  # `specdraft check T D`: the models are flags here, as in every other command
        flags = f"--target {refs[0]} --draft {refs[1]}" if len(refs) == 2 else "--target T --draft D"
        fail(f"check takes the models as options, not arguments ({' '.join(refs)}): pass them as {flags}")
    refuse_retired("check", "--json", "--out", retired_json, "models' switch")
    check_out(out, "--out", file=True, overwrite=overwrite)
    tpath = resolve_with_progress(target, "--target")
    dpath = resolve_with_progress(draft, "--draft")
    # Named once both references resolve: a bad one is the command's only line, its error.
    console.print(pair_line("check", target, draft), highlight=False, markup=False, soft_wrap=True)
    with console.status("comparing tokenizers, then loading both models…"):
        report = run_check(tpath, dpath, prompt=prompt, max_new_tokens=max_new_tokens, dtype=dtype,
                           target_name=target, draft_name=draft)
    print_check(report, max_new_tokens)
    if out:
        from specdraft.core.io import atomic_write_text

        atomic_write_text(out, json.dumps(report.to_dict(), indent=2, default=str))
        console.print(f"report written to {out}")
    names = f"--target {target} --draft {draft}"
    compat = report.compat
    if compat.verdict != "mismatch":
        console.print(f"[bold green]compatible[/] ({compat.verdict}): the draft speaks the target's tokenizer, "
                      "so it can draft for it as it is")
        console.print(f"next: specdraft eval {names}  (acceptance, speed-up and the best γ)", soft_wrap=True)
        return
    if (compat.mapping or {}).get("usable"):
        console.print(f"next: specdraft eval {names} --map-vocab  (the draft as given, through a mapping: "
                      "minutes)", soft_wrap=True)
        console.print(f"      specdraft export {names} --out DIR  (the draft as given, for vLLM's text proposer: "
                      "seconds)", soft_wrap=True)
        console.print(f"      specdraft run {names}  (the whole road for a draft of another tokenizer)", soft_wrap=True)
    raise typer.Exit(1)


def eval_cmd(
    target: str = target_option(),
    draft: str = draft_option(),
    prompts: str = prompts_option("humaneval:100:8", "Prompts to decode", HELD_OUT_NOTE),
    max_new_tokens: int = config_option(EvalConfig, "max_new_tokens", min=1, command="eval"),
    gamma: GammaOpt = None,
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    seed: int = seed_option(EvalConfig, "eval"),
    compare_hf: bool = config_option(EvalConfig, "compare_hf"),
    draft_confidence_threshold: float | None = config_option(EvalConfig, "draft_confidence_threshold", min=0.0, max=1.0),
    map_vocab: MapVocabOpt = None,
    mapped_proposals: ProposalMode | None = config_option(EvalConfig, "mapped_proposals"),
    dtype: ModelDtype = dtype_option(EvalConfig, "eval"),
    draft_quantization: DraftQuantization | None = config_option(EvalConfig, "draft_quantization"),
    draft_head_tokens: int | None = config_option(EvalConfig, "draft_head_tokens", min=0, show_default=False),
    gamma_policy: GammaPolicy = config_option(EvalConfig, "gamma_policy"),
    certify: int = config_option(EvalConfig, "certify", min=0),
    out: Path = out_option(Path("runs/eval"), "eval"),
    overwrite: bool = overwrite_option("eval"),
) -> None:
    """Measure speculative decoding against the target alone.

    Decodes prompts with the target alone and with speculative decoding (and optionally transformers' assisted
    generation); reports acceptance, tokens/s, speed-up, the analytic bound and the best γ; writes report.json and
    plots into --out."""
    from specdraft.measuring.eval_report import write_eval_report
    from specdraft.measuring.evaluate import run_eval
    from specdraft.measuring.pair import encode

    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    config = EvalConfig(num_speculative_tokens=gamma, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                        compare_hf=compare_hf, draft_confidence_threshold=draft_confidence_threshold,
                        mapped_proposals=mapped_proposals, dtype=dtype, draft_quantization=draft_quantization,
                        draft_head_tokens=draft_head_tokens, gamma_policy=gamma_policy, certify=certify)
    check_out(out, overwrite=overwrite)
    said: list[str] = []
    chosen = read_prompts(prompts, held_out=True, say=said.append)  # what will run, said before any model loads
    source, examples = chosen.sources[0], chosen.examples
    resolve_with_progress(target, "--target"), resolve_with_progress(draft, "--draft")
    # Named once the prompts are read and both references resolve: a bad input is the command's only line.
    console.print(pair_line("eval", target, draft), highlight=False, markup=False, soft_wrap=True)
    for line in said:
        typer.echo(line)
    pair = _load_pair(target, draft, dtype, map_vocab, mapped_proposals, sampling, named=True)
    ids = encode(pair, examples)
    with decode_progress(len(ids)) as shown:
        res = run_eval(pair.target, pair.draft, pair.tokenizer, ids, [e.id for e in examples], config,
                       vocab_mapping=pair.mapping, progress=shown.step, status=shown.say,
                       record={"target": target, "draft": draft, "prompts": source.name,
                               "prompt_offset": source.offset, "command": " ".join(sys.argv)})
    print_eval(res, write_eval_report(res, out), config)
    if not res.summary()["lossless"] or (res.certificate is not None and not res.certificate["passed"]):
        raise typer.Exit(2)


def generate(
    prompt: Annotated[str, typer.Argument(help="The user message (the chat template is applied).")],
    target: str = target_option(),
    draft: str = draft_option(),
    max_new_tokens: int = config_option(EvalConfig, "max_new_tokens", default=512, min=1, command="generate"),
    gamma: GammaOpt = None,
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    seed: int = seed_option(EvalConfig, "generate"),
    dtype: ModelDtype = dtype_option(EvalConfig, "generate"),
    draft_confidence_threshold: float | None = config_option(EvalConfig, "draft_confidence_threshold", min=0.0, max=1.0),
    map_vocab: MapVocabOpt = None,
    mapped_proposals: ProposalMode | None = config_option(EvalConfig, "mapped_proposals"),
    draft_quantization: DraftQuantization | None = config_option(EvalConfig, "draft_quantization"),
    draft_head_tokens: int | None = config_option(EvalConfig, "draft_head_tokens", min=0, show_default=False),
    gamma_policy: GammaPolicy = config_option(EvalConfig, "gamma_policy"),
) -> None:
    """Stream one speculative answer and print its acceptance counts."""
    from specdraft.measuring.pair import prepare_generation

    if not prompt.strip():
        fail('PROMPT is empty: give the user message to answer, e.g. specdraft generate "Reverse a string in Python."')
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    config = EvalConfig(num_speculative_tokens=gamma, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                        draft_confidence_threshold=draft_confidence_threshold, mapped_proposals=mapped_proposals,
                        dtype=dtype, draft_quantization=draft_quantization, draft_head_tokens=draft_head_tokens,
                        gamma_policy=gamma_policy)
    pair = _load_pair(target, draft, dtype, map_vocab, mapped_proposals, sampling)
    status_line("preparing the draft")  # lines, not a spinner: a calibration's lines follow it
    gen = prepare_generation(pair, prompt, config, status=status_line)
    print_configuration(gen.configuration)
    stream = TextStream(pair.tokenizer)
    counts = gen.run(stream)
    stream.flush()
    print_generation_end(gen, counts)


def rank(
    drafts: Annotated[list[str], typer.Argument(help="Candidate drafts: embedded names, local HF directories or cached "
                                                "hub ids (same tokenizer as the target, or another: then decoded "
                                                "through a vocabulary mapping).")],
    target: str = target_option(),
    prompts: str = prompts_option("humaneval:100:2", "Calibration prompts, per draft", HELD_OUT_NOTE),
    max_new_tokens: int = config_option(EvalConfig, "max_new_tokens", default=48, min=1, command="rank"),
    gamma: GammaOpt = None,
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    dtype: ModelDtype = dtype_option(EvalConfig, "rank"),
    draft_quantization: DraftQuantization | None = config_option(EvalConfig, "draft_quantization"),
    draft_head_tokens: int | None = config_option(EvalConfig, "draft_head_tokens", min=0, show_default=False),
    confirm: Annotated[bool | None, typer.Option(
        help="Then measure the top draft against the target alone (specdraft eval on the same prompts, at its "
        "recommended γ). Default: on for --engine specdraft; --engine llama.cpp cannot confirm (run the printed "
        "command).", show_default=False)] = None,
    out: Path = out_option(Path("runs/rank"), "rank"),
    overwrite: bool = overwrite_option("rank"),
    engine: Annotated[RankEngine, typer.Option(
        help="Whose decoding the ranking predicts: specdraft's (its speed model, measured here), or llama.cpp's "
        "(each GGUF's llama-bench timings and the α measured here; picks --spec-draft-n-max and prints the "
        "llama-server command of the best draft).")] = "specdraft",
    target_gguf: Annotated[Path | None, typer.Option(
        help="--engine llama.cpp: the target's GGUF. Default: an embedded target's packaged GGUF.")] = None,
    draft_gguf: Annotated[list[str] | None, typer.Option(
        metavar="NAME=PATH", help="--engine llama.cpp: a draft's GGUF, NAME as given in DRAFTS (repeat per draft). "
        "Default: an embedded draft's packaged GGUF; write one with specdraft export --format gguf.")] = None,
    target_bench: Annotated[Path | None, typer.Option(
        metavar="FILE", help="--engine llama.cpp: the target's saved llama-bench -o json output (tg and pp 2..9). "
        "Default: llama-bench is run on the GGUF.")] = None,
    draft_bench: Annotated[list[str] | None, typer.Option(
        metavar="NAME=FILE", help="--engine llama.cpp: a draft's saved llama-bench -o json output (repeat per "
        "draft). Default: llama-bench is run on the GGUF.")] = None,
    llama_cpp_bin: Annotated[Path | None, typer.Option(
        metavar="DIR", help="--engine llama.cpp: llama.cpp's build/bin holding llama-bench. Default "
        "$SPECDRAFT_LLAMA_CPP_BIN, else specdraft's build (python -m specdraft.serving.llama_cpp), else PATH.")] = None,
    threads: Annotated[int, typer.Option(
        min=1, help="--engine llama.cpp: llama.cpp threads, of llama-bench and of the printed command.")] = 2,
    llama_cpp_calibration: Annotated[Path | None, typer.Option(
        metavar="FILE", help="--engine llama.cpp: a calibration of your own (the JSON bench/llamacpp_check.py "
        "--embedded or --refit writes, or its 'calibration'), for timings the packaged one was not fitted to "
        "(another machine, thread count, backend or target). Default: the packaged calibration, where it "
        "applies.")] = None,
) -> None:
    """Rank candidate drafts by predicted speed-up, best first.

    Which draft should I use? Measures each candidate's acceptance and step cost on a short calibration set, prints
    the predicted speed-up of each (the measured speed model), best first, then confirms the top one by measurement.
    --engine llama.cpp: predicts llama.cpp's speed-up instead, from llama-bench timings of each GGUF and the α
    measured here, with the best --spec-draft-n-max of each; prints the llama.cpp command of the best. Writes
    rank.json (and the confirmation's report) into --out.

    Example: specdraft rank qwen2.5-coder-0.5b-instruct smollm2-135m-instruct --draft-quantization int4"""
    from specdraft.measuring.rank import (
        LLAMA_CPP_FLAGS,
        check_engine,
        confirm_top,
        named_paths,
        rank_candidates,
        write_rank,
    )

    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    config = EvalConfig(num_speculative_tokens=gamma, max_new_tokens=max_new_tokens, sampling=sampling, dtype=dtype,
                        draft_quantization=draft_quantization, draft_head_tokens=draft_head_tokens)
    confirm = check_engine(engine, confirm, dict(zip(LLAMA_CPP_FLAGS, (target_gguf, draft_gguf, target_bench,
                                                                       draft_bench, llama_cpp_bin,
                                                                       llama_cpp_calibration))))
    llama = {"target_gguf": target_gguf, "draft_ggufs": named_paths(draft_gguf, "--draft-gguf"),
             "target_bench": target_bench, "draft_benches": named_paths(draft_bench, "--draft-bench"),
             "llama_cpp_bin": llama_cpp_bin, "calibration": llama_cpp_calibration}
    check_out(out, overwrite=overwrite)
    chosen = read_prompts(prompts, held_out=True)  # what will run, said before any model loads
    source, examples = chosen.sources[0], chosen.examples
    resolve_with_progress(target, "--target")
    for ref in drafts:
        resolve_with_progress(ref, "candidate draft")
    with console.status("calibrating…") as status:
        ranking = rank_candidates(target, drafts, examples, config, prompts=source.name, engine=engine, llama=llama,
                                  threads=threads, progress=status_lines(status))
    if ranking.llama is not None:
        print_llama_cpp_ranking(ranking.llama, ranking.rows, target, out)
        return
    print_ranking(ranking, max_new_tokens)
    if confirm and ranking.rows:
        with console.status("confirming…") as status:
            confirmation = confirm_top(ranking, out, progress=status_lines(status))
        print_confirmation(confirmation, sampling.greedy)
    console.print(f"report: {write_rank(ranking, out, ' '.join(sys.argv))}")
