"""The round's price S and adaptive γ: what a round costs, what it yields, and how many tokens a row should draft.

:class:`SpeedModel` holds measured costs — t(k), one target pass over k new tokens, and d, one draft step — and
prices a round of k drafts at k·d + t(k+1) seconds for E(α, k) = (1 − α^(k+1)) / (1 − α) tokens (Leviathan et al.
2023, eq. 1): S(α, k) = E(α, k) · t(1) / (k·d + t(k+1)) times the target alone (Theorem 3.8 when t(k) = t(1)).
:class:`AdaptiveGamma` drafts per row the k maximising S, or nothing while none gains; the output stays the
target's. Why measured t(k), and the probes: docs/architecture.md#specdraftdecodingspeed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from specdraft.core.acceptance import expected_tokens_per_pass


@dataclass
class SpeedModel:
    """Measured per-pass costs of a pair (batch 1, at ``context`` tokens), seconds: ``target_s`` = ``[t(1), …,
    t(γ_max + 1)]`` (maybe fitted; raw in ``target_s_measured``), ``draft_s`` = d, and both prompts' prefill."""

    target_s: list[float]
    draft_s: float
    target_prefill_s: float = 0.0
    draft_prefill_s: float = 0.0
    context: int = 0
    target_s_measured: list[float | None] | None = None

    @property
    def max_gamma(self) -> int:
        return len(self.target_s) - 1

    @property
    def cost_ratio(self) -> float:
        """c = d / t(1) (Leviathan et al.'s cost coefficient)."""
        return self.draft_s / self.target_s[0]

    def round_seconds(self, k: int) -> float:
        """One round of k drafts: k·d + t(k+1) (k = 0: a plain target step, t(1))."""
        if not 0 <= k <= self.max_gamma:
            raise ValueError(f"k must be in 0..{self.max_gamma} (t(k) measured up to {len(self.target_s)}), got {k}")
        return k * self.draft_s + self.target_s[k]

    def speedup(self, alpha: float, k: int) -> float:
        """S(α, k) = E(α, k) · t(1) / (k·d + t(k+1)): tokens/s relative to the target alone (k = 0 → 1)."""
        return expected_tokens_per_pass(alpha, k) * self.target_s[0] / self.round_seconds(k)

    def best_gamma(self, alpha: float, max_gamma: int | None = None) -> tuple[int, float]:
        """The k in 0..max_gamma maximising :meth:`speedup` (0 when no k beats the target alone), and S there."""
        top = self.max_gamma if max_gamma is None else min(max_gamma, self.max_gamma)
        k = max(range(top + 1), key=lambda j: (self.speedup(alpha, j), -j))
        return k, self.speedup(alpha, k)

    def predict(self, alpha: float, gamma: int, new_tokens: float, prompts: int = 1) -> float:
        """Predicted wall-clock speed-up of ``prompts`` decodes emitting ``new_tokens`` in all, prefill
        included."""
        target = prompts * self.target_prefill_s + new_tokens * self.target_s[0]
        spec = prompts * (self.target_prefill_s + self.draft_prefill_s) + \
            new_tokens / expected_tokens_per_pass(alpha, gamma) * self.round_seconds(gamma)
        return target / spec if spec > 0 else 0.0

    @classmethod
    def from_measurements(cls, target_s: dict[int, float], draft_s: float, **kw) -> SpeedModel:
        """A model whose t(k) is the least-squares line (slope ≥ 0) through measured
        ``{k: seconds}``, the raw timings kept in ``target_s_measured``."""
        ks = sorted(target_s)
        n = len(ks)
        mean_k, mean_t = sum(ks) / n, sum(target_s[k] for k in ks) / n
        var = sum((k - mean_k) ** 2 for k in ks)
        slope = max(0.0, sum((k - mean_k) * (target_s[k] - mean_t) for k in ks) / var) if var else 0.0
        fitted = [mean_t + slope * (k - mean_k) for k in range(1, ks[-1] + 1)]
        return cls(target_s=fitted, draft_s=draft_s, target_s_measured=[target_s.get(k) for k in range(1, ks[-1] + 1)],
                   **kw)

    def to_dict(self) -> dict:
        return asdict(self) | {"cost_ratio_c": self.cost_ratio}

    @classmethod
    def from_dict(cls, d: dict) -> SpeedModel:
        """Inverse of :meth:`to_dict`; keys that are not fields are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class AdaptiveGamma:
    """Per-row draft lengths from a :class:`SpeedModel` and each row's running acceptance.

    α̂ = a / r over reached (r) and accepted (a) drafts, both decayed by ``decay`` per round, starting at
    ``prior_alpha`` with ``prior_weight`` trials. A row drafts argmax_k S(α̂, k) ≤ ``gamma``; at 0 it waits ``wait``
    rounds, then probes with 1 draft, ``wait`` doubling up to ``max_wait`` while no gain is predicted.
    """

    def __init__(self, speed: SpeedModel, gamma: int, batch: int, prior_alpha: float = 0.8,
                 prior_weight: float = 2.0, decay: float = 0.9, max_wait: int = 32):
        if gamma > speed.max_gamma:
            raise ValueError(f"the speed model measured t(k) up to k = {speed.max_gamma + 1}; γ = {gamma} needs "
                             f"k up to {gamma + 1}")
        self.speed, self.gamma, self.decay, self.max_wait = speed, gamma, decay, max_wait
        self.a = [prior_alpha * prior_weight] * batch
        self.r = [prior_weight] * batch
        self.wait = [1] * batch  # rounds without drafting before the next probe
        self.idle = [0] * batch  # rounds drafted nothing since the last draft
        # k*(α) is monotone in α: a lookup grid keeps the per-round cost negligible.
        self._grid = [speed.best_gamma(i / 200, gamma)[0] for i in range(201)]

    def alpha(self, row: int) -> float:
        return self.a[row] / self.r[row]

    def plan(self) -> list[int]:
        """Drafts per row for the coming round (before the per-row room left is applied)."""
        ks = []
        for j in range(len(self.a)):
            k = self._grid[round(self.alpha(j) * 200)]
            if k == 0:
                k = 1 if self.idle[j] >= self.wait[j] else 0  # a probe: one draft, to measure α again
            ks.append(k)
        return ks

    def record(self, row: int, n_proposed: int, n_accepted: int) -> None:
        """A row's round: ``n_accepted`` of ``n_proposed`` drafts accepted."""
        if n_proposed == 0:
            self.idle[row] += 1
            return
        reached = min(n_accepted + 1, n_proposed)
        self.a[row] = self.a[row] * self.decay + n_accepted
        self.r[row] = self.r[row] * self.decay + reached
        was_idle, self.idle[row] = self.idle[row] > 0, 0
        if self._grid[round(self.alpha(row) * 200)] > 0:
            self.wait[row] = 1
        elif was_idle:  # a probe that still predicts no gain: wait twice as long
            self.wait[row] = min(self.wait[row] * 2, self.max_wait)

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished rows leave the batch)."""
        for name in ("a", "r", "wait", "idle"):
            setattr(self, name, [getattr(self, name)[j] for j in keep])
