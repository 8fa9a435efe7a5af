"""Cross-entropy through an output head restricted to a support of ids: a hard-label phase's loss without the
vocabulary-wide head.

With q_S = softmax(z on S) and S holding every id the teacher p gives mass to, ``−Σ_{x∈S} p(x) log q_S(x)`` equals
:func:`specdraft.core.losses.soft_ce_topk` with rows outside S masked (Jean et al. 2015, eq. 6–8).
Derivation: docs/architecture.md#specdraftmodelsrestricted_head.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

#: Config fields that transform logits after the head.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


#: The start of every refusal of a teacher with mass past its stored ids.
NEEDS_NO_TAIL = ("--head-support needs a top-k teacher with no leftover mass (hard labels: a self-teacher dump "
                 "without --token-level)")


class RestrictedHeadError(ValueError):
    """The restricted head cannot compute this loss exactly (names what and how to fix it)."""


def support_ids(data_ids: Iterable[int], ranked: Sequence[int] = (), frequent: int = 0,
                width: int | None = None) -> torch.Tensor:
    """The support S: every id of ``data_ids`` plus the first ``frequent`` of ``ranked``; ``[U] int64``, sorted.
    Raises :class:`RestrictedHeadError` for an id outside ``[0, width)`` or an empty support."""
    ids = {int(i) for i in data_ids} | {int(i) for i in list(ranked)[:max(frequent, 0)]}
    if not ids:
        raise RestrictedHeadError("an empty support: the restricted head needs the training data's token ids")
    bad = [i for i in ids if i < 0 or (width is not None and i >= width)]
    if bad:
        raise RestrictedHeadError(f"support ids outside the head's {width} rows, e.g. {sorted(bad)[:3]}")
    return torch.tensor(sorted(ids), dtype=torch.long)


def check_draft(draft) -> None:
    """Refuse a draft whose logits are not ``head(decoder(x))`` (no decoder accessor, or a logit transform).
    Raises :class:`RestrictedHeadError` naming the class or the transform."""
    if not callable(getattr(draft, "get_decoder", None)) or draft.get_output_embeddings() is None:
        raise RestrictedHeadError(f"{type(draft).__name__} has no get_decoder()/output head: train it with the full "
                                  "head (without --head-support)")
    cfg = getattr(draft, "config", None)
    for name in LOGIT_TRANSFORMS:
        value = getattr(cfg, name, None)
        if value not in (None, 0, 1, 1.0):
            raise RestrictedHeadError(f"the draft's config sets {name} = {value}: its logits are transformed after the "
                                      "head, which a restricted head skips; train it with the full head (without "
                                      "--head-support)")


def restricted_logits(draft, support: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      columns: torch.Tensor | None = None, autocast: bool = False) -> torch.Tensor:
    """The draft's logits over the support only: ``head.weight[S] · decoder(x)`` (+ bias).

    ``support``: ``[U] int64``; ``input_ids``: ``[B, S]``; ``columns``: ``[K] int64`` positions to keep (None: all).
    Returns ``[B, K or S, U] float32``; column u is id ``support[u]``.
    """
    head = draft.get_output_embeddings()
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = draft.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                     use_cache=False).last_hidden_state  # [B, S, H]
        if columns is not None:
            hidden = hidden[:, columns]
        bias = None if getattr(head, "bias", None) is None else head.bias.index_select(0, support)
        logits = F.linear(hidden, head.weight.index_select(0, support), bias)
    return logits.float()


def positions_in_support(ids: torch.Tensor, support: torch.Tensor, width: int) -> torch.Tensor:
    """Each id's column in the restricted logits, or −1 where it is outside the support; same shape as ``ids``."""
    where = torch.full((width,), -1, dtype=torch.long, device=ids.device)
    where[support.to(ids.device)] = torch.arange(support.numel(), device=ids.device)
    return where[ids.long().clamp(0, width - 1)].masked_fill((ids < 0) | (ids >= width), -1)


def restricted_soft_ce(logits_s: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
                       support: torch.Tensor, width: int, trained: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``−Σ_i p_i log q_S(id_i)`` and TVD(p, q_S) per position: ``([B, S] float32 nats, [B, S] float32)``.

    ``logits_s``: ``[B, S, U]``; ``topk_ids``/``topk_probs``: ``[B, S, k]``; ``trained``: ``[B, S] bool``. Raises
    :class:`RestrictedHeadError` where a trained position gives mass outside the support.
    """
    cols = positions_in_support(topk_ids, support, width)  # [B, S, k]
    outside = (cols < 0) & (topk_probs > 0)
    if trained is not None:
        outside &= trained.unsqueeze(-1)
    if outside.any():
        ids = topk_ids[outside].unique()[:3].tolist()
        raise RestrictedHeadError(f"the teacher gives mass to id(s) {ids} outside the restricted head's support: "
                                  "build the support from every id of the dump (support_ids) or use the full head")
    safe = cols.clamp(min=0)
    logq_k = logits_s.log_softmax(-1).gather(-1, safe)  # [B, S, k]
    has_mass = topk_probs > 0
    ce = -(topk_probs * logq_k.masked_fill(~has_mass, 0.0)).sum(-1)
    # With no mass outside the stored ids (distinct, the dump's rule), TVD = 1 − Σ_x min(p(x), q_S(x)) over them.
    overlap = torch.minimum(topk_probs, logq_k.exp()).masked_fill(~has_mass, 0.0).sum(-1)
    return ce, 1.0 - overlap
