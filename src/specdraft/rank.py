"""Which draft should I use? ``specdraft rank``'s road: calibrate each candidate, rank them by predicted speed-up,
confirm the top one by measurement, write ``rank.json``.

:func:`rank_candidates` measures (the target's t(k) once, each draft's step d and its α,
:func:`specdraft.evaluate.rank_drafts`); :func:`confirm_top` decodes the best against the target alone at the γ
the speed model recommends (:func:`specdraft.evaluate.run_eval`); :func:`write_rank` writes the report. With
``engine="llama.cpp"`` the ranking predicts llama.cpp's speed-up instead, from llama-bench timings of each GGUF and
the α measured here (:func:`write_llama_cpp_ranking`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.config import EvalConfig, RankEngine


class RankError(ValueError):
    """Flags of ``rank`` that do not go together (an engine's flag given to the other engine, a bad NAME=PATH)."""


#: The flags only ``--engine llama.cpp`` reads (their names as the user types them).
LLAMA_CPP_FLAGS = ("--target-gguf", "--draft-gguf", "--target-bench", "--draft-bench", "--llama-cpp-bin")


def check_engine(engine: RankEngine, confirm: bool | None, llama_flags: Mapping[str, Any]) -> bool:
    """Whether to confirm the top draft (default: yes for ``engine="specdraft"``, which alone can).

    Raises:
        RankError: a llama.cpp flag (``llama_flags``: flag → value) under ``engine="specdraft"``, or ``confirm``
            under ``engine="llama.cpp"``.
    """
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
    """``NAME=PATH`` values of a repeated option → ``{NAME: PATH}`` (the last ``=`` splits: a name may hold one).

    Raises:
        RankError: a value without ``=``, a name or a path.
    """
    out = {}
    for v in values or ():
        name, sep, path = v.rpartition("=")
        if not sep or not name or not path:
            raise RankError(f"{flag} {v}: give NAME=PATH (NAME: the draft as given in DRAFTS)")
        out[name] = path
    return out


@dataclass
class Ranking:
    """The calibration of every candidate: ``rows`` best first (one dict per draft: ``draft``, ``alpha``,
    ``acceptance_rate``, ``draft_step_ms``, ``cost_ratio_c``, ``best_gamma``, ``predicted_speedup``,
    ``predicted_speedup_at_gamma``, ``mapped``; :func:`specdraft.evaluate.rank_drafts`), with what measured them:
    the loaded target and tokenizer, the prompts (``examples``, token ``ids``), a loader per draft, and the
    llama.cpp inputs under ``engine="llama.cpp"`` (``llama``, else ``None``). ``confirmation`` is filled by
    :func:`confirm_top`."""

    target: str
    prompts: str
    config: EvalConfig
    rows: list[dict[str, Any]]
    examples: list = field(repr=False, default_factory=list)
    ids: list[list[int]] = field(repr=False, default_factory=list)
    target_model: Any = field(repr=False, default=None)
    tokenizer: Any = field(repr=False, default=None)
    loaders: dict[str, Callable[[], tuple[Any, Any]]] = field(repr=False, default_factory=dict)
    llama: Any = None
    confirmation: dict[str, Any] | None = None

    def to_dict(self, command: str = "") -> dict[str, Any]:
        """What ``rank.json`` holds for specdraft's engine."""
        report = {"target": self.target, "prompts": self.prompts, "config": self.config.model_dump(),
                  "ranking": self.rows, "command": command}
        if self.confirmation is not None:
            report["confirmation"] = self.confirmation
        return report


def rank_candidates(target: str, drafts: Sequence[str], examples: Sequence, config: EvalConfig, *, prompts: str = "",
                    engine: RankEngine = "specdraft", llama: Mapping[str, Any] | None = None, threads: int = 2,
                    progress: Callable[[str], None] | None = None) -> Ranking:
    """Calibrate each of ``drafts`` for ``target`` on ``examples`` (the prompts of the source named ``prompts``,
    :func:`specdraft.prompts.load_prompts`) and rank them by predicted speed-up, best first.

    A draft of another tokenizer is calibrated through a vocabulary mapping. Under ``engine="llama.cpp"`` the GGUFs
    and llama-bench timings are found first (``llama``: :func:`specdraft.llama_cpp.rank_inputs`), before any model
    loads. ``progress(step)`` names each step.

    Raises:
        ModelResolutionError: a reference that names no model.
    """
    from specdraft.check import check_compatible
    from specdraft.data import encode_prompts
    from specdraft.evaluate import rank_drafts
    from specdraft.models import load_model, resolve
    from specdraft.vocab import build_vocab_mapping

    say = progress or (lambda _step: None)
    tpath = resolve(target)
    paths = {d: resolve(d) for d in drafts}
    inputs = None
    if engine == "llama.cpp":
        from specdraft.llama_cpp import rank_inputs

        llama = dict(llama or {})
        inputs = rank_inputs(target, drafts, llama.get("target_gguf"), llama.get("draft_ggufs"),
                             llama.get("target_bench"), llama.get("draft_benches"), llama.get("llama_cpp_bin"),
                             threads, progress=say)
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
    """Decode the top draft against the target alone on the calibration prompts, at the γ its speed model
    recommends (at least 1), write that evaluation's report under ``out/confirm``, and return the confirmation:
    ``draft``, ``gamma``, ``measured_speedup`` and ``predicted_speedup`` (× the target alone), ``lossless`` (greedy
    outputs equal to the target's). Also kept as ``ranking.confirmation``."""
    from specdraft.evaluate import run_eval
    from specdraft.report import write_eval_report

    top = ranking.rows[0]
    d, mapping = ranking.loaders[top["draft"]]()
    cfg = ranking.config.model_copy(update={"num_speculative_tokens": max(top["best_gamma"], 1)})
    if progress is not None:
        progress(f"confirming {top['draft']} at γ = {cfg.num_speculative_tokens}")
    res = run_eval(ranking.target_model, d, ranking.tokenizer, ranking.ids, [e.id for e in ranking.examples], cfg,
                   vocab_mapping=mapping, record={"target": ranking.target, "draft": top["draft"]})
    write_eval_report(res, Path(out) / "confirm")
    s = res.summary()
    ranking.confirmation = {"draft": top["draft"], "gamma": cfg.num_speculative_tokens,
                            "measured_speedup": s["speedup"], "predicted_speedup": top["predicted_speedup"],
                            "lossless": s["lossless"]}
    return ranking.confirmation


def _write(report: dict[str, Any], out: str | Path) -> Path:
    from specdraft.io import atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "rank.json", json.dumps(report, indent=2, default=str))
    return out / "rank.json"


def write_rank(ranking: Ranking, out: str | Path, command: str = "") -> Path:
    """Write ``out/rank.json`` (:meth:`Ranking.to_dict`, with the command line that made it); returns its path."""
    return _write(ranking.to_dict(command), out)


def write_llama_cpp_ranking(llama, rows: list[dict[str, Any]], target: str, out: str | Path,
                            command: str = "") -> tuple[list[dict[str, Any]], Path]:
    """The drafts ranked by llama.cpp's predicted speed-up at the α of ``rows`` (``llama``: the
    :class:`~specdraft.llama_cpp.LlamaCppRankInputs` of :func:`rank_candidates`), written to ``out/rank.json`` with
    the llama-server command of the best. Returns ``(ranked rows, best first; the report's path)``."""
    ranked = llama.rank({r["draft"]: r["alpha"] for r in rows})
    report = {"target": target, "engine": "llama.cpp", "target_gguf": str(llama.target_gguf),
              "target_bench": llama.target_bench_source, "ranking": ranked, "llama_cpp_command": ranked[0]["command"],
              "specdraft_calibration": rows, "command": command}
    return ranked, _write(report, out)
