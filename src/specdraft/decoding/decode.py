"""Lossless speculative decoding with an independent draft model, and the target-only baseline.

One round (gpt-fast's shape, Leviathan et al. 2023 Algorithm 1):

1. the draft proposes γ tokens d_1..d_γ autoregressively from q;
2. the target scores ``[cur, d_1..d_γ]`` in one pass, giving p_1..p_{γ+1};
3. verification keeps the longest accepted prefix and emits one more token from the target (the correction at the
   first rejection, or the bonus token from p_{γ+1});
4. both KV caches keep only the accepted prefix.

Greedy: d_i is accepted while it equals argmax p_i, so the output equals target-only greedy decoding token for token.
Sampled: d_i ~ q_i is accepted with probability min(1, p_i(d_i)/q_i(d_i)), a rejection draws from
norm(max(p_i − q_i, 0)): the output follows p exactly (Theorem 3.5). Drafters: :mod:`specdraft.decoding.drafters`; the γ
policy: :mod:`specdraft.decoding.speed`. Batches and their holes, drafts of another tokenizer, caches:
docs/architecture.md#specdraftdecodingdecode.
"""

from __future__ import annotations

import numbers
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from specdraft.core.acceptance import AcceptanceCounts
from specdraft.core.config import NUM_SPECULATIVE_TOKENS, SamplingConfig
from specdraft.core.sampling import (
    ContextWindowError,
    check_context,
    check_token_ids,
    filter_logits,
    input_width,
    output_width,
    sample,
)
from specdraft.decoding.drafters import (
    DecodeError,
    MappedDrafter,
    Proposal,
    Row,
    RowDraws,
    SameTokenizerDrafter,
    Stream,
    proposal_mode,
)
from specdraft.decoding.speed import AdaptiveGamma, SpeedModel
from specdraft.models.tokens import stop_ids


class NonFiniteError(DecodeError):
    """Logits holding NaN or +inf where a distribution is needed: no law to keep, so decoding stops."""


def _model_name(model) -> str:
    dtype = next(model.parameters()).dtype
    return f"{type(model).__name__}, {str(dtype).removeprefix('torch.')}"


# --------------------------------------------------------------------------------------- verification


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  n_proposed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: ``(n_accepted [B] int64, next_token [B] int64)``.

    ``draft_tokens``: ``[B, γ] int64``; ``target_logits``: ``[B, γ+1, V]`` at ``[cur, d_1..d_γ]``; ``n_proposed``:
    ``[B] int64`` real proposals per row (default γ). Accepts the prefix equal to the target's argmax and emits the
    argmax after it (correction or bonus).
    """
    target_argmax = target_logits.argmax(dim=-1)  # [B, γ+1]
    match = (draft_tokens == target_argmax[:, :-1]).long()  # [B, γ]
    if n_proposed is not None:
        match = match * (torch.arange(match.shape[1], device=match.device)[None, :] < n_proposed[:, None])
    n = match.cumprod(dim=1).sum(dim=1)  # first rejection via cumulative product (as transformers does)
    return n, target_argmax.gather(1, n[:, None]).squeeze(1)


def verify_sampled(
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
    n_proposed: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling verification (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Alg. 2).

    Args:
        draft_tokens: ``[B, γ] int64`` d_i ~ ``q[:, i]``.
        q: ``[B, γ, V] float32`` the draft's filtered distributions; p: ``[B, γ+1, V] float32`` the target's.
        n_proposed: ``[B] int64`` real proposals per row (default γ); row b is verified as a round of that many.
        u: ``[B, γ+1] float64`` uniforms (the loop's per-row streams, :class:`RowDraws`) instead of ``generator``.

    Returns ``(n_accepted [B] int64, next_token [B] int64)``: d_i accepted when u_i < p_i(d_i)/q_i(d_i); the next
    token drawn from norm(max(p_n − q_n, 0)) at the first rejection n, else from p_{γ+1}.
    """
    B, gamma = draft_tokens.shape
    live = None
    if n_proposed is not None:
        live = torch.arange(gamma, device=q.device)[None, :] < n_proposed[:, None]  # [B, γ]
        # q = 0 past a row's proposals: the next token is drawn from p, as a bonus.
        q = q * live[..., None]
    idx = draft_tokens[..., None]
    p_d = p[:, :gamma].gather(2, idx).squeeze(2)  # [B, γ]
    q_d = q.gather(2, idx).squeeze(2)  # [B, γ]
    u_next = None
    if u is None:
        u = torch.rand(p_d.shape, generator=generator, device=p_d.device)
    else:
        u, u_next = u[:, :gamma], u[:, gamma:gamma + 1]
    # u < p/q  ⇔  u·q < p  (q_d > 0 because d was drawn from q; this form avoids dividing).
    accept = (u * q_d < p_d).long()
    if live is not None:
        accept = accept * live
    n = accept.cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(B, device=p.device)
    p_n = p[rows, n]  # [B, V]: p at the first rejection, or the bonus distribution when n == γ
    q_n = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n]  # q = 0 at the bonus slot → residual = p
    residual = (p_n - q_n).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # mass = 0 only if p == q, where rejection has probability 0.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)
    nxt = sample(residual, generator, u_next)
    return n, nxt


# ------------------------------------------------------------------------------------------ the loop


def _sliding_window(model) -> int | None:
    """The model's attention window in tokens, or None (Qwen2's is unused unless ``use_sliding_window``)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None)


def _ends_with_any(seq: list[int], stops: Sequence[Sequence[int]]) -> bool:
    return any(len(s) and len(seq) >= len(s) and seq[-len(s):] == list(s) for s in stops)


def check_max_new_tokens(max_new_tokens: int, name: str = "max_new_tokens",
                         error: type[Exception] = DecodeError) -> None:
    """Refuse a budget below 1 new token per row: the loop emits one token before it counts.
    Raises ``error`` (:class:`DecodeError` by default), naming ``name`` and its value."""
    if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise error(f"{name} must be an integer >= 1 (new tokens per row), got {max_new_tokens!r}")


def check_decode_context(longest: int, max_new_tokens: int, gamma: int, target, draft,
                         error: type[Exception] = ContextWindowError) -> None:
    """Refuse a prompt of ``longest`` tokens + ``max_new_tokens`` + γ+1 that exceeds either model's
    context window (``draft`` None: not checked). Raises ``error``, naming the terms and the fix."""
    need = longest + max_new_tokens + gamma + 1
    check_context(need, [("target", target), ("draft", draft)],
                  f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + γ+1 = {need}",
                  "shorten the prompt or lower --max-new-tokens.", error=error)


def _check_inputs(target, draft, input_ids, attention_mask, gamma: int, max_new_tokens: int, mapped: bool,
                  real_vocab: int | None = None) -> None:
    if draft is not None and gamma < 1:
        raise DecodeError(f"num_speculative_tokens (γ) must be >= 1, got {gamma}")
    check_max_new_tokens(max_new_tokens)
    if input_ids.dim() != 2:
        raise DecodeError(f"input_ids must be [batch, prompt_len], got shape {tuple(input_ids.shape)}")
    if bool((attention_mask[:, -1] == 0).any()):
        raise DecodeError("prompts must be left-padded (attention_mask[:, -1] is 0 for some row)")
    # Ids past the embedding or head would fail later as an IndexError.
    check_token_ids(input_ids, [("target", target)] + ([("draft", draft)] if draft is not None
                                                                           and not mapped else []), error=DecodeError)
    if draft is not None and not mapped and real_vocab is not None:
        emitted = min(real_vocab, output_width(target))  # the ids the target can emit, each read by the draft next
        if (rows := min(input_width(draft), output_width(draft))) < emitted:
            raise DecodeError(f"the target can emit token ids up to {emitted - 1} (real_vocab {real_vocab}) but the "
                              f"draft reads and scores only ids below {rows}: tokens added to the tokenizer after the "
                              "draft was made? Resize the draft's embeddings (resize_token_embeddings) and train "
                              "them, or decode with a draft of this tokenizer.")
    longest = int(attention_mask.sum(dim=1).max())
    # A mapped draft counts positions in its own tokens: its window is checked each round instead.
    check_decode_context(longest, max_new_tokens, gamma, target, None if mapped else draft, error=DecodeError)
    for name, m in (("target", target), ("draft", draft)):
        w = _sliding_window(m) if m is not None else None
        if w is not None and input_ids.shape[0] > 1 and input_ids.shape[1] + max_new_tokens + gamma + 1 > w:
            raise DecodeError(f"the {name} uses sliding-window attention (window {w}); rows of a batch can accept "
                              "different numbers of tokens, which would shift that window: decode one prompt at a "
                              "time (batch 1).")


def _eos_ids(target, eos_token_id) -> set[int]:
    return set(stop_ids(target)) if eos_token_id is None else \
        ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))


def _check_target_logits(t_logits: torch.Tensor, target) -> None:
    """Refuse target logits holding NaN or +inf (−inf is a masked id)."""
    if bool((torch.isnan(t_logits) | torch.isposinf(t_logits)).any()):  # one host sync per round
        rows = sorted({int(r) for r in (torch.isnan(t_logits) | torch.isposinf(t_logits)).any(-1).nonzero()[:, 0]})
        raise NonFiniteError(f"the target ({_model_name(target)}) returned NaN or +inf logits (batch rows {rows}): "
                             "its activations overflow or its weights are not finite, so there is no distribution "
                             "to decode from. Load it in bfloat16 or float32 (--dtype), or check its weights.")


def _verify(prop: Proposal | None, t_logits, sampling: SamplingConfig, u: torch.Tensor | None):
    """``(n_accepted [b], next_token [b])`` for a round's proposals (none: the target's own next token)."""
    b = t_logits.shape[0]
    if sampling.greedy:
        if prop is None:
            return t_logits.new_zeros(b, dtype=torch.long), t_logits[:, -1].argmax(-1)
        return verify_greedy(prop.tokens, t_logits, prop.n_proposed)
    p = filter_logits(t_logits, sampling.temperature, sampling.top_k, sampling.top_p).softmax(-1)
    half = (u.shape[1] - 1) // 2  # γ: acceptance tests in columns γ..2γ−1, the next token's draw in 2γ
    if prop is None:
        return t_logits.new_zeros(b, dtype=torch.long), sample(p[:, -1], u=u[:, 2 * half:])
    k = prop.tokens.shape[1]
    return verify_sampled(prop.tokens, prop.q, p, n_proposed=prop.n_proposed,
                          u=torch.cat([u[:, half:half + k], u[:, 2 * half:]], dim=1))


def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    sampling: SamplingConfig | None = None,
    max_new_tokens: int = 128,
    stop: Sequence[Sequence[int]] = (),
    eos_token_id: int | Sequence[int] | None = None,
    real_vocab: int | None = None,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    draft_confidence_threshold: float | None = None,
    vocab_mapping=None,
    mapped_proposals: str | None = None,
    speed_model: SpeedModel | None = None,
) -> tuple[list[list[int]], AcceptanceCounts]:
    """Generate with speculative decoding (``draft`` given) or target alone (``draft=None``, same code).

    Args:
        target / draft: causal LMs in eval mode; the draft shares the target's tokenizer or, with ``vocab_mapping``
            (:class:`~specdraft.models.vocab.VocabMapping`), speaks another (``mapped_proposals``: ``"tokens"`` or
            greedy-only
            ``"text"``).
        input_ids / attention_mask: ``[B, P] int64``, **left**-padded.
        num_speculative_tokens: γ ≥ 1; max_new_tokens: per row, met unless EOS/stop comes first.
        stop / eos_token_id: what ends a row (included); default :func:`~specdraft.models.tokens.stop_ids` of the target.
        real_vocab: ``len(tokenizer)``; ids at or past it get zero probability.
        generator: sampling RNG; each row draws from its own stream (:class:`RowDraws`).
        draft_confidence_threshold: stop drafting once the draft's probability of its latest token falls below this
            in every row (transformers' ``assistant_confidence_threshold``; lossless).
        speed_model: measured costs (:func:`specdraft.decoding.calibration.measure_speed_model`): each row drafts the k ≤ γ
            predicted fastest (:class:`~specdraft.decoding.speed.AdaptiveGamma`).

    Returns ``(tokens, counts)``: per row the new ids (EOS/stop included) and the
    :class:`~specdraft.core.acceptance.AcceptanceCounts`.

    Raises:
        DecodeError: γ < 1, ``max_new_tokens`` < 1, ids past either model's embedding or head, a context window
            exceeded, a batch of several rows with a sliding-window model, a too-wide ``vocab_mapping``, ``"text"``
            proposals with sampling.
        ValueError: a ``speed_model`` measured for a smaller γ.
    """
    sampling = sampling or SamplingConfig()
    gamma = num_speculative_tokens if draft is not None else 0
    device, (B, P) = input_ids.device, input_ids.shape
    attention_mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).long()
    mapped = draft is not None and vocab_mapping is not None
    _check_inputs(target, draft, input_ids, attention_mask, gamma, max_new_tokens, mapped, real_vocab)
    eos = _eos_ids(target, eos_token_id)
    width = output_width(target)
    real_vocab = min(real_vocab or width, width)
    draws = None if sampling.greedy else RowDraws(generator, B, gamma, device)
    args = (B, width, real_vocab, device, sampling, draws, draft_confidence_threshold)
    drafter = (None if draft is None else SameTokenizerDrafter(draft, *args) if not mapped else
               MappedDrafter(draft, vocab_mapping, proposal_mode(mapped_proposals, sampling), *args))
    policy = AdaptiveGamma(speed_model, gamma, B) if speed_model is not None and drafter is not None else None
    counts = AcceptanceCounts(max(gamma, 1))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t_start = time.perf_counter()
    tgt = Stream(target, B, width, real_vocab, device)
    if P > 1:  # prefill all but the last prompt token (cur); the first round feeds cur to both models
        tgt.forward(input_ids[:, :-1], attention_mask[:, :-1], logits_to_keep=1)
    if drafter is not None:
        drafter.prefill(input_ids, attention_mask)
    sync()
    counts.time_prefill = time.perf_counter() - t_start
    cur = input_ids[:, -1].clone()  # [b]: the last token, read by both models next round
    rows = [Row(i, input_ids[i][attention_mask[i] == 1].tolist()) for i in range(B)]
    active = list(range(B))  # indices into `rows` of rows still decoding, in batch order

    while active:
        # ---- 1. propose: γ (or the policy's k) per row, at most what it can still emit beyond the target's token
        t0 = time.perf_counter()
        plan = policy.plan() if policy is not None else [gamma] * len(active)
        ks = [max(0, min(k, max_new_tokens - len(rows[i].tokens) - 1)) for k, i in zip(plan, active)]
        u = draws.u([rows[i] for i in active]) if draws is not None else None  # [b, 2γ+1], each row its own
        prop = drafter.propose(cur, [rows[i] for i in active], ks, u) if drafter and max(ks) > 0 else None
        sync()
        t1 = time.perf_counter()
        moved = prop.prefill_seconds if prop is not None else 0.0  # a mapped draft's first read is its prefill
        counts.time_draft += t1 - t0 - moved
        counts.time_prefill += moved
        # ---- 2. verify: one target pass over [cur, d_1..d_k] ----------------------------------------------
        drafts = prop.tokens if prop is not None else cur.new_zeros(len(active), 0)
        t_ids = torch.cat([cur[:, None], drafts], dim=1)  # [b, k+1]
        t_mask = torch.ones_like(t_ids)
        if prop is not None and prop.n_proposed is not None:  # right-padding of shorter rows is a hole
            t_mask[:, 1:] = (torch.arange(drafts.shape[1], device=device) < prop.n_proposed[:, None]).long()
        start = tgt.length
        t_logits = tgt.forward(t_ids, t_mask)  # [b, k+1, V]
        _check_target_logits(t_logits, target)
        n_acc, nxt = _verify(prop, t_logits, sampling, u)
        sync()
        counts.time_target += time.perf_counter() - t1
        # ---- 3. accept: emit the accepted drafts + one target token per row, stop, account ----------------
        n_prop = (prop.n_proposed.tolist() if prop is not None and prop.n_proposed is not None
                  else [drafts.shape[1]] * len(active))
        keep = []
        for j, (n, d, nx) in enumerate(zip(n_acc.tolist(), drafts.tolist(), nxt.tolist())):
            row, kept, ended = rows[active[j]], [], False
            for tok in d[:n] + [nx]:
                kept.append(tok)
                row.tokens.append(tok)
                ended = tok in eos or _ends_with_any(row.tokens, stop) or len(row.tokens) >= max_new_tokens
                if ended:
                    break
            if ended and len(kept) <= n:  # ended inside the accepted block: later drafts are dropped
                counts.record_round(len(kept), n_proposed=len(kept), bonus=False)
            else:  # the baseline drafts nothing: n = 0, one bonus token per round
                counts.record_round(n, n_proposed=n_prop[j], bonus=True)
            if policy is not None:
                policy.record(j, n_prop[j], n)
            if not ended:
                keep.append(j)
            if on_tokens is not None:
                on_tokens(row.index, kept)
        # ---- 4. roll back: both caches keep only the accepted prefix ---------------------------------------
        tgt.keep(start, n_acc + 1)  # cur and the n accepted drafts
        if prop is not None:
            drafter.commit(n_acc)
        cur = nxt
        if not keep:
            break
        if len(keep) < len(active):
            sel = torch.tensor(keep, dtype=torch.long, device=device)
            tgt.select(sel)
            if drafter is not None:
                drafter.select(sel)
            if policy is not None:
                policy.select(keep)
            cur, active = cur[sel], [active[j] for j in keep]
    if drafter is not None and drafter.nonfinite_rows:
        warnings.warn(f"the draft ({_model_name(draft)}) gave a non-finite q (NaN or +inf logits) in "
                      f"{drafter.nonfinite_rows} row-rounds; those rows proposed nothing from there and the target drew "
                      "its own token (the output's law is unchanged, acceptance is lower). Load the draft in bfloat16 "
                      "or float32.", stacklevel=2)
    counts.target_calls = tgt.calls - (1 if P > 1 else 0)
    counts.prefill_calls = (1 if P > 1 else 0) + (drafter.prefill_calls if drafter else 0)
    counts.draft_calls = drafter.calls - drafter.prefill_calls if drafter else 0
    counts.time_total = time.perf_counter() - t_start
    return [r.tokens for r in rows], counts


def target_generate(target, input_ids, attention_mask=None, **kwargs) -> tuple[list[list[int]], AcceptanceCounts]:
    """Target-only baseline: :func:`speculative_generate` without a draft (same sampling and errors)."""
    kwargs.pop("num_speculative_tokens", None)
    return speculative_generate(target, None, input_ids, attention_mask, **kwargs)
