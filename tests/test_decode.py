"""Speculative decoding invariants on tiny models: greedy == target-only, batch == solo, sampled follows p."""

from __future__ import annotations

import pytest
import torch

from specdraft.core.config import SamplingConfig
from specdraft.core.stats import chi2_goodness_of_fit
from specdraft.decoding.decode import (
    DecodeError,
    NonFiniteError,
    speculative_generate,
    target_generate,
    verify_greedy,
    verify_sampled,
)
from specdraft.models.tokens import left_pad
from specdraft.testing import exact_two_token_law, patch_everywhere, perturbed, tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("qwen2", 128, seed=0, layers=3)
    return target, perturbed(target, 0.04)


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_greedy_equals_target_only_batched_and_solo(pair, gamma):
    target, draft = pair
    ids, mask = left_pad(PROMPTS, 0)
    base, base_counts = target_generate(target, ids, mask, max_new_tokens=29, eos_token_id=[])
    # The baseline records one round per emitted token, each accepting 0 drafts plus its bonus token.
    assert base_counts.accepted_hist == [base_counts.rounds, 0] and base_counts.emitted == 29 * len(PROMPTS)
    spec, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=gamma,
                                        max_new_tokens=29, eos_token_id=[])
    assert spec == base
    for i, p in enumerate(PROMPTS):
        solo, _ = speculative_generate(target, draft, *left_pad([p], 0), num_speculative_tokens=gamma,
                                       max_new_tokens=29, eos_token_id=[])
        assert solo[0] == base[i]
    # Partial agreement: some rounds accept, some reject, rows differ within a round.
    assert 0.0 < counts.acceptance_rate < 1.0
    assert counts.emitted == 29 * len(PROMPTS)
    assert sum(counts.accepted_hist) == counts.rounds


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_draft_equal_to_target_accepts_everything(arch):
    target = tiny_model(arch, 96, seed=3, layers=2)
    ids, mask = left_pad(PROMPTS[:3], 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=17, eos_token_id=[])
    spec, counts = speculative_generate(target, target, ids, mask, num_speculative_tokens=4,
                                        max_new_tokens=17, eos_token_id=[])
    assert spec == base
    # Rounds that ended on the length limit inside the block count only the positions up to the end.
    assert counts.acceptance_rate == 1.0
    assert counts.alpha_per_position == [1.0] * 4


def test_unrelated_draft_is_still_lossless():
    target = tiny_model("llama", 128, seed=0, layers=3)
    draft = tiny_model("llama", 128, seed=99, layers=1)
    ids, mask = left_pad(PROMPTS, 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=20, eos_token_id=[])
    spec, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=3,
                                        max_new_tokens=20, eos_token_id=[])
    assert spec == base
    assert counts.acceptance_rate < 0.5


def test_draft_with_padded_vocabulary_is_lossless():
    # Same tokenizer (128 real ids); the draft's matrix has 160 rows. Padding rows must carry no mass.
    target = tiny_model("llama", 128, seed=0, layers=3)
    draft = tiny_model("llama", 160, seed=0, layers=3)
    with torch.no_grad():
        for (n, pt), (_, pd) in zip(target.named_parameters(), draft.named_parameters()):
            pd[: pt.shape[0]].copy_(pt) if pd.shape != pt.shape else pd.copy_(pt)
        draft.lm_head.weight[128:] = 50.0  # would win every argmax if padding were not masked
    ids, mask = left_pad(PROMPTS, 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=12, eos_token_id=[])
    spec, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=3,
                                        max_new_tokens=12, eos_token_id=[], real_vocab=128)
    assert spec == base
    assert counts.acceptance_rate == 1.0


def test_eos_inside_drafted_block_ends_the_row():
    target = tiny_model("llama", 128, seed=0, layers=3)
    ids, mask = left_pad([PROMPTS[0]], 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=20, eos_token_id=[])
    eos = base[0][1]  # the 2nd token: position 2 of the first 5-token block
    assert eos not in base[0][:1]
    spec, counts = speculative_generate(target, target, ids, mask, num_speculative_tokens=5,
                                        max_new_tokens=20, eos_token_id=eos)
    assert spec[0] == base[0][:2]
    assert counts.accepted == [1, 1, 0, 0, 0]  # the 3 drafts after the EOS are dropped, not counted
    assert counts.proposed == [1, 1, 0, 0, 0]
    assert counts.emitted == 2 and counts.bonus == 0


def test_stop_sequence_and_batch_rows_end_independently():
    target = tiny_model("llama", 128, seed=0, layers=3)
    draft = perturbed(target, 0.03)
    ids, mask = left_pad(PROMPTS, 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=25, eos_token_id=[])
    stop = base[2][3:5]  # ends row 2 after its 5th token (and any other row that happens to contain it)
    spec, _ = speculative_generate(target, draft, ids, mask, num_speculative_tokens=3, max_new_tokens=25,
                                   eos_token_id=[], stop=[stop])
    for row_base, row_spec in zip(base, spec):
        end = next((i + 2 for i in range(len(row_base) - 1) if row_base[i:i + 2] == stop), len(row_base))
        assert row_spec == row_base[:end]
    assert len(spec[2]) <= 5


@pytest.mark.parametrize("max_new,gamma", [(7, 3), (1, 4), (10, 2)])
def test_max_new_tokens_met_exactly(pair, max_new, gamma):
    target, _draft = pair
    ids, mask = left_pad(PROMPTS, 0)
    spec, counts = speculative_generate(target, target, ids, mask, num_speculative_tokens=gamma,
                                        max_new_tokens=max_new, eos_token_id=[])
    assert [len(s) for s in spec] == [max_new] * len(PROMPTS)
    assert counts.emitted == max_new * len(PROMPTS)


# ------------------------------------------------------------------------------------- hand-built logits


def _logits_for(tokens, vocab=8):
    out = torch.full((1, len(tokens), vocab), -5.0)
    for i, t in enumerate(tokens):
        out[0, i, t] = 5.0
    return out


def test_verify_greedy_hand_built():
    drafts = torch.tensor([[1, 2, 3]])
    n, nxt = verify_greedy(drafts, _logits_for([1, 2, 3, 4]))  # always accept → bonus 4
    assert (n.item(), nxt.item()) == (3, 4)
    n, nxt = verify_greedy(drafts, _logits_for([5, 2, 3, 4]))  # reject at once → correction 5
    assert (n.item(), nxt.item()) == (0, 5)
    n, nxt = verify_greedy(drafts, _logits_for([1, 6, 3, 4]))  # accept then reject (later match ignored)
    assert (n.item(), nxt.item()) == (1, 6)


def test_verify_sampled_hand_built():
    V = 4
    drafts = torch.tensor([[1, 2]])
    one_hot = torch.eye(V)
    q = torch.stack([one_hot[1], one_hot[2]])[None]  # draft certain of its tokens
    p_same = torch.stack([one_hot[1], one_hot[2], one_hot[3]])[None]
    n, nxt = verify_sampled(drafts, q, p_same)
    assert (n.item(), nxt.item()) == (2, 3)  # p = q: always accepted, bonus from p_{γ+1}
    p_never = torch.stack([one_hot[0], one_hot[0], one_hot[3]])[None]
    n, nxt = verify_sampled(drafts, q, p_never)
    assert (n.item(), nxt.item()) == (0, 0)  # p(d) = 0: rejected, residual max(p − q, 0) is all on 0
    p_mixed = torch.stack([one_hot[1], one_hot[3], one_hot[0]])[None]
    n, nxt = verify_sampled(drafts, q, p_mixed)
    assert (n.item(), nxt.item()) == (1, 3)


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=6, top_p=0.9)],
    ids=["plain", "temp-topk-topp"],
)
def test_sampled_output_follows_target_law(sampling):
    """χ² goodness of fit of the first two speculative tokens against the target's exact law.

    The draft is a different model (acceptance < 1), so accepted drafts, corrections from max(p − q, 0) and
    bonus tokens all contribute. N independent rows are decoded in one batch with one seeded generator.
    """
    V, N = 12, 6000
    target = tiny_model("llama", V + 5, seed=0, layers=2, hidden=16)
    draft = perturbed(target, 0.08, seed=5)
    prompt = [5, 6, 7]
    law = exact_two_token_law(target, prompt, sampling)
    ids = torch.tensor([prompt] * N)
    g = torch.Generator().manual_seed(1234)
    out, counts = speculative_generate(target, draft, ids, None, num_speculative_tokens=3, sampling=sampling,
                                       max_new_tokens=2, eos_token_id=[], generator=g)
    assert 0.05 < counts.acceptance_rate < 0.95
    pvalue, outside = chi2_goodness_of_fit(out, law)
    assert outside == 0  # never a token outside the filtered support
    assert pvalue > 1e-3, f"speculative samples do not follow the target law (p={pvalue:.2e})"


def test_sampled_target_only_follows_target_law():
    V, N = 12, 4000
    target = tiny_model("llama", V + 5, seed=0, layers=2, hidden=16)
    sampling = SamplingConfig(temperature=1.3)
    law = exact_two_token_law(target, [5, 6, 7], sampling)
    out, _ = target_generate(target, torch.tensor([[5, 6, 7]] * N), None, sampling=sampling, max_new_tokens=2,
                             eos_token_id=[], generator=torch.Generator().manual_seed(7))
    pvalue, outside = chi2_goodness_of_fit(out, law)
    assert outside == 0 and pvalue > 1e-3


# ------------------------------------------------------------------------------------------ bad input


def test_bad_input_is_refused_before_decoding(pair):
    target, draft = pair
    ids, mask = left_pad([[5, 6, 7]], 0)
    with pytest.raises(DecodeError, match="num_speculative_tokens"):
        speculative_generate(target, draft, ids, mask, num_speculative_tokens=0)
    with pytest.raises(DecodeError, match="context window"):
        speculative_generate(target, draft, ids, mask, max_new_tokens=10_000)
    right_padded = torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]])
    with pytest.raises(DecodeError, match="left-padded"):
        speculative_generate(target, draft, *right_padded)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-0.1)


@pytest.mark.parametrize("threshold", [0.3, 0.9])
def test_confidence_threshold_drafts_fewer_and_stays_lossless(pair, threshold):
    target, draft = pair
    ids, mask = left_pad(PROMPTS, 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=25, eos_token_id=[])
    spec, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=6, max_new_tokens=25,
                                        eos_token_id=[], draft_confidence_threshold=threshold)
    assert spec == base
    # Fewer proposals at the later positions than a fixed γ = 6 would make (rounds that stopped early).
    assert counts.proposed[-1] < counts.proposed[0]
    assert sum(counts.proposed) < 6 * counts.rounds


def test_confidence_threshold_sampled_follows_target_law():
    V, N = 12, 6000
    sampling = SamplingConfig(temperature=1.0)
    target = tiny_model("llama", V + 5, seed=0, layers=2, hidden=16)
    draft = perturbed(target, 0.08, seed=5)
    law = exact_two_token_law(target, [5, 6, 7], sampling)
    out, _counts = speculative_generate(target, draft, torch.tensor([[5, 6, 7]] * N), None, num_speculative_tokens=3,
                                       sampling=sampling, max_new_tokens=2, eos_token_id=[],
                                       generator=torch.Generator().manual_seed(99), draft_confidence_threshold=0.5)
    pvalue, outside = chi2_goodness_of_fit(out, law)
    assert outside == 0 and pvalue > 1e-3


# ------------------------------------------------------------------------ drafts of another tokenizer


def _renumbered_pair(vocab=64):
    """Target on one tokenizer; draft = the same weights re-indexed into a renumbered copy of it."""
    from specdraft.models.vocab import build_vocab_mapping, vocab_swap
    from specdraft.testing import tiny_tokenizer

    t_tok, d_tok = tiny_tokenizer(vocab, newline=False), tiny_tokenizer(vocab, permute=3, newline=False)
    target = tiny_model("llama", vocab, seed=0, layers=2)
    draft, report = vocab_swap(perturbed(target, 0.0), t_tok, d_tok)
    assert report.copied == vocab and report.initialised == 0
    mapping = build_vocab_mapping(t_tok, d_tok, target_config=vocab, draft_config=vocab)
    return target, draft.eval(), mapping, t_tok


def test_renumbered_draft_through_a_mapping_accepts_everything():
    # Decode → re-encode is the identity for this tokenizer, so a draft that is the target up to the id
    # numbering must agree at every position: any slip in the mapping or the context hand-over would reject.
    target, draft, mapping, tok = _renumbered_pair()
    assert not torch.equal(mapping.target_to_draft[5:], torch.arange(5, 64))  # ids really differ
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("a b c d", "def f", "user x y z w v")]
    ids, mask = left_pad(prompts, 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=20, eos_token_id=[])
    spec, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=4, max_new_tokens=20,
                                        eos_token_id=[], vocab_mapping=mapping)
    assert spec == base
    assert counts.acceptance_rate == 1.0
    # Without the mapping, the renumbered draft is a different model on these ids and mostly rejected.
    _, raw = speculative_generate(target, draft, ids, mask, num_speculative_tokens=4, max_new_tokens=20,
                                  eos_token_id=[])
    assert raw.acceptance_rate < 0.5


def _bpe_pair():
    """Target and draft on two byte-level BPE tokenizers that segment text differently; the draft is a noisy
    copy of the target re-indexed into its own tokenizer (mean rows for the strings the target lacks)."""
    from specdraft.models.vocab import build_vocab_mapping, vocab_swap
    from specdraft.testing import tiny_bpe_tokenizer

    t_tok, d_tok = tiny_bpe_tokenizer(300), tiny_bpe_tokenizer(360, seed=1)
    target = tiny_model("llama", 300, seed=0, layers=3)
    draft, _ = vocab_swap(perturbed(target, 0.03), t_tok, d_tok)
    mapping = build_vocab_mapping(t_tok, d_tok, target_config=300, draft_config=360)
    return target, draft.eval(), mapping, t_tok, d_tok


@pytest.mark.parametrize("proposals", ["text", "tokens"])
@pytest.mark.parametrize("gamma", [1, 3])
def test_mapped_draft_with_other_segmentation_is_lossless_batched_and_solo(gamma, proposals):
    target, draft, mapping, t_tok, d_tok = _bpe_pair()
    text = "for index in range(count):\n    print("
    assert t_tok.tokenize(text) != d_tok.tokenize(text)  # the draft really reads other tokens
    prompts = [t_tok(t, add_special_tokens=False)["input_ids"]
               for t in ("def total(items):\n", "hello world", text, "x")]
    ids, mask = left_pad(prompts, 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=21, eos_token_id=[])
    spec, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=gamma, max_new_tokens=21,
                                        eos_token_id=[], vocab_mapping=mapping, mapped_proposals=proposals)
    assert spec == base
    assert counts.emitted == 21 * len(prompts)
    # Per batched round one re-read + at most γ−1 steps (fewer near the end: no wasted drafting); the first
    # re-read is the draft's prompt prefill.
    assert counts.target_calls - 2 <= counts.draft_calls <= counts.target_calls * gamma - 1
    assert counts.prefill_calls == 2
    for i, p in enumerate(prompts):
        solo, _ = speculative_generate(target, draft, *left_pad([p], 0), num_speculative_tokens=gamma,
                                       max_new_tokens=21, eos_token_id=[], vocab_mapping=mapping,
                                       mapped_proposals=proposals)
        assert solo[0] == base[i]


@pytest.mark.parametrize("proposals", ["text", "tokens"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_a_mapped_draft_replayed_along_the_target_answer_counts_what_decoding_it_counts(gamma, proposals):
    """replay_mapped runs the decoder's own drafter along the target's greedy answer and never the target: its
    rounds must be the decoded rounds, also where a row ends at an EOS inside an accepted block."""
    from specdraft.decoding.replay import replay_mapped

    target, draft, mapping, t_tok, _ = _bpe_pair()
    prompts = [t_tok(t, add_special_tokens=False)["input_ids"]
               for t in ("def total(items):\n", "for index in range(count):\n    print(", "x")]
    base, _ = target_generate(target, *left_pad(prompts, 0), max_new_tokens=21, eos_token_id=[])
    for eos in ([], [base[0][9]]):  # no EOS, then one the first answer writes mid-way
        decoded, answers = [], []
        for p in prompts:  # decoded one at a time, as the speed stage decodes
            out, c = speculative_generate(target, draft, *left_pad([p], 0), num_speculative_tokens=gamma,
                                          max_new_tokens=21, eos_token_id=eos, vocab_mapping=mapping,
                                          mapped_proposals=proposals)
            decoded.append(c)
            answers.append(out[0])
        assert len(answers[0]) == (10 if eos else 21)
        # replayed one at a time and all rows in lockstep (rows leave the batch as their answers end)
        for batch_size in (1, len(prompts)):
            done = []
            replayed = replay_mapped(draft, mapping, prompts, answers, gamma, 21, set(eos), 300, 300, proposals,
                                     batch_size=batch_size, progress=lambda k, n, done=done: done.append((k, n)))
            assert done[-1] == (3, 3)
            for r, c in zip(replayed, decoded, strict=True):
                for key in ("proposed", "reached", "accepted", "accepted_hist"):
                    assert getattr(r, key) == getattr(c, key), (key, eos, batch_size)
    assert sum(sum(c.accepted) for c in decoded) > 0  # the noisy copy agrees often enough for the rounds to be tested


def test_text_candidates_reencode_the_drafted_text_with_the_target_tokenizer():
    from specdraft.decoding.drafters import _text_candidates

    _, _, mapping, t_tok, d_tok = _bpe_pair()
    context = d_tok("def", add_special_tokens=False)["input_ids"]
    drafted = d_tok(" total(items", add_special_tokens=False)["input_ids"]
    assert d_tok.convert_ids_to_tokens(drafted)[0] == "Ġtotal"
    assert mapping.draft_to_target[drafted[0]] < 0  # no target twin: token mapping could never propose it
    want = t_tok(" total(items", add_special_tokens=False)["input_ids"]
    assert t_tok.convert_ids_to_tokens(want)[:3] == ["Ġ", "t", "otal"]
    target_context = t_tok("def", add_special_tokens=False)["input_ids"]
    cands, n = _text_candidates([drafted, drafted[:1]], [context, []], [target_context, []], d_tok, t_tok, [4, 4],
                                torch.device("cpu"))
    assert n.tolist() == [4, 3]
    assert cands[0].tolist() == want[:4]
    assert cands[1].tolist() == want[:3] + [0]  # right-padded; the padding is never verified


def test_text_proposals_with_sampling_are_refused():
    target, draft, mapping, _, _ = _bpe_pair()
    ids, mask = left_pad([[5, 6, 7]], 0)
    with pytest.raises(DecodeError, match="greedy decoding only"):
        speculative_generate(target, draft, ids, mask, vocab_mapping=mapping, mapped_proposals="text",
                             sampling=SamplingConfig(temperature=1.0))
    with pytest.raises(DecodeError, match="'text' or 'tokens'"):
        speculative_generate(target, draft, ids, mask, vocab_mapping=mapping, mapped_proposals="words")


def test_a_drafter_takes_its_uniforms_and_returns_its_prompt_reading_time_in_the_proposal():
    """The loop wrote the round's uniforms on the drafter (drafter.u) before each round and read and reset
    drafter.prefill_seconds after it; now the uniforms are propose's argument and the seconds come back in the
    Proposal: a mapped draft's first read (its prompt) is prefill, later reads are drafting."""
    from specdraft.decoding.drafters import MappedDrafter, Row

    _, draft, mapping, t_tok, _ = _bpe_pair()
    prompt = t_tok("def total(items):\n", add_special_tokens=False)["input_ids"]
    drafter = MappedDrafter(draft, mapping, "tokens", 1, 300, 300, torch.device("cpu"),
                            SamplingConfig(temperature=1.0), None, None)
    cur, rows = torch.tensor([prompt[-1]]), [Row(0, prompt)]
    low = drafter.propose(cur, rows, [3], torch.zeros(1, 7, dtype=torch.float64))
    assert low.prefill_seconds > 0 and drafter.prefill_calls == 1
    high = drafter.propose(cur, rows, [3], torch.full((1, 7), 1 - 1e-9, dtype=torch.float64))
    assert high.prefill_seconds == 0.0 and drafter.prefill_calls == 1
    # Inverse-CDF draws with the uniforms given: u = 0 takes each step's lowest id of positive q, u → 1 its highest.
    for prop, pick in ((low, min), (high, max)):
        assert prop.tokens.shape == (1, 3)
        for i, tok in enumerate(prop.tokens[0].tolist()):
            assert tok == pick(prop.q[0, i].nonzero().squeeze(-1).tolist()), (i, tok)
    assert not hasattr(drafter, "u") and not hasattr(drafter, "prefill_seconds")


def test_mapped_draft_never_proposes_tokens_without_a_twin():
    target, draft, mapping, t_tok, _ = _bpe_pair()
    no_twin = (mapping.target_to_draft < 0).nonzero().squeeze(-1)
    assert no_twin.numel() > 0
    with torch.no_grad():  # make every target token without a draft twin the target's favourite
        target.lm_head.weight[no_twin] = target.lm_head.weight[no_twin] * 20
    ids, mask = left_pad([t_tok("hello world", add_special_tokens=False)["input_ids"]], 0)
    spec, _ = speculative_generate(target, draft, ids, mask, num_speculative_tokens=3, max_new_tokens=12,
                                   eos_token_id=[], vocab_mapping=mapping,
                                   sampling=SamplingConfig(temperature=1.0),
                                   generator=torch.Generator().manual_seed(0))
    # The target emits such tokens (as corrections and bonus tokens); the output is still the target's.
    assert any(t in set(no_twin.tolist()) for t in spec[0])
    # Check the draft side directly: mapped q gives those ids zero probability.
    from specdraft.decoding.drafters import Stream

    s = Stream(draft, 1, 300, 300, torch.device("cpu"), mapping)
    d_ids = mapping.reencode_batch_for_draft([ids[0].tolist()])[0]
    q = s.forward(torch.tensor([d_ids]), torch.ones(1, len(d_ids), dtype=torch.long)).softmax(-1)
    assert q[..., no_twin].sum() == 0 and torch.allclose(q.sum(-1), torch.ones(1, len(d_ids)))


@pytest.mark.parametrize("pair_kind", ["renumbered", "bpe"])
def test_mapped_sampled_output_follows_target_law(pair_kind):
    sampling = SamplingConfig(temperature=0.7, top_k=6, top_p=0.9)
    if pair_kind == "renumbered":  # a noisy renumbered draft: partial acceptance, every verification path
        from specdraft.models.vocab import build_vocab_mapping, vocab_swap
        from specdraft.testing import tiny_tokenizer

        t_tok, d_tok = tiny_tokenizer(64, newline=False), tiny_tokenizer(64, permute=3, newline=False)
        target = tiny_model("llama", 64, seed=0, layers=2, hidden=16)
        draft, _ = vocab_swap(perturbed(target, 0.08, seed=5), t_tok, d_tok)
        mapping = build_vocab_mapping(t_tok, d_tok, target_config=64, draft_config=64)
        prompt, low, high = t_tok("a b c", add_special_tokens=False)["input_ids"], 0.05, 0.95
    else:  # other segmentation: the draft mostly disagrees, corrections from max(p − q, 0) dominate
        target, draft, mapping, t_tok, _ = _bpe_pair()
        prompt, low, high = t_tok("def total(", add_special_tokens=False)["input_ids"], 0.0, 0.5
    law = exact_two_token_law(target, prompt, sampling)
    N = 4000
    out, counts = speculative_generate(target, draft.eval(), torch.tensor([prompt] * N), None,
                                       num_speculative_tokens=3, sampling=sampling, max_new_tokens=2,
                                       eos_token_id=[], generator=torch.Generator().manual_seed(11),
                                       vocab_mapping=mapping)
    assert low < counts.acceptance_rate < high
    pvalue, outside = chi2_goodness_of_fit(out, law)
    assert outside == 0
    assert pvalue > 1e-3, f"mapped speculative samples do not follow the target law (p={pvalue:.2e})"


def test_mapping_wider_than_the_target_is_refused():
    target, draft, mapping, t_tok, _ = _bpe_pair()
    from specdraft.models.vocab import build_vocab_mapping

    wide = build_vocab_mapping(t_tok, mapping.draft_tokenizer, target_config=320, draft_config=360)
    ids, mask = left_pad([[5, 6, 7]], 0)
    with pytest.raises(DecodeError, match="320"):
        speculative_generate(target, draft, ids, mask, vocab_mapping=wide)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "sampled"])
def test_mapped_renumbered_draft_behaves_exactly_like_the_unmapped_draft(sampling):
    # A noisy draft, once in the target's numbering (no mapping) and once renumbered (through the mapping):
    # the same proposals, the same acceptance, the same output, round for round and draw for draw. Any slip in
    # the draft's cache after a re-read (truncation, holes) would change its proposals and the counts.
    from specdraft.models.vocab import build_vocab_mapping, vocab_swap
    from specdraft.testing import tiny_tokenizer

    t_tok, d_tok = tiny_tokenizer(64, newline=False), tiny_tokenizer(64, permute=3, newline=False)
    target = tiny_model("llama", 64, seed=0, layers=2)
    noisy = perturbed(target, 0.05, seed=2)
    renumbered, _ = vocab_swap(perturbed(noisy, 0.0), t_tok, d_tok)
    mapping = build_vocab_mapping(t_tok, d_tok, target_config=64, draft_config=64)
    prompts = [t_tok(t, add_special_tokens=False)["input_ids"] for t in ("a b c d", "def f", "user x y z w v q")]
    ids, mask = left_pad(prompts, 0)
    runs = []
    for draft, m in ((noisy, None), (renumbered.eval(), mapping)):
        out, c = speculative_generate(target, draft, ids, mask, num_speculative_tokens=3, max_new_tokens=24,
                                      eos_token_id=[], sampling=sampling, vocab_mapping=m,
                                      generator=torch.Generator().manual_seed(5))
        runs.append((out, c.accepted, c.proposed, c.accepted_hist))
    assert runs[0] == runs[1]
    assert 0 < sum(runs[0][1]) < sum(runs[0][2])  # partial acceptance: rejections exercise the cache trim


def test_mapped_draft_outgrowing_its_window_hands_over_to_the_target():
    # The draft's tokenizer splits the text more finely than the target's, so its window (counted in its own
    # tokens) fills first; decoding stays lossless and the target finishes alone.
    from specdraft.models.vocab import build_vocab_mapping
    from specdraft.testing import tiny_bpe_tokenizer

    t_tok, d_tok = tiny_bpe_tokenizer(360, seed=1), tiny_bpe_tokenizer(300)
    target = tiny_model("llama", 360, seed=0, layers=2)
    draft = tiny_model("gpt2", 300, seed=1, layers=1, n_positions=57)
    mapping = build_vocab_mapping(t_tok, d_tok, target_config=360, draft_config=300)
    prompt = t_tok("for index in range(count):\n    print(total)\n" * 3, add_special_tokens=False)["input_ids"]
    assert len(mapping.reencode_batch_for_draft([prompt])[0]) > 57 > len(prompt) + 8 + 3
    ids, mask = left_pad([prompt], 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=8, eos_token_id=[])
    with pytest.warns(UserWarning, match="outgrew its window"):
        spec, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=3, max_new_tokens=8,
                                            eos_token_id=[], vocab_mapping=mapping)
    assert spec == base
    assert counts.draft_calls == 0 and sum(counts.proposed) == 0


def test_a_round_never_drafts_more_than_can_still_be_emitted():
    """draft = target accepts everything: 7 tokens with γ = 5 are one full round (5 drafts + bonus) and one round
    with a single slot left, where drafting would be wasted: the target emits its token alone."""
    target = tiny_model("llama", 96, seed=3, layers=2)
    ids, mask = left_pad([PROMPTS[0]], 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=7, eos_token_id=[])
    spec, counts = speculative_generate(target, target, ids, mask, num_speculative_tokens=5, max_new_tokens=7,
                                        eos_token_id=[])
    assert spec == base and counts.target_calls == 2
    assert sum(counts.proposed) == 5 and counts.draft_calls == 5  # one read of cur + 4 steps, nothing after
    assert counts.accepted_hist == [1, 0, 0, 0, 0, 1]
    # With 8 tokens the second round has 2 slots: it drafts exactly 1.
    spec, counts = speculative_generate(target, target, ids, mask, num_speculative_tokens=5, max_new_tokens=8,
                                        eos_token_id=[])
    assert counts.proposed == [2, 1, 1, 1, 1] and counts.target_calls == 2 and counts.emitted == 8


@pytest.mark.parametrize("gamma", [1, 4])
def test_sliding_window_models_roll_back_across_the_window(gamma):
    """Mistral with a 6-token window, a 12-token prompt and 20 new tokens: the context passes the window many times
    over. Rolling back must work (no DynamicCache.crop error) and the output must be the target's own — checked
    against transformers' generate, whose sliding-window cache is the reference."""
    target = tiny_model("mistral", 128, seed=0, layers=2, sliding_window=6)
    draft = perturbed(target, 0.05)
    prompt = list(range(5, 17))
    ids, mask = left_pad([prompt], 0)
    with torch.no_grad():
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, 12:].tolist()
    base, _ = target_generate(target, ids, mask, max_new_tokens=20, eos_token_id=[])
    spec, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=gamma, max_new_tokens=20,
                                        eos_token_id=[])
    assert base[0] == ref and spec == base
    assert 0.0 < counts.acceptance_rate < 1.0  # rollbacks really happened
    # A batch would let rows' holes widen the window (measured in cache positions): refused, naming the window.
    two, two_mask = left_pad([prompt, prompt[:9]], 0)
    with pytest.raises(DecodeError, match="sliding-window attention \\(window 6\\)"):
        speculative_generate(target, draft, two, two_mask, num_speculative_tokens=gamma, max_new_tokens=20)


def test_sliding_window_mapped_draft_is_lossless():
    from specdraft.models.vocab import build_vocab_mapping, vocab_swap
    from specdraft.testing import tiny_bpe_tokenizer

    t_tok, d_tok = tiny_bpe_tokenizer(300), tiny_bpe_tokenizer(360, seed=1)
    target = tiny_model("mistral", 300, seed=0, layers=2, sliding_window=5)
    draft, _ = vocab_swap(perturbed(target, 0.03), t_tok, d_tok)
    mapping = build_vocab_mapping(t_tok, d_tok, target_config=300, draft_config=360)
    ids, mask = left_pad([t_tok("def total(items):\n    for x in items", add_special_tokens=False)["input_ids"]], 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=18, eos_token_id=[])
    for proposals in ("text", "tokens"):
        spec, _ = speculative_generate(target, draft.eval(), ids, mask, num_speculative_tokens=3, max_new_tokens=18,
                                       eos_token_id=[], vocab_mapping=mapping, mapped_proposals=proposals)
        assert spec == base, proposals


def test_mapped_draft_with_no_context_waits_instead_of_reading_a_stand_in_id():
    """The draft's tokenizer cannot spell the prompt and adds no BOS: its re-encoded context is empty. It must not
    be fed an arbitrary id (0); the target decodes alone until the draft has text to read."""
    target, draft, mapping, t_tok, _ = _bpe_pair()
    seen = []
    real_forward = draft.forward

    def spy(*a, **k):
        seen.append(k["input_ids"].tolist())
        return real_forward(*a, **k)

    draft.forward = spy
    contexts = iter([[[]]] * 3)  # the first three rounds: a batch of one empty context
    real = mapping.reencode_batch_for_draft
    mapping.reencode_batch_for_draft = lambda seqs: next(contexts, None) or real(seqs)
    try:
        ids, mask = left_pad([t_tok("hello world", add_special_tokens=False)["input_ids"]], 0)
        base, _ = target_generate(target, ids, mask, max_new_tokens=12, eos_token_id=[])
        spec, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=3, max_new_tokens=12,
                                            eos_token_id=[], vocab_mapping=mapping, mapped_proposals="tokens")
    finally:
        mapping.reencode_batch_for_draft = real
        del draft.forward
    assert spec == base
    assert counts.accepted_hist[0] >= 3  # three target-only rounds, then drafting resumes
    # The draft's first read is the real context after those three tokens, not a stand-in id.
    assert seen[0] == [real([ids[0].tolist() + base[0][:3]])[0]]


def test_prompt_ids_past_either_models_width_are_named_before_decoding():
    """Tokens added to the target after the draft was made (draft 80 rows, target 96): the ids the draft cannot
    read are named in a ValueError before any forward pass (was an IndexError inside the draft), padding included
    (it is looked up too); ids past the target itself are named for the target; with ``real_vocab``, a draft
    narrower than what the target can emit is refused."""
    target, draft = tiny_model("llama", 96, seed=0, layers=2), tiny_model("llama", 80, seed=1, layers=1)
    ids, mask = left_pad([[5, 85, 6, 90], [7, 8]], pad_id=93)
    with pytest.raises(DecodeError, match=r"draft cannot read or score: 85, 90, 93 \(its input embedding has 80 rows"):
        speculative_generate(target, draft, ids, mask, num_speculative_tokens=2, max_new_tokens=3)
    assert issubclass(DecodeError, ValueError)
    ok, mask = left_pad([[5, 6, 7], [7, 8]], pad_id=0)
    # A tokenizer of 80 ids (the target's rows past it are padding): the target never emits an id the draft lacks.
    out, _ = speculative_generate(target, draft, ok, mask, num_speculative_tokens=2, max_new_tokens=3, real_vocab=80)
    assert [len(r) for r in out] == [3, 3]
    with pytest.raises(DecodeError, match=r"target can emit token ids up to 95 .* only ids below 80"):
        speculative_generate(target, draft, ok, mask, num_speculative_tokens=2, real_vocab=96)
    with pytest.raises(DecodeError, match=r"target cannot read or score: 100"):
        speculative_generate(target, None, torch.tensor([[5, 100]]), max_new_tokens=2)


def test_a_draft_with_non_finite_logits_never_reaches_a_draw_and_the_target_law_is_kept():
    """An overflowing draft (NaN logits) in sampled decoding: was an IndexError from drawing from a NaN q. Now a
    row stops proposing at its first non-finite q and the target draws its own token: χ² of the first two tokens
    against the target's exact law, with half the rows NaN from their first step and the rest +inf at every third
    draft call (mid-round), and a warning naming the draft and its dtype."""
    V, N = 12, 6000
    sampling = SamplingConfig(temperature=1.0)
    target = tiny_model("llama", V + 5, seed=0, layers=2)
    draft = perturbed(target, 0.08, seed=5)
    calls = {"n": 0}

    def overflow(_module, _args, logits):
        calls["n"] += 1
        logits = logits.clone()
        logits[0::2] = float("nan")
        if calls["n"] % 3 == 0:  # call 3 is the first round's second draft step: a cut mid-round
            logits[1::2, :, 3] = float("inf")  # +inf is not finite either (softmax gives NaN)
        return logits

    draft.lm_head.register_forward_hook(overflow)
    law = exact_two_token_law(target, [5, 6, 7], sampling)
    with pytest.warns(UserWarning, match=r"draft \(LlamaForCausalLM, float32\) gave a non-finite q"):
        out, counts = speculative_generate(target, draft, torch.tensor([[5, 6, 7]] * N), None,
                                           num_speculative_tokens=3, sampling=sampling, max_new_tokens=4,
                                           eos_token_id=[], generator=torch.Generator().manual_seed(4321))
    assert sum(counts.accepted) > 0  # the odd rows' finite first proposals still count
    pvalue, outside = chi2_goodness_of_fit(out, law)
    assert outside == 0 and pvalue > 1e-3, f"p={pvalue:.2e}"


@pytest.mark.parametrize("greedy", [True, False])
def test_a_target_with_non_finite_logits_is_named_with_its_dtype(greedy):
    target = tiny_model("llama", 32, seed=0, layers=1)
    with torch.no_grad():
        target.lm_head.weight[7] = float("nan")
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=1.0)
    with pytest.raises(NonFiniteError, match=r"target \(LlamaForCausalLM, float32\) returned NaN or \+inf logits "
                                             r"\(batch rows \[0, 1\]\)"):
        speculative_generate(target, perturbed(target, 0.05), torch.tensor([[5, 6], [7, 8]]), sampling=sampling,
                             max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    assert issubclass(NonFiniteError, ValueError)


def test_sample_refuses_a_distribution_it_cannot_draw_from():
    from specdraft.core.sampling import sample

    for bad in ([0.5, float("nan"), 0.5], [0.0, 0.0, 0.0], [1.0, float("inf"), 0.0]):
        with pytest.raises(ValueError, match="NaN or inf, or no mass"):
            sample(torch.tensor([[0.2, 0.3, 0.5], bad]))


@pytest.mark.parametrize("with_draft", [True, False])
def test_a_rows_sampled_tokens_do_not_change_when_rows_join_its_batch(pair, with_draft):
    """Seeds are a contract: row j draws from its own stream (seed s + j, s drawn once from the generator), keyed by
    its own length, so a row decodes the same tokens alone or with other rows appended to its batch (was: one
    shared stream, so every row's tokens moved when the batch changed). A reused generator still gives new draws."""
    target, draft = pair
    sampling = SamplingConfig(temperature=1.0)
    d = draft if with_draft else None

    def run(prompts, seed=11, gen=None):
        ids, mask = left_pad(prompts, pad_id=0)
        out, _ = speculative_generate(target, d, ids, mask, num_speculative_tokens=3, sampling=sampling,
                                      max_new_tokens=12, eos_token_id=[],
                                      generator=gen or torch.Generator().manual_seed(seed))
        return out

    alone = run(PROMPTS[:1])
    pair_ = run(PROMPTS[:2])
    five = run(PROMPTS)
    assert pair_[0] == alone[0] and five[0] == alone[0] and five[1] == pair_[1]
    assert run(PROMPTS[1:2])[0] != pair_[1]  # alone, prompt 1 is row 0: seed s + 0, another stream
    assert len({tuple(r) for r in run([PROMPTS[0]] * 4)}) > 1  # each row its own stream, even for one prompt
    g = torch.Generator().manual_seed(11)
    assert run(PROMPTS[:1], gen=g) == alone and run(PROMPTS[:1], gen=g) != alone  # a reused generator moves on


def test_generates_stream_prints_exactly_the_final_decode_when_characters_split_across_chunks(tmp_path, monkeypatch):
    """A byte-level BPE tokenizer spells each CJK character and emoji in 3-4 byte tokens; chunks of new tokens end
    inside a character. The stream holds an unfinished character back (no replacement character the final decode
    lacks, no character dropped) and flushes at the end: what it printed is the final decode."""
    from typer.testing import CliRunner

    import specdraft.decoding.decode as decode_mod
    from specdraft.cli import app
    from specdraft.testing import save_tiny_pair, tiny_bpe_tokenizer

    tok = tiny_bpe_tokenizer(300)
    text = "数据 🙂 print(世界)"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) and tok.decode(ids) == text  # byte tokens: characters span several ids
    tdir, ddir = save_tiny_pair(tmp_path, tokenizer=tok)

    def fake_generate(target, draft, inp, mask, on_tokens=None, **kw):  # the decode's chunks of new tokens
        from specdraft.core.acceptance import AcceptanceCounts

        for a in range(0, len(ids), 2):
            on_tokens(0, ids[a:a + 2])
        return torch.tensor([ids]), AcceptanceCounts(2)

    patch_everywhere(monkeypatch, decode_mod, "speculative_generate", fake_generate)
    r = CliRunner().invoke(app, ["generate", "x", "--target", tdir, "--draft", ddir, "--gamma", "2",
                                 "--gamma-policy", "fixed", "--dtype", "float32", "--max-new-tokens", "30"])
    assert r.exit_code == 0, r.output
    assert "\ufffd" not in r.output and text in r.output


def test_incremental_detokenizer_holds_back_an_unfinished_character_and_flushes_at_the_end():
    from specdraft.models.tokens import IncrementalDetokenizer
    from specdraft.testing import tiny_bpe_tokenizer

    tok = tiny_bpe_tokenizer(300)
    ids = tok.encode("数据 🙂 x\xff", add_special_tokens=False) + tok.convert_tokens_to_ids(["<eos>"])
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + detok.flush() == tok.decode(ids, skip_special_tokens=True)
    cut = tok.encode("🙂", add_special_tokens=False)[:2]  # an emoji cut short: its replacement shows at the flush
    rest = IncrementalDetokenizer(tok)
    assert rest.push(cut) == "" and rest.flush() == tok.decode(cut) and "\ufffd" in tok.decode(cut)


def test_one_stop_set_is_the_union_of_the_tokenizers_eos_and_the_generation_configs_eos_list(monkeypatch):
    """A row ends at any id of one set, whoever asks (decode, generate, eval, the dump's generation): the
    generation config's EOS list (the chat turn's end) together with the tokenizer's EOS, as vLLM serves."""
    from transformers import GenerationConfig

    import specdraft.decoding.responses as responses_mod
    from specdraft.measuring.evaluate import eos_ids
    from specdraft.models.tokens import stop_ids
    from specdraft.testing import tiny_tokenizer

    tok = tiny_tokenizer(64)  # eos "<eos>" = 4, "<|im_end|>" = 3
    model = tiny_model("llama", 64, eos_token_id=4)
    model.generation_config = GenerationConfig(eos_token_id=[3])
    assert stop_ids(model, tok) == [3, 4]
    assert eos_ids(model, tok) == [3, 4]
    assert stop_ids(model) == [3]  # without a tokenizer: the generation config's list
    seen = {}

    def fake_target_generate(model, ids, mask, eos_token_id=None, **kw):  # what the dump's generation stops at
        seen["eos"] = eos_token_id
        return [[3]], None

    patch_everywhere(monkeypatch, "specdraft.decoding.decode", "target_generate", fake_target_generate)
    responses_mod.generate_from_ids(model, tok, [[5, 6]], 4)
    assert seen["eos"] == [3, 4]


def _scripted_target(vocab: int, script: list[int]):
    """A tiny target whose greedy choice at every position is the next token of ``script`` (batch of one): its
    output is the script, tokenized as its tokenizer tokenizes the script's text."""
    target = tiny_model("llama", vocab, seed=0)
    script_ids = torch.tensor(script)

    def follow_script(module, args, kwargs, out):
        pos = kwargs["position_ids"][:, -out.logits.shape[1]:]  # [1, w] positions counted in real tokens
        nxt = script_ids[(pos + 1).clamp(max=len(script) - 1)].to(out.logits.device)
        out.logits = torch.full_like(out.logits, -10.0).scatter(-1, nxt[..., None], 10.0)
        return out

    target.register_forward_hook(follow_script, with_kwargs=True)
    return target


@pytest.mark.parametrize("gamma", [2, 5])
def test_oracle_text_drafter_on_a_sentencepiece_target_is_accepted_whole(monkeypatch, gamma):
    """Text mode hands the target the drafted text tokenized after its context. An oracle drafter proposing the
    target's own continuation as text (in the draft's byte-level tokens) must then be accepted whole; encoded alone,
    a sentencepiece target's fragment would open with a dummy-prefix '▁' and mid-word continuations would reject."""
    from specdraft.decoding import decode
    from specdraft.decoding.drafters import MappedDrafter
    from specdraft.models.vocab import build_vocab_mapping
    from specdraft.testing import tiny_bpe_tokenizer, tiny_corpus, tiny_llama_tokenizer

    t_tok, d_tok = tiny_llama_tokenizer(400), tiny_bpe_tokenizer(360, seed=1)
    scripts = [t_tok(" ".join(tiny_corpus(8, seed=s)))["input_ids"] for s in (3, 4)]
    n_prompt, n_new = 6, 40
    assert min(len(s) for s in scripts) > n_prompt + n_new
    draft = tiny_model("llama", len(d_tok), seed=1)
    mapping = build_vocab_mapping(t_tok, d_tok, target_config=len(t_tok), draft_config=len(d_tok), min_coverage=0.0)

    class Oracle(MappedDrafter):
        """Proposes the text of the target's next k script tokens, in the draft's tokens."""

        def propose(self, cur, rows, ks, u=None):
            contexts = self.mapping.reencode_batch_for_draft([r.prompt + r.tokens for r in rows])
            drafted = []
            for r, k in zip(rows, ks):
                seen = r.prompt + r.tokens
                text = t_tok.decode(script[: len(seen) + k])[len(t_tok.decode(seen)):]
                drafted.append(d_tok(text, add_special_tokens=False)["input_ids"])
            return self.text_proposal(drafted, contexts, rows, ks)

    monkeypatch.setattr(decode, "MappedDrafter", Oracle)
    for script in scripts:
        target = _scripted_target(len(t_tok), script)
        ids, mask = left_pad([script[:n_prompt]], 0)
        out, counts = speculative_generate(target, draft, ids, mask, num_speculative_tokens=gamma,
                                           max_new_tokens=n_new, eos_token_id=[], vocab_mapping=mapping,
                                           mapped_proposals="text")
        assert out == [script[n_prompt:n_prompt + n_new]]  # the hook really scripts the target
        assert counts.acceptance_rate == 1.0
        assert sum(counts.proposed) >= n_new - n_new // (gamma + 1) - gamma  # and it drafted nearly every token


def test_text_candidates_continue_a_word_without_a_dummy_prefix_piece():
    from specdraft.decoding.drafters import _text_candidates
    from specdraft.testing import tiny_bpe_tokenizer, tiny_llama_tokenizer

    t_tok, d_tok = tiny_llama_tokenizer(400), tiny_bpe_tokenizer(360, seed=1)
    target_context = t_tok("print = count def", add_special_tokens=False)["input_ids"]
    want = t_tok("print = count defitems in", add_special_tokens=False)["input_ids"]
    assert want[: len(target_context)] == target_context  # "items" continues the word "def" in the target's tokens
    assert t_tok.convert_ids_to_tokens(want[len(target_context):])[0] == "items"
    context = d_tok("print = count def", add_special_tokens=False)["input_ids"]
    drafted = d_tok("items in", add_special_tokens=False)["input_ids"]
    cands, n = _text_candidates([drafted], [context], [target_context], d_tok, t_tok, [5], torch.device("cpu"))
    assert cands[0, : int(n[0])].tolist() == want[len(target_context):][:5]
    assert "▁" not in t_tok.convert_ids_to_tokens(cands[0, :1].tolist())[0]
