"""How much faster will it be? Predicted α, measured acceptance and tokens/s, the analytic bound, the best γ.

``evaluate`` runs, prompt by prompt and interleaved (so that machine noise hits all contenders alike):
the target alone, speculative decoding, and optionally transformers' assisted generation
(``generate(assistant_model=draft)``). Greedy outputs must match the target alone token for token; every
divergence is reported with the target's top-2 logit margin at that position, and a divergence whose margin
exceeds the dtype's rounding tolerance is a failure, not numerics.

Like with like: every contender gets the same explicit settings — sampling, max new tokens, EOS ids, γ — and
nothing else. transformers would otherwise fill every field a call leaves unset from the model's own
``generation_config`` (a checkpoint's ``repetition_penalty``, ``top_k``, ``do_sample``…), which specdraft never
applies; so assisted generation runs with a complete :class:`~transformers.GenerationConfig`
(:func:`hf_generation_config`) standing in for both models' own during the call. Each contender's effective
settings are recorded in ``config["contenders"]`` (``report.json``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdraft.acceptance import AcceptanceCounts, best_gamma, expected_speedup, expected_tokens_per_pass
from specdraft.config import EvalConfig, SamplingConfig
from specdraft.decode import (
    DecodeError,
    _Stream,
    left_pad,
    proposal_mode,
    speculative_generate,
    target_generate,
)
from specdraft.draft_model import (
    HEAD_TOKENS_FILE,
    choose_draft_options,
    default_head_corpus,
    describe_draft,
    draft_label,
    frequent_tokens,
    load_head_tokens,
    prepare_draft,
)
from specdraft.losses import sum_min
from specdraft.models import takes_logits_to_keep
from specdraft.sampling import align_logits, check_token_ids, filtered_probs, greedy_probs, output_width
from specdraft.speed import SpeedModel
from specdraft.stats import ratio_ci

# Largest top-2 logit margin (logit units) that a change of pass shape (1 token vs γ+1 tokens) can flip by
# rounding alone. bf16 keeps 8 significand bits: logits of magnitude ~20 are spaced 0.125 apart, and errors
# accumulate over layers, so 0.5 is a conservative bound; fp32 differences are ~1e-5.
ROUNDING_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}


@torch.no_grad()
def _tail_logits(model, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, keep: int) -> torch.Tensor:
    """``[B, keep, V]`` logits of the last ``keep`` positions of a left-padded batch. The output head runs only
    there (transformers' ``logits_to_keep``: the head is applied to ``hidden_states[:, -keep:]``) when the model's
    forward takes it; otherwise every position is scored and the tail is sliced (same values)."""
    if 0 < keep < ids.shape[1] and takes_logits_to_keep(model):
        return model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=keep).logits
    return model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -keep:]


def predicted_alpha(
    target,
    draft,
    sequences: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]] | None = None,
    sampling: SamplingConfig | None = None,
    real_vocab: int | None = None,
    batch_size: int = 4,
    pad_id: int = 0,
) -> dict[str, Any]:
    """Teacher-forced α: mean over positions of Σ_x min(p(x), q(x)), no decoding.

    Both models score each sequence once; at every position where ``masks`` is 1 (default: every position
    but the last) α = Σ min(p, q) with p and q after the serving filter (greedy: one-hot argmax, so α is the
    argmax agreement).

    Args:
        sequences: token id lists (a prompt, or a prompt plus a response).
        masks: per sequence, 1 where the next-token distribution counts (same length as the sequence).
        sampling: the serving filter; greedy by default.
        real_vocab: ``len(tokenizer)``: ids past it are padding rows with zero probability.

    Returns:
        ``{"alpha": float, "positions": int, "alpha_sum": float, "top1_agreement": float, "per_sequence":
        [[alpha_sum, positions], …], "draft_top1": [[id, …], …]}`` (counts first: sums and positions merge across
        calls and sequences; ``draft_top1``: per sequence the draft's argmax over the real vocabulary at each
        counted position, in order — what :func:`replay_greedy` compares with the target's answer).

    Both heads run only over the tail of each batch that holds counted positions (``logits_to_keep``): with masks
    over answers, the prompt positions are not scored.
    """
    sampling = sampling or SamplingConfig()
    width = output_width(target)
    total, n, agree = 0.0, 0, 0
    per_sequence: list[list[float]] = []
    draft_top1: list[list[int]] = []
    device = next(target.parameters()).device
    for start in range(0, len(sequences), batch_size):
        chunk = [list(s) for s in sequences[start:start + batch_size]]
        ids, attn = left_pad(chunk, pad_id, device)
        cm = torch.zeros_like(attn)
        for i, s in enumerate(chunk):
            m = list(masks[start + i]) if masks is not None else [1] * (len(s) - 1) + [0]
            if len(m) != len(s):
                raise ValueError(f"mask {start + i} has length {len(m)}, sequence has {len(s)}")
            cm[i, ids.shape[1] - len(s):] = torch.tensor(m, device=device)
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        counted = cm.any(0).nonzero()
        keep = ids.shape[1] - int(counted[0]) if len(counted) else 1  # the tail holding every counted position
        cm = cm[:, -keep:]
        p_logits = align_logits(_tail_logits(target, ids, attn, pos, keep), width, real_vocab)
        q_logits = align_logits(_tail_logits(draft, ids, attn, pos, keep), width, real_vocab)
        sel = cm.bool()
        p_l, q_l = p_logits[sel], q_logits[sel]  # [N, V]
        if sampling.greedy:
            p, q = greedy_probs(p_l), greedy_probs(q_l)
        else:
            p = filtered_probs(p_l, sampling.temperature, sampling.top_k, sampling.top_p)
            q = filtered_probs(q_l, sampling.temperature, sampling.top_k, sampling.top_p)
        a = sum_min(p, q).double()  # [N]
        row = sel.nonzero()[:, 0]  # the sequence of each selected position
        sums = torch.zeros(len(chunk), dtype=torch.float64, device=a.device).index_add_(0, row, a)
        per_sequence += [[float(x), int(c)] for x, c in zip(sums.tolist(), sel.sum(1).tolist())]
        q_top1 = q_l.argmax(-1)
        draft_top1 += [q_top1[row == i].tolist() for i in range(len(chunk))]
        total += float(a.sum())
        agree += int((p_l.argmax(-1) == q_top1).sum())
        n += int(sel.sum())
    # Σ min(p, q) ≤ 1 per position; float rounding of the filtered distributions may overshoot by ~1e-6.
    return {"alpha": min(total / n, 1.0) if n else 0.0, "positions": n, "alpha_sum": total,
            "top1_agreement": agree / n if n else 0.0, "per_sequence": per_sequence, "draft_top1": draft_top1}


@torch.no_grad()
def replay_greedy(
    draft,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos_token_id: Sequence[int] = (),
    real_vocab: int | None = None,
    batch_size: int = 4,
    pad_id: int = 0,
) -> list[AcceptanceCounts]:
    """Greedy speculative decoding's acceptance counts, replayed from one teacher-forced draft pass per prompt.

    Greedy verification accepts a drafted token iff it equals the target's argmax, and the output is the
    target's greedy response y. So inside a round that starts after y[:n], the draft's i-th proposal is read in
    the context y[:n + i] as long as the earlier ones were accepted: the round accepts exactly the run of
    positions n, n+1, … (at most k) where the draft's teacher-forced argmax equals y, and the target then emits
    y[n + accepted]. Replaying :func:`~specdraft.decode.speculative_generate`'s rounds (batch 1: k = min(γ,
    what the row can still emit − 1), an EOS or the length bound ending a row, a row ending inside the accepted
    block) over that agreement vector gives its counts without decoding; only rounding differs (a full-sequence
    pass vs cached steps can flip a near-tie argmax in bfloat16), which :func:`run_eval` can check against
    decoded counts. One target answer serves every draft compared on it (before/after distillation, paired).

    Args:
        draft: causal LM sharing the target's tokenizer.
        prompts: ``[n]`` prompt id lists; ``responses``: ``[n]`` the target's greedy answers (EOS included).
        num_speculative_tokens: γ; ``max_new_tokens``: the bound the answers were generated with.
        eos_token_id: ids that end a row (as given to the decoding).
        real_vocab: ids at or past it are padding rows (never proposed).

    Returns:
        ``[n]`` :class:`~specdraft.acceptance.AcceptanceCounts` (no timings), one per prompt.
    """
    eos = set(eos_token_id)
    width = draft.get_output_embeddings().weight.shape[0]
    device = next(draft.parameters()).device
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = [(list(p), list(r)) for p, r in zip(prompts[start:start + batch_size],
                                                    responses[start:start + batch_size], strict=True)]
        ids, attn = left_pad([p + r for p, r in chunk], pad_id, device)
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        keep = max(len(r) for _, r in chunk) + 1  # the head scores only the answers' predicting positions
        guess = align_logits(_tail_logits(draft, ids, attn, pos, keep), width, real_vocab).argmax(-1)  # [b, keep]
        for i, (p, y) in enumerate(chunk):
            first = keep - len(y) - 1  # left padding: the last prompt position predicts y[0]
            out.append(_replay_answer(guess[i, first:first + len(y)].tolist(), y, num_speculative_tokens,
                                      max_new_tokens, eos))
    return out


def _replay_answer(draft_top1: Sequence[int], y: list[int], gamma: int, max_new_tokens: int,
                   eos: set[int]) -> AcceptanceCounts:
    """:func:`_replay_rounds` from the draft's teacher-forced argmax at each answer position (``draft_top1[j]``
    predicts ``y[j]``): the one place a replay turns argmaxes into matches."""
    return _replay_rounds([int(g) == t for g, t in zip(draft_top1, y)], y, gamma, max_new_tokens, eos)


def _replay_rounds(match: list[bool], y: list[int], gamma: int, max_new_tokens: int, eos: set[int]) -> AcceptanceCounts:
    """The rounds of greedy speculative decoding (batch 1) over the agreement vector ``match`` (see
    :func:`replay_greedy`), recorded as :meth:`AcceptanceCounts.record_round` is by the decoder."""
    counts = AcceptanceCounts(gamma)
    n = 0
    while n < len(y):
        k = max(0, min(gamma, max_new_tokens - n - 1))
        acc = 0
        while acc < k and n + acc < len(y) and match[n + acc]:
            acc += 1
        kept, ended = 0, False
        for t in range(acc + 1):  # the accepted drafts, then the target's own token
            if n + t >= len(y):
                break
            kept += 1
            ended = y[n + t] in eos or n + t + 1 >= max_new_tokens
            if ended:
                break
        if ended and kept <= acc:  # ended inside the accepted block: no target token
            counts.record_round(kept, n_proposed=kept, bonus=False)
        else:
            counts.record_round(acc, n_proposed=k, bonus=True)
        n += kept
        if ended:
            break
    return counts


@torch.no_grad()
def top2_margin(target, context: Sequence[int]) -> float:
    """Target's top-1 minus top-2 logit for the token after ``context`` (one plain forward pass)."""
    device = next(target.parameters()).device
    logits = target(torch.tensor([list(context)], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@torch.no_grad()
def pass_seconds(model, context: Sequence[int], widths: Sequence[int], repeats: int = 3, warmup: int = 1,
                 last_only: bool = False) -> tuple[dict[int, float], float]:
    """Wall-clock cost of one forward pass over k new tokens after reading ``context``, batch 1, for each k.

    The pass runs as decoding runs it (:class:`~specdraft.decode._Stream`: the same cache, masks and logits); the
    k new tokens are rolled back after each pass, so every pass sees the same ``len(context)`` cached tokens. The
    widths are interleaved within each repeat, so machine noise hits them alike.

    Args:
        model: a causal LM.
        context: token ids read first (≥ 2).
        widths: the k to time.
        repeats / warmup: timed / untimed rounds over all widths; the median of the timed ones is returned.
        last_only: score only the last position (a draft step) instead of all k (a verification pass).

    Returns:
        ``({k: seconds}, prefill_seconds)``: the median pass time per k, and the faster of two reads of
        ``context[:-1]`` (the prompt prefill decoding does).
    """
    device = next(model.parameters()).device
    width = output_width(model)
    stream = _Stream(model, 1, width, width, device)
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
    for r in range(warmup + repeats):
        for k in widths:
            t0 = time.perf_counter()
            stream.forward(new[:, :k], torch.ones_like(new[:, :k]), logits_to_keep=1 if last_only else 0)
            if r >= warmup:
                samples[k].append(time.perf_counter() - t0)
            stream.keep(start, torch.zeros(1, dtype=torch.long, device=device))
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}, min(prefill)


def measure_speed_model(target, draft, context: Sequence[int], max_gamma: int = 8, repeats: int = 3,
                        draft_context: Sequence[int] | None = None) -> SpeedModel:
    """The pair's :class:`~specdraft.speed.SpeedModel`: t(k) for k = 1..max_gamma+1 (target, all k positions
    scored, as verification does; the least-squares line through the timings, :meth:`SpeedModel.from_measurements`),
    d (draft, one token, last position scored), and both prompt prefills, measured after reading ``context``
    (``draft_context`` for a draft of another tokenizer: the context in its ids).

    Takes ``(warmup + repeats) · (max_gamma + 1)`` target passes (about 10 s for the 1.5B Qwen target on 2 CPU
    threads); speeds are those of the machine at the time, so measure on the machine that decodes.
    """
    t, t_prefill = pass_seconds(target, context, range(1, max_gamma + 2), repeats=repeats)
    d, d_prefill = pass_seconds(draft, draft_context or context, [1], repeats=repeats + 2, last_only=True)
    return SpeedModel.from_measurements(t, d[1], target_prefill_s=t_prefill, draft_prefill_s=d_prefill,
                                        context=len(context))


#: Other processes' share of the machine's CPU time (0..1) above which timings are marked as taken on a busy machine
#: (two low-priority jobs beside `make run` on 2 cores halved the target's tokens/s: 4.06 instead of ~7.4).
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
    """How busy the machine was, from the outside, while a timed stage ran: other processes' share of all CPU time.

    ``with LoadMonitor() as load: ...`` then ``load.others_share`` (0..1: CPU time of every other process over the
    machine's CPU time in the interval, from ``/proc/stat`` less this process's own ``os.times()``) and ``load.busy``
    (share > :data:`BUSY_SHARE`). ``None`` / False where ``/proc/stat`` does not exist.
    """

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


#: Version of the calibration cache's key and file layout (:func:`cached_speed_model`); a change misses every entry.
SPEED_CACHE_FORMAT = 1


@torch.no_grad()
def model_fingerprint(model) -> str:
    """A sha256 of what a model computes with, cheap enough to take before every evaluation: its class, config
    (without ``_name_or_path``), every parameter's and buffer's name, shape, dtype and device type, and up to 64 values
    read at a stride through each tensor (a changed weight, a distilled draft, a new quantisation all change it)."""
    import hashlib

    h = hashlib.sha256(type(model).__name__.encode())
    cfg = model.config.to_dict() if hasattr(model, "config") else {}
    cfg.pop("_name_or_path", None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            sample = flat[:: max(1, flat.numel() // 64)][:64]
            h.update(sample.to(torch.float32).cpu().numpy().tobytes() if sample.is_floating_point() or
                     sample.dtype == torch.bfloat16 else sample.to(torch.int64).cpu().numpy().tobytes())
    return h.hexdigest()


def speed_cache_key(target, draft, max_gamma: int) -> dict[str, Any]:
    """What a calibration depends on: both models (:func:`model_fingerprint`, the draft as prepared), the draft's
    preparation, γ's bound, the device, the machine (CPU model, cores), torch's version and threads, OpenMP's wait
    policy. Two calibrations with equal keys would measure the same costs up to machine noise."""
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    device = next(target.parameters()).device
    return {"format": SPEED_CACHE_FORMAT, "target": model_fingerprint(target), "draft": model_fingerprint(draft),
            "preparation": describe_draft(draft), "max_gamma": max_gamma, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
            "cpu_count": os.cpu_count(), "dtype": str(next(target.parameters()).dtype)} | machine_info()


def calibration_context(prompt_ids: Sequence[Sequence[int]]) -> list[int]:
    """The prompt the pair's costs are measured on (:func:`measure_speed_model`): the one of median length among
    ``prompt_ids`` (``[n]`` token id lists; ties broken by order), ``[]`` when there is none."""
    return list(sorted(prompt_ids, key=len)[len(prompt_ids) // 2]) if prompt_ids else []


def cached_speed_model(target, draft, context: Sequence[int], max_gamma: int = 8, repeats: int = 3,
                       draft_context: Sequence[int] | None = None, cache_dir: str | Path | None = None,
                       refresh: bool = False) -> tuple[SpeedModel, str]:
    """:func:`measure_speed_model`, measured once per :func:`speed_cache_key` and then read back.

    Entries live in ``cache_dir`` (default ``$SPECDRAFT_SPEED_CACHE``, else ``$SPECDRAFT_CACHE/speed``), one JSON file per key, named by the key's
    sha256 and holding the key itself: an entry is used only when its stored key equals this call's key in every
    field (a file renamed or written for other models, another preparation, thread count, torch or machine is a
    miss, never a hit), and is replaced atomically after a new measurement. The cached costs are those of the
    calibration context (``context`` of the first call).

    A calibration measured while other processes held more than :data:`BUSY_SHARE` of the CPU
    (:class:`LoadMonitor`) is returned but not cached. A hit is spot-checked first (:func:`_stale_costs`: t(1) and d
    timed now): the same machine kind can run at half the speed on another day, so a hit whose costs no longer hold
    is re-measured and replaced.

    Returns:
        ``(speed_model, source)``: source ``"cache, measured <ISO time>: <path of the entry>"``, ``"measured"``,
        ``"measured (the cached costs were stale: …)"``
        or ``"measured on a busy machine (…)"``.
    """
    import hashlib

    from specdraft.io import atomic_write_text
    from specdraft.models import cache_root

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
            refresh_reason = _stale_costs(cached, target, draft, context, draft_context)
            if refresh_reason is None:
                return cached, f"cache, measured {saved.get('measured_at', 'at an unrecorded time')}: {path}"
    with LoadMonitor() as load:
        speed = measure_speed_model(target, draft, context, max_gamma=max_gamma, repeats=repeats,
                                    draft_context=draft_context)
    if load.busy:  # costs measured beside other work would price every later run wrongly: not cached
        return speed, f"measured on a busy machine (other processes held {load.others_share:.0%} of the CPU; not cached)"
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "speed_model": speed.to_dict(),
                                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, default=str, indent=1))
    return speed, (f"measured ({refresh_reason})" if refresh_reason else "measured")


#: A cached calibration is re-measured when a spot check of t(1) or d differs from it by more than this factor and by
#: more than :data:`STALE_ABS_S` (the same VM kind ran the 1.5B bf16 target's step at 135 ms one day and 290 ms the
#: next: a key of models, machine, torch and threads cannot see that; a prediction off by +97% did).
STALE_FACTOR = 1.5
STALE_ABS_S = 0.02


def _stale_costs(cached: SpeedModel, target, draft, context: Sequence[int],
                 draft_context: Sequence[int] | None) -> str | None:
    """Spot-check a cached calibration: time t(1) and d now (2 repeats each, about one prefill and a few passes) and
    say why the cache is stale (both of two checks in a row), or ``None`` when t(1) and d agree with it within
    :data:`STALE_FACTOR` or :data:`STALE_ABS_S`."""
    def check() -> str | None:
        t, _ = pass_seconds(target, context, [1], repeats=2)
        d, _ = pass_seconds(draft, draft_context or context, [1], repeats=2, last_only=True)
        for name, now, then in (("t(1)", t[1], cached.target_s[0]), ("d", d[1], cached.draft_s)):
            if abs(now - then) > STALE_ABS_S and not (1 / STALE_FACTOR <= now / max(then, 1e-12) <= STALE_FACTOR):
                return f"the cached costs were stale: {name} {now * 1e3:.1f} ms now, {then * 1e3:.1f} ms cached"
        return None

    # Stale only when two spot checks in a row say so: one pass caught by a hiccup of the machine is not a new day.
    return check() and check()


@dataclass
class Divergence:
    """A prompt whose speculative (or HF assisted) output differs from the target alone."""

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


def machine_info() -> dict[str, Any]:
    """What the speeds depend on besides the models: torch's intra-op threads, OpenMP's wait policy (``"unset"`` =
    libgomp's default, which spins briefly between parallel regions; ``PASSIVE`` makes each of a CPU draft step's
    ~200 small operations wake a sleeping thread: the 0.5B int4 draft step 29-34 ms against 16-19 ms unset or
    ``ACTIVE``, 2 cores), the CPU architecture and torch's version."""
    return {"cpu_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
            "machine": platform.machine(), "torch": torch.__version__}


def machine_line() -> str:
    """:func:`machine_info` as the one line the benchmark results carry: ``"x86_64, 2 threads, OMP_WAIT_POLICY=…"``."""
    m = machine_info()
    return f"{m['machine']}, {m['cpu_threads']} threads, OMP_WAIT_POLICY={m['omp_wait_policy']}"


#: What the figures of ``report.json`` that could be confused are (written into it as ``definitions``).
REPORT_DEFINITIONS = {
    "summary.cost_ratio_c": "c of the analytic model (analytic_speedup, analytic_recommended_gamma): the mean draft "
    "step of the speculative run over the mean target pass of the target-alone run, both timed while decoding",
    "summary.speed_model.cost_ratio_c": "d / t(1) of the measured speed model (predicted_speedup, recommended_gamma): "
    "one draft step over one one-token target pass, timed apart before decoding at one prompt's context; it "
    "differs from summary.cost_ratio_c by timing noise and context length",
    "summary.acceptance_rate_ci95": "95% bootstrap interval over prompts; null with fewer than 2 prompts (one prompt "
    "gives no interval)",
}


@dataclass
class EvalResult:
    """Everything ``specdraft eval`` measured (counts first; ratios derived in :meth:`summary`)."""

    config: dict[str, Any]
    spec_counts: AcceptanceCounts
    target_counts: AcceptanceCounts
    target_tokens: int = 0
    spec_tokens: int = 0
    target_seconds: float = 0.0
    spec_seconds: float = 0.0
    hf_tokens: int = 0
    hf_seconds: float = 0.0
    hf_matches: int = 0
    prompts: int = 0
    predicted_prompt: dict[str, Any] = field(default_factory=dict)
    predicted_response: dict[str, Any] = field(default_factory=dict)
    speed_model: dict[str, Any] | None = None
    load: dict[str, Any] | None = None
    certificate: dict[str, Any] | None = None
    divergences: list[Divergence] = field(default_factory=list)
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=machine_info)

    def summary(self) -> dict[str, Any]:
        """Derived figures: tokens/s (tokens per wall-clock second), speed-ups, α, c, analytic bound, best γ.

        ``acceptance_rate_ci95`` / ``alpha_ci95``: ``[low, high]`` 95% bootstrap intervals over prompts
        (:func:`specdraft.stats.ratio_ci`, seed 0) from the per-prompt counts; ``None`` without them or with fewer
        than 2 prompts (one prompt gives no interval). ``cost_ratio_c`` is timed while decoding; the speed model's
        own ``cost_ratio_c`` is timed apart (:data:`REPORT_DEFINITIONS`)."""
        c = self.spec_counts
        gamma = self.config["num_speculative_tokens"]
        tps = lambda tok, s: tok / s if s else 0.0
        t_tps, s_tps, h_tps = tps(self.target_tokens, self.target_seconds), tps(self.spec_tokens, self.spec_seconds), \
            tps(self.hf_tokens, self.hf_seconds)
        # c = one draft step / one target pass, the latter from the target-only run (Leviathan et al. §3.4).
        draft_step = c.time_draft / c.draft_calls if c.draft_calls else 0.0
        target_pass = self.target_counts.time_target / self.target_counts.target_calls \
            if self.target_counts.target_calls else 0.0
        cost_ratio = draft_step / target_pass if target_pass else 0.0
        # The analytic model takes α = accepted / reached (the per-token acceptance probability), not
        # accepted / proposed, which also counts the drafts after a rejection that were never tested.
        alpha = c.alpha
        g_best, s_best = best_gamma(alpha, cost_ratio) if cost_ratio else (gamma, 0.0)
        speed = SpeedModel.from_dict(self.speed_model) if self.speed_model else None
        measured = s_tps / t_tps if t_tps else 0.0
        predicted = speed.predict(alpha, gamma, self.spec_tokens, self.prompts) if speed and self.prompts else None
        g_pred, s_pred = speed.best_gamma(alpha) if speed else (None, None)
        bugs = [d for d in self.divergences if not d.is_numerics and d.contender == "specdraft"]
        return {
            "prompts": self.prompts,
            "acceptance_rate": c.acceptance_rate,
            "acceptance_rate_ci95": self._ci("accepted", "proposed"),
            "alpha": alpha,
            "alpha_ci95": self._ci("accepted", "reached"),
            "mean_accepted_length": c.mean_accepted_length,
            "alpha_per_position": c.alpha_per_position,
            "predicted_alpha_prompt": self.predicted_prompt.get("alpha"),
            "predicted_alpha_response": self.predicted_response.get("alpha"),
            "target_tokens_per_s": t_tps,
            "speculative_tokens_per_s": s_tps,
            "speedup": s_tps / t_tps if t_tps else 0.0,
            "hf_assisted_tokens_per_s": h_tps if self.hf_seconds else None,
            "speedup_vs_hf_assisted": s_tps / h_tps if h_tps else None,
            "hf_assisted_matches_target": f"{self.hf_matches}/{self.prompts}" if self.hf_seconds else None,
            "cost_ratio_c": cost_ratio,
            "draft_step_ms": draft_step * 1e3,
            "target_pass_ms": target_pass * 1e3,
            "analytic_tokens_per_pass": expected_tokens_per_pass(alpha, gamma),
            "analytic_speedup": expected_speedup(alpha, gamma, cost_ratio),
            "share_of_analytic": (s_tps / t_tps) / expected_speedup(alpha, gamma, cost_ratio)
            if t_tps and cost_ratio else None,
            "recommended_gamma": g_pred if g_pred is not None else g_best,
            "predicted_speedup_at_recommended_gamma": s_pred if s_pred is not None else s_best,
            "analytic_recommended_gamma": g_best,
            "analytic_speedup_at_recommended_gamma": s_best,
            # The measured speed model (t(k), d, prefills; specdraft.speed) at the measured α: prefill included, so it
            # compares with the measured wall-clock speed-up. prediction_error = predicted / measured − 1.
            "predicted_speedup": predicted,
            "prediction_error": predicted / measured - 1 if predicted and measured else None,
            "speed_model": self.speed_model,
            "divergences": len([d for d in self.divergences if d.contender == "specdraft"]),
            "divergences_beyond_tolerance": len(bugs),
            "lossless": not bugs,
            # Other processes' share of the CPU while decoding (LoadMonitor): speeds measured on a busy machine are
            # marked, never silently reported as the pair's.
            "sampling_certificate": self.certificate,
            "machine_load": self.load,
            "busy_machine": bool(self.load and self.load.get("busy")),
        }

    def _ci(self, numerator: str, denominator: str) -> list[float] | None:
        rows = self.per_prompt
        # One prompt: every bootstrap replicate is that prompt, a zero-width interval that says nothing: none.
        if len(rows) < 2 or any(numerator not in r or denominator not in r for r in rows):
            return None
        return ratio_ci([r[numerator] for r in rows], [r[denominator] for r in rows]).interval

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "machine": self.machine,
            "summary": self.summary(),
            "speculative_counts": self.spec_counts.to_dict(),
            "target_counts": self.target_counts.to_dict(),
            "predicted_alpha": {"prompt": self.predicted_prompt, "response": self.predicted_response},
            "divergences": [d.__dict__ | {"is_numerics": d.is_numerics} for d in self.divergences],
            "per_prompt": self.per_prompt,
            "definitions": REPORT_DEFINITIONS,
        }


def eos_ids(model, tokenizer=None) -> list[int]:
    """The ids that end a row: :func:`specdraft.decode.stop_ids` (the one stop set)."""
    from specdraft.decode import stop_ids

    return stop_ids(model, tokenizer)


def hf_generation_config(sampling: SamplingConfig, max_new_tokens: int, eos_token_id: list[int], pad_token_id: int,
                         num_speculative_tokens: int, draft_confidence_threshold: float | None = None):
    """A complete, explicit ``transformers.GenerationConfig`` for assisted generation that matches specdraft's run.

    Every field transformers would otherwise default is set to its neutral global default (no penalty, no bias,
    no suppressed token, one beam), then ours: sampling (``top_k`` 0 = off in both), max new tokens, EOS and
    padding ids, and the drafting rule — γ tokens per round with a constant schedule, and the draft confidence
    threshold (0 = off, like ``draft_confidence_threshold=None``) instead of transformers' default 20 tokens
    and 0.4. Used with :func:`_models_generation_config`, so nothing comes from either model's own config.
    """
    from transformers import GenerationConfig

    # transformers' own table of the values it falls back to (5.x); the deprecated beam-group keys warn when set.
    # The length is max_new_tokens alone: a max_length / min_length beside it (the table's 20 and 0) makes every
    # generate call — the target's and each drafting round of the assistant's — warn "Both `max_new_tokens` and
    # `max_length` seem to have been set"; left None, transformers derives both from the *_new_tokens it is given.
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    for deprecated_or_length in ("num_beam_groups", "diversity_penalty", "max_length", "min_length"):
        defaults.pop(deprecated_or_length, None)
    gc = GenerationConfig(**defaults)
    gc.update(do_sample=not sampling.greedy, max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_id),
              pad_token_id=pad_token_id, num_assistant_tokens=num_speculative_tokens,
              num_assistant_tokens_schedule="constant", assistant_confidence_threshold=draft_confidence_threshold or 0.0)
    if not sampling.greedy:
        gc.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return gc


#: The one notice transformers logs about its own assisted-generation internals (5.x): its candidate generator calls
#: ``assistant_model.generate(generation_config=..., max_new_tokens=..., min_new_tokens=...)`` each drafting round,
#: which its deprecation check reports however the caller configured generation. Nothing a user can change.
_INTERNAL_NOTICE = "Passing `generation_config` together with generation-related arguments"
_CANDIDATE_GENERATOR = os.path.join("transformers", "generation", "candidate_generator.py")


class _CandidateGeneratorNotice(logging.Filter):
    """Drops :data:`_INTERNAL_NOTICE` when, and only when, transformers' candidate generator is on the stack that
    logs it (its own call to the assistant); every other record — that notice from a caller's own ``generate``
    call included — passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_INTERNAL_NOTICE):
            return True
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.endswith(_CANDIDATE_GENERATOR):
                return False
            frame = frame.f_back
        return True


@contextlib.contextmanager
def _models_generation_config(gc, target, draft):
    """Stand ``gc`` in for both models' ``generation_config`` during a ``generate`` call, then put theirs back.

    transformers fills every field a call leaves at ``None`` from ``self.generation_config`` and builds the
    assistant's settings from ``assistant_model.generation_config``; with ``gc`` in both places nothing of the
    checkpoints' own generation settings is used. The draft keeps its own special-token ids (another tokenizer).
    With a complete ``gc`` (:func:`hf_generation_config`) the call itself warns of nothing; the one notice about
    transformers' own drafting call is dropped for the call's duration (:class:`_CandidateGeneratorNotice`).
    """
    saved = [(m, m.generation_config) for m in (target, draft)]
    notice = _CandidateGeneratorNotice()
    log = logging.getLogger("transformers.generation.utils")
    log.addFilter(notice)
    try:
        if draft is not target:
            dgc = copy.deepcopy(gc)
            for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
                own = getattr(draft.generation_config, key, None)
                setattr(dgc, key, own if own is not None else getattr(gc, key))
            draft.generation_config = dgc
        target.generation_config = gc
        yield
    finally:
        log.removeFilter(notice)
        for m, own in reversed(saved):
            m.generation_config = own


def _specdraft_settings(config: EvalConfig, eos: list[int]) -> dict[str, Any]:
    """The settings specdraft's target-alone and speculative runs use, in transformers' field names."""
    s = config.sampling
    return {"do_sample": not s.greedy, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
            "max_new_tokens": config.max_new_tokens, "eos_token_id": eos,
            "logits_processors": "none: no repetition penalty, bias, suppressed or forced token"}


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _compare(target, prompt: Sequence[int], base: list[int], out: list[int], prompt_id: str, contender: str,
             tol: float, divergences: list[Divergence]) -> bool:
    """Greedy: does ``out`` equal the target alone (``base``)? A divergence is appended with the target's top-2
    logit margin at the first differing position."""
    pos = _first_difference(base, out)
    if pos is not None and pos < min(len(base), len(out)):
        margin = top2_margin(target, list(prompt) + base[:pos])
        divergences.append(Divergence(prompt_id, contender, pos, base[pos], out[pos], margin, tol))
    return pos is None


def prepared_draft(draft, tokenizer, config: EvalConfig, vocab_mapping=None, copy_model: bool = True):
    """The draft with ``config``'s draft options applied (:func:`specdraft.draft_model.choose_draft_options` decides
    what ``draft_quantization="auto"`` means, :func:`~specdraft.draft_model.prepare_draft` applies it; on a copy
    unless ``copy_model=False``); ``draft`` itself when there are none. The plan is kept on the returned model as
    ``specdraft_plan`` (a :class:`~specdraft.draft_model.DraftPlan`), and :func:`describe_draft` reports it.

    The trimmed head's tokens come from the draft's directory when it holds a saved ranking
    (:data:`specdraft.draft_model.HEAD_TOKENS_FILE`, written by the pipeline's export), else from the embedded
    training prompts; where they came from is ``describe_draft(...)["head_tokens_source"]``.

    The prepared copy is what specdraft's decoder runs; an exported speculator stays the dense draft (vLLM serves
    dense weights; :mod:`specdraft.export`).

    Raises:
        DecodeError: a trimmed head (``draft_head_tokens``) for a draft of another tokenizer (``vocab_mapping``).
        ValueError: a saved ranking counted with another tokenizer.
    """
    if config.draft_head_tokens and vocab_mapping is not None:
        raise DecodeError("--draft-head-tokens keeps the most frequent *target* tokens in the draft's head: it needs "
                          "a draft of the target's tokenizer (not --map-vocab)")
    plan = choose_draft_options(draft, config.draft_quantization, config.draft_head_tokens,
                                same_tokenizer=vocab_mapping is None)
    head_ids, source = None, None
    if plan.head_tokens is not None:
        # A speculator exported with its token ranking (head_tokens.json) keeps the tokens counted where it was made.
        path = getattr(draft.config, "_name_or_path", "") or ""
        head_ids = load_head_tokens(path, plan.head_tokens, tokenizer) if Path(path).is_dir() else None
        source = f"{Path(path) / HEAD_TOKENS_FILE}" if head_ids is not None else None
        if head_ids is None:
            corpus = default_head_corpus(tokenizer)
            head_ids = frequent_tokens(tokenizer, n=plan.head_tokens, token_lists=corpus)
            source = f"embedded training prompts (conversations + humaneval:0:100, {len(corpus)} prompts)"
    model = prepare_draft(draft, plan.quantization, head_ids, copy_model=copy_model)
    head = model.get_output_embeddings()
    if source is not None and hasattr(head, "token_ids"):
        head.source = source
    if model is not draft or not copy_model:
        model.specdraft_plan = plan
    return model


def draft_configuration(draft) -> dict[str, Any]:
    """The configuration a report names: :func:`describe_draft` of the model that ran, plus the plan's reason
    (``"reason"``) and its short label (``"label"``)."""
    info = describe_draft(draft)
    plan = getattr(draft, "specdraft_plan", None)
    return info | {"label": draft_label(info), "requested": plan.requested if plan else None,
                   "reason": plan.reason if plan else "the draft as given"}


@torch.no_grad()
def certify_sampling(target, draft, prompt: Sequence[int], sampling: SamplingConfig, draws: int,
                     num_speculative_tokens: int, *, real_vocab: int | None = None, pad_id: int = 0,
                     batch_size: int = 64, seed: int = 0, vocab_mapping=None) -> dict[str, Any]:
    """Is sampled speculative decoding exact on this pair? A χ² goodness-of-fit test of the first sampled token.

    ``draws`` rows of ``prompt`` (in batches of ``batch_size``) each emit one token by speculative sampling
    (:func:`~specdraft.decode.speculative_generate`, ``max_new_tokens=1``: a draft proposal, then acceptance with
    min(1, p/q) or a draw from the residual max(0, p − q)); the counts are tested against the target's own filtered
    law p of that position (one target forward pass; :func:`specdraft.sampling.filtered_probs`). Cells of expected
    count < 5 are merged into one (:func:`specdraft.testing.chi2_goodness_of_fit`). Leviathan et al. 2023, Thm 3.5:
    the emitted token's law is p whatever q is, so a small p-value (< 0.001 over enough draws) would be a bug.

    Returns:
        ``{"draws", "p_value", "outside_support"`` (draws of tokens with p = 0: must be 0),
        ``"cells"`` (χ² cells after merging), ``"top_tokens"`` ([[id, p, observed share], …] for the 5 likeliest),
        ``"passed"`` (p_value ≥ 0.001 and nothing outside the support)}.

    Raises:
        ValueError: greedy ``sampling`` (there the identity count is the certificate) or ``draws`` < 1.
    """
    import numpy as np

    from specdraft.testing import chi2_goodness_of_fit

    if sampling.greedy:
        raise ValueError("--certify tests sampled decoding; greedy output is certified token by token")
    if draws < 1:
        raise ValueError(f"--certify needs at least 1 draw (got {draws})")
    device = next(target.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    logits = align_logits(target(ids).logits[0, -1].float(), output_width(target), real_vocab)
    law = filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p).double().cpu().numpy()
    law = law / law.sum()
    gen = torch.Generator(device=device).manual_seed(seed)
    first: list[int] = []
    while len(first) < draws:
        b = min(batch_size, draws - len(first))
        inp, mask = left_pad([list(prompt)] * b, pad_id, device)
        out, _ = speculative_generate(target, draft, inp, mask, num_speculative_tokens=num_speculative_tokens,
                                      sampling=sampling, max_new_tokens=1, real_vocab=real_vocab, generator=gen,
                                      vocab_mapping=vocab_mapping)
        first += [row[0] for row in out]
    counts = np.bincount(first, minlength=law.shape[0])
    outside = int(counts[law == 0].sum())
    # A draw of a token p gives no mass is proof enough (and scipy's χ² refuses unequal totals).
    p_value = 0.0 if outside else chi2_goodness_of_fit([[t] for t in first], law)[0]
    top = np.argsort(-law)[:5]
    cells = int((law * draws >= 5).sum()) + int((law * draws < 5).any())
    return {"draws": draws, "p_value": p_value, "outside_support": outside, "cells": cells,
            "top_tokens": [[int(t), float(law[t]), float(counts[t] / draws)] for t in top],
            "passed": p_value >= 1e-3 and outside == 0}


def run_eval(
    target,
    draft,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    prompt_names: Sequence[str] | None = None,
    config: EvalConfig | None = None,
    *,
    vocab_mapping=None,
    progress: Callable[[int, int], None] | None = None,
    record: dict[str, Any] | None = None,
) -> EvalResult:
    """Decode each prompt with the target alone, with speculative decoding, and (optionally) with
    transformers' assisted generation, interleaved, batch 1; compare outputs; gather counts and times.

    Args:
        target, draft: loaded causal LMs sharing ``tokenizer`` (checked by the caller), or a draft of another
            tokenizer with ``vocab_mapping``.
        tokenizer: the target's tokenizer.
        prompt_ids: target token ids per prompt (chat template already applied).
        prompt_names: one name per prompt (default its index), in the per-prompt table.
        config: γ, max new tokens, sampling (greedy by default; sampled outputs are not compared token by token —
            they are random; the χ² tests cover the law), seed, the HF comparison, the mapped-proposal mode, the
            draft options (int8 weights, a trimmed head: applied to a copy of ``draft`` that speculative decoding
            and predicted α use; transformers' assisted generation gets ``draft`` as given) and the γ policy. The
            pair's costs are measured once first (:func:`measure_speed_model`, ~10 s on CPU for the default pair).
        vocab_mapping: :class:`~specdraft.vocab.VocabMapping` for a draft of another tokenizer (see
            :func:`~specdraft.decode.speculative_generate`). Predicted α (teacher-forced) needs aligned
            positions and is left out; transformers' assisted generation runs as its universal assisted
            generation (``tokenizer`` + ``assistant_tokenizer``), greedy only, since its sampled variant prunes
            the draft's output head in place.
        progress: called as ``progress(done, total)`` after each prompt.
        record: extra facts stored in the result's ``config`` (e.g. the model references).

    Every contender runs with the same explicit settings, none taken from the models' ``generation_config``
    (see the module docstring); ``result.config["contenders"]`` records each one's effective settings.

    Returns:
        :class:`EvalResult`.
    """
    config = config or EvalConfig()
    sampling, seed, max_new_tokens = config.sampling, config.seed, config.max_new_tokens
    mapped_proposals, compare_hf = config.mapped_proposals, config.compare_hf
    draft_confidence_threshold = config.draft_confidence_threshold
    names = list(prompt_names or [str(i) for i in range(len(prompt_ids))])
    real_vocab = len(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    tol = ROUNDING_TOLERANCE.get(dtype, 0.5)
    gamma = config.num_speculative_tokens
    res = EvalResult(
        config=(record or {}) | config.model_dump(exclude={"dtype"}) | {
            "dtype": str(dtype), "vocab_mapping": vocab_mapping.to_dict() if vocab_mapping is not None else None,
            "mapped_proposals": proposal_mode(mapped_proposals, sampling) if vocab_mapping is not None else None},
        spec_counts=AcceptanceCounts(gamma),
        target_counts=AcceptanceCounts(1),
    )
    spec_draft = prepared_draft(draft, tokenizer, config, vocab_mapping)
    res.config["draft_options"] = draft_configuration(spec_draft)
    # The pair's costs, measured once on a prompt of median length (the speed model: predicted speed-up, best γ,
    # and the adaptive policy's costs).
    calib = calibration_context(prompt_ids)
    if len(calib) >= 2:
        d_calib = vocab_mapping.reencode_batch_for_draft([list(calib)])[0] if vocab_mapping is not None else None
        speed, source = cached_speed_model(target, spec_draft, calib, max_gamma=max(gamma, 8),
                                           draft_context=d_calib if d_calib and len(d_calib) >= 2 else None,
                                           cache_dir=config.speed_cache_dir, refresh=not config.speed_cache)
        res.speed_model = speed.to_dict() | {"source": source}
        res.config["speed_model_source"] = source
    elif config.gamma_policy == "adaptive":
        raise ValueError("--gamma-policy adaptive measures the pair's costs on a prompt of at least 2 tokens")
    eos = eos_ids(target, tokenizer)
    common_settings = _specdraft_settings(config, eos)
    contenders: dict[str, Any] = {
        "target": common_settings | {"decoder": "specdraft.decode.target_generate"},
        "specdraft": common_settings | {"decoder": "specdraft.decode.speculative_generate",
                                        "num_speculative_tokens": gamma,
                                        "draft_confidence_threshold": draft_confidence_threshold,
                                        "mapped_proposals": res.config["mapped_proposals"],
                                        "draft_options": res.config["draft_options"],
                                        "gamma_policy": config.gamma_policy},
    }
    res.config["contenders"] = contenders
    run_hf, hf_tokenizers = compare_hf, {}
    if compare_hf and vocab_mapping is not None:
        if sampling.greedy:
            hf_tokenizers = {"tokenizer": tokenizer, "assistant_tokenizer": vocab_mapping.draft_tokenizer}
        else:
            run_hf = False
            res.config["hf_assisted_skipped"] = ("sampled universal assisted generation prunes the draft's output "
                                                 "head in place; compared for greedy decoding only")
    hf_config = None
    if run_hf:
        hf_config = hf_generation_config(sampling, max_new_tokens, eos, pad, gamma, draft_confidence_threshold)
        contenders["hf_assisted"] = {k: v for k, v in hf_config.to_diff_dict().items() if k != "transformers_version"}
        contenders["hf_assisted"]["decoder"] = "transformers generate(assistant_model=draft)"
        contenders["hf_assisted"]["draft"] = "as loaded (without specdraft's draft options)"
    elif compare_hf:
        contenders["hf_assisted"] = {"skipped": res.config["hf_assisted_skipped"]}
    responses = []
    load = LoadMonitor().__enter__()  # other processes' CPU share over the timed decoding (a busy machine is said)
    for k, ids in enumerate(prompt_ids):
        inp, mask = left_pad([ids], pad, device)
        common = {"sampling": sampling, "max_new_tokens": max_new_tokens, "real_vocab": real_vocab,
                  "eos_token_id": eos}
        base, bc = target_generate(target, inp, mask, generator=torch.Generator(device=device).manual_seed(seed + k),
                                   **common)
        spec, sc = speculative_generate(target, spec_draft, inp, mask, num_speculative_tokens=gamma,
                                        generator=torch.Generator(device=device).manual_seed(seed + k),
                                        draft_confidence_threshold=draft_confidence_threshold,
                                        vocab_mapping=vocab_mapping, mapped_proposals=mapped_proposals,
                                        speed_model=speed if config.gamma_policy == "adaptive" else None, **common)
        res.target_counts = res.target_counts.merge(bc)
        res.spec_counts = res.spec_counts.merge(sc)
        res.target_tokens += len(base[0])
        res.spec_tokens += len(spec[0])
        res.target_seconds += bc.time_total
        res.spec_seconds += sc.time_total
        row = {"id": names[k], "prompt_tokens": len(ids), "target_tokens": len(base[0]),
               "target_s": bc.time_total, "spec_s": sc.time_total,
               # Counts, so intervals and paired gains can be computed over prompts (specdraft.stats).
               "accepted": sum(sc.accepted), "proposed": sum(sc.proposed), "reached": sum(sc.reached),
               "acceptance_rate": sc.acceptance_rate, "mean_accepted_length": sc.mean_accepted_length}
        if sampling.greedy:
            row["specdraft_matches"] = _compare(target, ids, base[0], spec[0], names[k], "specdraft", tol,
                                                res.divergences)
        if run_hf:
            t0 = time.perf_counter()
            if not sampling.greedy:  # transformers samples from the global torch RNG
                torch.manual_seed(seed + k)
            with torch.no_grad(), _models_generation_config(hf_config, target, draft):
                hf = target.generate(input_ids=inp, attention_mask=mask, assistant_model=draft,
                                     generation_config=hf_config, **hf_tokenizers)
            hf_s = time.perf_counter() - t0
            hf_out = hf[0, inp.shape[1]:].tolist()
            res.hf_tokens += len(hf_out)
            res.hf_seconds += hf_s
            if sampling.greedy:
                row["hf_matches"] = _compare(target, ids, base[0], hf_out, names[k], "hf_assisted", tol,
                                             res.divergences)
                res.hf_matches += row["hf_matches"]
            row["hf_s"] = hf_s
        res.per_prompt.append(row)
        responses.append(base[0])
        res.prompts += 1
        if progress:
            progress(k + 1, len(prompt_ids))
    # Predicted α from teacher-forced passes: over the prompts (available before any decoding), and over the
    # target's own responses (the positions speculative decoding actually drafts).
    load.__exit__(None, None, None)
    res.load = load.to_dict()
    if config.certify and not sampling.greedy and prompt_ids:
        res.certificate = certify_sampling(target, spec_draft, prompt_ids[0], sampling, config.certify, gamma,
                                           real_vocab=real_vocab, pad_id=pad, seed=seed, vocab_mapping=vocab_mapping)
    if vocab_mapping is not None:  # teacher-forced α needs one position grid for both models
        return res
    res.predicted_prompt = predicted_alpha(target, spec_draft, prompt_ids, sampling=sampling, real_vocab=real_vocab,
                                           pad_id=pad)
    seqs = [list(p) + r for p, r in zip(prompt_ids, responses) if r]
    # Position j predicts token j+1: response tokens are predicted from positions P−1..P+R−2; the last
    # position has no successor in the sequence.
    masks = [[0] * (len(p) - 1) + [1] * len(r) + [0] for p, r in zip(prompt_ids, responses) if r]
    if seqs:
        res.predicted_response = predicted_alpha(target, spec_draft, seqs, masks, sampling=sampling,
                                                 real_vocab=real_vocab, pad_id=pad)
    return res


def acceptance_eval(
    target,
    draft,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    prompt_names: Sequence[str],
    config: EvalConfig,
    serving: SamplingConfig,
    *,
    answers: Sequence[Sequence[int]] | None = None,
    vocab_mapping=None,
    decoder=None,
    speed_model: SpeedModel | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Greedy acceptance of ``draft`` on held-out prompts, per prompt, plus the teacher-forced α at the serving
    settings: the measure :func:`specdraft.pipeline.run_pipeline` compares before and after distillation.

    Without ``answers`` every prompt is decoded by greedy speculative decoding (batch 1; its output is the
    target's greedy answer); the counts are then replayed (:func:`replay_greedy`) on those answers, the number of
    prompts where replayed and decoded counts agree is reported (``replay_check``, and the decoded rate as
    ``decoded_acceptance_rate``), and the rows hold the replayed counts, so that every draft compared on these
    answers is counted by one method (a draft of another tokenizer cannot be replayed: its rows are decoded). With
    ``answers`` (the target's answers from an earlier call) nothing is decoded: the counts are replayed, so a
    second draft is compared on the very same target answers (a paired comparison) in one draft pass per
    prompt.

    ``decoder`` (e.g. :func:`prepared_draft`'s int4 + trimmed-head copy of ``draft``) writes the answers instead of
    ``draft``, with the adaptive γ ≤ ``config.num_speculative_tokens`` when ``speed_model`` is given: greedy
    speculative decoding outputs the target's greedy answer whichever draft proposes (lossless; bfloat16 near-ties
    aside), so the fastest lossless decoder writes them and ``draft`` — the model that is exported — is still
    counted by replay at fixed γ. ``decoded_acceptance_rate`` is then the decoder's (``decoder_label`` names it) and
    ``replay_check`` is None (the decoder's rounds are not the draft's).

    Sampled acceptance: ``alpha_sampled`` is Σ min(p̃, q̃) under ``serving`` (the serving temperature / top-k /
    top-p), teacher-forced over the target's answers — the per-token acceptance probability of speculative
    sampling at those contexts (Leviathan et al. 2023, §3.1), not a decoded count.

    Args:
        target, draft: causal LMs sharing ``tokenizer`` (or a draft of another tokenizer with ``vocab_mapping``,
            decoded only: replay and teacher forcing need one position grid).
        prompt_ids / prompt_names: the prompts (chat template applied) and their ids.
        config: γ and max new tokens (greedy; its ``sampling`` must be greedy).
        serving: the filter of the sampled α.
        decoder: the model that decodes the answers (default ``draft``); not with ``answers`` or ``vocab_mapping``.
        speed_model: the decoder's measured costs (:func:`cached_speed_model`): adaptive γ; None: fixed γ.

    Returns:
        ``{"method": "decoded" | "replayed", "prompts", "rows": [{"id", "accepted", "proposed", "reached",
        "alpha_sum", "positions"}], "answers": [[ids]], "counts": AcceptanceCounts dict, "acceptance_rate",
        "acceptance_rate_ci95", "alpha", "alpha_ci95", "drafted", "mean_accepted_length", "alpha_per_position",
        "alpha_sampled", "alpha_sampled_ci95", "replay_check", "decoded_acceptance_rate", "decoder_label",
        "decode_seconds", "decoded_tokens", "seconds"}`` (intervals: bootstrap over prompts; seconds: wall clock).

    Raises:
        ValueError: a sampled ``config``, ``answers`` with a draft of another tokenizer, or a ``decoder`` with
            ``answers`` or ``vocab_mapping``.
    """
    if not config.sampling.greedy:
        raise ValueError("acceptance_eval measures greedy acceptance; the sampled figure is alpha_sampled")
    if answers is not None and vocab_mapping is not None:
        raise ValueError("a draft of another tokenizer cannot be replayed: decode it (answers=None)")
    if decoder is not None and (answers is not None or vocab_mapping is not None):
        raise ValueError("a decoder writes the target's answers: give it without answers and without a vocab_mapping")
    decoder = draft if decoder is None else decoder
    t0 = time.perf_counter()
    gamma, max_new = config.num_speculative_tokens, config.max_new_tokens
    eos = eos_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    real_vocab = len(tokenizer)
    device = next(target.parameters()).device
    decoded: list[AcceptanceCounts] | None = None
    decode_seconds = 0.0
    if answers is None:
        answers, decoded = [], []
        for k, ids in enumerate(prompt_ids):
            inp, mask = left_pad([ids], pad, device)
            out, c = speculative_generate(target, decoder, inp, mask, num_speculative_tokens=gamma,
                                          max_new_tokens=max_new, eos_token_id=eos, real_vocab=real_vocab,
                                          vocab_mapping=vocab_mapping, mapped_proposals=config.mapped_proposals,
                                          speed_model=speed_model)
            answers.append(out[0])
            decoded.append(c)
            decode_seconds += c.time_total
            if progress:
                progress(k + 1, len(prompt_ids))
    answers = [list(a) for a in answers]
    sampled, replayed = None, None
    if vocab_mapping is None:
        # One teacher-forced pass of each model over prompt + answer gives both the sampled α and the draft's argmax
        # at every answer position, from which the greedy rounds are replayed (replay_greedy's method, one draft
        # pass fewer).
        seqs = [list(p) + a for p, a in zip(prompt_ids, answers)]
        masks = [[0] * (len(p) - 1) + [1] * len(a) + [0] for p, a in zip(prompt_ids, answers)]
        sampled = predicted_alpha(target, draft, seqs, masks, sampling=serving, real_vocab=real_vocab, pad_id=pad)
        replayed = [_replay_answer(top1, y, gamma, max_new, set(eos))
                    for top1, y in zip(sampled["draft_top1"], answers, strict=True)]
    # The rows are replayed counts whenever the draft can be replayed, also when it was decoded: the gain between
    # two drafts then compares one method with itself (decoded vs replayed differ only by bfloat16 near-ties,
    # reported as replay_check and decoded_acceptance_rate).
    counts_per_prompt = replayed if replayed is not None else decoded
    keys = ("proposed", "reached", "accepted", "accepted_hist")
    check, decoded_rate = None, None
    if decoded is not None:
        merged = AcceptanceCounts(gamma)
        for c in decoded:
            merged = merged.merge(c)
        decoded_rate = merged.acceptance_rate
    if decoded is not None and replayed is not None and decoder is draft and speed_model is None:
        same = sum(all(getattr(d, k) == getattr(r, k) for k in keys) for d, r in zip(decoded, replayed))
        check = f"{same}/{len(decoded)}"
    rows = []
    for k, c in enumerate(counts_per_prompt):
        row = {"id": prompt_names[k], "accepted": sum(c.accepted), "proposed": sum(c.proposed),
               "reached": sum(c.reached), "answer_tokens": len(answers[k])}
        if sampled is not None:
            row["alpha_sum"], row["positions"] = sampled["per_sequence"][k]
        rows.append(row)
    total = AcceptanceCounts(gamma)
    for c in counts_per_prompt:
        total = total.merge(c)
    ci = lambda num, den: ratio_ci([r[num] for r in rows], [r[den] for r in rows]).interval if rows else None
    return {
        "method": "decoded" if decoded is not None else "replayed", "prompts": len(rows), "rows": rows,
        "answers": answers, "counts": total.to_dict(), "acceptance_rate": total.acceptance_rate,
        "acceptance_rate_ci95": ci("accepted", "proposed"), "alpha": total.alpha, "alpha_ci95": ci("accepted", "reached"),
        "drafted": sum(total.proposed), "mean_accepted_length": total.mean_accepted_length,
        "alpha_per_position": total.alpha_per_position,
        "alpha_sampled": sampled["alpha"] if sampled else None,
        "alpha_sampled_ci95": ci("alpha_sum", "positions") if sampled else None,
        "serving": serving.model_dump(), "replay_check": check, "decoded_acceptance_rate": decoded_rate,
        "decoder_label": _decoder_label(draft, decoder, speed_model, gamma) if decoded is not None else None,
        "decode_seconds": decode_seconds if decoded is not None else None,
        "decoded_tokens": sum(len(a) for a in answers) if decoded is not None else None,
        "seconds": time.perf_counter() - t0,
    }


def _decoder_label(draft, decoder, speed_model: SpeedModel | None, gamma: int) -> str:
    """What wrote :func:`acceptance_eval`'s answers, in a report's words."""
    label = "the draft as given" if decoder is draft else "draft " + draft_configuration(decoder)["label"]
    return label + (f", adaptive γ ≤ {gamma}" if speed_model is not None else f", fixed γ {gamma}")


def interleaved_speed(
    target,
    drafts: dict[str, Any],
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    prompt_names: Sequence[str],
    config: EvalConfig,
    *,
    hf_draft: str | None = None,
    vocab_mappings: dict[str, Any] | None = None,
    warmup_tokens: int = 8,
) -> dict[str, Any]:
    """Tokens/s of the target alone, of speculative decoding with each draft and (``hf_draft``: the name of one
    of ``drafts``) of transformers' assisted generation, in one run: after a warm-up (every contender decodes
    ``warmup_tokens`` of the first prompt, untimed), prompt by prompt with the contenders in a rotating order,
    so machine noise and warm caches hit all alike.

    Greedy outputs are compared with the target alone's (a divergence beyond the dtype's rounding tolerance is a
    bug: ``lossless`` False). Speed-ups are ratios of tokens/s on the same prompts with a paired bootstrap
    interval (:func:`specdraft.stats.paired_ratio_ci`).

    Returns:
        ``{"prompts", "contenders": {name: {"tokens", "seconds", "tokens_per_s", "tokens_per_s_ci95",
        "speedup", "speedup_ci95", "matches_target"}}, "rows": [{"id", name: [tokens, seconds], …}],
        "divergences", "lossless", "warmup_tokens"}``; contender names: ``target``, ``speculative:<draft>``,
        ``hf_assisted:<draft>``.
    """
    from specdraft.stats import paired_ratio_ci

    sampling, gamma, max_new = config.sampling, config.num_speculative_tokens, config.max_new_tokens
    vocab_mappings = vocab_mappings or {}
    eos = eos_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    real_vocab = len(tokenizer)
    device = next(target.parameters()).device
    tol = ROUNDING_TOLERANCE.get(next(target.parameters()).dtype, 0.5)
    hf_config = hf_generation_config(sampling, max_new, eos, pad, gamma, config.draft_confidence_threshold)
    # specdraft's contenders decode with the configuration's draft preparation and γ policy (transformers' assisted
    # generation gets each draft as given); the speed model of each prepared draft comes from the calibration cache.
    prepared = {n: prepared_draft(m, tokenizer, config, vocab_mappings.get(n)) for n, m in drafts.items()}
    speeds: dict[str, SpeedModel] = {}
    speed_sources: dict[str, str] = {}
    if config.gamma_policy == "adaptive" and prompt_ids:
        calib = calibration_context(prompt_ids)
        for n, m in prepared.items():
            mapping = vocab_mappings.get(n)
            d_calib = mapping.reencode_batch_for_draft([calib])[0] if mapping is not None else None
            speeds[n], speed_sources[n] = cached_speed_model(
                target, m, calib, max_gamma=max(gamma, 8), draft_context=d_calib if d_calib and len(d_calib) >= 2
                else None, cache_dir=config.speed_cache_dir, refresh=not config.speed_cache)

    def run(name: str, ids: list[int], k: int, n_new: int) -> list[int]:
        inp, mask = left_pad([ids], pad, device)
        gen = torch.Generator(device=device).manual_seed(config.seed + k)
        common = {"sampling": sampling, "max_new_tokens": n_new, "real_vocab": real_vocab, "eos_token_id": eos,
                  "generator": gen}
        if name == "target":
            return target_generate(target, inp, mask, **common)[0][0]
        kind, draft_name = name.split(":", 1)
        if kind == "speculative":
            return speculative_generate(target, prepared[draft_name], inp, mask, num_speculative_tokens=gamma,
                                        draft_confidence_threshold=config.draft_confidence_threshold,
                                        vocab_mapping=vocab_mappings.get(draft_name),
                                        mapped_proposals=config.mapped_proposals,
                                        speed_model=speeds.get(draft_name), **common)[0][0]
        mapping = vocab_mappings.get(draft_name)
        extra = {"tokenizer": tokenizer, "assistant_tokenizer": mapping.draft_tokenizer} if mapping else {}
        gc = hf_config if n_new == max_new else copy.deepcopy(hf_config)
        gc.max_new_tokens = n_new
        if not sampling.greedy:
            torch.manual_seed(config.seed + k)
        with torch.no_grad(), _models_generation_config(gc, target, drafts[draft_name]):
            out = target.generate(input_ids=inp, attention_mask=mask, assistant_model=drafts[draft_name],
                                  generation_config=gc, **extra)
        return out[0, inp.shape[1]:].tolist()

    names = ["target"] + [f"speculative:{d}" for d in drafts] + ([f"hf_assisted:{hf_draft}"] if hf_draft else [])
    if prompt_ids:
        for name in names:  # warm-up: first calls pay for allocation and kernel selection
            run(name, list(prompt_ids[0]), 0, warmup_tokens)
    rows, divergences = [], []
    load = LoadMonitor().__enter__()
    for k, ids in enumerate(prompt_ids):
        row: dict[str, Any] = {"id": prompt_names[k]}
        outputs = {}
        for name in names[k % len(names):] + names[: k % len(names)]:
            t0 = time.perf_counter()
            outputs[name] = run(name, list(ids), k, max_new)
            row[name] = [len(outputs[name]), time.perf_counter() - t0]
        if sampling.greedy:
            for name in names[1:]:
                row[f"{name}:matches"] = _compare(target, ids, outputs["target"], outputs[name], prompt_names[k],
                                                  name, tol, divergences)
        rows.append(row)
    load.__exit__(None, None, None)
    contenders = {}
    for name in names:
        tok, sec = [r[name][0] for r in rows], [r[name][1] for r in rows]
        c = {"tokens": sum(tok), "seconds": sum(sec), "tokens_per_s": sum(tok) / sum(sec) if sum(sec) else 0.0,
             "tokens_per_s_ci95": ratio_ci(tok, sec).interval if rows else None}
        if name != "target" and rows:
            base_tok, base_sec = [r["target"][0] for r in rows], [r["target"][1] for r in rows]
            sp = paired_ratio_ci(tok, sec, base_tok, base_sec)
            c |= {"speedup": sp.value, "speedup_ci95": sp.interval}
            if sampling.greedy:
                c["matches_target"] = f"{sum(r[f'{name}:matches'] for r in rows)}/{len(rows)}"
        contenders[name] = c
    bugs = [d for d in divergences if not d.is_numerics and not d.contender.startswith("hf_assisted")]
    return {"prompts": len(rows), "contenders": contenders, "rows": rows, "warmup_tokens": warmup_tokens,
            "divergences": [d.__dict__ | {"is_numerics": d.is_numerics} for d in divergences],
            "lossless": not bugs, "max_new_tokens": max_new, "num_speculative_tokens": gamma,
            "gamma_policy": config.gamma_policy, "machine_load": load.to_dict(), "busy_machine": load.busy,
            "draft_configuration": {n: draft_configuration(m) for n, m in prepared.items()},
            "speed_models": {n: sp.to_dict() | {"source": speed_sources[n]} for n, sp in speeds.items()}}


def rank_drafts(target, tokenizer, prompt_ids: Sequence[Sequence[int]],
                drafts: Sequence[tuple[str, Callable[[], tuple[Any, Any]]]], config: EvalConfig | None = None,
                progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Which draft should I use? Each candidate's predicted speed-up on a short calibration set, best first.

    The target's t(k) is measured once; then per candidate — loaded by its callable as ``(model, vocab_mapping or
    None)``, given ``config``'s draft options, and freed before the next — its step d is measured and its α by
    decoding ``prompt_ids`` speculatively (γ and sampling of ``config``), and the
    :class:`~specdraft.speed.SpeedModel` predicts its speed-up at the γ it recommends. Nothing is compared token by
    token here: confirm the top one with :func:`run_eval`.

    Returns:
        one dict per candidate: ``draft``, ``alpha``, ``acceptance_rate``, ``draft_step_ms``, ``cost_ratio_c``,
        ``best_gamma``, ``predicted_speedup`` (at ``best_gamma``, prefill included), ``predicted_speedup_at_gamma``
        (at the config's γ), ``speed_model``; sorted by ``predicted_speedup``, highest first.

    Raises:
        specdraft.sampling.TokenWidthError: prompt ids past the target's or a draft's embedding or head (named;
            a draft's checked when it is loaded, before it is timed).
    """
    import gc

    config = config or EvalConfig()
    check_token_ids(prompt_ids, [("target", target)], what="the calibration prompts")
    gamma, sampling = config.num_speculative_tokens, config.sampling
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(target.parameters()).device
    calib = calibration_context(prompt_ids)
    max_k = max(gamma, 8) + 1
    t_k, t_prefill = pass_seconds(target, calib, range(1, max_k + 1))
    eos = eos_ids(target, tokenizer)
    rows = []
    for name, load in drafts:
        if progress:
            progress(name)
        model, mapping = load()
        if mapping is None:  # before timing it: an id past its embedding is an IndexError inside the draft
            check_token_ids(prompt_ids, [(f"draft {name}", model)], what="the calibration prompts")
        draft = prepared_draft(model, tokenizer, config, mapping, copy_model=False)
        d_calib = mapping.reencode_batch_for_draft([list(calib)])[0] if mapping is not None else calib
        d, d_prefill = pass_seconds(draft, d_calib, [1], repeats=5, last_only=True)
        speed = SpeedModel.from_measurements(t_k, d[1], target_prefill_s=t_prefill, draft_prefill_s=d_prefill,
                                             context=len(calib))
        counts, tokens = AcceptanceCounts(gamma), 0
        for k, ids in enumerate(prompt_ids):
            out, c = speculative_generate(
                target, draft, *left_pad([ids], pad, device), num_speculative_tokens=gamma, sampling=sampling,
                max_new_tokens=config.max_new_tokens, real_vocab=len(tokenizer), eos_token_id=eos,
                generator=torch.Generator(device=device).manual_seed(config.seed + k), vocab_mapping=mapping,
                mapped_proposals=config.mapped_proposals)
            counts, tokens = counts.merge(c), tokens + len(out[0])
        g, _ = speed.best_gamma(counts.alpha)
        rows.append({"draft": name, "alpha": counts.alpha, "acceptance_rate": counts.acceptance_rate,
                     "draft_step_ms": 1e3 * speed.draft_s, "cost_ratio_c": speed.cost_ratio, "best_gamma": g,
                     "predicted_speedup": speed.predict(counts.alpha, g, tokens, len(prompt_ids)),
                     "predicted_speedup_at_gamma": speed.predict(counts.alpha, gamma, tokens, len(prompt_ids)),
                     "mapped": mapping is not None, "draft_options": draft_configuration(draft),
                     "speed_model": speed.to_dict()})
        del model, draft
        gc.collect()
    return sorted(rows, key=lambda r: -r["predicted_speedup"])


def write_report(res: EvalResult, out_dir: str | Path, title: str = "specdraft eval") -> dict[str, Path]:
    """Write ``report.json`` and PNG plots (α per position, accepted-length histogram) atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specdraft.io import atomic_path, atomic_write_text

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"report": out / "report.json", "alpha_plot": out / "alpha_per_position.png",
             "hist_plot": out / "accepted_length_hist.png"}
    atomic_write_text(paths["report"], json.dumps(res.to_dict(), indent=2, default=str))
    c = res.spec_counts
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(range(1, c.gamma + 1), c.alpha_per_position, color="#4C72B0")
    ax.set(xlabel="draft position", ylabel="P(accept | reached)", ylim=(0, 1.05), title=f"{title}: α per position")
    fig.tight_layout()
    with atomic_path(paths["alpha_plot"]) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(range(c.gamma + 1), c.accepted_hist, color="#55A868")
    ax.set(xlabel="drafts accepted per round", ylabel="rounds", title=f"{title}: accepted length")
    fig.tight_layout()
    with atomic_path(paths["hist_plot"]) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return paths
