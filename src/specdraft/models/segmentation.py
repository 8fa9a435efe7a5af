"""Where a vocabulary swap loses agreement: target tokens without a draft twin, and the swapped draft's
disagreements with the target split by kind.

Each teacher-forced answer position where the swapped draft's argmax is not the target's token is ``merged``,
``non_canonical``, ``after_non_twin_input`` or ``other``, the first that holds. The kinds with examples:
docs/architecture.md#specdraftmodelssegmentation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: The disagreement kinds, in assignment order.
KINDS = ("merged", "non_canonical", "after_non_twin_input", "other")
#: Kinds fixed by head rows (output side) and embedding rows (input side).
OUTPUT_SIDE = ("merged", "non_canonical")
INPUT_SIDE = ("after_non_twin_input",)


@dataclass
class SegmentationReport:
    """What :func:`diagnose` counted: answer ``positions``, those ``without_twin``, ``disagreements``
    split into ``kinds``, and the most frequent twin-less tokens as ``[text, count]``."""

    positions: int = 0
    without_twin: int = 0
    disagreements: int = 0
    kinds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    top_without_twin: list[list[Any]] = field(default_factory=list)

    @property
    def without_twin_share(self) -> float | None:
        """Share of answer tokens without a draft twin; None when nothing was scored."""
        return self.without_twin / self.positions if self.positions else None

    @property
    def agreement(self) -> float | None:
        """Teacher-forced argmax agreement of the draft with the target's answers."""
        return 1 - self.disagreements / self.positions if self.positions else None

    def share(self, kind: str) -> float | None:
        """Share of the disagreements of one kind (``KINDS``); None when there are none."""
        return self.kinds[kind] / self.disagreements if self.disagreements else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: the counts, the derived shares and the verdict."""
        return asdict(self) | {"without_twin_share": self.without_twin_share, "agreement": self.agreement,
                               "shares": {k: self.share(k) for k in KINDS}, "verdict": verdict(self)}


def _text(tok, i: int) -> str:
    return tok.decode([i], clean_up_tokenization_spaces=False)


def diagnose(target_tokenizer, has_twin: Sequence[bool], answers: Sequence[Sequence[int]],
             draft_top1: Sequence[Sequence[int]], last_prompt_ids: Sequence[int], top: int = 50) -> SegmentationReport:
    """Count the twin-less target tokens and split the draft's disagreements by kind.

    ``has_twin``: ``[V]`` per target id (``VocabMapping.target_to_draft >= 0``); ``draft_top1[s][j]`` predicts
    ``answers[s][j]``; ``last_prompt_ids``: what the draft read before each answer. Raises ValueError when
    ``draft_top1`` and ``answers`` differ in shape.
    """
    rep = SegmentationReport()
    missing: Counter[int] = Counter()
    canonical: dict[int, bool] = {}

    def is_canonical(i: int) -> bool:
        if i not in canonical:
            canonical[i] = target_tokenizer.encode(_text(target_tokenizer, i), add_special_tokens=False) == [i]
        return canonical[i]

    def twin(i: int) -> bool:
        return 0 <= i < len(has_twin) and bool(has_twin[i])

    for s, (y, guess) in enumerate(zip(answers, draft_top1, strict=True)):
        if len(y) != len(guess):
            raise ValueError(f"sequence {s}: {len(guess)} draft argmaxes for {len(y)} answer tokens")
        for j, (t, g) in enumerate(zip(y, guess)):
            rep.positions += 1
            if not twin(t):
                rep.without_twin += 1
                missing[t] += 1
            if g == t:
                continue
            rep.disagreements += 1
            read = y[j - 1] if j else last_prompt_ids[s]
            if not twin(t) and (tt := _text(target_tokenizer, t)).startswith(gt := _text(target_tokenizer, g)) \
                    and len(gt) < len(tt):
                kind = "merged"
            elif not is_canonical(g):
                kind = "non_canonical"
            elif not twin(read):
                kind = "after_non_twin_input"
            else:
                kind = "other"
            rep.kinds[kind] += 1
    rep.top_without_twin = [[_text(target_tokenizer, i), c] for i, c in missing.most_common(top)]
    return rep


def verdict(rep: SegmentationReport) -> str:
    """One sentence naming the dominant kind of disagreement and the fix it points to."""
    if not rep.disagreements:
        return "the draft agrees with the target at every scored position"
    kind = max(KINDS, key=lambda k: rep.kinds[k])
    out = sum(rep.kinds[k] for k in OUTPUT_SIDE) / rep.disagreements
    fix = {"merged": "train the head's rows for merged target tokens (output side)",
           "non_canonical": "train the head's rows away from tokens the target never writes (output side)",
           "after_non_twin_input": "train the embedding rows of twin-less input tokens (input side)",
           "other": "distil on the target's distribution (not a segmentation problem)"}[kind]
    return (f"{kind} dominates ({rep.kinds[kind] / rep.disagreements:.0%} of {rep.disagreements} disagreements; "
            f"output-side kinds {out:.0%}): {fix}")


def draft_answer_top1(draft, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> list[list[int]]:
    """The draft's teacher-forced argmax at each answer position, ``[n][len(answer)]`` ids."""
    import torch

    device = next(draft.parameters()).device
    out = []
    with torch.no_grad():
        for p, y in zip(prompts, answers, strict=True):
            ids = torch.tensor([list(p) + list(y)], device=device)
            logits = draft(input_ids=ids).logits[0, len(p) - 1:len(p) - 1 + len(y)]  # [len(y), V]
            out.append(logits.argmax(-1).tolist())
    return out


def answer_runs(sequence: Sequence[int], mask: Sequence[bool | int]) -> list[tuple[int, list[int]]]:
    """A sequence's masked positions as ``[(read, answer)]`` runs: position j predicts ``sequence[j + 1]``
    (``loss_mask`` convention), ``read`` the token before; a mask on the last position is ignored."""
    runs: list[tuple[int, list[int]]] = []
    prev = -2
    for j, m in enumerate(mask):
        if not m or j + 1 >= len(sequence):
            continue
        if j != prev + 1:
            runs.append((int(sequence[j]), []))
        runs[-1][1].append(int(sequence[j + 1]))
        prev = j
    return runs


def diagnose_masked(target_tokenizer, has_twin: Sequence[bool], sequences: Sequence[Sequence[int]],
                    masks: Sequence[Sequence[bool | int]], draft_top1: Sequence[Sequence[int]],
                    top: int = 50) -> SegmentationReport:
    """:func:`diagnose` at the masked positions of ``sequences``; ``draft_top1[s][i]`` predicts the token
    after the i-th masked position. Raises ValueError when ``draft_top1[s]`` is too short."""
    answers, guesses, read = [], [], []
    for s, (seq, mask, top1) in enumerate(zip(sequences, masks, draft_top1, strict=True)):
        runs = answer_runs(seq, mask)
        if sum(len(a) for _, a in runs) > len(top1):
            raise ValueError(f"sequence {s}: {len(top1)} draft argmaxes for {sum(len(a) for _, a in runs)} answer "
                             "tokens")
        at = 0
        for r, a in runs:
            answers.append(a)
            guesses.append(list(top1[at:at + len(a)]))
            read.append(r)
            at += len(a)
    return diagnose(target_tokenizer, has_twin, answers, guesses, read, top=top)


def masked_swap_diagnostic(draft, target_tokenizer, has_twin: Sequence[bool], sequences: Sequence[Sequence[int]],
                           masks: Sequence[Sequence[bool | int]], top: int = 50) -> SegmentationReport:
    """:func:`diagnose_masked` of a swapped ``draft``, one pass per sequence, argmax over the real
    vocabulary."""
    import torch

    device = next(draft.parameters()).device
    real = len(target_tokenizer)
    top1 = []
    with torch.no_grad():
        for seq, mask in zip(sequences, masks, strict=True):
            logits = draft(input_ids=torch.tensor([list(seq)], device=device)).logits[0, :, :real]  # [S, V]
            top1.append(logits[torch.tensor([bool(m) for m in mask], device=device)].argmax(-1).tolist())
    return diagnose_masked(target_tokenizer, has_twin, sequences, masks, top1, top=top)

