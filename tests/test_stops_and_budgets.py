"""When a row ends (one stop set, whoever decodes) and how many tokens it may have (one budget rule, every entry)."""

from __future__ import annotations

import copy

import pytest
import torch

from specdraft.core.config import DumpConfig, EvalConfig, SamplingConfig
from specdraft.decoding.decode import DecodeError, speculative_generate, target_generate
from specdraft.models.tokens import stop_ids
from specdraft.testing import tiny_model, tiny_tokenizer

V = 64
N = 12  # the budget: long enough that the free continuation holds two first occurrences to stop at
PROMPT = [2, 10, 11, 12]


@pytest.fixture(scope="module")
def free():
    """The target's greedy continuation of PROMPT with no stop id at all, and two positions i < j whose tokens
    appear there for the first time (a stop at either ends the row exactly there)."""
    target = tiny_model("llama", V, seed=0)
    out, _ = target_generate(target, torch.tensor([PROMPT]), max_new_tokens=N, eos_token_id=[])
    y = out[0]
    firsts = [k for k in range(1, len(y)) if y[k] not in y[:k] and y[k] > 4]
    assert len(y) == N and len(firsts) >= 2, y
    return target, y, firsts[0], firsts[1]


def _pair(free, tokenizer_first: bool):
    """Target, tokenizer and a draft (the target's weights) whose three EOS sources all differ: the config's EOS
    never occurs in the answer, the tokenizer's EOS and the generation config's list stop it at i or j (which
    first: ``tokenizer_first``). The draft's own generation config names neither, as a base model's would."""
    from transformers import GenerationConfig

    target0, y, i, j = free
    target = copy.deepcopy(target0)
    unused = [t for t in range(5, V) if t not in y and t not in PROMPT]
    tok = tiny_tokenizer(V)
    tok_eos, gc_eos = (y[i], y[j]) if tokenizer_first else (y[j], y[i])
    tok.eos_token = tok.convert_ids_to_tokens(tok_eos)
    assert tok.eos_token_id == tok_eos
    target.config.eos_token_id = unused[0]
    target.generation_config = GenerationConfig(eos_token_id=[gc_eos, unused[1]])
    draft = copy.deepcopy(target)
    draft.config.eos_token_id = unused[2]
    draft.generation_config = GenerationConfig(eos_token_id=unused[2])
    return target, draft, tok, y[: i + 1]


@pytest.mark.parametrize("tokenizer_first", [True, False], ids=["tokenizer-eos-first", "generation-config-eos-first"])
def test_every_component_ends_a_row_at_the_same_token_of_the_one_stop_set(free, tokenizer_first):
    """Dump, eval (target alone, speculative, transformers' assisted generate), generate, replay and the draft's
    on-policy answers all stop at the first id of stop_ids(target, tokenizer): the union of the tokenizer's EOS and
    the generation config's EOS list, whichever comes first in the answer, never the draft's own EOS config."""
    from specdraft.decoding.responses import generate_from_ids
    from specdraft.measuring.evaluate import acceptance_eval, run_eval
    from specdraft.measuring.pair import Generation, Pair
    from specdraft.training.distill_data import DraftWriter
    from specdraft.training.teacher import Teacher

    target, draft, tok, expected = _pair(free, tokenizer_first)
    assert set(stop_ids(target, tok)) >= {expected[-1]}
    config = EvalConfig(num_speculative_tokens=2, max_new_tokens=N, compare_hf=True)

    dumped = generate_from_ids(target, tok, [PROMPT], N)[0]  # the dump's generation (generate_responses)
    assert dumped == expected

    res = run_eval(target, draft, tok, [PROMPT], config=config)
    row = res.per_prompt[0]
    assert (row["target_tokens"], res.spec_tokens, res.hf_tokens) == (len(expected),) * 3
    assert row["specdraft_matches"] and row["hf_matches"]

    seen: list[int] = []
    Generation(Pair(target, draft, tok), config, list(PROMPT)).run(lambda _, new: seen.extend(new))
    assert seen == expected  # `specdraft generate`

    serving = SamplingConfig(temperature=1.0)
    decoded = acceptance_eval(target, draft, tok, [PROMPT], ["p"], config, serving)
    assert decoded.answers == [expected] and decoded.replay_check == "1/1"
    # Replayed over the answer run on past the stop, the rounds stop where the decoder's did.
    past = acceptance_eval(target, draft, tok, [PROMPT], ["p"], config, serving, answers=[free[1]])
    cut = acceptance_eval(target, draft, tok, [PROMPT], ["p"], config, serving, answers=[expected])
    keys = ("proposed", "reached", "accepted", "accepted_hist")
    assert [past.counts[k] for k in keys] == [cut.counts[k] for k in keys] == [decoded.counts[k] for k in keys]

    writer = DraftWriter(Teacher(target, V), tok, DumpConfig(teacher_format="hidden", hidden_dtype="float32",
                                                             answer_only=True, generate=N, max_length=64),
                         SamplingConfig(), N)
    item = writer(draft, [("p", list(PROMPT))], seed=0)[0]
    assert item["input_ids"].tolist() == PROMPT + expected  # on-policy: the draft's answer, the target's stops


# ------------------------------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("budget", [0, -1])
def test_every_public_entry_that_takes_a_budget_refuses_one_below_one_token_naming_it(budget):
    """max_new_tokens ≤ 0 is refused (the configs' ge=1 and the CLI's min=1, one rule) before anything is decoded,
    with an error naming the argument and the value: the loop would otherwise still emit one token."""
    from specdraft.decoding.assisted import hf_generation_config
    from specdraft.decoding.replay import replay_answer
    from specdraft.decoding.responses import generate_from_ids
    from specdraft.measuring.evaluate import acceptance_eval, interleaved_speed, run_eval
    from specdraft.models.dump_reader import DumpError
    from specdraft.training.distill_data import DistillError, DraftWriter
    from specdraft.training.teacher import Teacher

    target, tok = tiny_model("llama", V, seed=0), tiny_tokenizer(V)
    ids = torch.tensor([PROMPT])
    named = f"max_new_tokens must be an integer >= 1 .*got {budget}"
    with pytest.raises(DecodeError, match=named):
        speculative_generate(target, target, ids, max_new_tokens=budget)
    with pytest.raises(DecodeError, match=named):
        target_generate(target, ids, max_new_tokens=budget)
    with pytest.raises(DumpError, match=named):
        generate_from_ids(target, tok, [PROMPT], budget)
    with pytest.raises(DistillError, match=named):
        DraftWriter(Teacher(target, V), tok, DumpConfig(), SamplingConfig(), budget)
    with pytest.raises(DecodeError, match=named):
        replay_answer([5, 6], [5, 6], 2, budget, {4})
    with pytest.raises(DecodeError, match=named):
        hf_generation_config(SamplingConfig(), budget, [4], 0, 2)
    config = EvalConfig(num_speculative_tokens=2, max_new_tokens=4)
    config.max_new_tokens = budget  # pydantic checks at construction only
    for call in (lambda: run_eval(target, target, tok, [PROMPT], config=config),
                 lambda: acceptance_eval(target, target, tok, [PROMPT], ["p"], config, SamplingConfig()),
                 lambda: acceptance_eval(target, target, tok, [PROMPT], ["p"], config, SamplingConfig(),
                                         answers=[[5, 6]]),
                 lambda: interleaved_speed(target, {"self": target}, tok, [PROMPT], ["p"], config)):
        with pytest.raises(DecodeError, match=named):
            call()
    with pytest.raises(ValueError, match="max_new_tokens"):
        EvalConfig(max_new_tokens=budget)  # the configs' own rule, which the functions now share


def test_a_budget_of_one_token_yields_exactly_one_token():
    """The smallest accepted budget: one token per row, from every decoder."""
    target = tiny_model("llama", V, seed=0)
    ids = torch.tensor([PROMPT, PROMPT])
    for out, _ in (target_generate(target, ids, max_new_tokens=1, eos_token_id=[]),
                   speculative_generate(target, target, ids, max_new_tokens=1, eos_token_id=[])):
        assert [len(r) for r in out] == [1, 1]
