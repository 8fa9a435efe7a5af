"""Reading one tokenizer once: every id's string, the special roles, the padding rows, and its fingerprint.

:class:`TokenizerView` is what :mod:`specdraft.models.vocab` pairs and :mod:`specdraft.models.check` compares;
:func:`tokenizer_fingerprint` names the tokenizer an artifact speaks (:mod:`specdraft.training.dump`,
:mod:`specdraft.serving.export`). Only tokenizers and configs are read here, never weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from specdraft.core.embedded import ModelResolutionError
from specdraft.models.loading import resolve

SPECIAL_ROLES = ("bos", "eos", "pad", "unk")

# llama.cpp's GGUF converter names ids the tokenizer lacks "[PAD<id>]"; transformers' GGUF loader keeps
# them as vocabulary entries. They are padding rows, not tokens.
_PLACEHOLDER = re.compile(r"\[PAD(\d+)\]")


@dataclass
class TokenizerView:
    """Everything the comparison and the mapping need from one tokenizer, read once (``get_vocab`` and one
    ``convert_ids_to_tokens`` over the whole id range)."""

    tok: Any
    name: str
    tokens: list[str | None]  # id → token string over [0, max id]; None for holes
    vocab: dict[str, int]  # string → id, as the tokenizer reports it
    real: int  # ids below this are tokens; the rest are placeholders / holes (padding rows)
    roles: dict[str, tuple[str | None, int | None]]  # bos/eos/pad/unk → (string, id)
    special_ids: list[int]  # ids the tokenizer treats as special (skipped by decode(skip_special_tokens))
    control_ids: set[int]  # added tokens flagged special: keyed by content, never paired with text tokens
    text_added_ids: set[int]  # added tokens not flagged special: text standing for their literal content
    config_vocab: int | None  # config.vocab_size = rows of the embedding / logits width

    @property
    def width(self) -> int:
        """Logits width of the model: ``config.vocab_size``, or the tokenizer's id range without a config."""
        return self.config_vocab if self.config_vocab is not None else len(self.tokens)


def _config_vocab(config) -> int | None:
    if config is None:
        return None
    if isinstance(config, int):
        return config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    v = getattr(text, "vocab_size", None)
    return int(v) if v is not None else None


def _real_length(tokens: list[str | None]) -> int:
    """Length of the vocabulary once trailing GGUF placeholders (``[PAD<id>]``) and holes are removed."""
    n = len(tokens)
    while n > 0:
        t = tokens[n - 1]
        m = _PLACEHOLDER.fullmatch(t) if t is not None else None
        if t is not None and not (m and int(m.group(1)) == n - 1):
            break
        n -= 1
    return n


def tokenizer_view(tok, name: str | None = None, config=None) -> TokenizerView:
    vocab = dict(tok.get_vocab())
    n = max(len(tok), max(vocab.values(), default=-1) + 1)
    tokens = tok.convert_ids_to_tokens(list(range(n)))
    tokens = [None if t is None else str(t) for t in tokens]
    real = _real_length(tokens)
    roles = {}
    for role in SPECIAL_ROLES:
        s = getattr(tok, f"{role}_token", None)
        i = getattr(tok, f"{role}_token_id", None)
        roles[role] = (None if s is None else str(s), None if i is None else int(i))
    decoder = getattr(tok, "added_tokens_decoder", {}) or {}
    special_ids = sorted(int(i) for i, t in decoder.items() if getattr(t, "special", False) and i < real)
    # Added tokens not flagged special (Gemma's "\n" runs, Qwen's <tool_call>) are text: they stand for their
    # content, literally, like any other text token.
    control_ids = set(special_ids)
    text_added_ids = {int(i) for i in decoder if i < real} - control_ids
    return TokenizerView(tok=tok, name=name or getattr(tok, "name_or_path", "") or type(tok).__name__,
                 tokens=tokens, vocab=vocab, real=real, roles=roles, special_ids=special_ids,
                 control_ids=control_ids, text_added_ids=text_added_ids, config_vocab=_config_vocab(config))


def view_fingerprint(v: TokenizerView) -> str:
    payload = {
        "format": 1,
        "tokens": v.tokens[: v.real],
        "roles": {r: list(v.roles[r]) for r in SPECIAL_ROLES},
        "special_ids": v.special_ids,
    }
    blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (hex) of a tokenizer's full id → string vocabulary and its special tokens.

    Hashed: the token string of every id below the real vocabulary length (GGUF ``[PAD<id>]`` placeholders
    and trailing holes are padding rows, left out, so tokenizers identical up to padding share a
    fingerprint), the bos/eos/pad/unk strings and ids, and the ids flagged special. Not hashed: the
    normaliser, pre-tokeniser and chat template (they change how text becomes ids, not what an id means).

    Args:
        tokenizer: any transformers tokenizer.

    Returns:
        64 hex characters.
    """
    return view_fingerprint(tokenizer_view(tokenizer))


def load_tokenizer_view(ref, config, role: str) -> TokenizerView:
    """A reference (embedded name, local dir, cached hub id) → tokenizer + config, never the weights; a
    tokenizer object is used as given (``config``: a config object, an int width, or None)."""
    if not isinstance(ref, (str, os.PathLike)):
        return tokenizer_view(ref, config=config)
    from transformers import AutoConfig, AutoTokenizer


    path = resolve(ref)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # any loader failure becomes one message naming the path
        raise ModelResolutionError(
            f"Could not load the {role} tokenizer from {path}: {type(exc).__name__}: {exc}"
        ) from exc
    if config is None:
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as exc:
            raise ModelResolutionError(
                f"Could not read the {role} config in {path}: {type(exc).__name__}: {exc}"
            ) from exc
    return tokenizer_view(tok, name=str(ref), config=config)
