"""specdraft's vLLM proposer for a draft of another tokenizer, without vLLM: its pure parts (a slot's target ids →
text → the draft's proposal → target ids, the drafters kept per request and their caches trimmed when a context
changes), the speculator it serves (exported as given, proposal method "text") and the commands printed for it.
`make test-vllm` runs it inside vLLM's engine (bench/vllm_check.py)."""

from __future__ import annotations

import copy
import subprocess
import sys
import types

import pytest
import torch

from specdraft.core.config import SamplingConfig
from specdraft.decoding.decode import speculative_generate
from specdraft.decoding.drafters import MappedDrafter, Row
from specdraft.models.tokens import left_pad
from specdraft.models.vocab import build_vocab_mapping, vocab_swap
from specdraft.serving.vllm_proposer import (
    PROPOSER_CLASS,
    SPECULATOR_ENV,
    SPECULATOR_KEY,
    TextDrafts,
    TextProposer,
)
from specdraft.testing import perturbed, tiny_bpe_tokenizer, tiny_model

GAMMA = 3


@pytest.fixture(scope="module")
def pair():
    """A target and a draft on two byte-level BPE tokenizers that segment text differently (the draft: a noisy
    copy of the target re-indexed into its own tokenizer)."""
    t_tok, d_tok = tiny_bpe_tokenizer(300), tiny_bpe_tokenizer(360, seed=1)
    target = tiny_model("llama", 300, seed=0, layers=3)
    draft, _ = vocab_swap(perturbed(target, 0.03), t_tok, d_tok)
    mapping = build_vocab_mapping(t_tok, d_tok, target_config=300, draft_config=360)
    return target, draft.eval(), mapping, t_tok, d_tok


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _reference(draft, mapping, ctx, k=GAMMA):
    """specdraft's own drafter, alone on one context: its text proposal in target ids ([] for none)."""
    ref = MappedDrafter(draft, mapping, "text", 1, 300, 300, torch.device("cpu"), SamplingConfig(), None, None)
    p = ref.propose(None, [Row(0, ctx)], [k], None)
    if p is None:
        return []
    n = p.tokens.shape[1] if p.n_proposed is None else int(p.n_proposed[0])
    return p.tokens[0, :n].tolist()


def test_a_slots_proposal_is_the_mapped_drafters_text_proposal(pair):
    _, draft, mapping, t_tok, d_tok = pair
    texts = ("def total(items):\n", "for index in range(count):\n    print(", "hello world", "x = value")
    contexts = [_ids(t_tok, t) for t in texts]
    assert t_tok.tokenize(texts[1]) != d_tok.tokenize(texts[1])  # really another tokenizer
    got = TextDrafts(draft, mapping, GAMMA, 300).propose(contexts)
    assert got == [_reference(draft, mapping, c) for c in contexts]
    assert all(len(p) <= GAMMA for p in got) and any(got)


def test_ks_cap_proposals_and_an_empty_slot_proposes_nothing(pair):
    _, draft, mapping, t_tok, _ = pair
    ctx = _ids(t_tok, "def total(items):\n")
    got = TextDrafts(draft, mapping, GAMMA, 300).propose([ctx, None, ctx], ks=[1, GAMMA, 0])
    assert len(got[0]) <= 1 and got[1] == [] and got[2] == []


def test_a_request_keeps_its_drafter_across_slots_and_rounds_and_its_cache_is_trimmed(pair):
    _, draft, mapping, t_tok, _ = pair
    a, b = _ids(t_tok, "def total(items):\n"), _ids(t_tok, "hello world value")
    drafts = TextDrafts(draft, mapping, GAMMA, 300)
    first = drafts.propose([a, b])
    entry_a = next(e for e in drafts.entries if e.history == a)
    # next round: the requests swapped slots and each emitted its first proposal plus one token
    a2, b2 = a + first[0][:1] + [17], b + first[1][:1] + [42]
    drafts.propose([b2, a2])
    assert len(drafts.entries) == 2 and entry_a.history == a2  # the same drafter followed request a
    d = entry_a.drafter
    # the draft's cache holds exactly the draft ids it keeps (its common prefix with the new context, the new
    # context's rest, and the γ−1 drafts it read while drafting)
    assert int(d.stream.n_real[0]) == len(d.draft_ids[0]) - 1 or int(d.stream.n_real[0]) == len(d.draft_ids[0])
    reread = mapping.reencode_for_draft(a2)
    assert d.draft_ids[0][:len(reread)] == reread


def test_a_changed_context_trims_the_drafters_cache_to_the_common_prefix(pair):
    _, draft, mapping, t_tok, _ = pair
    ctx = _ids(t_tok, "def total(items):\n    return count")
    drafts = TextDrafts(draft, mapping, GAMMA, 300)
    drafts.propose([ctx])
    d = drafts.entries[0].drafter
    held = list(d.draft_ids[0])
    changed = ctx[:4] + _ids(t_tok, " lambda")  # the same request, rolled back and continued otherwise
    fresh = TextDrafts(draft, mapping, GAMMA, 300)
    assert drafts.propose([changed]) == fresh.propose([changed])  # same proposals as a drafter that never saw ctx
    new = mapping.reencode_for_draft(changed)
    keep = min(next((i for i, (x, y) in enumerate(zip(held, new)) if x != y), min(len(held), len(new))), len(new) - 1)
    assert keep < len(held)  # the cache really had to be cut
    assert d.draft_ids[0][:len(new)] == new
    # holes aside, the cache holds the kept prefix, the re-read rest and the γ−1 drafts read while drafting
    assert int(d.stream.n_real[0]) == len(new) + GAMMA - 1


def _counting_reads(model):
    """A forward pre-hook on ``model`` adding up the tokens each call feeds it (a drafter reads one row: no holes);
    returns ``(counter, handle)``."""
    fed = [0]

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        fed[0] += int(ids.shape[1])

    return fed, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_a_request_that_outgrew_the_window_leaves_later_requests_proposed_for(pair):
    """The first request outgrows the draft's window, so its drafter stops proposing; every later request shares
    its first token (as every request does behind a BOS or a chat template) and must still be proposed for."""
    _, draft, mapping, t_tok, _ = pair
    small = copy.deepcopy(draft)
    small.config.max_position_embeddings = 24
    drafts = TextDrafts(small, mapping, GAMMA, 300)
    long = _ids(t_tok, "def total(items):\n    return count\n" * 6)
    assert len(mapping.reencode_for_draft(long)) + GAMMA > 24
    with pytest.warns(UserWarning, match="outgrew"):
        assert drafts.propose([long]) == [[]]
    got = []
    for text in ("def total(items):\n", "def index(value):", "def print(count, items):\n", "def hello(world):"):
        ctx = _ids(t_tok, text)
        assert ctx[0] == long[0]  # the prefix it shares with the outgrown request
        got.append(drafts.propose([ctx])[0])
        assert got[-1] == _reference(small, mapping, ctx)
    assert sum(map(len, got)) >= len(got)  # really proposed for, not one empty round after another


def test_a_running_request_keeps_its_drafter_when_a_new_request_joins_in_an_earlier_slot(pair):
    """A new request in slot 0 shares its first token with the running request in slot 1: the running one keeps
    its drafter and the draft reads only its new tokens, not its whole context again."""
    _, draft, mapping, t_tok, _ = pair
    a = _ids(t_tok, "def total(items):\n    for index in range(count):\n        print(index, value)\n")
    b = _ids(t_tok, "def hello(world):")
    assert a[0] == b[0]
    drafts = TextDrafts(draft, mapping, GAMMA, 300)
    first = drafts.propose([a])
    entry_a = drafts.entries[0]
    a2 = a + first[0][:1] + [17]
    fed_b, handle = _counting_reads(draft)
    try:
        TextDrafts(draft, mapping, GAMMA, 300).propose([b])  # what b costs alone: read and draft
        alone = fed_b[0]
        fed_b[0] = 0
        got = drafts.propose([b, a2])
    finally:
        handle.remove()
    assert got[1] == _reference(draft, mapping, a2)
    assert next(e for e in drafts.entries if e.history == a2) is entry_a
    read_for_a = fed_b[0] - alone
    assert read_for_a <= GAMMA + 3 < len(mapping.reencode_for_draft(a2)) // 2  # its new tokens and γ − 1 drafts


def _older_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                   use_cache=None, logits_to_keep=0, **unused):
    """A causal LM's forward as transformers 5.19 (vLLM 0.32's pin) spells it: the KV cache is ``past_key_values``
    and any other keyword is taken into ``**unused`` and ignored (there: passed on to attention, which ignores it)."""
    return type(self).__mro__[1].forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                         position_ids=position_ids, cache=past_key_values, use_cache=use_cache,
                                         logits_to_keep=logits_to_keep)


def test_a_draft_whose_forward_takes_past_key_values_drafts_with_its_cache(pair):
    """vLLM runs the proposer under its own transformers, whose models name the cache ``past_key_values``: handed
    ``cache=`` they would read each fed token without its context, and propose other tokens."""
    _, draft, mapping, t_tok, _ = pair
    older = copy.deepcopy(draft)
    older.__class__ = type("OlderArgs", (type(draft),), {"forward": _older_forward})
    new, old = TextDrafts(draft, mapping, GAMMA, 300), TextDrafts(older, mapping, GAMMA, 300)
    ctx = _ids(t_tok, "for index in range(count):\n    print(")
    rounds = [ctx + extra for extra in ([], _ids(t_tok, "index"), _ids(t_tok, "index, total)"))]
    want = [new.propose([c])[0] for c in rounds]
    assert [old.propose([c])[0] for c in rounds] == want
    assert max(map(len, want)) > 1  # a round of several draft tokens: its drafting steps read the cache
    held = [d.entries[0].drafter.stream.cache.get_seq_length() for d in (old, new)]
    assert held[0] == held[1] > 0


def test_a_new_request_gets_a_fresh_drafter_and_unused_ones_are_dropped(pair):
    _, draft, mapping, t_tok, _ = pair
    drafts = TextDrafts(draft, mapping, GAMMA, 300, keep_rounds=2)
    drafts.propose([_ids(t_tok, "def total(items):\n")])
    drafts.propose([_ids(t_tok, "hello world")])
    assert len(drafts.entries) == 2
    drafts.propose([_ids(t_tok, "hello world value")])
    drafts.propose([_ids(t_tok, "hello world value items")])
    assert len(drafts.entries) == 1 and drafts.entries[0].history[:2] == _ids(t_tok, "hello world")[:2]


def test_text_proposals_verified_greedily_give_the_target_alone(pair):
    """What vLLM does with the proposals under greedy decoding, done here with specdraft's own loop: the same
    drafter's proposals, verified against the target's argmax, leave the target's output unchanged."""
    target, draft, mapping, t_tok, _ = pair
    prompts = [_ids(t_tok, t) for t in ("def total(items):\n", "for index in range(count):\n    print(")]
    ids, mask = left_pad(prompts, 0)
    base, _ = speculative_generate(target, None, ids, mask, max_new_tokens=16, eos_token_id=[])
    spec, _ = speculative_generate(target, draft, ids, mask, num_speculative_tokens=GAMMA, max_new_tokens=16,
                                   eos_token_id=[], vocab_mapping=mapping, mapped_proposals="text")
    assert spec == base


def _vllm_config(tmp_path, spec_dir, target_dir, additional=None):
    spec = types.SimpleNamespace(num_speculative_tokens=GAMMA)
    model = types.SimpleNamespace(max_model_len=64, tokenizer=target_dir, dtype=torch.float32,
                                  get_vocab_size=lambda: 300)
    return types.SimpleNamespace(speculative_config=spec, model_config=model, additional_config=additional or {},
                                 scheduler_config=types.SimpleNamespace(max_num_seqs=4),
                                 device_config=types.SimpleNamespace(device=torch.device("cpu")))


@pytest.fixture(scope="module")
def exported(pair, tmp_path_factory):
    """The pair on disk and the draft exported as given (another tokenizer: proposal method "text")."""
    from specdraft.serving.export import export_draft

    target, draft, _, t_tok, d_tok = pair
    root = tmp_path_factory.mktemp("pair")
    for name, model, tok in (("target", target, t_tok), ("draft", draft, d_tok)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    res = export_draft(root / "draft", root / "target", root / "spec", num_speculative_tokens=GAMMA)
    return str(root / "target"), res


def test_a_draft_of_another_tokenizer_is_exported_as_given_to_draft_through_text(exported):
    from specdraft.models.speculator import load_speculator_config

    _target_dir, res = exported
    conf = load_speculator_config(str(res.out))
    assert conf.drafts_through_text and conf.num_speculative_tokens == GAMMA
    assert res.config["speculators_config"]["proposal_methods"][0]["proposal_type"] == "text"
    assert res.compat_verdict == "mismatch"
    assert res.serve.drafting == "text"
    assert res.serve.speculative_config == {"method": "custom_class", "model": PROPOSER_CLASS,
                                            "num_speculative_tokens": GAMMA}
    assert res.serve.additional_config == {SPECULATOR_KEY: str(res.out)}
    assert "--additional-config" in res.vllm_command and PROPOSER_CLASS in res.vllm_command
    assert any("vocab-swap" in n for n in res.serve.notes)  # the re-indexed alternative, named beside it


def test_the_plugin_serves_a_text_speculator_with_the_custom_class_proposer(exported, monkeypatch):
    from specdraft.serving import vllm_plugin

    target_dir, res = exported
    verifier, spec = vllm_plugin.plan_independent(res.config, str(res.out), {"method": "draft_model",
                                                                             "num_speculative_tokens": 2})
    assert verifier == target_dir
    assert spec == {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": 2}
    monkeypatch.delenv(SPECULATOR_ENV, raising=False)
    wrapped = vllm_plugin.wrap(lambda *a, **k: pytest.fail("vLLM's function must not see an independent speculator"))
    assert wrapped(str(res.out), None, False)[2]["method"] == "custom_class"
    import os

    assert os.environ[SPECULATOR_ENV] == str(res.out)


def test_the_proposer_serves_the_speculator_named_in_additional_config(exported, pair):
    target_dir, res = exported
    proposer = TextProposer(_vllm_config(None, str(res.out), target_dir, {SPECULATOR_KEY: str(res.out)}))
    proposer.load_model(object())
    _, draft, mapping, t_tok, _ = pair
    a, b = _ids(t_tok, "def total(items):\n"), _ids(t_tok, "hello world")
    table = torch.zeros(4, 64, dtype=torch.int32)
    table[0, :len(a)], table[1, :len(b)] = torch.tensor(a), torch.tensor(b)
    n = torch.tensor([len(a), len(b), 0, 0]).numpy()
    got = proposer.propose([[a[-1]], [], ], n, table.numpy())
    assert got[1] == [] and got[0] == _reference(draft, mapping, a)
    n[0] = 63  # one position left before max_model_len: one proposal at most
    assert len(proposer.propose([[a[-1]]], n, table.numpy())[0]) <= 1


def test_the_proposer_loads_the_tokenizers_and_draft_as_the_engine_configured_them(exported, monkeypatch):
    """Inside vLLM the target's ids come from the engine's tokenizer (its path, revision, mode, remote code): the
    proposer decodes them with that one, and loads the draft with the draft's revision and the engine's trust."""
    import transformers

    target_dir, res = exported
    calls = []

    def recording(cls, attr):
        real = getattr(cls, attr)

        def load(path, **kwargs):
            calls.append((cls.__name__, str(path), kwargs))
            return real(path, **{k: v for k, v in kwargs.items() if k == "dtype"})

        monkeypatch.setattr(cls, attr, load)

    recording(transformers.AutoTokenizer, "from_pretrained")
    recording(transformers.AutoModelForCausalLM, "from_pretrained")
    config = _vllm_config(None, str(res.out), target_dir, {SPECULATOR_KEY: str(res.out)})
    config.model_config.__dict__.update(model="org/target", revision="model-rev", tokenizer_revision="tok-rev",
                                        tokenizer_mode="slow", trust_remote_code=True)
    config.speculative_config.revision = "draft-rev"
    config.speculative_config.draft_model_config = config.model_config  # a method with no draft model of vLLM's
    TextProposer(config).load_model(object())
    assert calls == [
        ("AutoTokenizer", target_dir, {"revision": "tok-rev", "trust_remote_code": True, "use_fast": False}),
        ("AutoTokenizer", str(res.out), {"revision": "draft-rev", "trust_remote_code": True}),
        ("AutoModelForCausalLM", str(res.out), {"revision": "draft-rev", "trust_remote_code": True,
                                                "dtype": torch.float32}),
    ]


def test_a_draft_with_its_own_vllm_model_config_loads_with_that_config():
    from specdraft.serving.vllm_proposer import draft_load_kwargs

    target = types.SimpleNamespace(trust_remote_code=True, revision="target-rev", hf_token="tok")
    spec = types.SimpleNamespace(revision="draft-rev",
                                 draft_model_config=types.SimpleNamespace(revision="own-rev", trust_remote_code=False))
    assert draft_load_kwargs(spec, target) == {"revision": "own-rev", "trust_remote_code": False, "token": "tok"}


def test_the_proposer_refuses_a_tokenizer_mode_it_cannot_load(exported):
    target_dir, res = exported
    config = _vllm_config(None, str(res.out), target_dir, {SPECULATOR_KEY: str(res.out)})
    config.model_config.tokenizer_mode = "mistral"
    from specdraft.serving.vllm_proposer import ProposerError

    with pytest.raises(ProposerError, match="tokenizer_mode 'mistral'.*--tokenizer-mode auto"):
        TextProposer(config)


def test_the_proposer_says_how_to_name_its_speculator(monkeypatch):
    from specdraft.serving.vllm_proposer import ProposerError

    monkeypatch.delenv(SPECULATOR_ENV, raising=False)
    with pytest.raises(ProposerError, match="--additional-config"):
        TextProposer(_vllm_config(None, None, "t"))


def test_the_proposer_module_imports_without_vllm_torch_or_transformers():
    code = ("import sys, specdraft.serving.vllm_proposer; bad = [m for m in ('vllm', 'torch', 'transformers') if m in "
            "sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_class_path_every_text_speculator_records_names_the_proposer_without_torch():
    module, _, name = PROPOSER_CLASS.rpartition(".")
    code = (f"import sys, importlib; cls = getattr(importlib.import_module({module!r}), {name!r}); "
            "from specdraft.serving.vllm_proposer import TextProposer; assert cls is TextProposer; "
            "bad = [m for m in ('vllm', 'torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
