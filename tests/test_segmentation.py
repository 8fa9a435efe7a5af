"""The swap diagnostic's kinds on a tiny hand-built pair whose target vocabulary merges a line end."""

import pytest

from specdraft.segmentation import KINDS, diagnose, verdict


class GreedyTokenizer:
    """Longest-match tokenizer over a fixed vocabulary: enough to make canonical and non-canonical tokens."""

    def __init__(self, vocab):
        self.vocab = list(vocab)

    def decode(self, ids, clean_up_tokenization_spaces=False):
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            j = max((k for k, s in enumerate(self.vocab) if s and text.startswith(s, i)), key=lambda k: len(self.vocab[k]))
            out.append(j)
            i += len(self.vocab[j])
        return out


# Target ids: 0 "):", 1 "):\n" (a merged line end), 2 "\n", 3 "x", 4 " return", 5 "\n ", 6 "\n    ", 7 "   ".
TARGET = GreedyTokenizer(["):", "):\n", "\n", "x", " return", "\n ", "\n    ", "   "])
# The draft's original vocabulary has every target string but "):\n" (id 1) and "\n    " (id 6).
HAS_TWIN = [True, False, True, True, True, True, False, True]


def test_each_disagreement_lands_in_the_first_kind_that_holds():
    assert TARGET.encode("\n ") == [5]  # canonical on its own
    answers = [[1, 3, 4, 6, 3]]
    draft_top1 = [[0, 3, 3, 2, 4]]
    # pos 0: target "):\n" (no twin), draft "):" = a proper prefix → merged
    # pos 1: agree
    # pos 2: target " return", draft "x" (canonical), previous input "x" has a twin → other
    # pos 3: target "\n    " (no twin), draft "\n" is its prefix → merged
    # pos 4: target "x", draft " return"; previous input "\n    " has no twin → after_non_twin_input
    rep = diagnose(TARGET, HAS_TWIN, answers, draft_top1, last_prompt_ids=[3])
    assert rep.positions == 5 and rep.without_twin == 2 and rep.disagreements == 4
    assert rep.kinds == {"merged": 2, "non_canonical": 0, "after_non_twin_input": 1, "other": 1}
    assert rep.agreement == pytest.approx(0.2)
    assert rep.top_without_twin == [["):\n", 1], ["\n    ", 1]]
    assert verdict(rep).startswith("merged dominates (50% of 4 disagreements; output-side kinds 50%)")


def test_a_draft_choice_the_target_never_writes_is_non_canonical():
    # Id 4 repeats id 1's string: encoding "a" gives id 1, so the target never writes id 4.
    vocab = GreedyTokenizer(["ab", "a", "b", "abc", "a"])
    assert vocab.encode("a") == [1]  # the first "a" wins: id 4 is never produced
    rep = diagnose(vocab, [True] * 5, [[0, 1]], [[4, 1]], last_prompt_ids=[2])
    assert rep.kinds["non_canonical"] == 1 and rep.disagreements == 1
    assert sum(rep.kinds.values()) == rep.disagreements
    assert set(rep.to_dict()["shares"]) == set(KINDS)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="sequence 0: 1 draft argmaxes for 2 answer tokens"):
        diagnose(TARGET, HAS_TWIN, [[1, 3]], [[0]], last_prompt_ids=[3])
