"""Which draft should I use? ``specdraft rank``'s road: calibrate each candidate, rank them by predicted speed-up,
confirm the top one by measurement, write ``rank.json``.

:func:`rank_candidates` measures, :func:`confirm_top` decodes the best against the target alone, :func:`write_rank`
writes the report. ``engine="llama.cpp"`` predicts llama.cpp's speed-up instead (:func:`write_llama_cpp_ranking`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.core.acceptance import AcceptanceCounts
from specdraft.core.config import EvalConfig, RankEngine
from specdraft.core.io import atomic_write_text
from specdraft.core.sampling import check_token_ids
from specdraft.data.sources import encode_prompts, tokenizer_pad_id
from specdraft.decoding.calibration import calibrate
from specdraft.decoding.decode import speculative_generate
from specdraft.decoding.draft_model import apply_draft_options, draft_configuration
from specdraft.measuring.eval_report import write_eval_report
from specdraft.measuring.evaluate import eos_ids, run_eval
from specdraft.models.check import check_compatible
from specdraft.models.loading import load_model, resolve
from specdraft.models.tokens import left_pad
from specdraft.models.vocab import build_vocab_mapping
from specdraft.serving.llama_cpp import rank_inputs, read_llama_cpp_calibration

if TYPE_CHECKING:
    from specdraft.decoding.speed import SpeedModel
    from specdraft.serving.llama_cpp import LlamaCppCandidate, LlamaCppRankInputs


class RankError(ValueError):
    """Flags of ``rank`` that do not go together (an engine's flag given to the other engine, a bad NAME=PATH)."""


#: The flags only ``--engine llama.cpp`` reads (their names as the user types them).
LLAMA_CPP_FLAGS = ("--target-gguf", "--draft-gguf", "--target-bench", "--draft-bench", "--llama-cpp-bin",
                   "--llama-cpp-calibration")


def check_engine(engine: RankEngine, confirm: bool | None, llama_flags: Mapping[str, Any]) -> bool:
    """Whether to confirm the top draft (default: only ``engine="specdraft"`` can). Raises
    :class:`RankError` for a llama.cpp flag under specdraft, or ``confirm`` under llama.cpp."""
    if engine == "specdraft":
        given = [flag for flag, v in llama_flags.items() if v]
        if given:
            raise RankError(f"{given[0]} needs --engine llama.cpp (--engine specdraft serves no GGUF and runs no "
                            "llama-bench)")
    elif confirm:
        raise RankError("--confirm measures specdraft's decoding; --engine llama.cpp prints the llama.cpp command of "
                        "the best draft to measure instead")
    return engine == "specdraft" if confirm is None else confirm


def named_paths(values: Sequence[str] | None, flag: str) -> dict[str, str]:
    """``NAME=PATH`` values → ``{NAME: PATH}`` (the last ``=`` splits). Raises :class:`RankError` for a
    value missing ``=``, the name or the path."""
    out = {}
    for v in values or ():
        name, sep, path = v.rpartition("=")
        if not sep or not name or not path:
            raise RankError(f"{flag} {v}: give NAME=PATH (NAME: the draft as given in DRAFTS)")
        out[name] = path
    return out


@dataclass
class RankedDraft:
    """One candidate as :func:`rank_drafts` calibrated it: α (accepted / reached) and acceptance rate,
    d in ms and c = d / t(1), the recommended γ (0: drafting cannot win), predicted speed-ups (× the target alone,
    prefill included) at that γ and the config's, the draft options, and the speed model with its source."""

    draft: str
    alpha: float
    acceptance_rate: float
    draft_step_ms: float
    cost_ratio_c: float
    best_gamma: int
    predicted_speedup: float
    predicted_speedup_at_gamma: float
    mapped: bool
    draft_options: dict[str, Any]
    speed_model: SpeedModel
    speed_source: str

    def to_dict(self) -> dict[str, Any]:
        """One row of ``rank.json``'s ``ranking`` (``specdraft_calibration`` under ``engine="llama.cpp"``)."""
        return {"draft": self.draft, "alpha": self.alpha, "acceptance_rate": self.acceptance_rate,
                "draft_step_ms": self.draft_step_ms, "cost_ratio_c": self.cost_ratio_c, "best_gamma": self.best_gamma,
                "predicted_speedup": self.predicted_speedup,
                "predicted_speedup_at_gamma": self.predicted_speedup_at_gamma, "mapped": self.mapped,
                "draft_options": self.draft_options,
                "speed_model": self.speed_model.to_dict() | {"source": self.speed_source}}


@dataclass
class Ranking:
    """Every candidate's calibration, ``rows`` best first, with the target, tokenizer, prompts, draft loaders,
    the llama.cpp inputs (or None) and the ``confirmation`` of :func:`confirm_top`."""

    target: str
    prompts: str
    config: EvalConfig
    rows: list[RankedDraft]
    examples: list = field(repr=False, default_factory=list)
    ids: list[list[int]] = field(repr=False, default_factory=list)
    target_model: Any = field(repr=False, default=None)
    tokenizer: Any = field(repr=False, default=None)
    loaders: dict[str, Callable[[], tuple[Any, Any]]] = field(repr=False, default_factory=dict)
    llama: LlamaCppRankInputs | None = None
    confirmation: dict[str, Any] | None = None

    def to_dict(self, command: str = "") -> dict[str, Any]:
        """What ``rank.json`` holds for specdraft's engine."""
        report = {"target": self.target, "prompts": self.prompts, "config": self.config.model_dump(),
                  "ranking": [r.to_dict() for r in self.rows], "command": command}
        if self.confirmation is not None:
            report["confirmation"] = self.confirmation
        return report


def rank_drafts(target, tokenizer, prompt_ids: Sequence[Sequence[int]],
                drafts: Sequence[tuple[str, Callable[[], tuple[Any, Any]]]], config: EvalConfig | None = None,
                progress: Callable[[str], None] | None = None) -> list[RankedDraft]:
    """Each candidate's predicted speed-up on a short calibration set, best first.

    Per candidate (loaded, prepared, freed before the next): costs from :func:`~specdraft.decoding.calibration.calibrate`, α by
    decoding ``prompt_ids``, the speed-up at the γ the :class:`~specdraft.decoding.speed.SpeedModel` recommends. Raises
    :class:`specdraft.core.sampling.TokenWidthError` for prompt ids past a model's embedding or head.
    """
    import gc

    import torch


    config = config or EvalConfig()
    check_token_ids(prompt_ids, [("target", target)], what="the calibration prompts")
    gamma, sampling = config.num_speculative_tokens, config.sampling
    pad = tokenizer_pad_id(tokenizer)
    device = next(target.parameters()).device
    eos = eos_ids(target, tokenizer)
    rows = []
    for name, load in drafts:
        if progress:
            progress(name)
        model, mapping = load()
        if mapping is None:  # before timing it: an id past its embedding is an IndexError inside the draft
            check_token_ids(prompt_ids, [(f"draft {name}", model)], what="the calibration prompts")
        draft = apply_draft_options(model, tokenizer, config, mapping, copy_model=False)
        speed, source = calibrate(target, draft, prompt_ids, config, mapping)
        counts, tokens = AcceptanceCounts(gamma), 0
        for k, ids in enumerate(prompt_ids):
            out, c = speculative_generate(
                target, draft, *left_pad([ids], pad, device), num_speculative_tokens=gamma, sampling=sampling,
                max_new_tokens=config.max_new_tokens, real_vocab=len(tokenizer), eos_token_id=eos,
                generator=torch.Generator(device=device).manual_seed(config.seed + k), vocab_mapping=mapping,
                mapped_proposals=config.mapped_proposals)
            counts, tokens = counts.merge(c), tokens + len(out[0])
        g, _ = speed.best_gamma(counts.alpha)
        rows.append(RankedDraft(
            draft=name, alpha=counts.alpha, acceptance_rate=counts.acceptance_rate, draft_step_ms=1e3 * speed.draft_s,
            cost_ratio_c=speed.cost_ratio, best_gamma=g,
            predicted_speedup=speed.predict(counts.alpha, g, tokens, len(prompt_ids)),
            predicted_speedup_at_gamma=speed.predict(counts.alpha, gamma, tokens, len(prompt_ids)),
            mapped=mapping is not None, draft_options=draft_configuration(draft), speed_model=speed,
            speed_source=source))
        del model, draft
        gc.collect()
    return sorted(rows, key=lambda r: -r.predicted_speedup)


def rank_candidates(target: str, drafts: Sequence[str], examples: Sequence, config: EvalConfig, *, prompts: str = "",
                    engine: RankEngine = "specdraft", llama: Mapping[str, Any] | None = None, threads: int = 2,
                    progress: Callable[[str], None] | None = None) -> Ranking:
    """Calibrate ``drafts`` for ``target`` on ``examples`` and rank them, best first; a mapped draft
    goes through a vocabulary mapping, llama.cpp's inputs are found before any model loads. Raises
    :class:`ModelResolutionError`."""

    say = progress or (lambda _step: None)
    tpath = resolve(target)
    paths = {d: resolve(d) for d in drafts}
    inputs = None
    if engine == "llama.cpp":

        llama = dict(llama or {})
        own = llama.get("calibration")
        inputs = rank_inputs(target, drafts, llama.get("target_gguf"), llama.get("draft_ggufs"),
                             llama.get("target_bench"), llama.get("draft_benches"), llama.get("llama_cpp_bin"),
                             threads, progress=say, calibration=read_llama_cpp_calibration(own) if own else None)
    t, tok = load_model(tpath, dtype=config.dtype)
    ids = encode_prompts(tok, examples)

    def loader(ref: str):
        def load():
            mapping = None
            if check_compatible(tpath, paths[ref]).verdict == "mismatch":
                mapping = build_vocab_mapping(tpath, paths[ref])
            return load_model(paths[ref], dtype=config.dtype)[0], mapping
        return load

    loaders = {d: loader(d) for d in drafts}
    rows = rank_drafts(t, tok, ids, list(loaders.items()), config, progress=lambda name: say(f"calibrating {name}"))
    return Ranking(target, prompts, config, rows, list(examples), ids, t, tok, loaders, inputs)


def confirm_top(ranking: Ranking, out: str | Path, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Decode the top draft against the target alone at its recommended γ (≥ 1), write the report under
    ``out/confirm`` and return (and keep as ``ranking.confirmation``) ``draft``, ``gamma``, measured and predicted
    speed-ups and ``lossless``."""

    top = ranking.rows[0]
    d, mapping = ranking.loaders[top.draft]()
    cfg = ranking.config.model_copy(update={"num_speculative_tokens": max(top.best_gamma, 1)})
    if progress is not None:
        progress(f"confirming {top.draft} at γ = {cfg.num_speculative_tokens}")
    res = run_eval(ranking.target_model, d, ranking.tokenizer, ranking.ids, [e.id for e in ranking.examples], cfg,
                   vocab_mapping=mapping, record={"target": ranking.target, "draft": top.draft})
    write_eval_report(res, Path(out) / "confirm")
    s = res.summary()
    ranking.confirmation = {"draft": top.draft, "gamma": cfg.num_speculative_tokens,
                            "measured_speedup": s["speedup"], "predicted_speedup": top.predicted_speedup,
                            "lossless": s["lossless"]}
    return ranking.confirmation


def _write(report: dict[str, Any], out: str | Path) -> Path:

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "rank.json", json.dumps(report, indent=2, default=str))
    return out / "rank.json"


def write_rank(ranking: Ranking, out: str | Path, command: str = "") -> Path:
    """Write ``out/rank.json`` (:meth:`Ranking.to_dict` with the command line); returns its path."""
    return _write(ranking.to_dict(command), out)


def write_llama_cpp_ranking(llama: LlamaCppRankInputs, rows: list[RankedDraft], target: str, out: str | Path,
                            command: str = "") -> tuple[list[LlamaCppCandidate], Path]:
    """The drafts ranked by llama.cpp's predicted speed-up at the α of ``rows``, written to
    ``out/rank.json`` with the llama-server command of the best (the target alone unless a calibrated plan's error
    band
    lies above 1x). Returns ``(ranked drafts, report path)``."""
    ranked = llama.rank({r.draft: r.alpha for r in rows})
    serve = llama.serving_command(ranked[0])
    report = {"target": target, "engine": "llama.cpp", "target_gguf": str(llama.target_gguf),
              "target_bench": llama.target_bench_source, "ranking": [r.to_dict() for r in ranked],
              "llama_cpp_command": serve,
              "llama_cpp_calibration": llama.calibration.to_dict() if llama.calibration is not None else None,
              "specdraft_calibration": [r.to_dict() for r in rows], "command": command}
    return ranked, _write(report, out)
