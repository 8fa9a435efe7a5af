"""The draft side of speculative decoding: drafters that propose each round's tokens, and the state they share
with the loop.

A :class:`Drafter` (:class:`SameTokenizerDrafter`, or :class:`MappedDrafter` for another tokenizer) ``propose``-s up
to k target-id tokens per row (with q when sampling), then ``commit``-s what the target accepted. A :class:`Stream`
is a model with its KV cache and hole mask. Proposals never change what verification keeps, only how much.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdraft.core.config import SamplingConfig
from specdraft.core.sampling import align_logits, context_window, filter_logits, output_width, sample


class DecodeError(ValueError):
    """Bad decoding input (context too long, incompatible vocabularies, bad settings); defined here because
    drafters raise it too, and re-exported as ``specdraft.decoding.decode.DecodeError``."""


def proposal_mode(mapped_proposals: str | None, sampling: SamplingConfig) -> str:
    """How a draft of another tokenizer proposes (default ``"text"`` greedy, ``"tokens"`` sampling).
    Raises :class:`DecodeError` for an unknown mode or ``"text"`` with sampling (sampling needs q over target ids)."""
    if mapped_proposals not in (None, "text", "tokens"):
        raise DecodeError(f"mapped_proposals must be 'text' or 'tokens', got {mapped_proposals!r}")
    if mapped_proposals == "text" and not sampling.greedy:
        raise DecodeError("mapped_proposals='text' is lossless for greedy decoding only; sampling needs q over "
                          "target ids (mapped_proposals='tokens')")
    return mapped_proposals or ("text" if sampling.greedy else "tokens")


# -------------------------------------------------------------------------------------------- uniforms


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64's finaliser folded over them)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


class RowDraws:
    """Each row's own random stream: row j draws from seed ``s + j``, ``s`` drawn once per call.

    ``u(rows)`` is ``[b, 2γ+1] float64``: the draft's draws, the acceptance tests, the correction/bonus draw. Keyed by
    seed and row length, so a row's tokens do not depend on its batch (except a batch-wide confidence stop). Why:
    docs/architecture.md#specdraftdecodingdrafters.
    """

    def __init__(self, generator: torch.Generator | None, batch: int, gamma: int, device):
        gen_device = generator.device if generator is not None else "cpu"
        base = int(torch.randint(0, 2**62, (1,), generator=generator, device=gen_device))
        self.seeds = [base + j for j in range(batch)]
        self.width, self.device = 2 * gamma + 1, device

    def u(self, rows: list[Row]) -> torch.Tensor:
        out = torch.empty(len(rows), self.width, dtype=torch.float64, device=self.device)
        for j, r in enumerate(rows):
            g = torch.Generator(device=self.device).manual_seed(_mix(self.seeds[r.index], len(r.tokens)))
            out[j] = torch.rand(self.width, generator=g, dtype=torch.float64, device=self.device)
        return out


# ------------------------------------------------------------------------------------ per-model state


class Stream:
    """A model plus its KV cache and the mask of real (1) vs padding/hole (0) cache positions.

    :meth:`forward` returns logits at the target's width (ids ≥ ``real_vocab`` at −inf; through ``mapping`` for
    another
    tokenizer); :meth:`keep`, :meth:`truncate`, :meth:`select` roll back and drop rows. Calibration times through it
    too.
    """

    def __init__(self, model, batch: int, width: int, real_vocab: int, device, mapping=None):
        from transformers import DynamicCache

        self.model = model
        self.mapping = mapping  # VocabMapping: the model speaks another tokenizer; logits are mapped to target ids
        # Full layers: sliding-window ones cannot crop back (DynamicCache.crop); the window is in the mask.
        self.cache = DynamicCache()
        self.cache_keyword = cache_keyword(model)
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
        kwargs[self.cache_keyword] = self.cache
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **kwargs)
        self.mask = attn
        self.n_real = self.n_real + chunk_mask.sum(dim=1)
        self.calls += 1
        logits = out.logits if self.mapping is None else self.mapping.map_draft_logits(out.logits)
        return align_logits(logits, self.width, self.real_vocab)

    def keep(self, start: int, n_valid: torch.Tensor) -> None:
        """Of the positions appended from ``start``, keep ``n_valid[b]`` per row; the rest become holes, and the
        common tail of holes is cropped."""
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
        """Keep the first ``n_keep[b]`` real positions per row (the rest become holes), crop the common tail."""
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


def cache_keyword(model) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``"cache"``, or ``"past_key_values"`` for an
    older forward naming only that (which would silently drop an unknown ``cache`` keyword)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# ------------------------------------------------------------------------------------------- drafters


@dataclass
class Proposal:
    """One round's proposals: ``tokens [b, k] int64`` (target ids), ``n_proposed [b] int64`` or None when every
    row proposed k, ``q [b, k, V] float32`` (sampling only), and ``prefill_seconds`` of prompt reading in the round.
    """

    tokens: torch.Tensor
    n_proposed: torch.Tensor | None = None
    q: torch.Tensor | None = None
    prefill_seconds: float = 0.0


@dataclass
class Row:
    """One prompt of a batch and what it emitted so far; ``index`` is its position in the caller's batch."""

    index: int
    prompt: list[int]  # target ids without padding
    tokens: list[int] = field(default_factory=list)  # emitted so far


def _verification_q(logits: torch.Tensor, q: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The q verification divides by: exactly the filtered q the token was drawn from (Theorem 3.5); a function of
    its own so a negative control can put a wrong q here and show :func:`specdraft.measuring.certify.certify_sampling` fails it."""
    return q


class Drafter:
    """The draft side of the loop: ``propose`` up to ``ks[j]`` tokens per active row, ``commit`` how many were
    accepted (rolling the cache back), ``select`` the rows that continue.

    Subclasses set ``self.stream`` and implement :meth:`prefill`, :meth:`propose` (uniforms ``u [b, 2γ+1]`` or None)
    and :meth:`commit`.
    """

    stream: Stream

    def __init__(self, sampling: SamplingConfig, draws: RowDraws | None, confidence_threshold: float | None):
        self.sampling, self.draws, self.threshold = sampling, draws, confidence_threshold
        self.prefill_calls = 0
        self.first_bad: torch.Tensor | None = None  # [b]: the round's first step whose q was not finite (γ: none)
        self.nonfinite_rows = 0  # row-rounds whose proposals stopped at a non-finite q (warned once per call)

    @property
    def calls(self) -> int:
        return self.stream.calls

    def _draft(self, logits: torch.Tensor, gamma: int, feed, u: torch.Tensor | None
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Up to γ draft steps from ``logits [b, V]`` (``feed(d)``: the id read back): ``(tokens per step,
        q per step)``, fewer steps when every row fell below the confidence threshold."""
        tokens, qs = [], []
        ones = torch.ones(logits.shape[0], 1, dtype=torch.long, device=logits.device)
        self.first_bad = None
        for i in range(gamma):
            if self.sampling.greedy:
                d = logits.argmax(dim=-1)  # NaN logits give some id, which greedy verification judges as any other
            else:
                s = self.sampling
                q_i = filter_logits(logits, s.temperature, s.top_k, s.top_p).softmax(-1)
                # A non-finite q stops the row's proposals here (the target draws its own token); placeholder keeps
                # tensors finite.
                bad = ~torch.isfinite(q_i).all(dim=-1)  # [b]
                placeholder = torch.zeros_like(q_i[:1])
                placeholder[0, 0] = 1.0
                q_i = torch.where(bad[:, None], placeholder, q_i)
                step = torch.where(bad, i, gamma)
                self.first_bad = step if self.first_bad is None else torch.minimum(self.first_bad, step)
                d = sample(q_i, u=u[:, i:i + 1])  # the row's own draw for step i (RowDraws)
                qs.append(_verification_q(logits, q_i, s))
            tokens.append(d)
            if i == gamma - 1:
                break
            if self.threshold is not None:
                q_d = (logits.float().softmax(-1) if self.sampling.greedy else q_i).gather(1, d[:, None])
                if bool((q_d < self.threshold).all()):  # one host sync per draft step
                    break
            logits = self.stream.forward(feed(d)[:, None], ones, logits_to_keep=1)[:, -1]
        return tokens, qs

    def _n_proposed(self, ks: list[int], drafted: int, device) -> torch.Tensor | None:
        """:func:`_n_proposed`, each row also capped at its first non-finite q."""
        n = _n_proposed(ks, drafted, device)
        if self.first_bad is None or not bool((cut := self.first_bad < drafted).any()):  # one host sync per round
            return n
        self.nonfinite_rows += int(cut.sum())
        return torch.minimum(n if n is not None else torch.full_like(self.first_bad, drafted), self.first_bad)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        raise NotImplementedError

    def propose(self, cur: torch.Tensor, rows: list[Row], ks: list[int], u: torch.Tensor | None
                ) -> Proposal | None:
        raise NotImplementedError

    def commit(self, n_accepted: torch.Tensor) -> None:
        raise NotImplementedError

    def select(self, keep: torch.Tensor) -> None:
        self.stream.select(keep)


class SameTokenizerDrafter(Drafter):
    """A draft sharing the target's tokenizer. Each round it reads, in one pass, the context it
    has not read yet (``cur``, a fully accepted round's last draft, tokens emitted while it drafted nothing), then
    drafts."""

    def __init__(self, model, batch: int, width: int, real_vocab: int, device, sampling, draws, threshold):
        super().__init__(sampling, draws, threshold)
        self.stream = Stream(model, batch, width, real_vocab, device)
        self.read = [0] * batch
        self.device = device

    def prefill(self, input_ids, attention_mask) -> None:
        if input_ids.shape[1] > 1:
            self.stream.forward(input_ids[:, :-1], attention_mask[:, :-1], logits_to_keep=1)
            self.prefill_calls = 1
        self.read = attention_mask[:, :-1].sum(dim=1).tolist()

    def propose(self, cur, rows, ks, u) -> Proposal:
        contexts = [r.prompt + r.tokens for r in rows]  # the last token of each is cur
        ids, mask = _left_holes([c[n:] for c, n in zip(contexts, self.read)], self.device)
        self.start, self.fed = self.stream.length, ids.shape[1]
        self.read = [len(c) for c in contexts]
        logits = self.stream.forward(ids, mask, logits_to_keep=1)[:, -1]
        tokens, qs = self._draft(logits, max(ks), feed=lambda d: d, u=u)
        self.drafts = torch.stack(tokens, dim=1)  # [b, k]
        return Proposal(self.drafts, self._n_proposed(ks, len(tokens), self.device),
                        torch.stack(qs, dim=1) if qs else None)

    def commit(self, n_accepted) -> None:
        kept = torch.clamp(n_accepted, max=self.drafts.shape[1] - 1)
        self.stream.keep(self.start, kept + self.fed)
        self.read = [r + n for r, n in zip(self.read, kept.tolist())]

    def select(self, keep) -> None:
        super().select(keep)
        self.read = [self.read[j] for j in keep.tolist()]


def _left_holes(feeds: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists → ``(ids [b, w], mask [b, w])`` right-aligned, holes on the left."""
    from torch.nn.utils.rnn import pad_sequence

    ids = pad_sequence([torch.tensor(f, dtype=torch.long) for f in feeds], batch_first=True, padding_side="left")
    mask = pad_sequence([torch.ones(len(f), dtype=torch.long) for f in feeds], batch_first=True, padding_side="left")
    return ids.to(device), mask.to(device)


def _n_proposed(ks: list[int], drafted: int, device) -> torch.Tensor | None:
    """``[b] int64`` proposals per row (``ks`` capped at the steps drafted), or None when all proposed all."""
    n = [min(k, drafted) for k in ks]
    return None if all(x == drafted for x in n) else torch.tensor(n, dtype=torch.long, device=device)


class MappedDrafter(Drafter):
    """A draft of another tokenizer through a :class:`~specdraft.models.vocab.VocabMapping`: it re-reads the
    context as text each round and proposes target ids (``"tokens"``, with q) or re-encoded text (``"text"``, greedy).
    Past its window it stops proposing (warned)."""

    def __init__(self, model, mapping, mode: str, batch: int, width: int, real_vocab: int, device, sampling,
                 draws, threshold):
        super().__init__(sampling, draws, threshold)
        if mapping.target_width > width:
            raise DecodeError(f"vocab_mapping covers {mapping.target_width} target ids but the target's output "
                              f"head has {width} rows; build the mapping with the target's config "
                              "(build_vocab_mapping(target_dir, draft_dir)).")
        self.mapping, self.text = mapping, mode == "text"
        self.t2d = mapping.target_to_draft.to(device)
        if self.text:  # the draft's own logits over its own vocabulary (padding rows masked)
            d_width = output_width(model)
            self.stream = Stream(model, batch, d_width, min(mapping.draft_real, d_width), device)
        else:
            self.stream = Stream(model, batch, width, real_vocab, device, mapping)
        self.limit, self.device = context_window(model), device
        self.draft_ids: list[list[int]] = [[] for _ in range(batch)]  # each row's real cache, in draft ids
        self.outgrown = False

    def prefill(self, input_ids, attention_mask) -> None:
        pass  # the draft reads its prompt (re-encoded) in its first round

    def _feed(self, contexts: list[list[int]]) -> tuple[torch.Tensor, float]:
        """Trim each row's cache to its common prefix with the new context and feed the rest:
        ``(logits [b, V], prefill seconds of a first read else 0)``."""
        n_keep, feeds = [], []
        for j, new in enumerate(contexts):
            n = min(common_prefix(self.draft_ids[j], new), len(new) - 1)  # feed ≥ 1 token for logits
            n_keep.append(n)
            feeds.append(new[n:])
            self.draft_ids[j] = list(new)
        self.stream.truncate(torch.tensor(n_keep, device=self.device))
        ids, mask = _left_holes(feeds, self.device)
        t0 = time.perf_counter()
        logits = self.stream.forward(ids, mask, logits_to_keep=1)[:, -1]
        if self.prefill_calls:
            return logits, 0.0
        self.prefill_calls = 1  # the first read is the draft's prompt prefill
        return logits, time.perf_counter() - t0

    def propose(self, cur, rows, ks, u) -> Proposal | None:
        gamma = max(ks)
        if self.outgrown:
            return None
        contexts = self.mapping.reencode_batch_for_draft([r.prompt + r.tokens for r in rows])
        if any(not c for c in contexts):  # nothing to read yet: the target decodes alone this round
            return None
        if self.limit is not None and max(len(c) for c in contexts) + gamma > self.limit:
            # Lossless either way: the target finishes alone (one token per pass) instead of failing.
            warnings.warn(f"the draft's context ({max(len(c) for c in contexts)} draft tokens + γ) outgrew its "
                          f"window ({self.limit}); the target decodes the rest alone", stacklevel=3)
            self.outgrown = True
            return None
        logits, prefill_seconds = self._feed(contexts)
        tokens, qs = self._draft(logits, gamma, feed=(lambda d: d) if self.text else (lambda d: self.t2d[d]), u=u)
        own = torch.stack(tokens, dim=1)  # [b, k] draft ids (text) or target ids (tokens)
        for j, fed in enumerate((own[:, :-1] if self.text else self.t2d[own[:, :-1]]).tolist()):
            self.draft_ids[j].extend(fed)  # the draft read d_1..d_{k−1} while drafting
        if self.text:  # each row's text cut at its own k: more drafted text can re-tokenize its first k tokens
            return self.text_proposal([d[:k] for d, k in zip(own.tolist(), ks)], contexts, rows, ks,
                                      prefill_seconds)
        return Proposal(own, self._n_proposed(ks, own.shape[1], self.device), torch.stack(qs, dim=1) if qs else None,
                        prefill_seconds)

    def text_proposal(self, drafted: list[list[int]], contexts: list[list[int]], rows, ks,
                      prefill_seconds: float = 0.0) -> Proposal | None:
        """Text mode: drafted ids → target-token candidates (:func:`_text_candidates`), or None."""
        cands, n = _text_candidates(drafted, contexts, [r.prompt + r.tokens for r in rows],
                                    self.mapping.draft_tokenizer, self.mapping.target_tokenizer, ks, self.device)
        return Proposal(cands, n, prefill_seconds=prefill_seconds) if int(n.max()) > 0 else None

    def commit(self, n_accepted) -> None:
        pass  # the cache is trimmed when the draft re-reads the context next round

    def select(self, keep) -> None:
        super().select(keep)
        self.draft_ids = [self.draft_ids[j] for j in keep.tolist()]



#: Context tokens decoded with the drafted text on each side, for boundary merges.
_TEXT_WINDOW = 8


def _text_candidates(drafted: list[list[int]], contexts: list[list[int]], target_contexts: list[list[int]], dtok,
                     ttok, ks: Sequence[int], device):
    """Text mode: the draft's own ids → up to ``ks[j]`` target-token candidates per row, the text
    tokenized in context after the target's tokens (transformers' ``AssistedCandidateGeneratorDifferentTokenizers``).
    Returns ``(candidates [b, K] int64, n_candidates [b] int64)``; a row that cannot continue proposes nothing."""
    tails = [c[-_TEXT_WINDOW:] for c in contexts]
    texts = dtok.batch_decode(tails + [t + d for t, d in zip(tails, drafted)], skip_special_tokens=False,
                              clean_up_tokenization_spaces=False)
    b = len(drafted)
    new_text = []
    for j in range(b):
        tail, full = texts[j], texts[b + j]
        new_text.append((full[len(tail):] if full.startswith(tail) else dtok.decode(drafted[j])).rstrip("\ufffd"))
    windows = ttok.batch_decode([c[-_TEXT_WINDOW:] for c in target_contexts], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
    encoded = ttok(windows + [w + t for w, t in zip(windows, new_text)], add_special_tokens=False)["input_ids"]
    cands = []
    for j, k in enumerate(ks):
        alone, joined = encoded[j], encoded[b + j]
        n = common_prefix(alone, joined)
        cands.append(list(joined[n:k + n]) if n == len(alone) and new_text[j] else [])
    from torch.nn.utils.rnn import pad_sequence

    out = pad_sequence([torch.tensor(c, dtype=torch.long) for c in cands], batch_first=True, padding_side="right")
    return out.to(device), torch.tensor([len(c) for c in cands], dtype=torch.long, device=device)
