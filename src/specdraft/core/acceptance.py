"""Acceptance accounting: counts first, ratios derived (so they merge across prompts, batches and ranks),
and the analytic speed-up model of Leviathan et al. (2023).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class AcceptanceCounts:
    """Counts gathered by speculative decoding; every ratio is derived, never stored.

    Per draft position i = 0..γ−1: ``proposed[i]`` (up to a row's end), ``reached[i]`` (verification got there: all
    earlier drafts accepted), ``accepted[i]`` (emitted). ``accepted_hist[n]``: row-rounds accepting exactly n drafts.
    ``rounds``: row-rounds; ``emitted``: accepted drafts + ``bonus`` (correction/bonus) tokens; ``*_calls``: batched
    passes; times in seconds (overhead = total − draft − target). ``matched`` / ``match_positions``: answer positions
    where the draft's greedy proposal is the target's token / positions counted (replays only; decodes leave 0).
    """

    gamma: int
    proposed: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    accepted_hist: list[int] = field(default_factory=list)
    rounds: int = 0
    emitted: int = 0
    bonus: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    prefill_calls: int = 0
    time_draft: float = 0.0
    time_target: float = 0.0
    time_prefill: float = 0.0
    time_total: float = 0.0
    matched: int = 0
    match_positions: int = 0

    def __post_init__(self) -> None:
        g = self.gamma
        self.proposed = self.proposed or [0] * g
        self.reached = self.reached or [0] * g
        self.accepted = self.accepted or [0] * g
        self.accepted_hist = self.accepted_hist or [0] * (g + 1)

    # ---- recording -------------------------------------------------------------------------------------
    def record_round(self, n_accepted: int, n_proposed: int | None = None, bonus: bool = True) -> None:
        """Record one row-round: ``n_accepted`` of ``n_proposed`` (default γ); ``bonus``: the
        target's token was emitted (False when the row ended inside the accepted block)."""
        g = self.gamma
        n_proposed = g if n_proposed is None else n_proposed
        if not 0 <= n_accepted <= n_proposed <= g:
            raise ValueError(f"need 0 <= accepted ({n_accepted}) <= proposed ({n_proposed}) <= γ ({g})")
        for i in range(n_proposed):
            self.proposed[i] += 1
        for i in range(min(n_accepted + 1, n_proposed)):
            self.reached[i] += 1
        for i in range(n_accepted):
            self.accepted[i] += 1
        self.accepted_hist[n_accepted] += 1
        self.rounds += 1
        self.emitted += n_accepted + int(bonus)
        self.bonus += int(bonus)

    def merge(self, other: AcceptanceCounts) -> AcceptanceCounts:
        """Sum of two count sets of the same γ (a new object)."""
        if other.gamma != self.gamma:
            raise ValueError(f"cannot merge counts of γ={self.gamma} and γ={other.gamma}")
        out = AcceptanceCounts(self.gamma)
        for k, v in asdict(self).items():
            if k == "gamma":
                continue
            w = getattr(other, k)
            setattr(out, k, [a + b for a, b in zip(v, w)] if isinstance(v, list) else v + w)
        return out

    # ---- derived ---------------------------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed drafts ∈ [0, 1]; None when nothing was proposed (0.0 would
        read as "all rejected"; :func:`format_rate` prints "—")."""
        p = sum(self.proposed)
        return sum(self.accepted) / p if p else None

    @property
    def alpha(self) -> float:
        """α for the analytic model: accepted / reached, the maximum-likelihood estimate under
        Leviathan et al.'s (2023, §3.3) i.i.d. assumption; drafts after a rejection were never tested. 0 if none
        reached."""
        r = sum(self.reached)
        return sum(self.accepted) / r if r else 0.0

    @property
    def match_rate(self) -> float | None:
        """matched / match_positions ∈ [0, 1], None without counted positions; independent of
        γ and policy, so it compares across regimes."""
        return self.matched / self.match_positions if self.match_positions else None

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target verification pass (per row): accepted drafts + the bonus token."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def alpha_per_position(self) -> list[float]:
        """accepted[i] / reached[i] per draft position (0 if unreached)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    @property
    def time_overhead(self) -> float:
        """Seconds outside draft and target forward passes (verification, bookkeeping)."""
        return max(0.0, self.time_total - self.time_draft - self.time_target - self.time_prefill)

    def to_dict(self) -> dict:
        """Counts plus the derived ratios (marked as such), JSON-safe."""
        d = asdict(self)
        d["derived"] = {
            "acceptance_rate": self.acceptance_rate,
            "alpha": self.alpha,
            "match_rate": self.match_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "alpha_per_position": self.alpha_per_position,
            "time_overhead": self.time_overhead,
        }
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AcceptanceCounts:
        d = {k: v for k, v in d.items() if k != "derived"}
        return cls(**d)


#: What each acceptance figure counts, in the words printed beside it: the one definition of each.
MEASURES = {
    "matched": "matched proposals / answer token: the draft's greedy proposal after the target's own prefix equals "
               "the target's token, at every answer position (bonus tokens not counted; the same at any γ)",
    "per_reached": "accepted / reached drafts: of the drafted positions verification tested (all earlier drafts of "
                   "the round accepted), the share accepted (bonus tokens not counted)",
    "per_proposed": "accepted / proposed drafts at the γ it ran with: drafts after a round's first rejection count as "
                    "proposed (bonus tokens not counted)",
    "per_pass": "tokens / target pass: accepted drafts plus the bonus token, per verification",
}


def format_rate(value: float | None, spec: str = "{:.3f}") -> str:
    """A ratio for print: "—" where it is undefined (None, e.g. an acceptance rate of 0 proposals)."""
    return "—" if value is None else spec.format(value)


# ----------------------------------------------------------------------------------- the analytic model


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """E[tokens per target pass] = (1 − α^(γ+1)) / (1 − α)  (Leviathan et al. 2023, eq. 1); γ+1 at α = 1."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Walltime improvement (1 − α^(γ+1)) / ((1 − α)(γc + 1)) (Leviathan et al. 2023, Theorem 3.8);
    γ = 0 is the target alone, c = draft step / target pass."""
    return expected_tokens_per_pass(alpha, gamma) / (gamma * cost_ratio + 1.0)


def best_gamma(alpha: float, cost_ratio: float, max_gamma: int = 16) -> tuple[int, float]:
    """The γ in 1..max_gamma maximising :func:`expected_speedup`, and that speed-up."""
    best = max(range(1, max_gamma + 1), key=lambda g: expected_speedup(alpha, g, cost_ratio))
    return best, expected_speedup(alpha, best, cost_ratio)
