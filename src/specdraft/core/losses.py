"""The distillation losses: pure per-position functions ``(draft_logits [B, S, V], teacher) -> [B, S] float32`` in
:data:`LOSSES` (sparse top-k forms in :data:`TOPK_LOSSES`), masked and averaged once, by :func:`masked_mean`.
p = target, q = draft; 1 − ``tvd_deploy`` is the deployed acceptance. Derivations:
docs/architecture.md#specdraftcorelosses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdraft.core.sampling import NEG_INF, filtered_probs, nucleus_threshold


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
    """Total variation distance ½ Σ_x |p(x) − q(x)| over the full distributions, ``[B, S] float32`` in [0, 1]
    (1 − tvd: the acceptance at temperature 1, no filter)."""
    q = draft_logits.float().softmax(dim=-1)
    return 0.5 * (p - q).abs().sum(dim=-1)


def tvd_deploy(draft_logits: torch.Tensor, p: torch.Tensor, *, teacher_logits: torch.Tensor | None = None,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, **_: object) -> torch.Tensor:
    """TVD after both p and q pass through the serving filter, ``[B, S] float32`` in [0, 1].

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


def ce(draft_logits: torch.Tensor, p: torch.Tensor, **_: object) -> torch.Tensor:
    """Cross-entropy on the teacher's argmax: −log q(argmax p), ``[B, S] float32`` nats."""
    logq = draft_logits.float().log_softmax(dim=-1)
    return -logq.gather(-1, p.argmax(dim=-1, keepdim=True)).squeeze(-1)


def nla(draft_logits: torch.Tensor, p: torch.Tensor, **_: object) -> torch.Tensor:
    """Negative log-acceptance −log α, α = Σ_x min(p(x), q(x)): ``[B, S] float32`` nats, ≥ 0."""
    q = draft_logits.float().softmax(dim=-1)
    return -sum_min(p, q).clamp(min=1e-12).log()


#: λ = exp(−LK_ETA · α) in :func:`lk_hybrid` (the paper's and speculators' default decay).
LK_ETA = 3.0


def lk_hybrid(draft_logits: torch.Tensor, p: torch.Tensor, **_: object) -> torch.Tensor:
    """λ·KL(p‖q) + (1 − λ)·TVD(p, q) with λ = exp(−3α) held constant (no gradient through λ), ``[B, S] float32``."""
    logq = draft_logits.float().log_softmax(dim=-1)
    q = logq.exp()
    logp = p.clamp(min=1e-30).log()
    kl = (p * (logp - logq)).masked_fill(p == 0, 0.0).sum(dim=-1)
    tv = 0.5 * (p - q).abs().sum(dim=-1)
    lam = torch.exp(-LK_ETA * (1.0 - tv)).detach()
    return lam * kl + (1.0 - lam) * tv




def _sparse_teacher(topk_probs: torch.Tensor, tail: torch.Tensor | None, rest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p_k [..., k], tail [...])`` float32 summing to 1 together, as
    :func:`specdraft.models.dump_reader.teacher_probs_from_topk` renormalises. ``tail`` defaults to ``1 − Σ p_k``
    (clamped at 0); it is 0 when ``rest == 0``."""
    p = topk_probs.float()
    t = (1.0 - p.sum(dim=-1)).clamp(min=0.0) if tail is None else tail.float()
    if rest <= 0:
        t = torch.zeros_like(t)
    z = p.sum(dim=-1) + t
    return p / z[..., None], t / z


def soft_ce_topk(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
                 tail: torch.Tensor | None = None, real_vocab: int | None = None) -> torch.Tensor:
    """:func:`soft_ce` against a top-k teacher whose tail is spread uniformly over the other real ids (the dense
    completion of :func:`specdraft.models.dump_reader.teacher_probs_from_topk`), without building it: ``draft_logits
    [B, S, V]``, ``topk_ids [B, S, k] int64`` (below ``real_vocab``, default V), ``topk_probs [B, S, k]``, ``tail
    [B, S]`` (default ``1 − Σ topk_probs``); returns ``[B, S] float32`` nats."""
    real = draft_logits.shape[-1] if real_vocab is None else min(real_vocab, draft_logits.shape[-1])
    rest = real - topk_ids.shape[-1]
    p, t = _sparse_teacher(topk_probs, tail, rest)
    logq = draft_logits.float().log_softmax(dim=-1)  # [B, S, V]
    logq_k = logq.gather(-1, topk_ids.long())  # [B, S, k]
    head = -(p * logq_k.masked_fill(p == 0, 0.0)).sum(dim=-1)
    if rest <= 0:
        return head
    others = logq[..., :real].sum(dim=-1) - logq_k.sum(dim=-1)  # Σ log q over the real ids outside K
    # A zero tail contributes nothing even where some log q is −inf: where, not 0 · (−inf).
    return head - torch.where(t > 0, t / rest * others, torch.zeros_like(t))


def tvd_topk(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
             tail: torch.Tensor | None = None, real_vocab: int | None = None) -> torch.Tensor:
    """:func:`tvd` against a top-k teacher, the tail taken as disjoint from q's mass outside K, ``[B, S] float32``.

    Args: as :func:`soft_ce_topk`.
    """
    real = draft_logits.shape[-1] if real_vocab is None else min(real_vocab, draft_logits.shape[-1])
    p, t = _sparse_teacher(topk_probs, tail, real - topk_ids.shape[-1])
    q_k = draft_logits.float().softmax(dim=-1).gather(-1, topk_ids.long())  # [B, S, k]
    return 0.5 * ((p - q_k).abs().sum(dim=-1) + (1.0 - q_k.sum(dim=-1)) + t)


#: Losses with a sparse (top-k teacher) form, by their dense form's name; the others densify a top-k teacher.
TOPK_LOSSES: dict[str, Callable[..., torch.Tensor]] = {"soft_ce": soft_ce_topk, "tvd": tvd_topk}


# Above this k the k×k id comparison of the sparse path costs more than the dense path saves.
SPARSE_TOP_K_MAX = 64


def _topk_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The filtered distribution restricted to its top-k support: ``(probs [..., k] float32, ids [..., k])``."""
    vals, ids = torch.topk(logits, top_k, dim=-1)  # descending
    vals = vals.float() / temperature
    if top_p < 1.0:
        vals = vals.masked_fill(vals < nucleus_threshold(vals, top_p), NEG_INF)
    return vals.softmax(dim=-1), ids


def _tvd_deploy_sparse(draft_logits, teacher_logits, temperature, top_k, top_p):
    """tvd_deploy over the two top-k supports: 1 − Σ_{x ∈ S_p ∩ S_q} min(p̃(x), q̃(x))."""
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
LOSSES: dict[str, LossFn] = {"soft_ce": soft_ce, "tvd": tvd, "tvd_deploy": tvd_deploy, "ce": ce, "nla": nla,
                             "lk_hybrid": lk_hybrid}


def masked_mean(per_position: torch.Tensor, mask: torch.Tensor,
                denominator: torch.Tensor | float | None = None) -> torch.Tensor:
    """Token-weighted mean of ``[B, S]`` values over positions where ``mask`` is true (the one reduction).

    Args:
        per_position: ``[B, S]`` values (a per-position loss or metric).
        mask: ``[B, S]`` bool/int, true where the value counts.
        denominator: the counted positions of the *whole* optimizer step when this batch is one of several
            (accumulation, ranks), so micro-batch values add up to the step's mean. Default: this mask's count.
    """
    mask = mask.bool()
    vals = torch.where(mask, per_position, torch.zeros_like(per_position))
    n = mask.sum() if denominator is None else torch.as_tensor(denominator, device=vals.device)
    return vals.sum() / n.clamp(min=1)


def sum_min(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α at each position: Σ_x min(p(x), q(x)) = 1 − TV(p, q), ``[...] float32`` probability."""
    return torch.minimum(p.float(), q.float()).sum(dim=-1)
