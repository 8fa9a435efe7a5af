"""Lossless speculative decoding with an independent draft model, and the target-only baseline.

One round (gpt-fast's shape, Leviathan et al. 2023 Algorithm 1):

1. the draft proposes γ tokens d_1..d_γ autoregressively from q;
2. the target scores ``[cur, d_1..d_γ]`` in one pass, giving p_1..p_{γ+1};
3. verification keeps the longest accepted prefix d_1..d_n and emits one more token from the target
   (the correction at the first rejection, or the bonus token from p_{γ+1} when all γ were accepted);
4. both KV caches keep only the accepted prefix; the draft catches up next round on the token(s) it did
   not propose.

Greedy (temperature 0): d_i is accepted while it equals argmax p_i — the output equals target-only greedy
decoding token for token. Sampled: d_i ~ q_i is accepted with probability min(1, p_i(d_i)/q_i(d_i)); on
rejection the emitted token is drawn from norm(max(p_i − q_i, 0)) — the output follows p exactly
(Leviathan et al. 2023, Theorem 3.5; Chen et al. 2023). p and q are the distributions after the same
temperature → top-k → renormalise → top-p filter (:func:`specdraft.losses.filter_logits`).

Batches: rows are left-padded and may accept different numbers of tokens in one round. Both caches keep a
common length; positions a row rejected become *holes*, masked out of attention (``attention_mask`` 0) and
skipped by ``position_ids``, and the common tail of holes is cropped. Each row therefore sees exactly the
keys and positions it would see decoded alone. Finished rows leave the batch (``batch_select_indices``).

Drafts of another tokenizer (``vocab_mapping``): the draft reads the context as *text* — each round the
target-side ids (prompt + output) are decoded and re-encoded with the draft's tokenizer, the draft's cache keeps
the longest prefix it already holds and is fed the rest — and proposes over target ids: its logits are mapped
through the one-to-one :class:`~specdraft.vocab.VocabMapping`, so a draft token with no target twin has
q = 0 and a target token with no draft twin is never proposed. Verification is unchanged (any q is exact),
so the output stays the target's; only acceptance depends on the mapping's coverage. This is the token-level
intersection of Timor et al. 2025 ("Accelerating LLM Inference with Lossless Speculative Decoding Algorithms
for Heterogeneous Vocabularies", Alg. 4), which transformers ships as ``UniversalSpeculativeDecodingGenerator``.
Greedy decoding may instead propose *text* (``mapped_proposals="text"``, the greedy default): the draft takes
its own argmax over its whole vocabulary, the drafted text is encoded with the target's tokenizer, and the
target verifies those tokens (up to γ) — Timor et al.'s string-level exact match (SLEM, Alg. 2), transformers'
``AssistedCandidateGeneratorDifferentTokenizers``. Greedy verification accepts any candidate sequence exactly,
so this is lossless; sampled decoding needs a q over target ids and always uses the token mapping.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdraft.acceptance import AcceptanceCounts
from specdraft.config import SamplingConfig
from specdraft.sampling import align_logits, filter_logits


class DecodeError(ValueError):
    """Bad decoding input (context too long, incompatible vocabularies, bad settings)."""


# --------------------------------------------------------------------------------------- verification


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  n_proposed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    Args:
        draft_tokens: ``[B, γ] int64`` proposals d_1..d_γ.
        target_logits: ``[B, γ+1, V]`` target logits at ``[cur, d_1..d_γ]`` (row i scores d_{i+1}).
        n_proposed: ``[B] int64``, proposals per row when rows proposed fewer than γ (the rest is padding,
            never accepted); default all γ.

    Returns:
        ``(n_accepted [B] int64, next_token [B] int64)``: the length of the prefix equal to the target's
        argmax, and the target's argmax right after it (correction or bonus token).
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling verification (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Alg. 2).

    Args:
        draft_tokens: ``[B, γ] int64`` d_i, each drawn from ``q[:, i]``.
        q: ``[B, γ, V] float32`` the exact (filtered) distributions the draft sampled from.
        p: ``[B, γ+1, V] float32`` the target's filtered distributions at the same positions plus the bonus.
        generator: torch RNG for the uniforms and the resampling.

    Returns:
        ``(n_accepted [B] int64, next_token [B] int64)``. d_i is accepted when u_i < p_i(d_i)/q_i(d_i);
        the next token is drawn from norm(max(p_n − q_n, 0)) at the first rejection n, or from p_{γ+1}
        when every draft was accepted.
    """
    B, gamma = draft_tokens.shape
    idx = draft_tokens[..., None]
    p_d = p[:, :gamma].gather(2, idx).squeeze(2)  # [B, γ]
    q_d = q.gather(2, idx).squeeze(2)  # [B, γ]
    u = torch.rand(p_d.shape, generator=generator, device=p_d.device)
    # u < p/q  ⇔  u·q < p  (q_d > 0 because d was drawn from q; this form avoids dividing).
    accept = (u * q_d < p_d).long()
    n = accept.cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(B, device=p.device)
    p_n = p[rows, n]  # [B, V]: p at the first rejection, or the bonus distribution when n == γ
    q_n = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n]  # q = 0 at the bonus slot → residual = p
    residual = (p_n - q_n).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # mass = 0 only if p == q, where rejection has probability 0; fall back to p for numerical safety.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)
    nxt = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return n, nxt


# ------------------------------------------------------------------------------------ per-model state


class _Stream:
    """A model plus its KV cache and the mask of real (1) vs padding/hole (0) cache positions."""

    def __init__(self, model, batch: int, width: int, real_vocab: int, device, mapping=None):
        from transformers import DynamicCache

        self.model = model
        self.mapping = mapping  # VocabMapping: the model speaks another tokenizer; logits are mapped to target ids
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)  # [B, L]
        self.n_real = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
        self.width = width
        self.real_vocab = real_vocab
        self.calls = 0

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, chunk_mask: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Feed ``ids [B, w]`` (``chunk_mask`` 0 = hole) and return logits ``[B, w', V_target]`` float."""
        pos = (self.n_real[:, None] + chunk_mask.cumsum(dim=1) - 1).clamp(min=0)
        attn = torch.cat([self.mask, chunk_mask], dim=1)
        kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=self.cache,
                         use_cache=True, **kwargs)
        self.mask = attn
        self.n_real = self.n_real + chunk_mask.sum(dim=1)
        self.calls += 1
        logits = out.logits if self.mapping is None else self.mapping.map_draft_logits(out.logits)
        # Padding rows (ids ≥ len(tokenizer)) get −inf, and widths are brought to the target's (see specdraft.sampling).
        return align_logits(logits, self.width, self.real_vocab)

    def keep(self, start: int, n_valid: torch.Tensor) -> None:
        """Of the positions appended from column ``start``, keep the first ``n_valid[b]`` per row; the rest
        become holes, and the tail that is a hole in every row is cropped from the cache."""
        w = self.length - start
        if w <= 0:
            return
        cols = torch.arange(w, device=self.mask.device)[None, :]
        valid = (cols < n_valid[:, None]).long()
        removed = (self.mask[:, start:] * (1 - valid)).sum(dim=1)
        self.mask[:, start:] *= valid
        self.n_real = self.n_real - removed
        drop = w - int(n_valid.max().clamp(max=w))
        if drop > 0:
            self.cache.crop(-drop)  # transformers ≥ 5: crop takes the negative number of tokens to remove
            self.mask = self.mask[:, : self.length - drop]

    def truncate(self, n_keep: torch.Tensor) -> None:
        """Keep only the first ``n_keep[b]`` real positions of each row (later ones become holes) and crop the
        tail that is a hole in every row. Used when the draft's re-encoded context diverges from its cache."""
        keep = (self.mask.cumsum(dim=1) <= n_keep[:, None]).long()
        self.mask = self.mask * keep
        self.n_real = torch.minimum(self.n_real, n_keep)
        real_cols = self.mask.any(dim=0).nonzero()
        new_len = int(real_cols.max()) + 1 if real_cols.numel() else 0
        drop = self.length - new_len
        if drop > 0:
            self.cache.crop(-drop)
            self.mask = self.mask[:, :new_len]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (finished rows leave the batch)."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.n_real = self.n_real[rows]


def _context_limit(model) -> int | None:
    cfg = model.config
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def _ends_with_any(seq: list[int], stops: Sequence[Sequence[int]]) -> bool:
    return any(len(s) and len(seq) >= len(s) and seq[-len(s):] == list(s) for s in stops)


def proposal_mode(mapped_proposals: str | None, sampling: SamplingConfig) -> str:
    """How a draft of another tokenizer proposes: ``mapped_proposals`` checked, or the default (``"text"`` for
    greedy decoding, ``"tokens"`` when sampling). See the module docstring.

    Raises:
        DecodeError: an unknown mode, or ``"text"`` with sampling (not lossless: sampling needs q over target ids).
    """
    if mapped_proposals not in (None, "text", "tokens"):
        raise DecodeError(f"mapped_proposals must be 'text' or 'tokens', got {mapped_proposals!r}")
    if mapped_proposals == "text" and not sampling.greedy:
        raise DecodeError("mapped_proposals='text' is lossless for greedy decoding only; sampling needs q over "
                          "target ids (mapped_proposals='tokens')")
    return mapped_proposals or ("text" if sampling.greedy else "tokens")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class _Row:
    index: int
    tokens: list[int]
    prompt: list[int] | None = None  # target ids without padding (mapped drafts only)
    draft_ids: list[int] | None = None  # the draft's real cache contents, in draft ids (mapped drafts only)


def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    num_speculative_tokens: int = 5,
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
) -> tuple[list[list[int]], AcceptanceCounts]:
    """Generate with speculative decoding (``draft`` given) or target alone (``draft=None``, same code).

    Args:
        target: transformers causal LM (the verifier), eval mode.
        draft: transformers causal LM sharing the target's tokenizer (ids mean the same strings; widths may
            differ by padding rows) or, with ``vocab_mapping``, speaking another tokenizer; ``None`` for the
            target-only baseline.
        input_ids: ``[B, P] int64`` prompts, **left**-padded.
        attention_mask: ``[B, P]`` 1 = token, 0 = padding; default all ones.
        num_speculative_tokens: γ ≥ 1, draft tokens per round.
        sampling: greedy at temperature 0 (default), else temperature/top-k/top-p sampling.
        max_new_tokens: tokens generated per row, met exactly unless EOS/stop comes first.
        stop: token-id sequences that end a row (included in the output, like EOS).
        eos_token_id: id(s) that end a row (default: the target's ``generation_config``/config EOS).
        real_vocab: ``len(tokenizer)``; logits of ids at or past it are padding and get zero probability.
        generator: torch RNG (sampling only); seed it for reproducible output.
        on_tokens: called as ``on_tokens(row, new_tokens)`` after each round (streaming).
        draft_confidence_threshold: if set, a round drafts fewer than γ tokens: drafting stops once the draft's
            probability of its own latest token falls below this value in every row (γ is then the maximum).
            Lossless: the number of proposals depends only on the draft, and each proposal is still
            verified exactly (as transformers' ``assistant_confidence_threshold``; SpecDec++ motivates it).
        vocab_mapping: a :class:`~specdraft.vocab.VocabMapping` (from
            :func:`~specdraft.vocab.build_vocab_mapping`, tokenizers attached) when the draft's tokenizer
            differs: the draft re-reads the context as text each round and proposes as ``mapped_proposals``
            says (see the module docstring). Lossless as without it.
        mapped_proposals: with ``vocab_mapping``, how the draft proposes: ``"tokens"`` (its tokens with a
            target twin, q over target ids; the only choice when sampling) or ``"text"`` (greedy only: its own
            argmax text, re-encoded with the target's tokenizer). Default: ``"text"`` greedy, ``"tokens"`` sampled.

    Returns:
        ``(tokens, counts)``: per row the new token ids (prompt excluded, EOS/stop included), and the
        :class:`AcceptanceCounts` of this call.

    Raises:
        DecodeError: γ < 1, a prompt plus ``max_new_tokens`` longer than either model's context window (a
            mapped draft's window is checked each round in its own tokens; once outgrown, the target finishes
            alone with a warning), a ``vocab_mapping`` wider than the target's output head,
            ``mapped_proposals="text"`` with sampling.
    """
    sampling = sampling or SamplingConfig()
    gamma = num_speculative_tokens if draft is not None else 0
    if draft is not None and gamma < 1:
        raise DecodeError(f"num_speculative_tokens (γ) must be >= 1, got {num_speculative_tokens}")
    if input_ids.dim() != 2:
        raise DecodeError(f"input_ids must be [batch, prompt_len], got shape {tuple(input_ids.shape)}")
    device = input_ids.device
    B, P = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.long()
    if bool((attention_mask[:, -1] == 0).any()):
        raise DecodeError("prompts must be left-padded (attention_mask[:, -1] is 0 for some row)")
    prompt_lens = attention_mask.sum(dim=1)
    # A mapped draft counts positions in its own tokens: its window is checked each round instead.
    for name, m in (("target", target), ("draft", None if vocab_mapping is not None else draft)):
        limit = _context_limit(m) if m is not None else None
        need = int(prompt_lens.max()) + max_new_tokens + gamma + 1
        if limit is not None and need > limit:
            raise DecodeError(
                f"prompt ({int(prompt_lens.max())} tokens) + max_new_tokens ({max_new_tokens}) + γ+1 = {need} "
                f"exceeds the {name}'s context window ({limit}); shorten the prompt or lower --max-new-tokens."
            )
    if eos_token_id is None:
        gc = getattr(target, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos_token_id is None:
            eos_token_id = target.config.eos_token_id
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])

    width = target.get_output_embeddings().weight.shape[0]
    real_vocab = min(real_vocab or width, width)
    mapped = draft is not None and vocab_mapping is not None
    text_mode = proposal_mode(mapped_proposals, sampling) == "text" and mapped
    if mapped:
        if vocab_mapping.target_width > width:
            raise DecodeError(f"vocab_mapping covers {vocab_mapping.target_width} target ids but the target's output "
                              f"head has {width} rows; build the mapping with the target's config "
                              "(build_vocab_mapping(target_dir, draft_dir)).")
        t2d = vocab_mapping.target_to_draft.to(device)
        dtok, ttok = vocab_mapping.draft_tokenizer, vocab_mapping.target_tokenizer
        start_id = next((i for i in (dtok.bos_token_id, dtok.eos_token_id) if i is not None), 0)
        draft_limit = _context_limit(draft)
    counts = AcceptanceCounts(max(gamma, 1) if draft is not None else 1)
    t_start = time.perf_counter()
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    tgt = _Stream(target, B, width, real_vocab, device)
    if text_mode:  # the draft's own logits over its own vocabulary (padding rows masked)
        d_width = draft.get_output_embeddings().weight.shape[0]
        drf = _Stream(draft, B, d_width, min(vocab_mapping.draft_real, d_width), device)
    elif draft is not None:
        drf = _Stream(draft, B, width, real_vocab, device, vocab_mapping if mapped else None)
    else:
        drf = None

    # Prefill everything but the last prompt token (cur); the first round feeds cur to both models.
    cur = input_ids[:, -1].clone()  # [B]
    t0 = time.perf_counter()
    if P > 1:
        for s in (tgt, None if mapped else drf):  # a mapped draft reads the prompt in its first round
            if s is not None:
                s.forward(input_ids[:, :-1], attention_mask[:, :-1], logits_to_keep=1)
                counts.prefill_calls += 1
    sync()
    counts.time_prefill += time.perf_counter() - t0

    rows = [_Row(i, []) for i in range(B)]
    if mapped:
        for i, r in enumerate(rows):
            r.prompt = input_ids[i][attention_mask[i] == 1].tolist()
            r.draft_ids = []
    active = list(range(B))  # indices into `rows` of rows still decoding, in batch order
    catch_up = torch.full((B,), -1, dtype=torch.long, device=device)  # d_γ the draft has not consumed
    ones = torch.ones(B, 1, dtype=torch.long, device=device)
    drafting = drf is not None  # false for the baseline, or once a mapped draft's context outgrows its window
    draft_prefills = 1 if (P > 1 and drf is not None and not mapped) else 0

    while active:
        b = len(active)
        ones_b = ones[:b]
        # ---- 1. draft γ tokens ---------------------------------------------------------------------------
        t0 = time.perf_counter()
        if mapped and drafting:
            # The draft re-reads the context as text; its cache keeps the prefix it already holds.
            contexts = vocab_mapping.reencode_batch_for_draft([rows[ri].prompt + rows[ri].tokens for ri in active])
            if draft_limit is not None and max(len(c) for c in contexts) + gamma > draft_limit:
                # Lossless either way: the target finishes alone (one token per pass) instead of failing.
                warnings.warn(f"the draft's context ({max(len(c) for c in contexts)} draft tokens + γ) outgrew its "
                              f"window ({draft_limit}); the target decodes the rest alone", stacklevel=2)
                drafting = False
        if mapped and drafting:
            n_keep, feeds = [], []
            for j, ri in enumerate(active):
                new = contexts[j] or [start_id]
                n = min(_common_prefix(rows[ri].draft_ids, new), len(new) - 1)  # feed ≥ 1 token for logits
                n_keep.append(n)
                feeds.append(new[n:])
                rows[ri].draft_ids = new
            drf.truncate(torch.tensor(n_keep, device=device))
            w = max(len(f) for f in feeds)
            ids = torch.zeros(b, w, dtype=torch.long)
            cmask = torch.zeros(b, w, dtype=torch.long)
            for j, f in enumerate(feeds):  # left-aligned holes: the last column is real in every row
                ids[j, w - len(f):] = torch.tensor(f, dtype=torch.long)
                cmask[j, w - len(f):] = 1
            ids, cmask = ids.to(device), cmask.to(device)
        elif drafting:
            need_catch = catch_up >= 0
            if bool(need_catch.any()):
                ids = torch.stack([catch_up.clamp(min=0), cur], dim=1)
                cmask = torch.stack([need_catch.long(), torch.ones_like(cur)], dim=1)
            else:
                ids, cmask = cur[:, None], ones_b
        if drafting:
            draft_start = drf.length
            d_tokens, q_list = [], []
            logits = drf.forward(ids, cmask, logits_to_keep=1)[:, -1]
            if mapped and draft_prefills == 0:  # the mapped draft's first read is its prompt prefill
                sync()
                dt = time.perf_counter() - t0
                counts.time_prefill += dt
                counts.prefill_calls += 1
                draft_prefills = 1
                t0 += dt
            for i in range(gamma):
                if sampling.greedy:
                    d = logits.argmax(dim=-1)
                else:
                    q_i = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p).softmax(-1)
                    d = torch.multinomial(q_i, 1, generator=generator).squeeze(1)
                    q_list.append(q_i)
                d_tokens.append(d)
                if i == gamma - 1:
                    break
                if draft_confidence_threshold is not None:
                    q_d = (logits.float().softmax(-1) if sampling.greedy else q_i).gather(1, d[:, None])
                    if bool((q_d < draft_confidence_threshold).all()):  # one host sync per draft step
                        break
                # A token-mapped draft is fed its own id of the proposed token.
                feed = t2d[d] if mapped and not text_mode else d
                logits = drf.forward(feed[:, None], ones_b, logits_to_keep=1)[:, -1]
            drafts = torch.stack(d_tokens, dim=1)  # [b, k], k ≤ γ drafted this round
            k_rows = None  # per-row proposals when rows propose different numbers (text mode)
            if text_mode:
                drafts, k_rows = _text_candidates(drafts.tolist(), [rows[ri].draft_ids for ri in active], dtok, ttok,
                                                  gamma, device)
            if mapped and len(d_tokens) > 1:
                own = torch.stack(d_tokens[:-1], dim=1)  # [b, k−1] fed to the draft this round
                for j, fed in enumerate((own if text_mode else t2d[own]).tolist()):
                    rows[active[j]].draft_ids.extend(fed)
            sync()
        else:
            drafts, k_rows = cur.new_zeros(b, 0), None
        t1 = time.perf_counter()
        counts.time_draft += t1 - t0

        k_round = drafts.shape[1]
        # ---- 2. one target pass over [cur, d_1..d_k] -------------------------------------------------------
        target_start = tgt.length
        t_ids = torch.cat([cur[:, None], drafts], dim=1)  # [b, k+1]
        t_mask = torch.ones_like(t_ids)
        if k_rows is not None:  # right-padding of rows with fewer candidates is a hole
            t_mask[:, 1:] = (torch.arange(k_round, device=device)[None, :] < k_rows[:, None]).long()
        t_logits = tgt.forward(t_ids, t_mask)  # [b, k+1, V]
        sync()
        t2 = time.perf_counter()
        counts.time_target += t2 - t1

        # ---- 3. verify -------------------------------------------------------------------------------------
        if sampling.greedy:
            if drafting:
                n_acc, nxt = verify_greedy(drafts, t_logits, k_rows)
            else:
                n_acc, nxt = torch.zeros(b, dtype=torch.long, device=device), t_logits[:, -1].argmax(-1)
        else:
            p = filter_logits(t_logits, sampling.temperature, sampling.top_k, sampling.top_p).softmax(-1)
            if drafting:
                n_acc, nxt = verify_sampled(drafts, torch.stack(q_list, dim=1), p, generator)
            else:
                n_acc = torch.zeros(b, dtype=torch.long, device=device)
                nxt = torch.multinomial(p[:, -1], 1, generator=generator).squeeze(1)
        # The one host sync verification needs: how many tokens each row emits.
        n_host = n_acc.tolist()
        drafts_host = drafts.tolist()
        k_host = k_rows.tolist() if k_rows is not None else [k_round] * b
        nxt_host = nxt.tolist()

        # ---- 4. emit, stop, account ------------------------------------------------------------------------
        keep_rows = []
        for j, ri in enumerate(active):
            row = rows[ri]
            n = n_host[j]
            emitted = drafts_host[j][:n] + [nxt_host[j]]
            kept = []
            ended = False
            for tok in emitted:
                kept.append(tok)
                row.tokens.append(tok)
                if tok in eos or _ends_with_any(row.tokens, stop) or len(row.tokens) >= max_new_tokens:
                    ended = True
                    break
            k = len(kept)
            if ended and k <= n:  # the row ended inside the accepted block: drafts after it are dropped
                counts.record_round(k, n_proposed=k, bonus=False)
            else:  # the baseline drafts nothing: k_round = n = 0, one bonus token per round
                counts.record_round(n, n_proposed=k_host[j], bonus=True)
            if on_tokens is not None:
                on_tokens(row.index, kept)
            if not ended:
                keep_rows.append(j)

        # ---- 5. roll caches back to the accepted prefix -----------------------------------------------------
        # Target holds [cur, d_1..d_k]: keep cur and the n accepted drafts.
        tgt.keep(target_start, n_acc + 1)
        if drafting and not mapped:  # a mapped draft trims its cache when it re-reads the context
            # Draft holds [catch-up?, cur, d_1..d_{k-1}]: keep the catch-up slot where real, cur and
            # min(n, k−1) drafts; a row that accepted all k still needs d_k next round.
            has_slot = drf.length - draft_start == k_round + 1
            valid = torch.clamp(n_acc, max=k_round - 1) + 1
            if has_slot:
                # The catch-up slot is a hole for rows that had nothing to catch up: keep its mask as is.
                valid = valid + 1
            drf.keep(draft_start, valid)
            catch_up = torch.where(n_acc == k_round, drafts[:, -1], torch.full_like(n_acc, -1))
        cur = nxt

        if len(keep_rows) < b:
            if not keep_rows:
                break
            sel = torch.tensor(keep_rows, device=device)
            tgt.select(sel)
            if drf is not None:
                drf.select(sel)
                catch_up = catch_up[sel]
            cur = cur[sel]
            active = [active[j] for j in keep_rows]
    prefilled = 1 if P > 1 else 0
    counts.target_calls = tgt.calls - prefilled
    counts.draft_calls = drf.calls - draft_prefills if drf is not None else 0
    counts.time_total = time.perf_counter() - t_start
    return [r.tokens for r in rows], counts


def _text_candidates(drafted: list[list[int]], contexts: list[list[int]], dtok, ttok, gamma: int, device):
    """Text mode: the draft's proposals (its own ids) → up to γ target-token candidates per row.

    The drafted text is cut from a decode of the draft's last context tokens plus its proposals (so a
    sentencepiece-style leading space survives), a trailing U+FFFD (an unfinished character) is left out,
    and the rest is encoded with the target's tokenizer.

    Returns:
        ``(candidates [b, K] int64, n_candidates [b] int64)``, rows right-padded with 0 past their count.
    """
    tails = [c[-8:] for c in contexts]
    texts = dtok.batch_decode(tails + [t + d for t, d in zip(tails, drafted)], skip_special_tokens=False,
                              clean_up_tokenization_spaces=False)
    b = len(drafted)
    new_text = []
    for j in range(b):
        tail, full = texts[j], texts[b + j]
        new_text.append((full[len(tail):] if full.startswith(tail) else dtok.decode(drafted[j])).rstrip("\ufffd"))
    cands = [c[:gamma] for c in ttok(new_text, add_special_tokens=False)["input_ids"]]
    k = max(len(c) for c in cands)
    out = torch.zeros(b, k, dtype=torch.long)
    for j, c in enumerate(cands):
        out[j, : len(c)] = torch.tensor(c, dtype=torch.long)
    return out.to(device), torch.tensor([len(c) for c in cands], dtype=torch.long, device=device)


def target_generate(target, input_ids, attention_mask=None, **kwargs) -> tuple[list[list[int]], AcceptanceCounts]:
    """Target-only baseline: :func:`speculative_generate` with the draft removed (same sampling code)."""
    kwargs.pop("num_speculative_tokens", None)
    return speculative_generate(target, None, input_ids, attention_mask, **kwargs)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(input_ids [B, P] int64, attention_mask [B, P] int64)``."""
    P = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), P), dtype=torch.long)
    for i, s in enumerate(sequences):
        if len(s):
            ids[i, P - len(s):] = torch.tensor(list(s), dtype=torch.long)
            mask[i, P - len(s):] = 1
    return ids.to(device), mask.to(device)
