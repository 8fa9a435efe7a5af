"""What a speed run measured: the contenders timed, each one's figures, per-prompt rows and the stage's sets.

:func:`specdraft.measuring.evaluate.interleaved_speed` writes a :class:`SpeedRun`; the pipeline keeps a :class:`SpeedStage`
(one run per held-out set); :mod:`specdraft.measuring.report` and :mod:`specdraft.measuring.recommend` read them back with ``from_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal


@dataclass(frozen=True)
class Contender:
    """One decoder the speed stage times: the target alone, specdraft with a draft, or transformers' assisted
    generation; :attr:`name` (``target``, ``speculative:<draft>``, ``hf_assisted:<draft>``) keys the results."""

    kind: Literal["target", "speculative", "hf_assisted"]
    draft: str | None = None

    @property
    def name(self) -> str:
        return self.kind if self.draft is None else f"{self.kind}:{self.draft}"

    @classmethod
    def from_name(cls, name: str) -> Contender:
        """The contender a result's key names (the inverse of :attr:`name`)."""
        kind, _, draft = name.partition(":")
        return cls(kind, draft or None)  # type: ignore[arg-type]


@dataclass
class Divergence:
    """A prompt whose greedy output differs from the target alone's: the first differing position, both
    tokens, and the target's top-1 − top-2 logit margin there beside the dtype's rounding tolerance."""

    prompt_id: str
    contender: str
    position: int
    target_token: int
    other_token: int
    margin: float
    tolerance: float

    @property
    def is_numerics(self) -> bool:
        return self.margin <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"is_numerics": self.is_numerics}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Divergence:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass
class Decoded:
    """One contender's answer to one prompt: the new token ids and the wall-clock seconds decoding them took."""

    tokens: list[int]
    seconds: float


@dataclass
class ContenderSpeed:
    """One contender's figures over a speed run: ``speedup`` (tokens/s × the target alone, paired
    interval; None for the target) and ``matches_target`` (``"equal/prompts"``; None for the target and sampled runs).
    """

    tokens_per_s: float  # new tokens per wall-clock second, over all prompts
    tokens_per_s_ci95: list[float] | None  # bootstrap over prompts; None without prompts
    tokens: int = 0  # new tokens over all prompts
    seconds: float = 0.0  # wall clock over all prompts
    speedup: float | None = None
    speedup_ci95: list[float] | None = None
    matches_target: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
             "tokens_per_s_ci95": self.tokens_per_s_ci95}
        if self.speedup is not None:
            d |= {"speedup": self.speedup, "speedup_ci95": self.speedup_ci95}
        if self.matches_target is not None:
            d["matches_target"] = self.matches_target
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ContenderSpeed:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class SpeedRow:
    """One prompt of a speed run: per contender ``(new tokens, seconds)`` and, when greedy, whether it matches."""

    id: str
    timings: dict[str, tuple[int, float]]
    matches: dict[str, bool] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``{"id", <name>: [tokens, seconds], …, "<name>:matches": bool, …}``."""
        return ({"id": self.id} | {n: list(t) for n, t in self.timings.items()}
                | {f"{n}:matches": m for n, m in self.matches.items()})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeedRow:
        rest = [k for k in d if k != "id"]
        return cls(d["id"], {k: tuple(d[k]) for k in rest if not k.endswith(":matches")},  # type: ignore[misc]
                   {k.removesuffix(":matches"): d[k] for k in rest if k.endswith(":matches")})


@dataclass
class SpeedRun:
    """What :func:`specdraft.measuring.evaluate.interleaved_speed` measured: every contender on the same prompts, keyed
    by :attr:`Contender.name`. ``lossless`` is False when a greedy speculative output diverged beyond rounding."""

    prompts: int
    contenders: dict[str, ContenderSpeed]
    rows: list[SpeedRow] = field(default_factory=list)
    warmup_tokens: int = 0  # tokens each contender decoded of the first prompt, untimed, before the timed run
    divergences: list[Divergence] = field(default_factory=list)
    lossless: bool = True
    max_new_tokens: int | None = None
    num_speculative_tokens: int | None = None  # γ (the most drafts per round under the adaptive policy)
    gamma_policy: str = "fixed"
    machine_load: dict[str, Any] | None = None  # specdraft.decoding.calibration.LoadMonitor.to_dict over the timed run
    busy_machine: bool = False  # other processes held the CPU while timing
    draft_configuration: dict[str, dict[str, Any]] = field(default_factory=dict)  # draft → its preparation
    speed_models: dict[str, dict[str, Any]] = field(default_factory=dict)  # draft → SpeedModel.to_dict + "source"

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "contenders": {k: c.to_dict() for k, c in self.contenders.items()},
                "rows": [r.to_dict() for r in self.rows], "warmup_tokens": self.warmup_tokens,
                "divergences": [d.to_dict() for d in self.divergences], "lossless": self.lossless,
                "max_new_tokens": self.max_new_tokens, "num_speculative_tokens": self.num_speculative_tokens,
                "gamma_policy": self.gamma_policy, "machine_load": self.machine_load,
                "busy_machine": self.busy_machine, "draft_configuration": self.draft_configuration,
                "speed_models": self.speed_models}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeedRun:
        """Inverse of :meth:`to_dict`; missing keys take their defaults."""
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["contenders"] = {k: ContenderSpeed.from_dict(c) for k, c in d["contenders"].items()}
        kw["rows"] = [SpeedRow.from_dict(r) for r in d.get("rows") or []]
        kw["divergences"] = [Divergence.from_dict(x) for x in d.get("divergences") or []]
        return cls(**kw)

    def contender(self, kind: str, draft: str | None = None) -> ContenderSpeed | None:
        """The figures of one contender (``None`` when it did not run)."""
        return self.contenders.get(Contender(kind, draft).name)  # type: ignore[arg-type]

    def of_kind(self, kind: str) -> dict[str, ContenderSpeed]:
        """The contenders of one kind, by name."""
        return {k: c for k, c in self.contenders.items() if Contender.from_name(k).kind == kind}


@dataclass
class SpeedStage:
    """The pipeline's speed stage: the headline set's :class:`SpeedRun` and each other held-out set's."""

    held_out: SpeedRun
    other_sets: dict[str, SpeedRun] = field(default_factory=dict)

    @property
    def lossless(self) -> bool:
        """No set diverged beyond rounding tolerance."""
        return all(s.lossless for s in self.by_set().values())

    def by_set(self) -> dict[str, SpeedRun]:
        """Every timed set by name, ``held_out`` first."""
        return {"held_out": self.held_out} | self.other_sets

    def to_dict(self) -> dict[str, Any]:
        """The headline run's keys (``lossless`` over every set) plus ``other_sets``."""
        d = self.held_out.to_dict() | {"other_sets": {k: v.to_dict() for k, v in self.other_sets.items()}}
        d["lossless"] = self.lossless
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeedStage:
        return cls(SpeedRun.from_dict(d), {k: SpeedRun.from_dict(v) for k, v in (d.get("other_sets") or {}).items()})
