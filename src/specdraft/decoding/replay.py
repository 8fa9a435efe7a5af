"""Teacher-forced α and greedy replay: how far a draft agrees with the target, with no decoding.

:func:`predicted_alpha` scores sequences with both models once (α = Σ min(p, q) per counted position, after the
serving filter) and keeps the draft's argmax; :func:`replay_answer` turns it over the target's greedy answer into
the rounds greedy speculative decoding would run (exact for greedy, batch 1); :func:`replay_mapped` does the same for
a draft of another tokenizer. Why: docs/architecture.md#specdraftdecodingreplay.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdraft.core.acceptance import AcceptanceCounts
from specdraft.core.config import SamplingConfig
from specdraft.core.io import atomic_path
from specdraft.core.losses import sum_min
from specdraft.core.sampling import align_logits, check_windows, filtered_probs, greedy_probs, output_width
from specdraft.decoding.decode import check_max_new_tokens
from specdraft.decoding.drafters import MappedDrafter, Row, proposal_mode
from specdraft.models.loading import model_fingerprint, takes_logits_to_keep
from specdraft.models.tokens import left_pad


@torch.no_grad()
def tail_logits(model, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, keep: int) -> torch.Tensor:
    """``[B, keep, V]`` logits of the last ``keep`` positions of a left-padded batch, the head run only there
    when the forward takes transformers' ``logits_to_keep`` (else sliced; same values)."""
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
    target_cache: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Teacher-forced α (Σ_x min(p(x), q(x)) averaged over counted positions) and the draft's argmax there.

    ``masks``: 1 where the next-token distribution counts (default: all but the last position); greedy makes α the
    argmax agreement. ``target_cache``: a directory of the target's counted logits per batch, shared by later calls on
    the same sequences (:func:`counted_target_logits`).

    Returns ``{"alpha", "positions", "alpha_sum", "top1_agreement", "per_sequence": [[alpha_sum, positions], …],
    "draft_top1": [[id, …], …]}``, counts first. Raises :class:`specdraft.core.sampling.ContextWindowError` before any
    pass.
    """
    sampling = sampling or SamplingConfig()
    check_windows(sequences, [("target", target), ("draft", draft)],
                  "score shorter prompts or answers (lower --max-new-tokens).")
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
        keep, cm = counted_tail(cm)
        sel = cm.bool()
        p_l = counted_target_logits(target, chunk, ids, attn, pos, cm, width, real_vocab, pad_id, target_cache)
        q_l = align_logits(tail_logits(draft, ids, attn, pos, keep), width, real_vocab)[sel]
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
    # Σ min(p, q) ≤ 1; rounding of the filtered distributions may overshoot.
    return {"alpha": min(total / n, 1.0) if n else 0.0, "positions": n, "alpha_sum": total,
            "top1_agreement": agree / n if n else 0.0, "per_sequence": per_sequence, "draft_top1": draft_top1}


def counted_tail(counted: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``(keep, counted[:, -keep:])``: the shortest tail of a ``[B, S]`` mask holding every counted position."""
    where = counted.any(0).nonzero()
    keep = counted.shape[1] - int(where[0]) if len(where) else 1
    return keep, counted[:, -keep:]


def counted_target_logits(target, chunk: list[list[int]], ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor,
                          counted: torch.Tensor, width: int, real_vocab: int | None, pad_id: int,
                          target_cache: str | os.PathLike | None = None) -> torch.Tensor:
    """The target's logits at one batch's counted positions, ``[N, width]`` in its dtype, row-major.

    ``counted``: ``[B, keep]`` over the batch's last ``keep`` positions. With ``target_cache`` they are read from or
    written to one safetensors file named by what determines them, so callers scoring the same batch share one pass.
    """
    keep = counted.shape[1]
    cached = _cache_file(target_cache, target, chunk, counted, real_vocab, pad_id) if target_cache else None
    if cached is not None and cached.exists():
        from safetensors.torch import load_file

        return load_file(cached, device=str(ids.device))["target_logits"]
    logits = align_logits(tail_logits(target, ids, attn, pos, keep), width, real_vocab)[counted.bool()]
    if cached is not None:
        _save_cached(cached, logits)
    return logits


def _cache_file(root, target, chunk: list[list[int]], counted: torch.Tensor, real_vocab: int | None,
                pad_id: int) -> Path:
    """Where one batch's target logits are kept, named by the target's content and the batch."""
    key = json.dumps([model_fingerprint(target), chunk, counted.to(torch.int8).tolist(), real_vocab, pad_id])
    return Path(root) / f"target-logits-{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"


def _save_cached(path: Path, logits: torch.Tensor) -> None:
    from safetensors.torch import save_file


    with atomic_path(path) as tmp:
        save_file({"target_logits": logits.contiguous().cpu()}, str(tmp))


def replay_answer(draft_top1: Sequence[int], y: list[int], gamma: int, max_new_tokens: int,
                   eos: set[int]) -> AcceptanceCounts:
    """:func:`_replay_rounds` from the draft's teacher-forced argmax (``draft_top1[j]`` predicts ``y[j]``).

    Stops at the first ``eos`` id in ``y`` or after ``max_new_tokens``, as the decoder does. Raises
    :class:`specdraft.decoding.decode.DecodeError` when ``max_new_tokens`` < 1.
    """
    check_max_new_tokens(max_new_tokens)
    match = [int(g) == t for g, t in zip(draft_top1, y)]

    def accepted(n: int, k: int) -> tuple[int, int]:
        acc = 0
        while acc < k and n + acc < len(y) and match[n + acc]:
            acc += 1
        return acc, k

    counts = _replay_rounds(accepted, y, gamma, max_new_tokens, eos)
    # Every answer position counts (AcceptanceCounts.match_rate).
    counts.matched, counts.match_positions = sum(bool(m) for m in match[:len(y)]), min(len(match), len(y))
    return counts


@torch.no_grad()
def replay_mapped(draft, vocab_mapping, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                  gamma: int, max_new_tokens: int, eos: set[int], target_width: int, real_vocab: int | None = None,
                  mapped_proposals: str | None = None, batch_size: int = 16,
                  progress=None) -> list[AcceptanceCounts]:
    """Greedy speculative decoding's counts for a draft of *another tokenizer*, replayed over the target's
    greedy ``answers`` (``[n]`` id lists, EOS included) with no target pass: ``[n]``
    :class:`~specdraft.core.acceptance.AcceptanceCounts` without timings.

    Raises :class:`specdraft.decoding.decode.DecodeError`: ``max_new_tokens`` < 1, a mapping wider than ``target_width``, an
    unknown proposal mode.
    """
    check_max_new_tokens(max_new_tokens)

    greedy = SamplingConfig()
    mode = proposal_mode(mapped_proposals, greedy)
    device = next(draft.parameters()).device
    real = min(real_vocab or target_width, target_width)
    books = [_Rounds([int(t) for t in y], gamma, max_new_tokens, eos) for y in answers]
    done = 0
    for start in range(0, len(books), batch_size):
        active = [i for i in range(start, min(start + batch_size, len(books))) if not books[i].done]
        done += min(start + batch_size, len(books)) - start - len(active)
        if not active:
            continue
        drafter = MappedDrafter(draft, vocab_mapping, mode, len(active), target_width, real, device, greedy, None, None)
        rows = {i: Row(i, [int(t) for t in prompts[i]]) for i in active}
        while active:
            ks = [books[i].k for i in active]
            for i in active:
                rows[i].tokens = books[i].y[:books[i].n]
            prop = drafter.propose(None, [rows[i] for i in active], ks, None) if max(ks) > 0 else None
            keep = []
            for j, i in enumerate(active):
                book, acc, n_prop = books[i], 0, 0
                if prop is not None:
                    n_prop = int(prop.n_proposed[j]) if prop.n_proposed is not None else prop.tokens.shape[1]
                    for c in prop.tokens[j, :n_prop].tolist():
                        if book.n + acc >= len(book.y) or c != book.y[book.n + acc]:
                            break
                        acc += 1
                book.record(acc, n_prop)
                if book.done:
                    done += 1
                    if progress:
                        progress(done, len(books))
                else:
                    keep.append(j)
            if len(keep) < len(active):
                if keep:
                    drafter.select(torch.tensor(keep, dtype=torch.long, device=device))
                active = [active[j] for j in keep]
    return [b.counts for b in books]


class _Rounds:
    """One row's rounds of greedy speculative decoding over the answer ``y``, booked as the decoder books them."""

    def __init__(self, y: list[int], gamma: int, max_new_tokens: int, eos: set[int]):
        self.y, self.gamma, self.max_new, self.eos = y, gamma, max_new_tokens, eos
        self.counts, self.n, self.done = AcceptanceCounts(gamma), 0, not y

    @property
    def k(self) -> int:
        return max(0, min(self.gamma, self.max_new - self.n - 1))

    def record(self, acc: int, n_proposed: int) -> None:
        y, n = self.y, self.n
        kept, ended = 0, False
        for t in range(acc + 1):  # the accepted drafts, then the target's own token
            if n + t >= len(y):
                break
            kept += 1
            ended = y[n + t] in self.eos or n + t + 1 >= self.max_new
            if ended:
                break
        if ended and kept <= acc:  # ended inside the accepted block: no target token
            self.counts.record_round(kept, n_proposed=kept, bonus=False)
        else:
            self.counts.record_round(acc, n_proposed=n_proposed, bonus=True)
        self.n += kept
        self.done = ended or self.n >= len(y)


def _replay_rounds(accepted, y: list[int], gamma: int, max_new_tokens: int, eos: set[int]) -> AcceptanceCounts:
    """:class:`_Rounds` over ``y`` with ``accepted(n, k)`` → ``(accepted, proposed)`` after ``y[:n]``."""
    book = _Rounds(y, gamma, max_new_tokens, eos)
    while not book.done:
        book.record(*accepted(book.n, book.k))
    return book.counts
