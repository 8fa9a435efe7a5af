"""Tokens shared by every room that reads or writes them: when a row ends, a batch left-padded, text streamed."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def stop_ids(model, tokenizer=None) -> list[int]:
    """The one rule for when a row ends: sorted ids of the generation config's EOS list (else the config's, as
    transformers falls back) plus the tokenizer's EOS — what vLLM stops at. ``model`` is always the target, so every
    stage's answers to one prompt end at one token. Empty when nothing names an EOS."""
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    ids = {int(eos)} if isinstance(eos, int) else {int(e) for e in eos or []}
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(input_ids [B, P] int64, attention_mask [B, P] int64)``."""
    from torch.nn.utils.rnn import pad_sequence

    rows = [torch.tensor(list(s), dtype=torch.long) for s in sequences]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_id, padding_side="left")
    mask = pad_sequence([torch.ones(len(r), dtype=torch.long) for r in rows], batch_first=True, padding_side="left")
    return ids.to(device), mask.to(device)


class IncrementalDetokenizer:
    """Text of a growing token sequence in pieces whose concatenation is the final decode; a
    split character is held back (why: docs/architecture.md#specdraftmodelstokens)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.printed = ""

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add ``new_ids``; returns the new text that is final (possibly "")."""
        self.ids.extend(int(i) for i in new_ids)
        stable = self._text().rstrip("\ufffd")  # an unfinished character decodes to trailing U+FFFD
        if not stable.startswith(self.printed) or len(stable) <= len(self.printed):
            return ""  # nothing final beyond what was handed out
        piece, self.printed = stable[len(self.printed):], stable
        return piece

    def flush(self) -> str:
        """The rest of the final decode (a character left unfinished at the end shows as the decode shows it)."""
        text = self._text()
        piece = text[len(self.printed):] if text.startswith(self.printed) else ""
        self.printed = text
        return piece
