"""The *independent speculator* format: a plain Hugging Face draft (q) packaged for a verifier (target, p).

The draft itself — same class, same weights — whose ``config.json`` adds ``speculators_model_type: "independent"``,
``speculators_version`` and ``speculators_config`` (proposal methods, γ, the verifier; speculators' schema, mirrored
without depending on it). A draft of another tokenizer carries the ``"text"`` proposal method and is served through
:mod:`specdraft.serving.vllm_proposer`. The format only: the runtime wrapper is
:class:`specdraft.decoding.speculator_model.IndependentSpeculator`. Details:
docs/architecture.md#specdraftmodelsspeculator.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specdraft import __version__
from specdraft.core.config import MAX_SPECULATIVE_TOKENS, NUM_SPECULATIVE_TOKENS, SpeculativeTokens
from specdraft.core.io import atomic_write_text
from specdraft.models.check import check_compatible
from specdraft.models.loading import portable_reference, resolve

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PretrainedConfig

# The three keys a speculator adds to the draft's config.json; nothing else changes.
SPECULATOR_KEYS = ("speculators_model_type", "speculators_version", "speculators_config")

class SpeculatorError(ValueError):
    """A speculator checkpoint, conversion input or verifier attachment is invalid."""


class NotASpeculatorError(SpeculatorError):
    """A config is a plain model config, without the ``speculators_*`` keys."""


# --------------------------------------------------------------------------------------------------
# Schema mirror of the speculators library (only what an independent greedy speculator uses)
# --------------------------------------------------------------------------------------------------


class GreedyTokenProposalConfig(BaseModel):
    """One chain of γ draft tokens, checked by the verifier (mirror of speculators' greedy proposal)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    proposal_type: Literal["greedy"] = Field(
        default="greedy", description="Proposal method name; the registry key in the speculators library."
    )
    speculative_tokens: SpeculativeTokens = NUM_SPECULATIVE_TOKENS
    verifier_accept_k: int = Field(
        default=1,
        ge=1,
        description="A drafted token is accepted when it is within the verifier's top-k; 1 = must equal the "
        "verifier's top token.",
    )
    accept_tolerance: float = Field(
        default=0.0,
        ge=0.0,
        description="With verifier_accept_k > 1: the largest log-likelihood gap (nats) to the verifier's top "
        "token that is still accepted; 0.0 is equivalent to verifier_accept_k = 1.",
    )


class TextProposalConfig(GreedyTokenProposalConfig):
    """specdraft's proposal method for a draft of another tokenizer: γ tokens drafted greedily in the
    draft's tokenizer, re-encoded in context as verifier tokens; served by
    :class:`specdraft.vllm_proposer.TextProposer`."""

    proposal_type: Literal["text"] = Field(  # type: ignore[assignment]
        default="text", description="Proposal method name: drafted in the draft's tokenizer, proposed as text."
    )


#: A proposal method, told apart by ``proposal_type``.
ProposalConfig = Annotated[GreedyTokenProposalConfig | TextProposalConfig, Field(discriminator="proposal_type")]

#: The ``proposal_type`` of a draft of another tokenizer (:class:`TextProposalConfig`).
TEXT_PROPOSALS = "text"


class VerifierConfig(BaseModel):
    """Which verifier (target, p) the speculator drafts for (mirror of speculators' ``VerifierConfig``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name_or_path: str | None = Field(
        description="Where the verifier is loaded from, as a reference that resolves on another machine: an "
        "absolute path for a local directory, the hub id for a hub model, and for a specdraft embedded model "
        "the hub id its weights derive from (they are a dequantised GGUF build of it). vLLM loads the "
        "verifier from this field when it serves the speculator directory alone."
    )
    architectures: list[str] = Field(
        description="The verifier config.json's `architectures`; used to check that a later verifier is of the "
        "same kind."
    )


class SpeculatorsConfig(BaseModel):
    """The ``speculators_config`` block (mirror of speculators' ``SpeculatorsConfig``); raises
    ``pydantic.ValidationError`` on unknown keys, bad bounds, no proposals or an unlisted default method."""

    model_config = ConfigDict(extra="forbid", strict=True)

    algorithm: Literal["independent"] = Field(
        description="Speculative decoding algorithm; an independent draft model is 'independent'."
    )
    proposal_methods: list[ProposalConfig] = Field(
        min_length=1, description="Token proposal methods the speculator supports."
    )
    default_proposal_method: str = Field(
        description="The proposal method used when none is asked for; one of proposal_methods' proposal_type."
    )
    verifier: VerifierConfig = Field(description="The verifier this speculator drafts for.")

    @model_validator(mode="after")
    def _default_is_listed(self) -> SpeculatorsConfig:
        types = [m.proposal_type for m in self.proposal_methods]
        if self.default_proposal_method not in types:
            raise ValueError(
                f"default_proposal_method {self.default_proposal_method!r} is not one of the proposal types "
                f"{types}"
            )
        return self


class SpeculatorFields(BaseModel):
    """The three top-level keys a speculator adds to ``config.json``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    speculators_model_type: Literal["independent"] = Field(
        description="Speculator kind; selects the config class (registry key)."
    )
    speculators_version: str = Field(description="Version of the tool that wrote the speculator (specdraft).")
    speculators_config: SpeculatorsConfig = Field(description="Algorithm, proposal methods and verifier.")


# --------------------------------------------------------------------------------------------------
# IndependentSpeculatorConfig
# --------------------------------------------------------------------------------------------------


class IndependentSpeculatorConfig(BaseModel):
    """The draft's own config plus the speculator metadata; ``to_dict()`` is ``config.json``.

    Build with :meth:`from_pretrained` or :meth:`for_draft`; the verifier may be missing until save time. Invalid
    fields raise ``pydantic.ValidationError`` at construction or assignment.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    speculators_model_type: ClassVar[str] = "independent"

    draft_config: dict[str, Any] = Field(
        description="The draft's config.json as its own save_pretrained writes it, without speculators_* keys."
    )
    speculators_version: str = Field(
        default=__version__, description="specdraft version that wrote (or converted) the speculator."
    )
    proposal_methods: list[ProposalConfig] = Field(
        default_factory=lambda: [GreedyTokenProposalConfig()], min_length=1,
        description="Token proposal methods; the default is one greedy chain of γ tokens.",
    )
    default_proposal_method: str = Field(default="greedy", description="proposal_type used by default.")
    verifier: VerifierConfig | None = Field(
        default=None, description="The verifier (target, p) drafted for; required to save."
    )

    @field_validator("draft_config")
    @classmethod
    def _plain_draft_config(cls, v: dict[str, Any]) -> dict[str, Any]:
        if "model_type" not in v:
            raise ValueError("draft_config has no model_type: it is not a Hugging Face model config")
        stray = [k for k in SPECULATOR_KEYS if k in v]
        if stray:
            raise ValueError(f"draft_config must not hold {stray}: they are fields of the speculator config")
        return v

    @model_validator(mode="after")
    def _default_is_listed(self) -> IndependentSpeculatorConfig:
        types = [m.proposal_type for m in self.proposal_methods]
        if self.default_proposal_method not in types:
            raise ValueError(f"default_proposal_method {self.default_proposal_method!r} is not one of {types}")
        return self

    # -------------------------------------------------------------------------------- construction

    @classmethod
    def for_draft(
        cls,
        draft_config: dict[str, Any] | PretrainedConfig,
        num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
        verifier: Any = None,
    ) -> IndependentSpeculatorConfig:
        """Convert a plain causal-LM config (dict or ``PretrainedConfig``): one greedy
        proposal of γ (1..64) tokens, ``verifier`` as :func:`verifier_config` takes it or None. Raises
        :class:`SpeculatorError` for a config that is not a causal LM's or γ < 1."""
        d = _config_dict(draft_config)
        check_causal_lm_config(d)
        return cls(
            draft_config=strip_speculator_keys(d),
            proposal_methods=[_greedy(num_speculative_tokens)],
            verifier=None if verifier is None else verifier_config(verifier),
        )

    @classmethod
    def from_speculator_dict(cls, d: dict[str, Any]) -> IndependentSpeculatorConfig:
        """Read a speculator ``config.json`` dict against the schema.
        Raises :class:`NotASpeculatorError` (no ``speculators_model_type``) or :class:`SpeculatorError` (another type,
        an
        invalid block)."""
        if "speculators_model_type" not in d:
            raise _not_a_speculator(d)
        try:
            fields = SpeculatorFields.model_validate({k: d[k] for k in SPECULATOR_KEYS if k in d})
        except ValidationError as exc:
            # One line without pydantic's prefix: the CLI shows it as `error: …`.
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: "
                                 f"{str(e['msg']).removeprefix('Value error, ')}" for e in exc.errors())
            raise SpeculatorError(f"invalid speculator config: {problems}") from exc
        sc = fields.speculators_config
        return cls(
            draft_config=strip_speculator_keys(d),
            speculators_version=fields.speculators_version,
            proposal_methods=sc.proposal_methods,
            default_proposal_method=sc.default_proposal_method,
            verifier=sc.verifier,
        )

    @classmethod
    def from_pretrained(
        cls,
        config: str | os.PathLike | PretrainedConfig | dict[str, Any] | IndependentSpeculatorConfig,
        *,
        verifier: Any = None,
        num_speculative_tokens: int | None = None,
    ) -> IndependentSpeculatorConfig:
        """Load a speculator config, or convert a plain causal-LM config into one.

        ``config``: a reference (:func:`specdraft.models.loading.resolve`), ``PretrainedConfig``, dict or speculator config;
        ``verifier`` and ``num_speculative_tokens`` replace the recorded ones (γ default 5 when converting). A saved
        speculator reads back equal. Raises :class:`SpeculatorError` and
        :class:`specdraft.core.embedded.ModelResolutionError`.
        """
        if isinstance(config, IndependentSpeculatorConfig):
            d = None
            cfg = config.model_copy(deep=True)
        else:
            d = _config_dict(config)
            cfg = cls.from_speculator_dict(d) if "speculators_model_type" in d else None
        if cfg is not None:
            if num_speculative_tokens is not None:
                cfg = cfg.with_num_speculative_tokens(num_speculative_tokens)
            if verifier is not None:
                cfg.verifier = verifier_config(verifier)
            return cfg
        return cls.for_draft(
            d,
            NUM_SPECULATIVE_TOKENS if num_speculative_tokens is None else num_speculative_tokens,
            verifier,
        )

    def with_num_speculative_tokens(self, num_speculative_tokens: int) -> IndependentSpeculatorConfig:
        """A copy proposing γ tokens; :class:`SpeculatorError` if γ < 1."""
        new = _greedy(num_speculative_tokens, self.default_proposal_method)
        methods = [new if m.proposal_type == self.default_proposal_method else m for m in self.proposal_methods]
        return self.model_copy(update={"proposal_methods": methods})

    def with_text_proposals(self) -> IndependentSpeculatorConfig:
        """A copy that drafts through text (:class:`TextProposalConfig`, same γ)."""
        return self.model_copy(update={"proposal_methods": [_greedy(self.num_speculative_tokens, TEXT_PROPOSALS)],
                                       "default_proposal_method": TEXT_PROPOSALS})

    @property
    def drafts_through_text(self) -> bool:
        """Whether the default proposal method is ``"text"``."""
        return self.default_proposal_method == TEXT_PROPOSALS

    # -------------------------------------------------------------------------------- views

    @property
    def num_speculative_tokens(self) -> int:
        """γ of the default proposal method."""
        return next(
            m.speculative_tokens for m in self.proposal_methods if m.proposal_type == self.default_proposal_method
        )

    @property
    def speculators_config(self) -> SpeculatorsConfig:
        """The validated block; :class:`SpeculatorError` until a verifier is named."""
        if self.verifier is None:
            raise SpeculatorError(
                "This speculator names no verifier, and a speculator checkpoint must record which verifier it "
                "drafts for. Name one with `speculator.attach_verifier('org/verifier-or-path')`, "
                "`IndependentSpeculatorConfig.from_pretrained(..., verifier='org/verifier-or-path')`, or "
                "`specdraft export --target T`."
            )
        return SpeculatorsConfig(
            algorithm="independent",
            proposal_methods=self.proposal_methods,
            default_proposal_method=self.default_proposal_method,
            verifier=self.verifier,
        )

    def to_dict(self) -> dict[str, Any]:
        """The on-disk ``config.json``; :class:`SpeculatorError` until a verifier is named."""
        out = copy.deepcopy(self.draft_config)
        out["speculators_model_type"] = self.speculators_model_type
        out["speculators_version"] = self.speculators_version
        out["speculators_config"] = self.speculators_config.model_dump(mode="json")
        return out

    def to_json_string(self) -> str:
        """``config.json`` text as transformers writes it (indent 2, sorted keys)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write ``config.json`` atomically into ``save_directory``; returns its path.
        Raises :class:`SpeculatorError` (nothing written) without a verifier."""

        text = self.to_json_string()  # raises before anything is written
        path = Path(save_directory) / "config.json"
        atomic_write_text(path, text)
        return path


# Registry keyed by speculators_model_type: the base loader dispatches on it.
SPECULATOR_CONFIGS: dict[str, type[IndependentSpeculatorConfig]] = {
    IndependentSpeculatorConfig.speculators_model_type: IndependentSpeculatorConfig,
}


def load_speculator_config(
    config: str | os.PathLike | PretrainedConfig | dict[str, Any],
) -> IndependentSpeculatorConfig:
    """Load a speculator checkpoint's config by its ``speculators_model_type``, never converting.
    Raises :class:`NotASpeculatorError`, :class:`SpeculatorError` or :class:`specdraft.core.embedded.ModelResolutionError`.
    """
    if isinstance(config, IndependentSpeculatorConfig):
        return config.model_copy(deep=True)
    d = _config_dict(config)
    kind = d.get("speculators_model_type")
    if kind is None:
        raise _not_a_speculator(d, config)
    if kind not in SPECULATOR_CONFIGS:
        raise SpeculatorError(
            f"speculators_model_type {kind!r} is not supported by specdraft (known: {sorted(SPECULATOR_CONFIGS)})."
        )
    return SPECULATOR_CONFIGS[kind].from_speculator_dict(d)


def config_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Top-level keys whose values differ: ``{key: (before or MISSING, after or MISSING)}``, sorted by key."""
    keys = sorted(set(before) | set(after))
    return {
        k: (before.get(k, MISSING), after.get(k, MISSING))
        for k in keys
        if k not in before or k not in after or before[k] != after[k]
    }


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


# --------------------------------------------------------------------------------------------------
# Verifier references
# --------------------------------------------------------------------------------------------------


def verifier_config(verifier: Any, name_or_path: str | None = None) -> VerifierConfig:
    """Describe a verifier — ``name_or_path`` and ``architectures`` — without loading weights.

    ``verifier``: a reference (only its config.json is read), model, config, dict or :class:`VerifierConfig`; a
    reference is recorded portably (:func:`specdraft.models.loading.portable_reference`). Raises :class:`SpeculatorError`
    (unreadable config, no name or architecture) and :class:`specdraft.core.embedded.ModelResolutionError`.
    """
    if isinstance(verifier, VerifierConfig):
        return verifier if name_or_path is None else verifier.model_copy(update={"name_or_path": name_or_path})
    if isinstance(verifier, dict) and set(verifier) <= {"name_or_path", "architectures"}:
        vc = VerifierConfig.model_validate(verifier)
        return vc if name_or_path is None else vc.model_copy(update={"name_or_path": name_or_path})
    if isinstance(verifier, (str, os.PathLike)):

        d = read_config_json(verifier, role="verifier")
        name = name_or_path or portable_reference(verifier)
    else:
        cfg = getattr(verifier, "config", verifier)  # a model → its config
        d = _config_dict(cfg)
        name = name_or_path or getattr(cfg, "name_or_path", None) or d.get("_name_or_path")
        if not d.get("architectures") and hasattr(verifier, "config"):
            d["architectures"] = [type(verifier).__name__]
    if not name:
        raise SpeculatorError(
            "The verifier has no name_or_path to record (an in-memory model). Pass name_or_path='org/name' "
            "(the hub id or directory it will be loaded from)."
        )
    return VerifierConfig(name_or_path=str(name), architectures=_architectures(d, role="verifier"))




# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _greedy(num_speculative_tokens: int, proposal_type: str = "greedy") -> GreedyTokenProposalConfig:
    kind = TextProposalConfig if proposal_type == TEXT_PROPOSALS else GreedyTokenProposalConfig
    try:
        return kind(speculative_tokens=num_speculative_tokens)
    except ValidationError as exc:
        raise SpeculatorError(
            f"num_speculative_tokens (--num-speculative-tokens) must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got "
            f"{num_speculative_tokens!r}"
        ) from exc


def read_config_json(ref: str | os.PathLike, role: str) -> dict[str, Any]:

    path = Path(resolve(ref)) / "config.json"
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpeculatorError(f"The {role} reference {str(ref)!r} is unreadable: {path}: {exc}") from exc
    if not isinstance(d, dict):
        raise SpeculatorError(f"The {role} reference {str(ref)!r} is unreadable: {path} is not a JSON object.")
    return d


def _config_dict(config: Any) -> dict[str, Any]:
    """A config as its config.json dict (deep copy)."""
    if isinstance(config, IndependentSpeculatorConfig):
        return config.to_dict()
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        return read_config_json(config, role="config")
    if hasattr(config, "to_json_string"):  # a PretrainedConfig: exactly what its save_pretrained writes
        return json.loads(config.to_json_string(use_diff=True))
    raise TypeError(f"expected a reference, directory, PretrainedConfig or dict, got {type(config).__name__}")


def strip_speculator_keys(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in SPECULATOR_KEYS}


def _not_a_speculator(d: dict[str, Any], source: Any = None) -> NotASpeculatorError:
    what = str(source) if isinstance(source, (str, os.PathLike)) else "This config"
    return NotASpeculatorError(
        f"{what} is not a speculator checkpoint — export it as one with `specdraft export --draft D --target T "
        f"--out DIR`. (Its config has no speculators_model_type: a plain {d.get('model_type')!r} config, "
        f"architectures {d.get('architectures')}.)"
    )


def _causal_lm_classes() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(v if isinstance(v, (list, tuple)) else [v])
    return names


def _is_causal_name(name: str, known: set[str]) -> bool:
    # Remote-code models are not in the mapping; their class names follow the same convention.
    return name in known or name.endswith(("ForCausalLM", "LMHeadModel"))


def check_causal_lm_config(d: dict[str, Any], what: str = "draft") -> None:
    known = _causal_lm_classes()
    archs = d.get("architectures") or []
    if archs:
        if not any(_is_causal_name(a, known) for a in archs):
            raise SpeculatorError(
                f"The {what} is a {', '.join(archs)} (model_type {d.get('model_type')!r}), not a causal "
                "language model: an independent speculator wraps a *ForCausalLM / *LMHeadModel checkpoint."
            )
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if d.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise SpeculatorError(
            f"The {what} config (model_type {d.get('model_type')!r}, no architectures) is not a causal "
            "language model's."
        )


def check_causal_lm_model(model: Any) -> None:
    """Refuse a draft that is not a transformers causal LM; :class:`SpeculatorError` names the class."""
    from transformers import PreTrainedModel

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise SpeculatorError(f"The draft must be a transformers PreTrainedModel, got {name}.")
    if getattr(model.config, "is_encoder_decoder", False) or not _is_causal_name(name, _causal_lm_classes()):
        raise SpeculatorError(
            f"The draft is a {name} (model_type {model.config.model_type!r}), not a causal language model: an "
            "independent speculator wraps a *ForCausalLM / *LMHeadModel."
        )


def _architectures(d: dict[str, Any], role: str) -> list[str]:
    archs = d.get("architectures")
    if archs:
        return list(archs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(d.get("model_type"))
    if isinstance(name, str):
        return [name]
    raise SpeculatorError(f"The {role} config names no architectures and model_type {d.get('model_type')!r} "
                          "has no causal-LM class.")


def tokenizer_dir(path: str | os.PathLike | None) -> str | None:
    """``path`` when it is a directory holding tokenizer files, else ``None``."""
    if not path:
        return None
    p = Path(path)
    if p.is_dir() and any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                                       "tokenizer.model")):
        return str(p)
    return None


def check_tokenizers(verifier_tok: Any, draft_tok: Any, verifier_name: str | None,
                      draft_name: str | None = None) -> str | None:
    """:func:`specdraft.models.check.check_compatible`, raising on "mismatch" (the way out: ``specdraft
    vocab-swap``); returns the verdict, None when a tokenizer is unknown (warned)."""

    missing = [side for side, tok in (("verifier", verifier_tok), ("draft", draft_tok)) if tok is None]
    if missing:
        warnings.warn(
            f"Tokenizer compatibility not checked: no tokenizer known for the {' and '.join(missing)}. Pass "
            "tokenizer= (or check_tokenizer=False to skip on purpose).",
            stacklevel=3,
        )
        return None
    report = check_compatible(verifier_tok, draft_tok)
    verdict = report.verdict
    if verdict == "mismatch":
        detail = report.summary()
        draft = f" {draft_name!r}" if draft_name else ""
        swap = (f"specdraft vocab-swap --target {verifier_name} --draft {draft_name} --out DIR" if draft_name
                else "specdraft vocab-swap")
        raise SpeculatorError(
            f"The verifier {verifier_name!r} and the draft{draft} do not share a tokenizer — {detail}. A speculator's "
            f"token ids must mean the same strings to both models: re-index the draft into the verifier's tokenizer "
            f"with `{swap}` (then distil it), and export that; see specdraft check."
        )
    return verdict
