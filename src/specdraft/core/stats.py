"""Confidence intervals for acceptance: bootstrap over prompts, counts first, ratios last.

Prompts are resampled; a replicate's rate is Σ accepted / Σ proposed, never a mean of ratios; a gain is paired.
Percentile intervals (Efron & Tibshirani 1993, §13.3), never narrower than Wilson's (1927) or, for a paired gain,
Newcombe's hybrid score interval (1998, method 10). Why: docs/architecture.md#specdraftcorestats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Replicates per interval: the 2.5% quantile sits on the 250th value.
N_BOOTSTRAP = 10_000

#: Fewer prompts than this and an interval is printed marked (Estimate.thin).
MIN_PROMPTS = 10

_BLOCK = 1_000


@dataclass(frozen=True)
class Estimate:
    """A ratio of summed counts (or a difference of two) with its bootstrap interval.

    ``value`` is from all prompts; ``low``/``high`` the replicates' quantiles, widened to ``floor``'s bound
    (``"wilson"`` / ``"newcombe"``, else None) where that is wider.
    """

    value: float
    low: float
    high: float
    level: float
    prompts: int
    replicates: int
    floor: str | None = None

    @property
    def thin(self) -> bool:
        """Fewer than :data:`MIN_PROMPTS` prompts: the interval says little about prompts not seen."""
        return self.prompts < MIN_PROMPTS

    @property
    def interval(self) -> list[float]:
        """``[low, high]`` (JSON-friendly)."""
        return [self.low, self.high]

    def to_dict(self) -> dict[str, Any]:
        out = {"value": self.value, "ci": self.interval, "level": self.level, "prompts": self.prompts,
               "replicates": self.replicates}
        return out | ({"floor": self.floor} if self.floor else {})


def _counts(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected one count per prompt (a 1-D sequence), got shape {a.shape}")
    if (a < 0).any() or not np.isfinite(a).all():
        raise ValueError(f"{name}: counts must be finite and ≥ 0")
    return a


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Σnum / Σden along the last axis; 0 where nothing was proposed."""
    n, d = num.sum(-1), den.sum(-1)
    return np.divide(n, d, out=np.zeros_like(n, dtype=np.float64), where=d > 0)


def _replicates(n: int, n_boot: int, seed: int):
    """Blocks of ``[b, n]`` prompt indices drawn with replacement."""
    rng = np.random.default_rng(seed)
    for start in range(0, n_boot, _BLOCK):
        yield rng.integers(0, n, size=(min(_BLOCK, n_boot - start), n))


def _estimate(value: float, reps: np.ndarray, level: float, n: int,
              floor: tuple[str, float, float] | None = None) -> Estimate:
    """The percentile interval of ``reps``, each end widened to ``floor = (name, low, high)``."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = (1 - level) / 2
    low, high = (float(x) for x in np.quantile(reps, [tail, 1 - tail]))
    name = None
    if floor is not None and (floor[1] < low or floor[2] > high):
        name, low, high = floor[0], min(low, floor[1]), max(high, floor[2])
    return Estimate(float(value), low, high, level, n, len(reps), name)


def wilson_interval(successes: float, trials: float, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of ``successes / trials`` (Wilson 1927); ``(0.0, 1.0)`` for no trials.
    Raises ValueError: a level outside (0, 1), ``successes`` outside [0, trials]."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must lie in [0, trials], got {successes} of {trials}")
    if trials == 0:
        return 0.0, 1.0
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + level / 2))
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * float(np.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)))
    return max(0.0, centre - half), min(1.0, centre + half)


def _wilson_floor(num: np.ndarray, den: np.ndarray, level: float) -> tuple[str, float, float] | None:
    """The Wilson bound of Σnum / Σden when the counts are a proportion, else None."""
    if (num > den).any() or den.sum() == 0:
        return None
    return ("wilson", *wilson_interval(float(num.sum()), float(den.sum()), level))


def _newcombe_floor(nb: np.ndarray, db: np.ndarray, na: np.ndarray, da: np.ndarray,
                    level: float) -> tuple[str, float, float] | None:
    """Newcombe's hybrid score interval (1998, method 10) of after − before, or None."""
    if (nb > db).any() or (na > da).any() or db.sum() == 0 or da.sum() == 0:
        return None
    pb, pa = nb.sum() / db.sum(), na.sum() / da.sum()
    (lb, ub), (la, ua) = wilson_interval(nb.sum(), db.sum(), level), wilson_interval(na.sum(), da.sum(), level)
    d = pa - pb
    return ("newcombe", float(d - np.hypot(pa - la, ub - pb)), float(d + np.hypot(ua - pa, pb - lb)))


def ratio_ci(numerators: Sequence[float], denominators: Sequence[float], *, level: float = 0.95,
             n_boot: int = N_BOOTSTRAP, seed: int = 0) -> Estimate:
    """Σ numerators / Σ denominators (0 when Σ denominators = 0) with a bootstrap interval over prompts.

    ``numerators``, ``denominators``: ``[n]`` per-prompt counts (accepted; proposed or reached). Where every numerator
    ≤ its denominator the interval is never narrower than Wilson's (``floor="wilson"``). Same seed → same interval.
    Raises ValueError: no prompts, lengths that differ, negative or non-finite counts, a level outside (0, 1).
    """
    num, den = _counts(numerators, "numerators"), _counts(denominators, "denominators")
    if len(num) != len(den):
        raise ValueError(f"{len(num)} numerators but {len(den)} denominators: one of each per prompt")
    if len(num) == 0:
        raise ValueError("no prompts to resample")
    reps = np.concatenate([_ratio(num[idx], den[idx]) for idx in _replicates(len(num), n_boot, seed)])
    return _estimate(_ratio(num, den), reps, level, len(num), _wilson_floor(num, den, level))


def _paired(**named: Sequence[float]) -> list[np.ndarray]:
    """The checked count arrays of a paired comparison, in argument order; ValueError when not paired."""
    arrays = [_counts(a, name) for name, a in named.items()]
    if len({len(a) for a in arrays}) != 1:
        raise ValueError(f"paired counts need one entry per prompt on both sides, got lengths "
                         f"{[len(a) for a in arrays]}")
    if len(arrays[0]) == 0:
        raise ValueError("no prompts to resample")
    return arrays


def paired_difference_ci(num_before: Sequence[float], den_before: Sequence[float], num_after: Sequence[float],
                         den_after: Sequence[float], *, level: float = 0.95, n_boot: int = N_BOOTSTRAP,
                         seed: int = 0) -> Estimate:
    """(Σnum_after / Σden_after) − (Σnum_before / Σden_before) with a paired bootstrap interval.

    Entry k of all four is prompt k; each replicate resamples the same prompts on both sides. When every replicate
    agrees (zero width) and both sides are proportions, the interval is Newcombe's (``floor="newcombe"``).
    Raises ValueError: sequences of different lengths, no prompts, bad counts or level.
    """
    nb, db, na, da = _paired(num_before=num_before, den_before=den_before, num_after=num_after, den_after=den_after)
    reps = np.concatenate([_ratio(na[idx], da[idx]) - _ratio(nb[idx], db[idx])
                           for idx in _replicates(len(nb), n_boot, seed)])
    floor = _newcombe_floor(nb, db, na, da, level) if np.ptp(reps) <= 1e-12 else None  # all agree, up to rounding
    return _estimate(_ratio(na, da) - _ratio(nb, db), reps, level, len(nb), floor)


def paired_gain_from_rows(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]], *,
                          numerator: str = "accepted", denominator: str = "proposed", level: float = 0.95,
                          n_boot: int = N_BOOTSTRAP, seed: int = 0) -> Estimate | None:
    """:func:`paired_difference_ci` from two ``EvalResult.per_prompt`` row lists, matched by ``id``.

    Returns None when a row lacks the count keys.
    Raises ValueError: not the same prompt ids (the differing ones are named), or an id occurring twice.
    """
    if any(numerator not in r or denominator not in r for r in (*before, *after)):
        return None
    index = {}
    for side, rows in (("before", before), ("after", after)):
        ids = [r["id"] for r in rows]
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompt ids repeat in the {side} evaluation: cannot pair them")
        index[side] = {r["id"]: r for r in rows}
    if index["before"].keys() != index["after"].keys():
        only_b = sorted(index["before"].keys() - index["after"].keys())
        only_a = sorted(index["after"].keys() - index["before"].keys())
        raise ValueError(f"not the same prompts: only before {only_b[:5]}, only after {only_a[:5]}")
    ids = [r["id"] for r in before]

    def col(side: str, key: str) -> list[float]:
        return [index[side][i][key] for i in ids]

    return paired_difference_ci(col("before", numerator), col("before", denominator), col("after", numerator),
                                col("after", denominator), level=level, n_boot=n_boot, seed=seed)


def paired_ratio_ci(num_a: Sequence[float], den_a: Sequence[float], num_b: Sequence[float], den_b: Sequence[float],
                    *, level: float = 0.95, n_boot: int = N_BOOTSTRAP, seed: int = 0) -> Estimate:
    """(Σnum_a / Σden_a) / (Σnum_b / Σden_b) with a paired bootstrap interval (a speed-up; 0 where b is 0).
    Raises ValueError: sequences of different lengths, no prompts, bad counts or level."""
    na, da, nb, db = _paired(num_a=num_a, den_a=den_a, num_b=num_b, den_b=den_b)

    def ratio(ra: np.ndarray, rb: np.ndarray) -> np.ndarray:
        return np.divide(ra, rb, out=np.zeros_like(ra, dtype=np.float64), where=rb > 0)

    reps = np.concatenate([ratio(_ratio(na[idx], da[idx]), _ratio(nb[idx], db[idx]))
                           for idx in _replicates(len(na), n_boot, seed)])
    value = ratio(np.asarray(_ratio(na, da)), np.asarray(_ratio(nb, db)))
    return _estimate(float(value), reps, level, len(na))


def chi2_goodness_of_fit(samples, law) -> tuple[float, int]:
    """χ² test of sampled token tuples against an exact ``law`` (``[V]`` or ``[V, V]`` probabilities).

    Returns ``(p_value, outside_support)``: scipy's ``chisquare`` p-value, cells of expected count < 5 merged into
    one, and the number of samples in cells of probability 0.
    """
    from scipy.stats import chisquare

    observed = np.zeros_like(law, dtype=np.float64)
    for s in samples:
        observed[tuple(s[: law.ndim])] += 1
    n = observed.sum()
    expected = (law / law.sum()).flatten() * n
    obs = observed.flatten()
    big = expected >= 5
    exp_cells = np.append(expected[big], expected[~big].sum())
    obs_cells = np.append(obs[big], obs[~big].sum())
    if exp_cells[-1] == 0:
        exp_cells, obs_cells = exp_cells[:-1], obs_cells[:-1]
    return float(chisquare(obs_cells, exp_cells).pvalue), int(obs[expected == 0].sum())
