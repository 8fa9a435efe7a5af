"""The distillation losses; the serving filter they apply is :func:`specdraft.sampling.filtered_probs`.

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

from specdraft.sampling import NEG_INF, _nucleus_threshold, filtered_probs

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


def masked_mean(per_position: torch.Tensor, mask: torch.Tensor,
                denominator: torch.Tensor | float | None = None) -> torch.Tensor:
    """Token-weighted mean of ``[B, S]`` values over positions where ``mask`` is true (the one reduction).

    Masked positions are zeroed with ``where`` (not multiplied) so a NaN/inf there cannot leak into the
    value or the gradient. Returns a 0-dim float32 tensor; 0 when the mask is empty.

    Args:
        per_position: ``[B, S]`` values (a per-position loss or metric).
        mask: ``[B, S]`` bool/int, true where the value counts.
        denominator: the number of counted positions of the *whole* optimizer step when this batch is one of
            several (gradient accumulation, data-parallel ranks): the sum over this batch is divided by it, so
            the micro-batch values add up to the token-weighted mean of the step. Default: this mask's count.
    """
    mask = mask.bool()
    vals = torch.where(mask, per_position, torch.zeros_like(per_position))
    n = mask.sum() if denominator is None else torch.as_tensor(denominator, device=vals.device)
    return vals.sum() / n.clamp(min=1)


def sum_min(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α at each position: Σ_x min(p(x), q(x)) = 1 − TV(p, q), ``[...] float32`` probability."""
    return torch.minimum(p.float(), q.float()).sum(dim=-1)
