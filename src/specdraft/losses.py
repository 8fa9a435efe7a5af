"""The serving filter and the distillation losses.

One filter serves decoding, α and the ``tvd_deploy`` loss: temperature → top-k → renormalise → top-p
(the order of vLLM's and transformers' samplers). It always keeps the argmax, its output sums to 1, and with
both filters off it equals the plain softmax at that temperature.

Losses are pure per-position functions ``(draft_logits [B, S, V], teacher) -> [B, S] float32`` and live in
:data:`LOSSES`; masking and averaging happen once, in :func:`masked_mean`.

Notation: p = target (teacher) distribution, q = draft distribution. Under speculative sampling a drafted
token is accepted with probability Σ_x min(p(x), q(x)) = 1 − TVD(p, q) (Leviathan et al. 2023, §3.1;
DistillSpec, Zhou et al. 2023, §3), so ``tvd_deploy`` — TVD after the serving filter — is exactly the
deployed rejection rate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def _nucleus_threshold(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest logit kept by top-p, given logits sorted in descending order ``[..., K]`` → ``[..., 1]``.

    Keeps the smallest prefix whose probability mass reaches ``top_p``: token j is kept when the mass of the
    tokens before it is < ``top_p`` (so the argmax, with zero mass before it, is always kept). The mass is
    renormalised over the K values given (after top-k, as serving stacks do).
    """
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = mass_before < top_p
    keep[..., 0] = True
    # The last kept index = number kept − 1 (keep is a prefix because probs are sorted descending).
    last = keep.sum(dim=-1, keepdim=True) - 1
    return sorted_logits.gather(-1, last)


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Apply temperature → top-k → renormalise → top-p; return float32 logits with ``-inf`` outside the kept set.

    ``softmax`` of the result is the sampling distribution. Ties at the k-th value are all kept (threshold
    semantics, as transformers' ``TopKLogitsWarper``), so more than k tokens survive on exact ties.

    Memory: with ``top_k > 0`` only ``torch.topk`` values ``[..., k]`` are sorted and the nucleus is taken over
    them — no full-vocabulary sort and no vocabulary-sized int64 index tensor; ``top_k = 0`` with
    ``top_p < 1`` takes the full-sort path.

    Args:
        logits: ``[..., V]`` any float dtype (upcast to float32).
        temperature: > 0 (greedy decoding does not call this function).
        top_k: keep the k largest; 0 disables.
        top_p: nucleus mass in (0, 1]; 1 disables.

    Returns:
        ``[..., V] float32`` filtered, temperature-scaled logits.

    Raises:
        ValueError: temperature <= 0, top_k < 0 or top_p outside (0, 1].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for a filtered distribution (got {temperature}); "
                         "temperature 0 means greedy decoding, which takes the argmax.")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        top_vals = torch.topk(x, top_k, dim=-1).values  # [..., k], descending
        threshold = top_vals[..., -1:]
        if top_p < 1.0:
            threshold = torch.maximum(threshold, _nucleus_threshold(top_vals, top_p))
        return x.masked_fill(x < threshold, NEG_INF)
    if top_p < 1.0:
        sorted_x = torch.sort(x, dim=-1, descending=True).values
        return x.masked_fill(x < _nucleus_threshold(sorted_x, top_p), NEG_INF)
    return x


def filtered_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``softmax(filter_logits(...))``: the distribution a sampler draws from, ``[..., V] float32``, sums to 1."""
    return filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)


# ----------------------------------------------------------------------------------------------- losses


def soft_ce(draft_logits: torch.Tensor, p: torch.Tensor, **_: object) -> torch.Tensor:
    """Cross-entropy against the teacher's soft distribution: −Σ_x p(x) log q(x).

    Args:
        draft_logits: ``[B, S, V]`` draft logits.
        p: ``[B, S, V]`` teacher probabilities (zero on padding rows).

    Returns:
        ``[B, S] float32`` nats.
    """
    logq = draft_logits.float().log_softmax(dim=-1)
    # Where p = 0 the term is 0 even if log q = −inf (padding rows): mask before multiplying to avoid 0·inf.
    return -(p * logq.masked_fill(p == 0, 0.0)).sum(dim=-1)


def tvd(draft_logits: torch.Tensor, p: torch.Tensor, **_: object) -> torch.Tensor:
    """Total variation distance ½ Σ_x |p(x) − q(x)| over the full distributions, ``[B, S] float32`` in [0, 1].

    1 − tvd is the acceptance probability of speculative sampling at temperature 1 with no filter.
    """
    q = draft_logits.float().softmax(dim=-1)
    return 0.5 * (p - q).abs().sum(dim=-1)


def tvd_deploy(draft_logits: torch.Tensor, p: torch.Tensor, *, teacher_logits: torch.Tensor | None = None,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, **_: object) -> torch.Tensor:
    """TVD after both p and q pass through the serving filter, ``[B, S] float32`` in [0, 1].

    1 − tvd_deploy = Σ min(p̃, q̃) is exactly the acceptance probability when serving with this
    temperature/top-k/top-p (DistillSpec §3: the deployed acceptance).

    Args:
        draft_logits: ``[B, S, V]``.
        p: ``[B, S, V]`` teacher probabilities; used only when ``teacher_logits`` is None (then assumed
            already filtered).
        teacher_logits: ``[B, S, V]`` teacher logits, filtered here with the same settings.
    """
    if teacher_logits is not None and 0 < top_k <= SPARSE_TOP_K_MAX and top_k < draft_logits.shape[-1]:
        sparse = _tvd_deploy_sparse(draft_logits, teacher_logits, temperature, top_k, top_p)
        if sparse is not None:
            return sparse
    q = filtered_probs(draft_logits, temperature, top_k, top_p)
    p_f = filtered_probs(teacher_logits, temperature, top_k, top_p) if teacher_logits is not None else p
    return 0.5 * (p_f - q).abs().sum(dim=-1)


# Above this k the k×k id comparison of the sparse path costs more than the dense path saves.
SPARSE_TOP_K_MAX = 64


def _topk_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The filtered distribution restricted to its top-k support: ``(probs [..., k] float32, ids [..., k])``.

    Equals :func:`filtered_probs` on those ids (zero elsewhere) when no value outside the top-k ties the k-th
    one; the caller checks that. Gradients flow through the k gathered logits only.
    """
    vals, ids = torch.topk(logits, top_k, dim=-1)  # descending
    vals = vals.float() / temperature
    if top_p < 1.0:
        vals = vals.masked_fill(vals < _nucleus_threshold(vals, top_p), NEG_INF)
    return vals.softmax(dim=-1), ids


def _tvd_deploy_sparse(draft_logits, teacher_logits, temperature, top_k, top_p):
    """tvd_deploy over the two top-k supports: 1 − Σ_{x ∈ S_p ∩ S_q} min(p̃(x), q̃(x)).

    Both filtered distributions live on at most k ids each, so TVD needs only their intersection: no
    vocabulary-sized float copies with gradients (the full path holds several [B, S, V] float32 tensors for
    backward). Returns None when a value outside the top-k ties the k-th one (threshold semantics would keep
    it), and the caller takes the dense path, so both paths always agree.
    """
    with torch.no_grad():
        for x in (draft_logits, teacher_logits):
            kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
            if bool(((x >= kth).sum(dim=-1) > top_k).any()):
                return None
    q, q_ids = _topk_filtered(draft_logits, temperature, top_k, top_p)
    with torch.no_grad():
        p, p_ids = _topk_filtered(teacher_logits, temperature, top_k, top_p)
    same = p_ids[..., :, None] == q_ids[..., None, :]  # [..., k, k]
    overlap = torch.where(same, torch.minimum(p[..., :, None], q[..., None, :]), torch.zeros((), device=q.device))
    return 1.0 - overlap.sum(dim=(-1, -2))


LossFn = Callable[..., torch.Tensor]
LOSSES: dict[str, LossFn] = {"soft_ce": soft_ce, "tvd": tvd, "tvd_deploy": tvd_deploy}


def masked_mean(per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-weighted mean of ``[B, S]`` values over positions where ``mask`` is true (the one reduction).

    Masked positions are zeroed with ``where`` (not multiplied) so a NaN/inf there cannot leak into the
    value or the gradient. Returns a 0-dim float32 tensor; 0 when the mask is empty.
    """
    mask = mask.bool()
    vals = torch.where(mask, per_position, torch.zeros_like(per_position))
    return vals.sum() / mask.sum().clamp(min=1)


def sum_min(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α at each position: Σ_x min(p(x), q(x)) = 1 − TV(p, q), ``[...] float32`` probability."""
    return torch.minimum(p.float(), q.float()).sum(dim=-1)


def greedy_probs(logits: torch.Tensor) -> torch.Tensor:
    """One-hot distribution at the argmax ``[..., V] float32`` (the 'distribution' of greedy decoding)."""
    return F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
