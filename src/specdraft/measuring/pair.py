"""A target and a draft ready to decode together: tokenizers checked before any weights load, then both models,
then (for one answer) the draft's preparation and the speed model. :func:`load_pair` serves ``eval`` and
``generate``; :func:`prepare_generation` is ``generate``'s single answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdraft.core.config import EvalConfig, ProposalMode, SamplingConfig
from specdraft.data.sources import Example, encode_prompts, tokenizer_pad_id
from specdraft.decoding.calibration import calibrate
from specdraft.decoding.decode import DecodeError, speculative_generate
from specdraft.decoding.draft_model import apply_draft_options, draft_configuration
from specdraft.decoding.drafters import proposal_mode as mode
from specdraft.measuring.evaluate import eos_ids
from specdraft.models.check import check_compatible
from specdraft.models.loading import load_model, resolve
from specdraft.models.speculator import SpeculatorError, load_speculator_config
from specdraft.models.tokens import left_pad
from specdraft.models.vocab import build_vocab_mapping


class TokenizerMismatchError(ValueError):
    """The tokenizers differ and no mapping was allowed; ``report`` is the
    :class:`~specdraft.models.check.CompatReport` to show (the command exits 1, not 2)."""

    def __init__(self, report, message: str):
        super().__init__(message)
        self.report = report


@dataclass
class Pair:
    """Both models loaded: ``target`` (p), ``draft`` (q), the target's ``tokenizer``, the ``mapping`` of a draft of
    another tokenizer (else None), how it proposes (``proposals``) and the ``notes`` a command shows."""

    target: Any
    draft: Any
    tokenizer: Any
    mapping: Any = None
    proposals: ProposalMode = "text"
    notes: list[tuple[str, str]] = field(default_factory=list)


def proposal_mode(mapped_proposals: ProposalMode | None, sampling: SamplingConfig) -> ProposalMode:
    """:func:`specdraft.decoding.drafters.proposal_mode`, its DecodeError worded for ``--mapped-proposals``."""

    try:
        return mode(mapped_proposals, sampling)
    except DecodeError as exc:
        raise DecodeError(f"--mapped-proposals: {exc}") from exc


def drafts_through_text(path) -> bool:
    """Whether ``path`` is a speculator that drafts through text; False for a plain model or an
    unreadable config."""

    try:
        return load_speculator_config(path).drafts_through_text
    except SpeculatorError:
        return False


def load_pair(target: str, draft: str, dtype: str, map_vocab: bool | None = None,
              mapped_proposals: ProposalMode | None = None, sampling: SamplingConfig | None = None) -> Pair:
    """Resolve both references, compare the tokenizers before loading weights, load both models in ``dtype``.

    A draft of another tokenizer is mapped (lossless) with ``map_vocab`` None when the mapping is usable, True always,
    False never; a text speculator is mapped unless False. Raises :class:`TokenizerMismatchError` (before any
    weights),
    :class:`DecodeError`, :class:`CompatibilityError` and :class:`ModelResolutionError`.
    """

    mode = proposal_mode(mapped_proposals, sampling or SamplingConfig())
    tpath, dpath = resolve(target), resolve(draft)
    report = check_compatible(tpath, dpath)
    notes, mapping = [], None
    if report.verdict != "mismatch" and (map_vocab or mapped_proposals):
        notes.append(("note", (f"the tokenizers are {report.verdict}: no vocabulary mapping is needed, "
                               "--map-vocab / --mapped-proposals have no effect.")))
    if report.verdict == "mismatch":
        usable = bool(report.mapping and report.mapping["usable"])
        if map_vocab is None and drafts_through_text(dpath):
            map_vocab = True
            notes.append(("note", (f"{draft} is a speculator exported as given: it drafts through text in its own "
                                   "tokenizer, so it is decoded through a vocabulary mapping.")))
        elif map_vocab is None and usable:
            map_vocab = True
            notes.append(("note", ("the tokenizers differ: the draft is decoded as given, through a vocabulary "
                                   "mapping (--no-map-vocab refuses instead; specdraft check shows the report).")))
        if not map_vocab:
            hint = (" Drop --no-map-vocab to decode through a vocabulary mapping of string-identical tokens "
                    "(lossless; acceptance depends on its coverage)." if usable else "")
            raise TokenizerMismatchError(
                report, f"the target and draft tokenizers differ; see the report above (specdraft check).{hint}")
        mapping = build_vocab_mapping(tpath, dpath)
        how = ("proposes text, encoded with the target's tokenizer" if mode == "text" else
               "proposes only tokens with a target twin")
        notes.append(("tokenizers differ", (
            f"decoding through a vocabulary mapping of {mapping.n_mapped:,} string-identical tokens "
            f"({mapping.target_coverage:.1%} of the target vocabulary reachable, {mapping.draft_coverage:.1%} of the "
            f"draft's mapped); the draft re-reads the context as text and {how} (--mapped-proposals {mode}).")))
    t, tok = load_model(tpath, dtype=dtype)
    d, _ = load_model(dpath, dtype=dtype)
    return Pair(t, d, tok, mapping, mode, notes)


@dataclass
class Generation:
    """One answer about to be decoded: the pair with its draft prepared, the prompt ``ids``, the speed model
    of adaptive γ (None under a fixed γ) and the ``configuration`` a report names."""

    pair: Pair
    config: EvalConfig
    ids: list[int]
    speed_model: Any = None
    speed_source: str = ""
    configuration: dict[str, Any] = field(default_factory=dict)

    def run(self, on_tokens: Callable[[int, list[int]], None] | None = None):
        """Decode the answer, calling ``on_tokens(row, new_ids)``; returns its
        :class:`~specdraft.core.acceptance.AcceptanceCounts`."""
        import torch


        p, c = self.pair, self.config
        inp, mask = left_pad([self.ids], tokenizer_pad_id(p.tokenizer), p.target.device)
        _, counts = speculative_generate(
            p.target, p.draft, inp, mask, num_speculative_tokens=c.num_speculative_tokens, sampling=c.sampling,
            max_new_tokens=c.max_new_tokens, real_vocab=len(p.tokenizer),
            generator=torch.Generator(device=p.target.device).manual_seed(c.seed), on_tokens=on_tokens,
            eos_token_id=eos_ids(p.target, p.tokenizer), draft_confidence_threshold=c.draft_confidence_threshold,
            vocab_mapping=p.mapping, mapped_proposals=c.mapped_proposals, speed_model=self.speed_model)
        return counts

    def seed_note(self) -> str | None:
        """When ``--seed`` reproduces this sampled answer, or None when the seed alone fixes it or
        nothing is random: under adaptive γ the answer also depends on the (cached) speed model."""
        c = self.config
        if c.sampling.greedy or self.speed_model is None:
            return None
        if self.speed_source.startswith("measured on a busy machine"):
            return (f"the speed model was measured on a busy machine and not cached; each round's draft count follows "
                    f"it, so a rerun with --seed {c.seed} measures again and may sample another answer. "
                    "--gamma-policy fixed makes the answer a function of the seed alone.")
        if self.speed_source.startswith("cache"):
            return (f"--seed {c.seed} reproduces this answer while the calibration cache holds this speed model "
                    "(each round's draft count follows it).")
        return (f"the speed model was measured now and cached: a rerun with --seed {c.seed} reads it and samples "
                "this answer again (until the cache entry is re-measured).")

    def shortened_by(self) -> list[str]:
        """What may draft fewer than γ besides the answer's end (adaptive γ, threshold, mapping)."""
        c = self.config
        return [w for w, on in (("adaptive γ", c.gamma_policy == "adaptive"),
                                ("--draft-confidence-threshold", c.draft_confidence_threshold is not None),
                                ("the mapped draft", self.pair.mapping is not None)) if on]


def prepare_generation(pair: Pair, prompt: str, config: EvalConfig,
                       status: Callable[[str], None] | None = None) -> Generation:
    """The user ``prompt`` under the chat template, the draft prepared as ``config`` asks, and under
    adaptive γ the pair's speed model (:func:`specdraft.decoding.calibration.calibrate`)."""

    ids = encode_prompts(pair.tokenizer, [Example("cli", [{"role": "user", "content": prompt}])])[0]
    pair.draft = apply_draft_options(pair.draft, pair.tokenizer, config, pair.mapping, copy_model=False)
    gamma = config.num_speculative_tokens
    speed, source = None, ""
    if config.gamma_policy == "adaptive":
        speed, source = calibrate(pair.target, pair.draft, [ids], config, pair.mapping, say=status) or (None, "")
    configuration = {"draft_options": draft_configuration(pair.draft), "gamma_policy": config.gamma_policy,
                     "num_speculative_tokens": gamma, "speed_model_source": source}
    return Generation(pair, config, list(ids), speed, source, configuration)


def encode(pair: Pair, examples: Sequence) -> list[list[int]]:
    """The examples' prompts as the target's token ids (its chat template applied)."""

    return encode_prompts(pair.tokenizer, examples)
