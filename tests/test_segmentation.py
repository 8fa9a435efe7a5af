"""The swap diagnostic's kinds on a tiny hand-built pair whose target vocabulary merges a line end."""

import pytest

from specdraft.models.segmentation import KINDS, diagnose, verdict


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


# ------------------------------------------------------------------ wired: headroom's pass, vocab-swap, headroom

import json

import torch
from torch import nn

REPLIES = ["def total(items):\n    return sum(items)", "for x in range(count):\n    print(hello world)",
           "value = lambda index: index + total", "return items", "print(value)\n    return total(items)"]


@pytest.fixture(scope="module")
def bpe_pair():
    """A target tokenizer with merges its draft's lacks (``Ġreturn``, ``ĠĠĠĠ``, ``Ġtotal``, …) and the twins."""
    from specdraft.models.vocab import build_vocab_mapping
    from specdraft.testing import tiny_bpe_tokenizer

    target_tok, draft_tok = tiny_bpe_tokenizer(360, seed=1), tiny_bpe_tokenizer(300)
    twins = (build_vocab_mapping(target_tok, draft_tok).target_to_draft >= 0).tolist()
    assert not twins[target_tok.convert_tokens_to_ids("Ġreturn")]
    return target_tok, draft_tok, twins


class RuleDraft(nn.Module):
    """A teacher-forced "draft" that reads the token it must predict off its own input (position j sees
    ``input_ids[j + 1]``) and proposes ``rule(read, next)``: its argmax at every position is known in advance."""

    def __init__(self, width: int, rule):
        super().__init__()
        self.width, self.rule = width, rule
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **_):
        nxt = torch.roll(input_ids, -1, dims=1)  # the last position wraps around: never scored
        choice = torch.tensor([[self.rule(int(r), int(t)) for r, t in zip(rr, tt)]
                               for rr, tt in zip(input_ids.tolist(), nxt.tolist())])
        logits = torch.full((*input_ids.shape, self.width), -10.0).scatter(-1, choice[..., None], 10.0)
        return type("Out", (), {"logits": logits})()


def test_headroom_splits_the_disagreements_of_its_own_pass_by_kind(bpe_pair):
    """forecast_headroom with twins: left-padded batches, pipeline-style masks; every bucket's count is known from
    the rule the draft follows."""
    from specdraft.core.config import HeadroomConfig
    from specdraft.measuring.headroom import forecast_headroom
    from specdraft.testing import tiny_model

    tok, _, twins = bpe_pair
    vocab = [tok.decode([i]) for i in range(len(tok))]
    e, a = tok.convert_tokens_to_ids("e"), tok.convert_tokens_to_ids("a")
    assert tok.encode("e", add_special_tokens=False) == [e]  # canonical

    def prefix(t: int) -> int:  # the longest target token that is a proper string prefix of t's
        return max((i for i, s in enumerate(vocab) if s and len(s) < len(vocab[t]) and vocab[t].startswith(s)),
                   key=lambda i: len(vocab[i]))

    def other(t: int) -> int:
        return e if t != e else a

    def rule(read: int, t: int) -> int:
        if not twins[t]:
            return prefix(t)  # merged
        if not twins[read]:
            return other(t)  # after a twin-less input
        return other(t) if t % 3 == 0 else t  # other, else agree

    prompts = [tok.encode(f"write {i}:", add_special_tokens=False) for i in range(len(REPLIES))]
    answers = [tok.encode(r, add_special_tokens=False) for r in REPLIES]
    seqs = [p + y for p, y in zip(prompts, answers)]
    masks = [[False] * (len(p) - 1) + [True] * len(y) + [False] for p, y in zip(prompts, answers)]
    want = dict.fromkeys(KINDS, 0)
    for p, y in zip(prompts, answers):
        for j, t in enumerate(y):
            read = y[j - 1] if j else p[-1]
            kind = ("merged" if not twins[t] else "after_non_twin_input" if not twins[read]
                    else "other" if t % 3 == 0 else None)
            if kind:
                want[kind] += 1
    assert want["merged"] > 0 and want["after_non_twin_input"] > 0 and want["other"] > 0
    target = tiny_model("llama", len(tok), seed=0, layers=1)
    res = forecast_headroom(target, RuleDraft(len(tok), rule), seqs, masks, HeadroomConfig(batch_size=2),
                            real_vocab=len(tok), twins=twins, tokenizer=tok).to_dict()
    seg = res["segmentation"]
    n = sum(map(len, answers))
    assert seg["positions"] == res["positions"] == n
    assert seg["kinds"] == want and seg["disagreements"] == sum(want.values())
    assert seg["without_twin"] == want["merged"] == sum(c for _, c in seg["top_without_twin"])
    assert [" return", 2] in seg["top_without_twin"]  # two replies write " return" (the third starts with it)
    top = max(KINDS, key=lambda k: want[k])
    assert f"; vocabulary swap: {top} dominates" in res["verdict"]
    json.dumps(res)
    with pytest.raises(ValueError, match="tokenizer"):
        forecast_headroom(target, target, seqs, masks, real_vocab=len(tok), twins=twins)
    assert forecast_headroom(target, target, seqs[:1], masks[:1], real_vocab=len(tok)).segmentation is None


def test_vocab_swap_report_and_headroom_on_the_swapped_draft_carry_the_diagnostic(bpe_pair, tmp_path):
    """The commands end to end: vocab-swap --prompts writes the diagnostic into vocab_swap.json and prints it;
    headroom on the swapped draft finds the original draft through that file and reports the same buckets. Both
    equal an independent count: draft_answer_top1 + diagnose on the swapped draft loaded from disk."""
    from typer.testing import CliRunner

    from specdraft.cli import app
    from specdraft.data.prompts import load_prompts
    from specdraft.data.sources import build_sequences
    from specdraft.models.segmentation import draft_answer_top1
    from specdraft.testing import tiny_model

    t_tok, d_tok, twins = bpe_pair
    tdir, ddir, out = tmp_path / "target", tmp_path / "draft", tmp_path / "swapped"
    for vocab, tok, d, seed in ((len(t_tok), t_tok, tdir, 0), (len(d_tok), d_tok, ddir, 1)):
        tiny_model("llama", vocab, seed=seed).save_pretrained(d)
        tok.save_pretrained(d)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"write {i}"},
                                                     {"role": "assistant", "content": r}]}) + "\n"
                            for i, r in enumerate(REPLIES)))
    r = CliRunner().invoke(app, ["vocab-swap", "--target", str(tdir), "--draft", str(ddir), "--out", str(out),
                                 "--prompts", str(data)])
    assert r.exit_code == 0, r.output
    seg = json.loads((out / "vocab_swap.json").read_text())["segmentation"]

    from transformers import AutoModelForCausalLM

    swapped = AutoModelForCausalLM.from_pretrained(out).eval()
    seqs = build_sequences(t_tok, load_prompts([str(data)]), answer_only=True)
    prompts, answers = [], []
    for s in seqs:
        on = [j for j, m in enumerate(s.loss_mask) if m]
        assert on == list(range(on[0], on[-1] + 1))  # one reply: one run
        prompts.append(s.ids[:on[0] + 1])
        answers.append(s.ids[on[0] + 1:on[-1] + 2])
    want = diagnose(t_tok, twins, answers, draft_answer_top1(swapped, prompts, answers), [p[-1] for p in prompts])
    assert seg["kinds"] == want.kinds and seg["positions"] == want.positions == sum(map(len, answers))
    assert seg["without_twin"] == want.without_twin > 0 and seg["top_without_twin"] == want.top_without_twin
    assert "swap diagnostic" in r.output and f"swap verdict: {seg['verdict']}" in " ".join(r.output.split())

    h = tmp_path / "h.json"
    r = CliRunner().invoke(app, ["headroom", "--target", str(tdir), "--draft", str(out), "--prompts", str(data),
                                 "--batch-size", "1", "--out", str(h)])
    assert r.exit_code == 0, r.output
    res = json.loads(h.read_text())
    assert res["segmentation"]["kinds"] == want.kinds and res["segmentation"]["without_twin"] == want.without_twin
    assert res["verdict"].endswith(f"vocabulary swap: {want.to_dict()['verdict']}")
    assert "swap diagnostic" in r.output
    # A draft of the target's own tokenizer is no swap: no diagnostic.
    r = CliRunner().invoke(app, ["headroom", "--target", str(tdir), "--draft", str(tdir), "--prompts", str(data),
                                 "--out", str(h), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert "segmentation" not in json.loads(h.read_text()) and "swap diagnostic" not in r.output
