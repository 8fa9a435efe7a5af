"""Calibration: the pair's measured costs (the speed model), their cache, and the machine-load monitor.

:func:`calibrate` is the one rule every stage uses: costs measured on the prompt of median length, γ's bound
``max(γ, 8)``, read from and written to the calibration cache (:func:`cached_speed_model`).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specdraft.core.config import EvalConfig
from specdraft.core.embedded import cache_root
from specdraft.core.io import atomic_write_text, cpu_model
from specdraft.core.sampling import output_width
from specdraft.decoding.decode import check_decode_context
from specdraft.decoding.draft_model import describe_draft
from specdraft.decoding.drafters import Stream
from specdraft.decoding.speed import SpeedModel
from specdraft.models.loading import model_fingerprint


@torch.no_grad()
def pass_seconds(model, context: Sequence[int], widths: Sequence[int], repeats: int = 3, warmup: int = 1,
                 last_only: bool = False,
                 on_warmup: Callable[[float, float], None] | None = None) -> tuple[dict[int, float], float]:
    """Seconds of one forward pass over k new tokens after reading ``context``, batch 1, for each k in ``widths``.

    Passes run as decoding runs them (:class:`~specdraft.decoding.drafters.Stream`), rolled back after each; widths interleave
    within a repeat so machine noise hits them alike. ``last_only`` scores only the last position (a draft step).
    Returns ``({k: median seconds}, prefill_seconds)``.
    """
    device = next(model.parameters()).device
    width = output_width(model)
    stream = Stream(model, 1, width, width, device)
    ids = torch.tensor([list(context)], device=device)
    prefill = []
    for _ in range(2):
        t0 = time.perf_counter()
        stream.forward(ids[:, :-1], torch.ones_like(ids[:, :-1]), logits_to_keep=1)
        prefill.append(time.perf_counter() - t0)
        if len(prefill) < 2:
            stream.keep(0, torch.zeros(1, dtype=torch.long, device=device))
    start = stream.length
    new = ids[:, -1:].repeat(1, max(widths))  # the content of the tokens does not change the cost
    samples: dict[int, list[float]] = {k: [] for k in widths}
    round_start = time.perf_counter()
    for r in range(warmup + repeats):
        if r == warmup and warmup and on_warmup is not None:
            on_warmup(sum(prefill), (time.perf_counter() - round_start) / warmup)
        for k in widths:
            t0 = time.perf_counter()
            stream.forward(new[:, :k], torch.ones_like(new[:, :k]), logits_to_keep=1 if last_only else 0)
            if r >= warmup:
                samples[k].append(time.perf_counter() - t0)
            stream.keep(start, torch.zeros(1, dtype=torch.long, device=device))
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}, min(prefill)


def _parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _duration(seconds: float) -> str:
    """``"40 s"`` below two minutes, ``"6 min"`` above."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def measure_speed_model(target, draft, context: Sequence[int], max_gamma: int = 8, repeats: int = 3,
                        draft_context: Sequence[int] | None = None,
                        say: Callable[[str], None] | None = None) -> SpeedModel:
    """The pair's :class:`~specdraft.decoding.speed.SpeedModel`: t(k) for k = 1..max_gamma+1 (least-squares
    line, :meth:`SpeedModel.from_measurements`), d (one draft token) and both prefills, after reading ``context``
    (``draft_context`` in a mapped draft's ids). Takes ``(warmup + repeats) · (max_gamma + 1)`` target passes."""
    widths = max_gamma + 1
    if say is not None:
        say(f"calibrating the pair's speed model (once per pair and machine, then cached): {(repeats + 1) * widths} "
            f"target passes of 1-{widths} tokens and {repeats + 3} draft steps after a {len(context)}-token prompt")
    t0 = time.perf_counter()

    def eta(prefill_s: float, round_s: float) -> None:
        share = _parameters(draft) / max(_parameters(target), 1)
        left = repeats * round_s + share * (prefill_s + (repeats + 3) * round_s / widths)
        say(f"calibrating: {time.perf_counter() - t0:.0f} s so far, about {_duration(left)} left")

    t, t_prefill = pass_seconds(target, context, range(1, widths + 1), repeats=repeats,
                                **({"on_warmup": eta} if say is not None else {}))
    d, d_prefill = pass_seconds(draft, draft_context or context, [1], repeats=repeats + 2, last_only=True)
    return SpeedModel.from_measurements(t, d[1], target_prefill_s=t_prefill, draft_prefill_s=d_prefill,
                                        context=len(context))


#: Other processes' CPU share (0..1) above which timings are marked busy.
BUSY_SHARE = 0.2


def _cpu_jiffies() -> tuple[int, int] | None:
    """``(busy, total)`` jiffies of all CPUs since boot (``/proc/stat``), or ``None`` where it cannot be read."""
    try:
        fields_ = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields_[3] + (fields_[4] if len(fields_) > 4 else 0)  # idle + iowait
    return sum(fields_[:8]) - idle, sum(fields_[:8])


class LoadMonitor:
    """How busy the machine was while a timed stage ran: ``others_share`` (0..1, other processes' CPU time
    from ``/proc/stat``) and ``busy`` (share > :data:`BUSY_SHARE`); None / False without ``/proc/stat``."""

    def __enter__(self) -> LoadMonitor:  # noqa: PYI034
        self._start, self._own = _cpu_jiffies(), sum(os.times()[:2])
        self._t0 = time.perf_counter()
        self.others_share: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        end = _cpu_jiffies()
        if self._start is None or end is None:
            return
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy, total = end[0] - self._start[0], end[1] - self._start[1]
        own = (sum(os.times()[:2]) - self._own) * hz
        if total > 0:
            self.others_share = max(0.0, min(1.0, (busy - own) / total))

    @property
    def busy(self) -> bool:
        return self.others_share is not None and self.others_share > BUSY_SHARE

    def to_dict(self) -> dict[str, Any]:
        return {"others_cpu_share": self.others_share, "busy": self.busy, "threshold": BUSY_SHARE}


#: Version of the calibration cache's key and layout; a change misses every entry.
SPEED_CACHE_FORMAT = 1


def speed_cache_key(target, draft, max_gamma: int) -> dict[str, Any]:
    """What a calibration depends on: both models' fingerprints, the draft's preparation, γ's bound,
    device, CPU, torch version and threads, OpenMP's wait policy."""
    cpu = cpu_model()
    device = next(target.parameters()).device
    return {"format": SPEED_CACHE_FORMAT, "target": model_fingerprint(target), "draft": model_fingerprint(draft),
            "preparation": describe_draft(draft), "max_gamma": max_gamma, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
            "cpu_count": os.cpu_count(), "dtype": str(next(target.parameters()).dtype)} | machine_info()


def calibration_context(prompt_ids: Sequence[Sequence[int]]) -> list[int]:
    """The prompt of median length among ``prompt_ids`` (ties by order), ``[]`` when there is none."""
    return list(sorted(prompt_ids, key=len)[len(prompt_ids) // 2]) if prompt_ids else []


def cached_speed_model(target, draft, context: Sequence[int], max_gamma: int = 8, repeats: int = 3,
                       draft_context: Sequence[int] | None = None, cache_dir: str | Path | None = None,
                       refresh: bool = False, say: Callable[[str], None] | None = None) -> tuple[SpeedModel, str]:
    """:func:`measure_speed_model`, measured once per :func:`speed_cache_key` and then read back.

    Entries (``cache_dir``, default ``$SPECDRAFT_SPEED_CACHE`` else ``$SPECDRAFT_CACHE/speed``) are JSON files named
    by the key's sha256 and used only when the stored key matches. A busy-machine measurement is not cached; a hit
    whose
    spot check disagrees (:func:`_stale_costs`) is re-measured. Returns ``(speed_model, source)``.
    """
    import hashlib


    key = speed_cache_key(target, draft, max_gamma)
    root = Path(cache_dir or os.environ.get("SPECDRAFT_SPEED_CACHE") or cache_root() / "speed")
    path = root / (hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32] + ".json")
    refresh_reason = None
    if not refresh and path.is_file():
        cached = None
        with contextlib.suppress(ValueError, KeyError, TypeError):
            saved = json.loads(path.read_text())
            if json.loads(json.dumps(key, default=str)) == saved["key"]:
                cached = SpeedModel.from_dict(saved["speed_model"])
        if cached is not None:
            if say is not None:
                say("speed model: found in the calibration cache, spot-checking it (a few passes)")
            refresh_reason = _stale_costs(cached, target, draft, context, draft_context)
            if refresh_reason is None:
                return cached, f"cache, measured {saved.get('measured_at', 'at an unrecorded time')}: {path}"
            if say is not None:
                say(f"speed model: the cached one no longer fits this machine ({refresh_reason}); measuring again")
    with LoadMonitor() as load:
        speed = measure_speed_model(target, draft, context, max_gamma=max_gamma, repeats=repeats,
                                    draft_context=draft_context, say=say)
    if load.busy:  # costs measured beside other work would price every later run wrongly: not cached
        return speed, f"measured on a busy machine (other processes held {load.others_share:.0%} of the CPU; not cached)"
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "speed_model": speed.to_dict(),
                                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, default=str, indent=1))
    return speed, (f"measured ({refresh_reason})" if refresh_reason else "measured")


#: Spot-check bounds: the same machine kind can run at half speed another day.
STALE_FACTOR = 1.5
STALE_ABS_S = 0.02


def _stale_costs(cached: SpeedModel, target, draft, context: Sequence[int],
                 draft_context: Sequence[int] | None) -> str | None:
    """Why a cached calibration is stale (t(1) or d off in two spot checks in a row), or None."""
    def check() -> str | None:
        t, _ = pass_seconds(target, context, [1], repeats=2)
        d, _ = pass_seconds(draft, draft_context or context, [1], repeats=2, last_only=True)
        for name, now, then in (("t(1)", t[1], cached.target_s[0]), ("d", d[1], cached.draft_s)):
            if abs(now - then) > STALE_ABS_S and not (1 / STALE_FACTOR <= now / max(then, 1e-12) <= STALE_FACTOR):
                return f"the cached costs were stale: {name} {now * 1e3:.1f} ms now, {then * 1e3:.1f} ms cached"
        return None

    # Two checks in a row: one hiccup of the machine is not a new day.
    return check() and check()


def machine_info() -> dict[str, Any]:
    """What speeds depend on besides the models: torch threads, ``OMP_WAIT_POLICY``, CPU, torch version."""
    return {"cpu_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
            "machine": platform.machine(), "torch": torch.__version__}


def machine_line() -> str:
    """:func:`machine_info` as the one line the benchmark results carry: ``"x86_64, 2 threads, OMP_WAIT_POLICY=…"``."""
    m = machine_info()
    return f"{m['machine']}, {m['cpu_threads']} threads, OMP_WAIT_POLICY={m['omp_wait_policy']}"


def calibrate(target, draft, prompt_ids: Sequence[Sequence[int]], config: EvalConfig,
              vocab_mapping=None, say: Callable[[str], None] | None = None) -> tuple[SpeedModel, str] | None:
    """The pair's :class:`~specdraft.decoding.speed.SpeedModel` and its source, or None without a prompt of 2+ tokens.

    Measured on :func:`calibration_context` (re-encoded for a mapped draft), γ bound
    ``max(config.num_speculative_tokens, 8)``, cache as ``config`` says. Raises
    :class:`specdraft.core.sampling.ContextWindowError` before calibrating when a prompt would exceed a window.
    """
    if prompt_ids:
        check_decode_context(max(len(p) for p in prompt_ids), config.max_new_tokens, config.num_speculative_tokens,
                             target, None if vocab_mapping is not None else draft)
    calib = calibration_context(prompt_ids)
    if len(calib) < 2:
        return None
    d_calib = vocab_mapping.reencode_batch_for_draft([list(calib)])[0] if vocab_mapping is not None else None
    return cached_speed_model(target, draft, calib, max_gamma=max(config.num_speculative_tokens, 8),
                              draft_context=d_calib if d_calib and len(d_calib) >= 2 else None,
                              cache_dir=config.speed_cache_dir, refresh=not config.speed_cache, say=say)


def gemv_gb_s(dtype: str = "bfloat16", rows: int = 8960, cols: int = 1536, reps: int = 100, rounds: int = 5) -> float:
    """This machine's matrix-vector throughput now, GB of weights per second: a [1, cols] × [cols, rows]
    product in ``dtype``, the best of ``rounds``. A batch-1 decode step is bounded by it. About 0.5 s."""
    dt = getattr(torch, dtype)
    w, x = torch.randn(rows, cols).to(dt), torch.randn(1, cols).to(dt)
    for _ in range(20):
        torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return w.numel() * w.element_size() * reps / best / 1e9
