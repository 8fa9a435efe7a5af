"""Pairing two tokenizers that disagree: the one-to-one twin mapping, and the draft re-indexed through it.

* :class:`VocabMapping` pairs string-identical tokens one to one (byte-level ``Ġ`` and sentencepiece ``▁``
  markers normalised to the bytes they stand for) so a draft of another family can propose in target ids
  (Timor et al. 2025, "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
  Heterogeneous Vocabularies"; :func:`specdraft.decoding.decode.speculative_generate` ``vocab_mapping``).
* :func:`vocab_swap` re-indexes a draft's embedding and output rows into the target's tokenizer for training
  (fast vocabulary transfer, Gee et al. 2022).

Each tokenizer is read once (:mod:`specdraft.models.tokenizer_view`); weights are
read only by :func:`vocab_swap`, after its mapping has been checked.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from specdraft.core.io import atomic_directory
from specdraft.data.sources import build_sequences
from specdraft.models.loading import ModelResolutionError, load_model, resolve
from specdraft.models.segmentation import masked_swap_diagnostic
from specdraft.models.tokenizer_view import (
    TokenizerView,
    load_tokenizer_view,
    view_fingerprint,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: Default ``min_coverage``: the share of the target's text tokens that must have a draft twin.
MIN_COVERAGE = 0.01

# Encoded by both tokenizers to compare normaliser and pre-tokeniser (code, NFC/NFD, scripts, emoji, whitespace).
PROBE_TEXT = (
    "def fib(n: int) -> int:\n"
    '    """Return F(n)."""\n'
    "\tif n < 2:\n"
    "\t\treturn n  # base case\n"
    "    return fib(n - 1) + fib(n - 2)\n\n\n"
    "x = {'a': [1, 2.5e-3, 0x1F]}; y = x['a'][0] ** 12345678 != 3.14159\n"
    "Ünïcödé: café naïve (NFD: cafe\u0301 nai\u0308ve)  Ελληνικά  русский  中文字符  日本語のテキスト  "
    "한국어  العربية  हिन्दी  ไทย\n"
    "emoji: 😀 👍🏽 👨\u200d👩\u200d👧 🇫🇷 ✅\n"
    "whitespace:   three  two\t\ttabs\r\nCRLF \u00a0nbsp \u3000ideographic    \n\n\n    trailing   "
)

#: Target strings without a draft twin listed by name in a vocab-swap report.
MAX_EXAMPLES = 10

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class CompatibilityError(ValueError):
    """Target and draft tokenizers cannot be used together (ids disagree, or no usable overlap)."""


def encode_text(tok, text: str, add_special_tokens: bool) -> list[int] | str:
    try:
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])
    except Exception as exc:  # noqa: BLE001 - reported, not raised: a probe must not stop the check
        return f"error: {type(exc).__name__}: {exc}"


def vocab_differences(t: TokenizerView, d: TokenizerView) -> tuple[list[int], list[str]]:
    """``(ids, strings)`` where two tokenizers disagree over their real vocabularies: ids whose strings differ
    (ascending) and strings whose ids differ; both empty ⇔ identical up to padding."""
    n = max(t.real, d.real)
    diff_ids = [i for i, (a, b) in enumerate(zip(t.tokens[: t.real], d.tokens[: d.real])) if a != b]
    diff_ids += list(range(min(t.real, d.real), n))
    tv = {s: i for s, i in t.vocab.items() if i < t.real}
    dv = {s: i for s, i in d.vocab.items() if i < d.real}
    return diff_ids, [s for s in tv.keys() | dv.keys() if tv.get(s) != dv.get(s)]


# --------------------------------------------------------------------------------------------------
# Vocabulary mapping between two tokenizers
# --------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-character table used by every byte-level BPE (Radford et al. 2019)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_B2U = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_B2U.values())
# str.translate to latin-1 code points, then .encode("latin-1"): one C call per token instead of a loop.
_U2LATIN1 = str.maketrans({u: chr(b) for b, u in _B2U.items()})

Scheme = Literal["byte-level", "metaspace", "plain"]


def _space_scheme(v: TokenizerView) -> Scheme:
    """How the tokenizer writes bytes and spaces into token strings: ``byte-level`` (GPT-2 table, space =
    ``Ġ``), ``metaspace`` (sentencepiece, space = ``▁``, raw bytes as ``<0xNN>``) or ``plain``."""
    state = ""
    backend = getattr(v.tok, "backend_tokenizer", None)
    for part in (getattr(backend, "decoder", None), getattr(backend, "pre_tokenizer", None)):
        try:
            state += part.__getstate__().decode("utf-8") if part is not None else ""
        except Exception:  # noqa: BLE001, S112 - a component without a JSON state: the vocabulary decides
            continue
    if "ByteLevel" in state:
        return "byte-level"
    if "Metaspace" in state or "\u2581" in state:
        return "metaspace"
    # Slow tokenizers and custom pipelines: count the space markers in the vocabulary itself.
    text = [s for i, s in enumerate(v.tokens[: v.real]) if s and i not in v.control_ids]
    g = sum(s.startswith("Ġ") for s in text)
    m = sum(s.startswith("\u2581") for s in text)
    if m > g:
        return "metaspace"
    return "byte-level" if g > 0 else "plain"


def _token_key(v: TokenizerView, scheme: Scheme, i: int, s: str) -> tuple[tuple, bool]:
    """``(key, is_byte_fallback)`` of token ``i`` spelled ``s``: ``("added", s)`` for a control token, else
    ``("text", bytes it stands for)``."""
    if i in v.control_ids:
        return ("added", s), False
    if i in v.text_added_ids:  # literal content, no byte or space markers
        return ("text", s.encode("utf-8")), False
    if scheme == "byte-level" and _BYTE_ALPHABET.issuperset(s):
        return ("text", s.translate(_U2LATIN1).encode("latin-1")), False
    if scheme == "metaspace" and (m := _BYTE_FALLBACK.fullmatch(s)):
        return ("text", bytes([int(m.group(1), 16)])), True
    if scheme == "metaspace":
        return ("text", s.replace("\u2581", " ").encode("utf-8")), False
    return ("text", s.encode("utf-8")), False


def _keys(v: TokenizerView, scheme: Scheme, limit: int) -> tuple[dict[tuple, int], int]:
    """Normalised key (:func:`_token_key`) → id below ``limit``, one id per key (the non-byte-fallback piece,
    then the lowest id); returns ``(keys, duplicates)``."""
    keys: dict[tuple, int] = {}
    fallback: set[int] = set()
    dup = 0
    for i, s in enumerate(v.tokens[:limit]):
        if s is None:
            continue
        key, is_fallback = _token_key(v, scheme, i, s)
        j = keys.get(key)
        if j is None:
            keys[key] = i
        else:
            dup += 1
            if j in fallback and not is_fallback:
                keys[key] = i
        if is_fallback:
            fallback.add(i)
    return keys, dup


@dataclass
class VocabMapping:
    """One-to-one map between string-identical target and draft tokens (:func:`build_vocab_mapping`): twins
    stand for the same bytes, or control tokens of the same content; no twin → ``-1``; padding rows never map.

    Attributes:
        draft_to_target: ``[draft_width] int64``; ``target_to_draft``: ``[target_width] int64``.
        n_mapped / n_text_mapped: twin pairs, with / without added tokens; ``*_real``, ``*_text``: sizes per side.
        target_scheme / draft_scheme: ``"byte-level" | "metaspace" | "plain"``; ``*_duplicates``: ids left out.
        probe_coverage: share of the target's :data:`PROBE_TEXT` tokens with a draft twin.
    """

    draft_to_target: torch.Tensor
    target_to_draft: torch.Tensor
    target_real: int
    draft_real: int
    n_mapped: int
    n_text_mapped: int
    target_text: int
    draft_text: int
    target_scheme: str
    draft_scheme: str
    target_duplicates: int
    draft_duplicates: int
    probe_coverage: float | None
    target_tokenizer: Any = field(default=None, repr=False, compare=False)
    draft_tokenizer: Any = field(default=None, repr=False, compare=False)
    _index_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def target_width(self) -> int:
        """Logits width of the target (``len(target_to_draft)``)."""
        return int(self.target_to_draft.shape[0])

    @property
    def draft_width(self) -> int:
        """Logits width of the draft (``len(draft_to_target)``)."""
        return int(self.draft_to_target.shape[0])

    @property
    def target_coverage(self) -> float:
        """Share of the target's real vocabulary reachable from the draft (has a draft twin), probability."""
        return self.n_mapped / self.target_real if self.target_real else 0.0

    @property
    def draft_coverage(self) -> float:
        """Share of the draft's real vocabulary with a target twin, probability."""
        return self.n_mapped / self.draft_real if self.draft_real else 0.0

    def usable_error(self, min_coverage: float) -> str | None:
        """Why the overlap is not usable (no text token shared, or text coverage below ``min_coverage``);
        ``None`` when it is."""
        text_cov = self.n_text_mapped / self.target_text if self.target_text else 0.0
        if self.n_text_mapped == 0 or text_cov < min_coverage:
            return (f"no usable overlap: {self.n_text_mapped} of the target's {self.target_text} text tokens "
                    f"({text_cov:.2%}, minimum {min_coverage:.2%}) have a string-identical draft token "
                    f"(target {self.target_scheme}, draft {self.draft_scheme}; {self.n_mapped - self.n_text_mapped} "
                    "added tokens shared)")
        return None

    def _index(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._index_cache:
            src = (self.draft_to_target >= 0).nonzero().squeeze(-1)
            self._index_cache[key] = (src.to(device), self.draft_to_target[src].to(device))
        return self._index_cache[key]

    def map_draft_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V]`` → ``[..., target_width]`` (same dtype, ``-inf`` where no twin): q restricted
        to twinned tokens, renormalised by softmax; speculative sampling stays exact with any q.

        Raises:
            ValueError: the last dimension is too narrow for the mapped draft ids.
        """
        src, dst = self._index(draft_logits.device)
        if src.numel() and draft_logits.shape[-1] <= int(src[-1]):
            raise ValueError(f"draft logits have width {draft_logits.shape[-1]}, but mapped draft ids go up to "
                             f"{int(src[-1])} (draft width {self.draft_width})")
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.target_width), float("-inf"))
        out[..., dst] = draft_logits[..., src]
        return out

    def _map(self, table: torch.Tensor, ids, strict: bool, src_tok, src_role: str):
        import torch

        as_tensor = isinstance(ids, torch.Tensor)
        t = ids if as_tensor else torch.as_tensor(ids, dtype=torch.long)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= table.shape[0]):
            raise ValueError(f"{src_role} ids must lie in [0, {table.shape[0]}); got {int(t.min())}..{int(t.max())}")
        out = table.to(t.device)[t]
        if strict and bool((out < 0).any()):
            bad = int(t[out < 0].flatten()[0])
            s = src_tok.convert_ids_to_tokens(bad) if src_tok is not None else None
            raise CompatibilityError(f"{src_role} id {bad} ({s!r}) has no string-identical twin in the other "
                                     f"tokenizer ({int((out < 0).sum())} unmapped ids in this input)")
        return out if as_tensor else out.tolist()

    def draft_ids_to_target(self, ids, strict: bool = True):
        """Draft ids → target ids (tensor, list or int; the same kind back).

        Raises:
            CompatibilityError: ``strict`` and an id without a twin (named); else unmapped → ``-1``.
            ValueError: an id outside ``[0, draft_width)``.
        """
        return self._map(self.draft_to_target, ids, strict, self.draft_tokenizer, "draft")

    def target_ids_to_draft(self, ids, strict: bool = True):
        """Target ids → draft ids; see :meth:`draft_ids_to_target`."""
        return self._map(self.target_to_draft, ids, strict, self.target_tokenizer, "target")

    def reencode_for_draft(self, target_ids: Sequence[int]) -> list[int]:
        """The context in draft ids: decode the target ids to text, encode the text with the draft's
        tokenizer. Every target id is handled, mapped or not; call it on whole sequences, since a byte-level id
        may end inside a multi-byte character. See :meth:`reencode_batch_for_draft` for BOS handling."""
        return self.reencode_batch_for_draft([target_ids])[0]

    def _bos(self, role: str) -> list[int]:
        """``[bos_id]`` when that side's tokenizer puts a BOS before every text by itself (Gemma, Llama:
        ``tokenizer("")`` gives ``[bos]``), else ``[]``."""
        key = f"bos-{role}"
        if key not in self._index_cache:
            tok = self.draft_tokenizer if role == "draft" else self.target_tokenizer
            ids = list(tok("", add_special_tokens=True)["input_ids"])
            bos = tok.bos_token_id
            self._index_cache[key] = [bos] if bos is not None and ids == [bos] else []
        return self._index_cache[key]

    def reencode_batch_for_draft(self, target_seqs: Sequence[Sequence[int]]) -> list[list[int]]:
        """Target id sequences → draft ids by one batched decode and encode: special tokens decoded as text, the
        target's own BOS dropped, the draft's added where its tokenizer adds one, a trailing U+FFFD held back.

        Raises:
            ValueError: the mapping was built without tokenizer objects.
        """
        if self.target_tokenizer is None or self.draft_tokenizer is None:
            raise ValueError("this VocabMapping has no tokenizers attached; build it with build_vocab_mapping")
        texts = self.target_tokenizer.batch_decode([list(s) for s in target_seqs], skip_special_tokens=False,
                                                   clean_up_tokenization_spaces=False)
        t_bos = self.target_tokenizer.bos_token if self._bos("target") else None
        texts = [(t[len(t_bos):] if t_bos and t.startswith(t_bos) else t).rstrip("\ufffd") for t in texts]
        bos = self._bos("draft")
        return [bos + list(x) for x in self.draft_tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe figures (no tensors)."""
        return {
            "n_mapped": self.n_mapped, "n_text_mapped": self.n_text_mapped,
            "target_coverage": self.target_coverage, "draft_coverage": self.draft_coverage,
            "probe_coverage": self.probe_coverage,
            "target_real": self.target_real, "draft_real": self.draft_real,
            "target_width": self.target_width, "draft_width": self.draft_width,
            "target_scheme": self.target_scheme, "draft_scheme": self.draft_scheme,
            "target_duplicates": self.target_duplicates, "draft_duplicates": self.draft_duplicates,
        }


def mapping_from_views(t: TokenizerView, d: TokenizerView) -> VocabMapping:
    import torch

    ts, ds = _space_scheme(t), _space_scheme(d)
    # Ids the model cannot produce (config narrower than the tokenizer) are left out like padding rows.
    t_limit, d_limit = min(t.real, t.width), min(d.real, d.width)
    tk, t_dup = _keys(t, ts, t_limit)
    dk, d_dup = _keys(d, ds, d_limit)
    pairs = [(dk[k], tk[k]) for k in dk.keys() & tk.keys()]
    d2t = torch.full((d.width,), -1, dtype=torch.long)
    t2d = torch.full((t.width,), -1, dtype=torch.long)
    if pairs:
        di = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        ti = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        d2t[di] = ti
        t2d[ti] = di
    n_text = sum(1 for p in pairs if p[1] not in t.control_ids)
    probe = encode_text(t.tok, PROBE_TEXT, False)
    probe_cov = None
    if isinstance(probe, list) and probe:
        probe_cov = sum(1 for i in probe if i < t.width and t2d[i] >= 0) / len(probe)
    return VocabMapping(
        draft_to_target=d2t, target_to_draft=t2d, target_real=t.real, draft_real=d.real,
        n_mapped=len(pairs), n_text_mapped=n_text,
        target_text=t_limit - sum(1 for i in t.control_ids if i < t_limit),
        draft_text=d_limit - sum(1 for i in d.control_ids if i < d_limit),
        target_scheme=ts, draft_scheme=ds, target_duplicates=t_dup, draft_duplicates=d_dup,
        probe_coverage=probe_cov, target_tokenizer=t.tok, draft_tokenizer=d.tok,
    )


def build_vocab_mapping(target, draft, *, target_config=None, draft_config=None,
                        min_coverage: float = MIN_COVERAGE) -> VocabMapping:
    """Pair string-identical target and draft tokens one to one (tokenizers and configs only, no weights).
    ``target`` / ``draft``: references or tokenizers (then ``*_config``: a config or an int width).

    Raises:
        CompatibilityError: text coverage below ``min_coverage`` — before any model is loaded.
        ModelResolutionError: a tokenizer or config cannot be loaded (names the path).
    """
    t = load_tokenizer_view(target, target_config, "target")
    d = load_tokenizer_view(draft, draft_config, "draft")
    mapping = mapping_from_views(t, d)
    if (why := mapping.usable_error(min_coverage)) is not None:
        raise CompatibilityError(f"Target {t.name} and draft {d.name}: {why}.")
    return mapping


# --------------------------------------------------------------------------------------------------
# Vocabulary swap for training
# --------------------------------------------------------------------------------------------------


@dataclass
class VocabSwapReport:
    """What :func:`vocab_swap` did. ``copied + initialised + padding_rows == width``."""

    width: int  # rows of the new embedding / output matrices (= new config.vocab_size)
    target_real: int  # the target tokenizer's real vocabulary
    draft_real: int
    copied: int  # target ids whose rows were copied from their draft twin
    initialised: int  # target ids without a draft twin (rows not copied)
    from_pieces: int  # of those, rows set to the mean of the draft rows of the token's text re-encoded
    padding_rows: int  # rows past target_real (mean rows too; masked by align_logits at decode time)
    tied: bool  # input and output embeddings share one matrix
    target_coverage: float
    draft_coverage: float
    initialised_examples: list[str]  # first target strings without a draft twin
    target_fingerprint: str  # the tokenizer the swapped model now speaks
    token_ids_rewritten: list[str] = field(default_factory=list)  # "config.eos_token_id", … now in target ids
    token_ids_dropped: dict[str, list[int]] = field(default_factory=dict)  # field → draft ids without a target twin
    segmentation: dict[str, Any] | None = None  # SegmentationReport.to_dict(); None without prompts

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field."""
        return asdict(self)


#: Config fields holding lists of token ids that are not named ``*_token_id(s)``.
TOKEN_LIST_FIELDS = ("suppress_tokens", "begin_suppress_tokens")
#: Config fields holding nested ids (id sequences, (position, id) pairs): dropped by a swap, never carried over.
NESTED_TOKEN_FIELDS = ("bad_words_ids", "forced_decoder_ids", "sequence_bias")


def swap_config_token_ids(configs: dict[str, Any], t: TokenizerView, d: TokenizerView,
                          draft_to_target: list[int]) -> tuple[list[str], dict[str, list[int]]]:
    """Rewrite ``configs``' token-id fields from draft into target ids in place (a role's id → the target's
    role id, others → the twin's); ids without one dropped (warned); nested fields dropped.
    Returns ``(rewritten names, {field: dropped draft ids})``."""
    import warnings

    roles = {d.roles[r][1]: t.roles[r][1] for r in ("bos", "eos", "pad", "unk")
             if d.roles[r][1] is not None and t.roles[r][1] is not None}

    def to_target(i: int) -> int | None:
        if i in roles:
            return roles[i]
        j = draft_to_target[i] if 0 <= i < len(draft_to_target) else -1
        return j if j >= 0 else None

    rewritten, dropped = [], {}
    for prefix, cfg in configs.items():
        if cfg is None:
            continue
        for name in sorted(cfg.to_dict()):
            value, key = getattr(cfg, name, None), f"{prefix}.{name}"
            if name in NESTED_TOKEN_FIELDS and value:
                setattr(cfg, name, None)
                dropped[key] = []
                warnings.warn(f"vocabulary swap: {key} holds draft token ids in a nested form; dropped", stacklevel=3)
                continue
            if not (name.endswith(("_token_id", "_token_ids")) or name in TOKEN_LIST_FIELDS):
                continue
            role = name[: -len("_token_id")]
            if value is None:
                if role in ("bos", "eos", "pad", "unk") and t.roles[role][1] is not None:
                    setattr(cfg, name, t.roles[role][1])  # the draft set none: the target's own role id
                    rewritten.append(key)
                continue
            ids = list(value) if isinstance(value, (list, tuple)) else [value]
            if not all(isinstance(i, int) for i in ids):
                continue
            mapped = [to_target(i) for i in ids]
            lost = [i for i, j in zip(ids, mapped) if j is None]
            kept = list(dict.fromkeys(j for j in mapped if j is not None))
            setattr(cfg, name, (kept or None) if isinstance(value, (list, tuple)) else (kept[0] if kept else None))
            rewritten.append(key)
            if lost:
                dropped[key] = lost
                warnings.warn(f"vocabulary swap: {key} draft ids {lost} have no twin in the target's tokenizer; "
                              "dropped", stacklevel=3)
    return rewritten, dropped


def vocab_swap(draft_model, draft_tokenizer, target_tokenizer, *, width: int | None = None,
               min_coverage: float = MIN_COVERAGE, dtype: str = "float32"):
    """Re-index the draft's embedding and output rows into the target's tokenizer (fast vocabulary transfer,
    Gee et al. 2022): row t is the draft twin's row; a target token without one gets the mean of its text's draft
    pieces, else of all real draft rows. Config ids become the target's and ``speculators_*`` keys are dropped.

    Args:
        draft_model: a causal LM, or a reference loaded in ``dtype`` only after the mapping is checked.
        draft_tokenizer: ``None`` with a reference loads it from there.
        width: rows of the new matrices; default the target's real vocabulary.

    Returns:
        ``(model, VocabSwapReport)``, the model modified in place (or loaded).

    Raises:
        CompatibilityError: no usable overlap.
        ValueError: ``width`` smaller than the target's real vocabulary.
    """
    import torch

    is_ref = isinstance(draft_model, (str, os.PathLike))
    if draft_tokenizer is None:
        if not is_ref:
            raise ValueError("draft_tokenizer is required when draft_model is a model object")
        draft_tokenizer = draft_model
    t = load_tokenizer_view(target_tokenizer, None, "target")
    d_config = None if is_ref else draft_model.get_input_embeddings().weight.shape[0]
    d = load_tokenizer_view(draft_tokenizer, d_config, "draft")
    width = t.real if width is None else width
    if width < t.real:
        raise ValueError(f"width {width} is smaller than the target's real vocabulary {t.real}")
    t.config_vocab = width
    mapping = mapping_from_views(t, d)
    if (why := mapping.usable_error(min_coverage)) is not None:
        raise CompatibilityError(f"Target {t.name} and draft {d.name}: {why}.")
    if is_ref:

        draft_model, _ = load_model(draft_model, dtype=dtype, device="cpu")

    emb = draft_model.get_input_embeddings()
    head = draft_model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.weight.data_ptr()
    d_rows = min(d.real, emb.weight.shape[0])
    old_emb = emb.weight.detach().clone()  # [Vd, H]
    old_head = None if head is None or tied else head.weight.detach().clone()  # [Vd, H]
    old_bias = None if head is None or getattr(head, "bias", None) is None else head.bias.detach().clone()

    t2d = mapping.target_to_draft[:width]  # [width]
    has_twin = t2d >= 0
    src = t2d.clamp(min=0)
    real_mask = torch.arange(width) < t.real
    missing = (~has_twin & real_mask).nonzero().squeeze(-1)
    piece_ids, flat, offsets = _draft_pieces(t, d, missing.tolist(), d_rows)

    def remap(old: torch.Tensor) -> torch.Tensor:  # [Vd, H] → [width, H], or a bias [Vd] → [width]
        mean = old[:d_rows].mean(dim=0)  # real draft rows only: padding rows are untrained noise
        rows = old[src.to(old.device)]
        keep = has_twin.to(old.device).view(-1, *([1] * (old.dim() - 1)))
        out = torch.where(keep, rows, mean)
        if piece_ids:
            table = old if old.dim() == 2 else old[:, None]
            bag = torch.nn.functional.embedding_bag(flat.to(old.device), table, offsets.to(old.device), mode="mean")
            out[torch.tensor(piece_ids, device=old.device)] = bag if old.dim() == 2 else bag[:, 0]
        return out

    # resize_token_embeddings builds modules of the right shape and keeps input/output tied when they were.
    draft_model.resize_token_embeddings(width, mean_resizing=False)
    with torch.no_grad():
        draft_model.get_input_embeddings().weight.copy_(remap(old_emb))
        new_head = draft_model.get_output_embeddings()
        if old_head is not None:
            new_head.weight.copy_(remap(old_head))
        if old_bias is not None:
            new_head.bias.copy_(remap(old_bias))

    rewritten, dropped = swap_config_token_ids(
        {"config": draft_model.config, "generation_config": getattr(draft_model, "generation_config", None)},
        t, d, mapping.draft_to_target.tolist())
    # AutoConfig keeps a speculator's keys on the plain config; saved, they would offer the text proposal of the
    # old tokenizer for a draft that now speaks the target's (export writes the new speculator's own). By prefix:
    # specdraft.models.speculator.SPECULATOR_KEYS, all three "speculators_*", imported here would close a circle.
    for key in [k for k in vars(draft_model.config) if k.startswith("speculators_")]:
        delattr(draft_model.config, key)

    report = VocabSwapReport(
        width=width, target_real=t.real, draft_real=d.real,
        copied=int((has_twin & real_mask).sum()), initialised=int(missing.numel()), from_pieces=len(piece_ids),
        padding_rows=width - t.real, tied=tied,
        target_coverage=mapping.target_coverage, draft_coverage=mapping.draft_coverage,
        initialised_examples=[t.tokens[i] for i in missing[:MAX_EXAMPLES].tolist()],
        target_fingerprint=view_fingerprint(t),
        token_ids_rewritten=rewritten, token_ids_dropped=dropped,
    )
    return draft_model, report


def _draft_pieces(t: TokenizerView, d: TokenizerView, target_ids: list[int], d_rows: int):
    """``(ids, flat [N] int64, offsets [len(ids)] int64)``: target tokens without a twin whose text encodes to
    usable draft pieces (no control or unknown token, all below ``d_rows``), in ``embedding_bag`` layout."""
    import torch

    scheme = _space_scheme(t)
    texts: dict[int, str] = {}
    for i in target_ids:
        key, _ = _token_key(t, scheme, i, t.tokens[i]) if t.tokens[i] is not None else (("added", ""), False)
        if key[0] != "text":
            continue
        try:
            texts[i] = key[1].decode("utf-8")
        except UnicodeDecodeError:  # a byte-level token ending inside a multi-byte character
            continue
    if not texts:
        return [], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    encoded = d.tok(list(texts.values()), add_special_tokens=False)["input_ids"]
    bad = d.control_ids | ({d.roles["unk"][1]} if d.roles["unk"][1] is not None else set())
    ids, flat, offsets = [], [], []
    for i, pieces in zip(texts, encoded):
        if pieces and all(p < d_rows and p not in bad for p in pieces):
            ids.append(i)
            offsets.append(len(flat))
            flat.extend(pieces)
    return ids, torch.tensor(flat, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)



#: The report :func:`save_vocab_swap` writes beside a swapped draft (read back by :func:`swapped_draft_twins`).
SWAP_REPORT = "vocab_swap.json"


def swapped_draft_twins(draft_path, target_path) -> list[bool] | None:
    """Per target id whether the *original* draft of a swapped one has a twin (its tokenizer only); ``None`` when
    ``draft_path`` holds no :data:`SWAP_REPORT`.

    Raises:
        specdraft.models.loading.ModelResolutionError: the original draft cannot be found any more (names it).
    """
    from pathlib import Path


    report = Path(draft_path) / SWAP_REPORT
    if not report.is_file():
        return None
    info = json.loads(report.read_text(encoding="utf-8"))
    refs = [r for r in (info.get("draft_path"), info.get("draft")) if r]
    for ref in refs:
        try:
            original = resolve(ref)
        except (ModelResolutionError, OSError):
            continue
        return (build_vocab_mapping(target_path, original).target_to_draft >= 0).tolist()
    raise ModelResolutionError(f"{report} names the original draft {' / '.join(map(str, refs)) or '(none)'}, which "
                               "cannot be found: the swap diagnostic needs its tokenizer")


def refuse_same_tokenizer(target, draft, instead: str) -> None:
    """Refuse a draft that already speaks the target's tokenizer, from the tokenizers alone.

    Raises:
        CompatibilityError: identical ids; the message ends with ``instead``.
    """
    if not any(vocab_differences(load_tokenizer_view(target, None, "target"), load_tokenizer_view(draft, None, "draft"))):
        raise CompatibilityError(f"the draft already speaks the target's tokenizer (identical ids): {instead}")


def save_vocab_swap(draft, target, out_dir: str | os.PathLike, *, dtype: str = "float32",
                    min_coverage: float = MIN_COVERAGE, overwrite: bool = False, examples=None,
                    max_length: int = 1024) -> VocabSwapReport:
    """Write the draft re-indexed into the target's tokenizer (:func:`vocab_swap`) as a plain HF checkpoint in
    ``out_dir`` (atomically): the model, the target's tokenizer files and :data:`SWAP_REPORT`. With ``examples``, the
    swapped draft's segmentation diagnostic (:func:`specdraft.models.segmentation.masked_swap_diagnostic`).

    Returns:
        The :class:`VocabSwapReport`.

    Raises:
        FileExistsError: ``out_dir`` is a file, or non-empty without ``overwrite`` (checked first).
        CompatibilityError: the tokenizers are already compatible, or no usable overlap (before weights are read).
        ModelResolutionError: a reference cannot be resolved.
        specdraft.data.sources.DataError: ``examples`` without replies, or a tokenizer without a chat template.
    """
    from pathlib import Path

    from transformers import AutoConfig, AutoTokenizer


    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a directory; choose another --out")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose another --out or pass --overwrite")
    tpath, dpath = resolve(target), resolve(draft)
    refuse_same_tokenizer(tpath, dpath, f"nothing to swap; use {draft} as the draft directly")
    t_cfg = AutoConfig.from_pretrained(tpath)
    width = getattr(t_cfg.get_text_config(), "vocab_size", None)
    model, report = vocab_swap(dpath, None, tpath, width=width, min_coverage=min_coverage, dtype=dtype)
    target_tok = AutoTokenizer.from_pretrained(tpath)
    if examples is not None:

        twins = (build_vocab_mapping(tpath, dpath, min_coverage=min_coverage).target_to_draft >= 0).tolist()
        seqs = build_sequences(target_tok, examples, answer_only=True, max_length=max_length)
        model.eval()
        report.segmentation = masked_swap_diagnostic(model, target_tok, twins, [q.ids for q in seqs],
                                                     [q.loss_mask for q in seqs]).to_dict()
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        target_tok.save_pretrained(tmp)
        info = report.to_dict() | {"draft": str(draft), "draft_path": str(Path(dpath).resolve()),
                                   "target": str(target), "dtype": dtype}
        (tmp / SWAP_REPORT).write_text(json.dumps(info, indent=2), encoding="utf-8")
    return report
