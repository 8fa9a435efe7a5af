"""vLLM serving a draft of *another tokenizer* as it is: :class:`TextProposer`, a ``custom_class`` proposer that
drafts through text.

vLLM builds the class named in ``speculative_config.model``, calls ``load_model`` once and ``propose`` every step.
Per request the target ids are decoded, re-encoded for the draft, drafted greedily and re-encoded in context as
target tokens (:class:`specdraft.decoding.drafters.MappedDrafter`, ``"text"`` mode; one per request via :class:`TextDrafts`).
Verification stays vLLM's and is lossless (q one-hot on the proposal). vLLM is never imported here; torch and
transformers only inside functions. Details: docs/architecture.md#specdraftservingvllm_proposer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: The class path vLLM's ``custom_class`` method is given (``speculative_config.model``).
PROPOSER_CLASS = "specdraft.vllm_proposer.TextProposer"
#: The ``--additional-config`` key naming the speculator directory.
SPECULATOR_KEY = "specdraft_speculator"
#: The environment variable naming it when the plugin serves the directory alone.
SPECULATOR_ENV = "SPECDRAFT_SPECULATOR"


class ProposerError(RuntimeError):
    """The proposer cannot find or load its speculator (names what is missing and how to give it)."""


@dataclass
class _Entry:
    """One request's drafter, the target ids it last drafted after, the round it last served and its slot."""

    drafter: Any
    history: list[int] = field(default_factory=list)
    used: int = 0
    slot: int = -1


class TextDrafts:
    """Drafters of another tokenizer, one per request, for a batch whose requests come and go.

    Each drafter's KV cache holds at most the draft's window; ``max_entries`` (vLLM's ``max_num_seqs`` suffices)
    bounds
    how many are kept. ``mapping``: the draft's :class:`~specdraft.models.vocab.VocabMapping` at the target's
    ``target_width``.
    """

    def __init__(self, draft, mapping, num_speculative_tokens: int, target_width: int, max_entries: int = 256,
                 keep_rounds: int = 64):
        self.draft, self.mapping, self.gamma = draft, mapping, num_speculative_tokens
        self.target_width, self.max_entries, self.keep_rounds = target_width, max_entries, keep_rounds
        self.device = next(draft.parameters()).device
        self.entries: list[_Entry] = []
        self.round = 0

    def _new_drafter(self):
        from specdraft.core.config import SamplingConfig
        from specdraft.decoding.drafters import MappedDrafter

        # Greedy whatever the request samples: vLLM verifies a proposal without q against p alone.
        return MappedDrafter(self.draft, self.mapping, "text", 1, self.target_width,
                             min(self.mapping.target_real, self.target_width), self.device, SamplingConfig(), None,
                             None)

    def assign(self, contexts: Sequence[Sequence[int] | None]) -> list[_Entry | None]:
        """Each context's drafter (None for a None context), matched by content: a kept drafter whose last
        context prefixes a slot's goes there; the rest take the unclaimed drafter sharing the longest prefix, else a
        new one."""
        from specdraft.decoding.drafters import common_prefix

        out: list[_Entry | None] = [None] * len(contexts)
        live = [j for j, c in enumerate(contexts) if c is not None]
        claimed: set[int] = set()

        def claim(candidates, another_request: bool) -> None:  # candidates: (rank..., slot j, entry i)
            for *_, j, i in sorted(candidates, reverse=True):
                if out[j] is None and i not in claimed:
                    claimed.add(i)
                    out[j] = self.entries[i]
                    if another_request:
                        self.entries[i].drafter.outgrown = False  # the window it outgrew was its last request's

        claim([(len(e.history), e.slot == j, j, i) for j in live for i, e in enumerate(self.entries)
              if e.history and list(contexts[j][:len(e.history)]) == e.history], False)
        claim([(common_prefix(e.history, contexts[j]), -j, j, i) for j in live if out[j] is None
              for i, e in enumerate(self.entries) if i not in claimed and e.history and e.history[0] == contexts[j][0]],
             True)
        for j in live:
            if out[j] is None:
                self.entries.append(_Entry(self._new_drafter()))
                out[j] = self.entries[-1]
        return out

    def propose(self, contexts: Sequence[Sequence[int] | None], ks: Sequence[int] | None = None) -> list[list[int]]:
        """Target-id proposals per slot, up to ``ks[j]`` (default γ) after ``contexts[j]``; ``[]`` for a
        None context, a k of 0, or drafted text that re-encodes to nothing continuing the target's tokens."""
        from specdraft.decoding.drafters import Row

        self.round += 1
        ks = [self.gamma] * len(contexts) if ks is None else list(ks)
        live = [None if c is None or k <= 0 or len(c) == 0 else list(c) for c, k in zip(contexts, ks)]
        out: list[list[int]] = []
        for j, (entry, ctx, k) in enumerate(zip(self.assign(live), live, ks)):
            if entry is None or ctx is None:
                out.append([])
                continue
            entry.history, entry.used, entry.slot = ctx, self.round, j
            prop = entry.drafter.propose(None, [Row(0, ctx)], [min(k, self.gamma)], None)
            if prop is None:
                out.append([])
                continue
            n = prop.tokens.shape[1] if prop.n_proposed is None else int(prop.n_proposed[0])
            out.append([int(t) for t in prop.tokens[0, :n].tolist()])
        self._evict()
        return out

    def _evict(self) -> None:
        kept = [e for e in self.entries if self.round - e.used < self.keep_rounds]
        kept.sort(key=lambda e: e.used, reverse=True)
        self.entries = kept[: self.max_entries]


def speculator_dir(additional_config: Any) -> str:
    """The speculator directory: ``additional_config["specdraft_speculator"]``, else
    ``$SPECDRAFT_SPECULATOR``. Raises :class:`ProposerError` when neither is set."""
    path = additional_config.get(SPECULATOR_KEY) if isinstance(additional_config, dict) else None
    path = path or os.environ.get(SPECULATOR_ENV)
    if not path:
        raise ProposerError(f"{PROPOSER_CLASS} needs the speculator directory: pass --additional-config "
                            f"'{{\"{SPECULATOR_KEY}\": \"/path/to/speculator\"}}' (the command `specdraft export` "
                            "prints), or serve the speculator directory itself with specdraft's plugin installed")
    return str(path)


#: vLLM's tokenizer modes that are a Hugging Face tokenizer, and how transformers loads each.
HF_TOKENIZER_MODES = {"auto": {}, "hf": {}, "slow": {"use_fast": False}}


def engine_tokenizer_kwargs(model_config) -> dict[str, Any]:
    """The ``from_pretrained`` keywords of the tokenizer vLLM's engine runs (revision, remote
    code, token, mode), so target ids decode by the tokenizer that made them. Raises :class:`ProposerError` for a
    ``tokenizer_mode`` that is not a Hugging Face tokenizer."""
    mode = str(getattr(model_config, "tokenizer_mode", None) or "auto")
    if mode not in HF_TOKENIZER_MODES:
        raise ProposerError(f"{PROPOSER_CLASS} decodes and re-encodes text with a Hugging Face tokenizer and cannot "
                            f"load tokenizer_mode {mode!r}: serve with --tokenizer-mode auto (or "
                            f"{', '.join(m for m in HF_TOKENIZER_MODES if m != 'auto')}), or the draft re-indexed "
                            "into the target's tokenizer (`specdraft vocab-swap`)")
    revision = getattr(model_config, "tokenizer_revision", None)
    if revision is None and getattr(model_config, "tokenizer", None) == getattr(model_config, "model", None):
        revision = getattr(model_config, "revision", None)
    return _load_kwargs(revision, model_config, model_config) | HF_TOKENIZER_MODES[mode]


def draft_load_kwargs(speculative_config, model_config) -> dict[str, Any]:
    """The ``from_pretrained`` keywords for the draft and its tokenizer: its own ``ModelConfig`` if
    vLLM built one, else the speculative config's revision, with the engine's remote-code trust and token."""
    draft = getattr(speculative_config, "draft_model_config", None)
    if draft is not None and draft is not model_config:  # a method with no draft model may be handed the target's
        return _load_kwargs(getattr(draft, "revision", None), draft, model_config)
    return _load_kwargs(getattr(speculative_config, "revision", None), model_config, model_config)


def _load_kwargs(revision, trust_from, token_from) -> dict[str, Any]:
    out: dict[str, Any] = {} if revision is None else {"revision": revision}
    out["trust_remote_code"] = bool(getattr(trust_from, "trust_remote_code", False))
    token = getattr(token_from, "hf_token", None)
    return out | ({} if token is None else {"token": token})


def load_text_drafts(speculator: str, target_tokenizer, target_width: int, num_speculative_tokens: int,
                     dtype: Any = "auto", device: Any = "cpu", max_entries: int = 256,
                     tokenizer_kwargs: dict[str, Any] | None = None,
                     draft_kwargs: dict[str, Any] | None = None) -> TextDrafts:
    """:class:`TextDrafts` for a text speculator directory and the target's tokenizer (object or reference).
    Raises :class:`ProposerError` (not a text speculator) and :class:`specdraft.models.vocab.CompatibilityError` (the
    tokenizers share almost no tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdraft.models.speculator import load_speculator_config
    from specdraft.models.vocab import build_vocab_mapping

    conf = load_speculator_config(speculator)
    if not conf.drafts_through_text:
        raise ProposerError(f"{speculator} shares the verifier's tokenizer (proposal method "
                            f"{conf.default_proposal_method!r}): serve it with vLLM's draft_model method "
                            "(`specdraft inspect` prints the command)")
    if isinstance(target_tokenizer, (str, os.PathLike)):
        target_tokenizer = AutoTokenizer.from_pretrained(target_tokenizer, **(tokenizer_kwargs or {}))
    draft_tok = AutoTokenizer.from_pretrained(speculator, **(draft_kwargs or {}))
    draft = AutoModelForCausalLM.from_pretrained(speculator, **(draft_kwargs or {}), dtype=dtype).to(device).eval()
    mapping = build_vocab_mapping(target_tokenizer, draft_tok, target_config=target_width,
                                  draft_config=draft.get_output_embeddings().weight.shape[0])
    return TextDrafts(draft, mapping, num_speculative_tokens, target_width, max_entries=max_entries)


class TextProposer:
    """vLLM's ``custom_class`` proposer for a speculator that drafts through text, built from ``vllm_config``.
    Raises :class:`ProposerError`: no speculator directory, a non-Hugging-Face tokenizer mode, not a text speculator.
    """

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        model = vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(model.max_model_len)
        self.speculator = speculator_dir(getattr(vllm_config, "additional_config", None))
        self.tokenizer = model.tokenizer
        self.tokenizer_kwargs = engine_tokenizer_kwargs(model)
        self.draft_kwargs = draft_load_kwargs(spec, model)
        self.target_width = int(model.get_vocab_size())
        self.dtype = model.dtype
        device = getattr(getattr(vllm_config, "device_config", None), "device", None)
        self.device = device if device is not None else "cpu"
        self.max_entries = 2 * int(getattr(vllm_config.scheduler_config, "max_num_seqs", 128))
        self.drafts: TextDrafts | None = None

    def load_model(self, *args, **kwargs) -> None:
        """Load the draft and both tokenizers (the target model vLLM passes is not used)."""
        self.drafts = load_text_drafts(self.speculator, self.tokenizer, self.target_width, self.k, dtype=self.dtype,
                                       device=self.device, max_entries=self.max_entries,
                                       tokenizer_kwargs=self.tokenizer_kwargs, draft_kwargs=self.draft_kwargs)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu, slot_mappings=None,
                **kwargs) -> list[list[int]]:
        """Draft ids per batch slot (``[]`` where a slot sampled nothing or has no room left).

        ``num_tokens_no_spec``: ``[max_num_reqs]`` tokens so far per slot; ``token_ids_cpu``: ``[max_num_reqs,
        max_model_len]`` int32 token ids.
        """
        if self.drafts is None:
            self.load_model()
        contexts, ks = [], []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            k = min(self.k, self.max_model_len - n)  # vLLM's ngram proposer caps the same way
            if not sampled or k <= 0:
                contexts.append(None)
                ks.append(0)
                continue
            contexts.append(token_ids_cpu[i, :n].tolist())
            ks.append(k)
        return self.drafts.propose(contexts, ks)
