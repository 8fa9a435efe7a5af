"""Tokenizer compatibility: verdicts, padding rows, vocabulary mapping, vocab swap, the ``check`` command.

Tiny tokenizers are WordLevel models built in the test (a token is a whole word), so which ids must agree,
differ or pair up is known by construction. Real-tokenizer tests (``real``) read only tokenizers and
configs, except the CLI test of an identical tiny pair, which loads tiny models.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specdraft.core.embedded import ModelResolutionError
from specdraft.core.sampling import align_logits
from specdraft.models.check import VERDICTS, CompatReport, check_compatible, print_report, require_compatible
from specdraft.models.tokenizer_view import tokenizer_fingerprint
from specdraft.models.vocab import CompatibilityError, build_vocab_mapping, vocab_swap
from specdraft.testing import (
    SPECIAL_TOKENS,
    TINY_CHAT_TEMPLATE,
    patch_everywhere,
    save_tiny_pair,
    tiny_model,
    tiny_tokenizer,
    tiny_words,
)


def word_tokenizer(words, specials=tuple(SPECIAL_TOKENS), scheme="plain", eos="<eos>"):
    """A WordLevel tokenizer over ``specials + words`` (ids in that order).

    ``scheme``: ``"plain"`` (whitespace split), ``"byte-level"`` (GPT-2 byte pre-tokeniser and decoder,
    so a word after a space is spelled ``Ġword``) or ``"metaspace"`` (sentencepiece ``▁word``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    strings = list(specials) + list(words)
    assert len(set(strings)) == len(strings)
    tok = Tokenizer(models.WordLevel(vocab={s: i for i, s in enumerate(strings)}, unk_token=specials[1]))
    if scheme == "byte-level":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    elif scheme == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
    else:
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=specials[0], unk_token=specials[1],
                                   eos_token=eos, additional_special_tokens=list(specials[2:4]))


def ids(tok, strings):
    return [tok.convert_tokens_to_ids(s) for s in strings]


# ------------------------------------------------------------------------------------------ verdicts


def test_identical_pair(tmp_path):
    target, draft = save_tiny_pair(tmp_path, vocab_size=64)
    r = check_compatible(target, draft)
    assert r.verdict == "identical" and r.compatible
    assert (r.n_diff_ids, r.n_diff_strings, r.differences) == (0, 0, [])
    assert r.real_vocab == r.target_width == r.draft_width == 64
    assert r.probe_equal and r.chat_template_equal and r.special_tokens_equal
    assert r.warnings == [] and r.mapping is None
    # The fingerprint survives save_pretrained / from_pretrained: a dump made with the saved tokenizer
    # must match the one built in memory.
    assert r.target_fingerprint == r.draft_fingerprint == tokenizer_fingerprint(tiny_tokenizer(64))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["verdict"] == "identical" and d["compatible"] is True
    assert require_compatible(target, draft).verdict == "identical"


def test_one_tokenizer_padded_to_two_widths(tmp_path):
    from transformers import AutoModelForCausalLM

    target, draft = save_tiny_pair(tmp_path, vocab_size=64, target_vocab=80, draft_vocab=72)
    r = check_compatible(target, draft)
    assert r.verdict == "identical-up-to-padding" and r.compatible
    assert (r.real_vocab, r.target_config_vocab, r.draft_config_vocab) == (64, 80, 72)
    assert (r.target_width, r.draft_width) == (80, 72)
    assert r.target_fingerprint == r.draft_fingerprint

    model = AutoModelForCausalLM.from_pretrained(draft).eval()
    with torch.no_grad():
        q_logits = model(torch.tensor([[5, 9, 13, 2]])).logits  # [1, 4, 72]
    assert q_logits.shape[-1] == r.draft_width
    for width in (r.target_width, 70):  # padded up to p's width, and extra rows dropped
        q = torch.softmax(align_logits(q_logits, width, r.real_vocab), dim=-1)  # [1, 4, width]
        assert q.shape[-1] == width
        torch.testing.assert_close(q.sum(-1), torch.ones(1, 4))
        assert q[..., r.real_vocab:].sum() == 0  # padding rows carry exactly zero probability
        # On real ids q is the draft's own distribution renormalised over the real vocabulary.
        torch.testing.assert_close(q[..., : r.real_vocab], torch.softmax(q_logits[..., : r.real_vocab], -1))


def test_gguf_placeholders_are_padding():
    words = tiny_words(59)
    plain = word_tokenizer(words)
    n = len(plain)
    padded = word_tokenizer(words + [f"[PAD{i}]" for i in range(n, n + 6)])
    r = check_compatible(plain, padded)
    assert r.verdict == "identical-up-to-padding"
    assert (r.real_vocab, r.target_width, r.draft_width, r.draft_len) == (n, n, n + 6, n + 6)
    assert tokenizer_fingerprint(plain) == tokenizer_fingerprint(padded)
    # A "[PAD…]" string whose number is not its own id is a real token: it makes the vocabularies differ.
    odd = word_tokenizer(words + ["[PAD3]"])
    r = check_compatible(plain, odd)
    assert r.verdict == "mismatch"
    assert [(x.id, x.target, x.draft) for x in r.differences] == [(n, None, "[PAD3]")]


def test_equal_size_with_one_id_swapped_is_refused():
    a, b = tiny_tokenizer(64), tiny_tokenizer(64, swap=(10, 20))
    r = check_compatible(a, b)
    assert r.verdict == "mismatch" and not r.compatible
    assert r.target_len == r.draft_len == 64  # equal sizes do not make a pair compatible
    assert (r.n_diff_ids, r.n_diff_strings) == (2, 2)
    s10, s20 = a.convert_ids_to_tokens(10), a.convert_ids_to_tokens(20)
    assert [(x.id, x.target, x.draft) for x in r.differences] == [(10, s10, s20), (20, s20, s10)]
    assert r.target_fingerprint != r.draft_fingerprint
    with pytest.raises(CompatibilityError, match="id 10") as exc:
        r.raise_for_mismatch()
    assert repr(s10) in str(exc.value) and repr(s20) in str(exc.value)
    with pytest.raises(CompatibilityError):
        require_compatible(a, b)


def test_differing_special_token_role_warns_but_ids_agree():
    a, b = tiny_tokenizer(64), tiny_tokenizer(64)
    b.eos_token = "<|im_end|>"  # same vocabulary, another id plays eos
    r = check_compatible(a, b)
    assert r.verdict == "identical"  # every id still means the same string: sampling stays exact
    assert not r.special_tokens_equal
    assert r.special_tokens["eos"] == {"target": ["<eos>", 4], "draft": ["<|im_end|>", 3], "equal": False}
    assert all(r.special_tokens[k]["equal"] for k in ("bos", "pad", "unk"))
    assert len(r.warnings) == 1 and r.warnings[0].startswith("eos token differs")
    assert r.target_fingerprint != r.draft_fingerprint


def test_differing_special_token_string_is_a_mismatch():
    words = tiny_words(59)
    a = word_tokenizer(words)
    b = word_tokenizer(words, specials=("<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "</s>"), eos="</s>")
    r = check_compatible(a, b)
    assert r.verdict == "mismatch"
    assert [(x.id, x.target, x.draft) for x in r.differences] == [(4, "<eos>", "</s>")]
    assert r.special_tokens["eos"]["target"] == ["<eos>", 4] and r.special_tokens["eos"]["draft"] == ["</s>", 4]


def test_chat_template_and_normaliser_differences_warn():
    from tokenizers import normalizers

    base = tiny_tokenizer(64)
    other_template = tiny_tokenizer(64, chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    r = check_compatible(base, other_template)
    assert r.verdict == "identical" and r.chat_template_equal is False and r.probe_equal
    assert any("chat templates render" in w for w in r.warnings)

    no_template = tiny_tokenizer(64)
    no_template.chat_template = None
    r = check_compatible(base, no_template)
    assert r.chat_template_equal is False and any("only the target has a chat template" in w for w in r.warnings)

    renamed = tiny_tokenizer(64)
    # A normaliser that rewrites the probe's first word ("def"); both spellings are in the vocabulary.
    renamed.backend_tokenizer.normalizer = normalizers.Replace("def", "return")
    r = check_compatible(base, renamed)
    assert r.verdict == "identical" and not r.probe_equal
    assert r.probe_detail["position"] == 0
    assert (r.probe_detail["target_tokens"][0], r.probe_detail["draft_tokens"][0]) == ("def", "return")
    assert any("normaliser / pre-tokeniser" in w for w in r.warnings)


def test_fingerprint_is_deterministic_and_sensitive():
    fp = tokenizer_fingerprint(tiny_tokenizer(64))
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert fp == tokenizer_fingerprint(tiny_tokenizer(64))
    assert fp != tokenizer_fingerprint(tiny_tokenizer(64, swap=(30, 31)))
    assert fp != tokenizer_fingerprint(tiny_tokenizer(65))


def test_unloadable_tokenizer_names_the_path(tmp_path):
    from specdraft.testing import tiny_config

    target, _ = save_tiny_pair(tmp_path / "pair", vocab_size=64)
    broken = tmp_path / "config-only"
    tiny_config().save_pretrained(broken)  # a checkpoint directory with no tokenizer files
    with pytest.raises(ModelResolutionError, match="draft tokenizer") as exc:
        check_compatible(target, str(broken))
    assert str(broken) in str(exc.value)
    with pytest.raises(ModelResolutionError, match="no-such-model"):
        check_compatible(str(tmp_path / "no-such-model"), target)


def test_print_report_names_the_first_differences():
    from rich.console import Console

    console = Console(record=True, width=160)
    a, b = tiny_tokenizer(64), tiny_tokenizer(64, swap=(10, 20))
    print_report(check_compatible(a, b), console)
    text = console.export_text()
    assert ("mismatch: 2 of the 64 ids below the larger real vocabulary (target 64, draft 64) and 2 strings of the "
            "two vocabularies' union differ (0 only in the target's, 0 only in the draft's, 2 in both under different "
            "ids)") in " ".join(text.split())
    assert repr(a.convert_ids_to_tokens(10)) in text and repr(a.convert_ids_to_tokens(20)) in text


def test_verdicts_have_one_source():
    assert VERDICTS == ("identical", "identical-up-to-padding", "mismatch")


# ------------------------------------------------------------------------------------------ CLI


def test_cli_check_exit_codes_and_json(tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    runner = CliRunner()
    target, draft = save_tiny_pair(tmp_path / "same", vocab_size=64, target_vocab=80)
    out = tmp_path / "report.json"
    res = runner.invoke(app, ["check", "--target", target, "--draft", draft, "--max-new-tokens", "2",
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "identical-up-to-padding" in res.output
    assert json.loads(out.read_text())["compat"]["verdict"] == "identical-up-to-padding"

    target, draft = save_tiny_pair(tmp_path / "swapped", vocab_size=64)
    swapped = tiny_tokenizer(64, swap=(10, 20))
    swapped.save_pretrained(draft)
    res = runner.invoke(app, ["check", "--target", target, "--draft", draft, "--out", str(out), "--overwrite"])
    assert res.exit_code == 1
    assert "mismatch" in res.output and repr(swapped.convert_ids_to_tokens(10)) in res.output
    saved = json.loads(out.read_text())
    assert saved["compat"]["n_diff_ids"] == 2 and "continuations" not in saved  # models never loaded


# ------------------------------------------------------------------------------------------ mapping

# Target: byte-level BPE spelling (Ġ = space, Ċ = newline). Draft: sentencepiece spelling (▁ = space,
# raw bytes as <0xNN>). Twins by meaning: Ġhello/▁hello, Ġworld/▁world, hello/hello, Ċ/<0x0A>, Ġ/▁.
TARGET_WORDS = ["hello", "Ġhello", "Ġworld", "Ċ", "Ġ", "Ġfoo", "bar"]
DRAFT_WORDS = ["▁hello", "hello", "▁world", "<0x0A>", "Ċ", "▁", "<0x20>", "▁baz"]


@pytest.fixture
def mixed_pair():
    return word_tokenizer(TARGET_WORDS, scheme="byte-level"), word_tokenizer(DRAFT_WORDS, scheme="metaspace")


def test_mapping_normalises_space_markers(mixed_pair):
    target, draft = mixed_pair
    m = build_vocab_mapping(target, draft, draft_config=len(draft) + 3)  # 3 padding rows on the draft
    assert (m.target_scheme, m.draft_scheme) == ("byte-level", "metaspace")
    twins = [("Ġhello", "▁hello"), ("Ġworld", "▁world"), ("hello", "hello"), ("Ċ", "<0x0A>"), ("Ġ", "▁")]
    twins += [(s, s) for s in SPECIAL_TOKENS]
    expected = {draft.convert_tokens_to_ids(d): target.convert_tokens_to_ids(t) for t, d in twins}
    got = {i: int(t) for i, t in enumerate(m.draft_to_target) if t >= 0}
    assert got == expected
    # Literal "Ċ" in a sentencepiece vocabulary is the letter U+010A, not a newline: no twin. "<0x20>"
    # stands for the same byte as "▁"; the piece the tokenizer emits ("▁") keeps the pairing.
    assert m.draft_ids_to_target(ids(draft, ["Ċ", "<0x20>", "▁baz"]), strict=False) == [-1, -1, -1]
    assert m.draft_duplicates == 1
    assert m.draft_width == len(draft) + 3 and (m.draft_to_target[len(draft):] == -1).all()
    assert m.n_mapped == len(expected)
    assert m.target_coverage == len(expected) / len(target)
    assert m.draft_coverage == len(expected) / len(draft)


def test_non_special_added_tokens_are_text(mixed_pair):
    # Gemma's tokenizer carries "\n" as an added token not flagged special (besides the <0x0A> byte piece);
    # it is the newline the tokenizer emits, so it is the twin of the byte-level "Ċ". A special added token of
    # the same spelling as a text token stays a control token.
    target, draft = mixed_pair
    draft.add_tokens(["\n"])  # non-special
    draft.add_tokens(["Ġworld"], special_tokens=True)
    newline = draft.convert_tokens_to_ids("\n")
    assert newline >= len(DRAFT_WORDS) + len(SPECIAL_TOKENS)
    m = build_vocab_mapping(target, draft)
    assert int(m.target_to_draft[target.convert_tokens_to_ids("Ċ")]) == newline
    assert m.draft_ids_to_target(ids(draft, ["<0x0A>"]), strict=False) == [-1]  # the byte piece loses the tie
    assert m.draft_ids_to_target(ids(draft, ["Ġworld"]), strict=False) == [-1]  # control ≠ text "Ġworld"
    assert draft.convert_ids_to_tokens(m.reencode_for_draft(target("hello\nhello", add_special_tokens=False)
                                                            ["input_ids"]))[1] == "\n"


def test_mapping_round_trip_and_no_aliasing(mixed_pair):
    target, draft = mixed_pair
    m = build_vocab_mapping(target, draft)
    mapped = (m.draft_to_target >= 0).nonzero().squeeze(-1)
    assert torch.equal(m.target_ids_to_draft(m.draft_ids_to_target(mapped)), mapped)
    baz = draft.convert_tokens_to_ids("▁baz")
    with pytest.raises(CompatibilityError, match="▁baz"):
        m.draft_ids_to_target([mapped[0].item(), baz])
    unmapped = m.draft_ids_to_target(torch.tensor([[baz, mapped[0].item()]]), strict=False)
    assert unmapped.tolist() == [[-1, int(m.draft_to_target[mapped[0]])]]  # never 0 or another real id
    with pytest.raises(CompatibilityError, match="Ġfoo"):
        m.target_ids_to_draft(target.convert_tokens_to_ids("Ġfoo"))
    with pytest.raises(ValueError):
        m.draft_ids_to_target([len(draft)])


def test_map_draft_logits_gives_unmapped_tokens_zero_probability(mixed_pair):
    target, draft = mixed_pair
    m = build_vocab_mapping(target, draft, target_config=len(target) + 2)
    torch.manual_seed(0)
    q_logits = torch.randn(2, 3, len(draft))  # [B, S, Vd]
    out = m.map_draft_logits(q_logits)  # [B, S, Vt]
    assert out.shape == (2, 3, len(target) + 2) and out.dtype == q_logits.dtype
    src = (m.draft_to_target >= 0).nonzero().squeeze(-1)
    dst = m.draft_to_target[src]
    torch.testing.assert_close(out[..., dst], q_logits[..., src])
    no_twin = m.target_to_draft < 0
    assert torch.isneginf(out[..., no_twin]).all()
    q = torch.softmax(out, -1)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))
    assert q[..., no_twin].sum() == 0
    # q over target ids = the draft's q restricted to tokens with a twin, renormalised.
    torch.testing.assert_close(q[..., dst], torch.softmax(q_logits[..., src], -1))
    with pytest.raises(ValueError, match="width"):
        m.map_draft_logits(q_logits[..., :2])


def test_reencode_for_draft(mixed_pair):
    target, draft = mixed_pair
    m = build_vocab_mapping(target, draft)
    t_ids = target("hello world hello", add_special_tokens=False)["input_ids"]
    d_ids = m.reencode_for_draft(t_ids)
    assert draft.convert_ids_to_tokens(d_ids) == ["▁hello", "▁world", "▁hello"]
    assert draft.decode(d_ids) == target.decode(t_ids) == "hello world hello"


def test_no_usable_overlap_fails_before_any_model_is_loaded(tmp_path, monkeypatch):
    import specdraft.models.loading

    latin = word_tokenizer(tiny_words(40))
    cyrillic = word_tokenizer([f"слово{i}" for i in range(40)])
    with pytest.raises(CompatibilityError, match="no usable overlap"):
        build_vocab_mapping(latin, cyrillic)  # the 5 shared special tokens do not make it usable
    r = check_compatible(latin, cyrillic)
    assert r.verdict == "mismatch" and r.mapping["usable"] is False and r.mapping["n_text_mapped"] == 0

    draft_dir = tmp_path / "draft"
    tiny_model(vocab_size=len(cyrillic)).save_pretrained(draft_dir)
    cyrillic.save_pretrained(draft_dir)

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the overlap was checked")

    patch_everywhere(monkeypatch, specdraft.models.loading, "load_model", no_weights)
    with pytest.raises(CompatibilityError, match="no usable overlap"):
        vocab_swap(str(draft_dir), None, latin)


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_swap_reindexes_rows(tied):
    draft_tok = tiny_tokenizer(64)
    words = tiny_words(59)
    # The target shares 40 of the draft's words in another order and adds 10 of its own.
    target_words = words[::-1][:40] + [f"neu{i}" for i in range(10)]
    target_tok = word_tokenizer(target_words, eos="<|im_end|>")
    shared = set(words) & set(target_words)
    draft = tiny_model(vocab_size=72, tie_word_embeddings=tied)  # 8 padding rows past the tokenizer
    old = copy.deepcopy(draft)

    model, rep = vocab_swap(draft, draft_tok, target_tok)
    assert model is draft and rep.tied == tied
    assert rep.width == model.config.vocab_size == len(target_tok) == 55
    # "<eos>" is the draft's eos but a plain word to this target (whose eos is "<|im_end|>"): a control
    # token never pairs with text of the same spelling, so it is initialised like the 10 new words.
    assert rep.copied == len(shared) + len(SPECIAL_TOKENS) - 1 and rep.padding_rows == 0
    assert rep.initialised == 11 and rep.initialised_examples == ["<eos>"] + [f"neu{i}" for i in range(9)]
    assert rep.target_fingerprint == tokenizer_fingerprint(target_tok)
    assert model.config.eos_token_id == target_tok.eos_token_id == 3
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == 55
    mean = old.get_input_embeddings().weight[:64].mean(0)  # the real draft rows, padding left out
    for i in ids(target_tok, [f"neu{i}" for i in range(10)]):
        torch.testing.assert_close(emb[i], mean)
    if tied:
        assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()

    # The swapped model in target ids computes what the draft computed in draft ids.
    seq = [words[20], words[45], "<|im_start|>", words[58], words[30]]
    assert set(seq) <= shared | {"<|im_start|>"}
    d_seq, t_seq = ids(draft_tok, seq), ids(target_tok, seq)
    with torch.no_grad():
        before = old(torch.tensor([d_seq])).logits  # [1, 5, 72]
        after = model(torch.tensor([t_seq])).logits  # [1, 5, 55]
    pairs = [(draft_tok.convert_tokens_to_ids(s), target_tok.convert_tokens_to_ids(s))
             for s in list(shared) + SPECIAL_TOKENS[:4]]
    d_cols, t_cols = zip(*pairs)
    torch.testing.assert_close(after[..., list(t_cols)], before[..., list(d_cols)], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ real tokenizers

SMOL = "smollm2-135m-instruct"
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct"
QWEN_TARGET = "qwen2.5-coder-1.5b-instruct"


@pytest.fixture(scope="module")
def real_tokenizers():
    from specdraft.models.loading import load_tokenizer

    return {name: load_tokenizer(name) for name in (SMOL, QWEN_DRAFT)}


def _real_vocab_strings(tok):
    """Strings of ids below the last added token + 1 (the GGUF conversion appends "[PAD<id>]" rows)."""
    real = max(tok.added_tokens_decoder) + 1
    return {s: i for s, i in tok.get_vocab().items() if i < real}, real


@pytest.mark.real
def test_real_smollm2_vs_qwen_mismatch(real_tokenizers):
    smol, qwen = real_tokenizers[SMOL], real_tokenizers[QWEN_DRAFT]
    r = check_compatible(SMOL, QWEN_DRAFT)
    assert r.verdict == "mismatch"
    assert r.differences[0].id == 0
    assert (r.differences[0].target, r.differences[0].draft) == (smol.convert_ids_to_tokens(0),
                                                                 qwen.convert_ids_to_tokens(0))
    assert r.draft_real_vocab == _real_vocab_strings(qwen)[1] and r.target_real_vocab == len(smol)
    # Every Qwen id past SmolLM2's vocabulary differs, whatever happens below it.
    assert r.n_diff_ids >= r.draft_real_vocab - r.target_real_vocab
    with pytest.raises(CompatibilityError, match="id 0"):
        r.raise_for_mismatch()
    assert r.mapping["usable"] and r.mapping["n_mapped"] > 0


@pytest.mark.real
def test_real_mapping_qwen_target_smollm2_draft(real_tokenizers):
    smol, qwen = real_tokenizers[SMOL], real_tokenizers[QWEN_DRAFT]
    m = build_vocab_mapping(QWEN_DRAFT, SMOL)
    assert (m.target_scheme, m.draft_scheme) == ("byte-level", "byte-level")
    # Both are byte-level BPEs over the same GPT-2 alphabet, so twins are exactly the shared spellings.
    q_vocab, q_real = _real_vocab_strings(qwen)
    s_vocab = smol.get_vocab()
    shared = q_vocab.keys() & s_vocab.keys()
    assert m.n_mapped == len(shared)
    assert m.target_real == q_real and m.draft_real == len(smol)
    assert m.target_coverage == pytest.approx(len(shared) / q_real)
    assert m.draft_coverage == pytest.approx(len(shared) / len(smol))
    print(f"\nSmolLM2 → Qwen mapping: {m.n_mapped} pairs, target coverage {m.target_coverage:.2%}, "
          f"draft coverage {m.draft_coverage:.2%}, probe coverage {m.probe_coverage:.2%}")
    assert m.target_width == 151936 == len(m.target_to_draft)

    mapped = (m.draft_to_target >= 0).nonzero().squeeze(-1)
    t_ids = m.draft_ids_to_target(mapped)
    assert torch.equal(m.target_ids_to_draft(t_ids), mapped)  # draft → target → draft
    assert qwen.convert_ids_to_tokens(t_ids.tolist()) == smol.convert_ids_to_tokens(mapped.tolist())
    assert not (m.target_to_draft[q_real:] >= 0).any()  # padding rows never map

    text = "def add(a, b):\n    return a + b  # 加法 ✅\n"
    q_ids = qwen(text, add_special_tokens=False)["input_ids"]
    assert smol.decode(m.reencode_for_draft(q_ids)) == text


@pytest.mark.real
def test_real_qwen_pair_identical():
    from transformers import AutoConfig

    from specdraft.models.loading import resolve

    r = check_compatible(QWEN_TARGET, QWEN_DRAFT)
    assert r.verdict == "identical", r.summary()
    tok = __import__("transformers").AutoTokenizer.from_pretrained(resolve(QWEN_DRAFT))
    assert r.real_vocab == max(tok.added_tokens_decoder) + 1  # GGUF "[PAD<id>]" rows are padding
    assert r.target_width == r.draft_width == AutoConfig.from_pretrained(resolve(QWEN_DRAFT)).vocab_size
    assert r.target_fingerprint == r.draft_fingerprint
    assert r.probe_equal and r.chat_template_equal and r.warnings == []


@pytest.mark.real
def test_real_cli_check_mismatch_exits_1(tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["check", "--target", SMOL, "--draft", QWEN_DRAFT, "--out", str(out)])
    assert res.exit_code == 1
    assert "mismatch" in res.output and "vocabulary mapping would pair" in res.output
    assert json.loads(out.read_text())["compat"]["verdict"] == "mismatch"


def test_cli_vocab_swap_writes_a_draft_that_speaks_the_target_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from specdraft.cli import app
    from specdraft.testing import tiny_bpe_tokenizer

    t_tok, d_tok = tiny_bpe_tokenizer(300), tiny_bpe_tokenizer(360, seed=1)
    tdir, ddir, out = tmp_path / "target", tmp_path / "draft", tmp_path / "swapped"
    for vocab, tok, d, seed in ((304, t_tok, tdir, 0), (360, d_tok, ddir, 1)):  # target: 4 padding rows
        tiny_model("llama", vocab, seed=seed).save_pretrained(d)
        tok.save_pretrained(d)
    args = ["vocab-swap", "--target", str(tdir), "--draft", str(ddir), "--out", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "vocab_swap.json").read_text())
    m = build_vocab_mapping(t_tok, d_tok)
    assert report["width"] == 304 and report["padding_rows"] == 4
    assert report["copied"] == m.n_mapped and report["initialised"] == 300 - m.n_mapped
    assert "config.eos_token_id" in report["token_ids_rewritten"]  # the swap's report names the ids it rewrote
    assert "token ids rewritten into the target's: " in r.output and "config.eos_token_id" in r.output
    swapped = AutoModelForCausalLM.from_pretrained(out)
    draft = AutoModelForCausalLM.from_pretrained(ddir)
    twin_t = (m.target_to_draft >= 0).nonzero().squeeze(-1)
    torch.testing.assert_close(swapped.get_input_embeddings().weight[twin_t],
                               draft.get_input_embeddings().weight[m.target_to_draft[twin_t]])
    assert check_compatible(str(tdir), str(out)).verdict == "identical"  # same tokenizer, same width
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "--overwrite" in again.output
    assert CliRunner().invoke(app, [*args, "--overwrite"]).exit_code == 0
    a_file = tmp_path / "file"
    a_file.write_text("")
    r = CliRunner().invoke(app, [*args[:-2], "--out", str(a_file), "--overwrite"])
    assert r.exit_code == 2 and "is a file" in " ".join(r.output.split()) and a_file.read_text() == ""
    same = CliRunner().invoke(app, ["vocab-swap", "--target", str(tdir), "--draft", str(out), "--out",
                                    str(tmp_path / "again")])
    assert same.exit_code == 2 and "nothing to swap" in " ".join(same.output.split())
    assert not (tmp_path / "again").exists()


def test_reencode_gives_the_draft_its_own_bos_and_drops_the_targets():
    from specdraft.testing import tiny_bpe_tokenizer

    plain, with_bos = tiny_bpe_tokenizer(300), tiny_bpe_tokenizer(320, seed=1, bos=True)
    text = "def total(items):"
    assert with_bos(text)["input_ids"][0] == with_bos.bos_token_id == 5
    # Draft adds a BOS by itself → the re-encoded context starts with it, once.
    m = build_vocab_mapping(plain, with_bos)
    d_ids = m.reencode_for_draft(plain(text)["input_ids"])
    assert d_ids == with_bos(text)["input_ids"] and d_ids.count(5) == 1
    # Target adds a BOS by itself, draft does not → the target's BOS does not reach the draft as text.
    m = build_vocab_mapping(with_bos, plain)
    assert m.reencode_batch_for_draft([with_bos(text)["input_ids"]]) == [plain(text, add_special_tokens=False)["input_ids"]]
    # A target that adds nothing keeps a leading special token as text (chat markers are context).
    chat = "<|im_start|>user\nhi"
    assert plain.decode(build_vocab_mapping(plain, plain).reencode_for_draft(plain(chat)["input_ids"])) == chat


@pytest.mark.real
def test_real_gemma_sentencepiece_draft_for_qwen(real_tokenizers):
    """A metaspace (sentencepiece) draft for a byte-level target: ▁ and Ġ normalised, byte pieces decoded,
    the draft's BOS put back, and the text round trip exact."""
    from specdraft.models.loading import load_tokenizer

    qwen, gemma = real_tokenizers[QWEN_DRAFT], load_tokenizer("gemma-3-270m")
    assert check_compatible(QWEN_DRAFT, "gemma-3-270m").verdict == "mismatch"
    m = build_vocab_mapping(QWEN_DRAFT, "gemma-3-270m")
    assert (m.target_scheme, m.draft_scheme) == ("byte-level", "metaspace")
    print(f"\nGemma-3 → Qwen mapping: {m.n_mapped} pairs, target coverage {m.target_coverage:.2%}, "
          f"draft coverage {m.draft_coverage:.2%}, probe coverage {m.probe_coverage:.2%}")
    for q, g in (("Ġreturn", "▁return"), ("ĠĠĠ", "▁▁▁"), ("def", "def"), ("Ċ", "\n")):
        assert m.target_ids_to_draft(qwen.convert_tokens_to_ids(q)) == gemma.convert_tokens_to_ids(g), (q, g)
    assert m.n_text_mapped > 50_000 and m.probe_coverage > 0.5
    text = "def add(a, b):\n    return a + b  # 加法 ✅\n"
    d_ids = m.reencode_for_draft(qwen(text, add_special_tokens=False)["input_ids"])
    assert d_ids[0] == gemma.bos_token_id and d_ids.count(gemma.bos_token_id) == 1
    assert gemma.decode(d_ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("tied", [True, False])
def test_vocab_swap_builds_missing_rows_from_draft_pieces(tied):
    from specdraft.testing import tiny_bpe_tokenizer

    draft_tok, target_tok = tiny_bpe_tokenizer(300), tiny_bpe_tokenizer(360, seed=1)
    draft = tiny_model("llama", 300, seed=4, tie_word_embeddings=tied)
    old = copy.deepcopy(draft)
    model, rep = vocab_swap(draft, draft_tok, target_tok)
    merged = target_tok.convert_tokens_to_ids("Ġtotal")
    assert draft_tok.convert_tokens_to_ids("Ġtotal") == draft_tok.unk_token_id  # the draft lacks it...
    pieces = draft_tok(" total", add_special_tokens=False)["input_ids"]
    assert draft_tok.convert_ids_to_tokens(pieces) == ["Ġ", "t", "otal"]  # ...but spells it in three pieces
    for new, before in ((model.get_input_embeddings(), old.get_input_embeddings()),
                        (model.get_output_embeddings(), old.get_output_embeddings())):
        torch.testing.assert_close(new.weight[merged], before.weight[pieces].mean(0))
    assert 0 < rep.from_pieces <= rep.initialised
    assert rep.copied + rep.initialised + rep.padding_rows == rep.width == len(target_tok)
    # Control tokens without a twin never take pieces: there are none here, all 5 specials are shared.
    assert all(int(mapping_row) >= 0 for mapping_row in
               build_vocab_mapping(target_tok, draft_tok).target_to_draft[:5])


def test_mismatch_count_names_both_vocabularies_whichever_is_larger():
    """"N of M ids" took M from the draft for one pair and from the target for another, unsaid."""
    small, large = tiny_tokenizer(64), tiny_tokenizer(80, swap=(10, 20))
    for t, d, sizes in ((large, small, "(target 80, draft 64)"), (small, large, "(target 64, draft 80)")):
        detail = check_compatible(t, d).detail()
        assert detail.startswith(f"18 of the 80 ids below the larger real vocabulary {sizes} and "), detail


def test_parameter_note_explains_a_separate_output_head(tmp_path):
    """check's counts (1,777 M / 630 M for the embedded pair) exceed the published sizes: an untied head, said once."""
    from specdraft.models.check import model_facts, parameter_note
    from specdraft.testing import tiny_model

    tok = tiny_tokenizer(64)
    untied, tied = tiny_model("llama", vocab_size=64), tiny_model("llama", vocab_size=64, tie_word_embeddings=True)
    f_untied, f_tied = model_facts(untied, tok), model_facts(tied, tok)
    assert f_untied.output_head_parameters == 64 * 32 and f_tied.output_head_parameters == 0
    assert f_untied.parameters - f_tied.parameters == 64 * 32  # what the tie saves
    assert parameter_note(f_tied, f_tied) is None
    note = parameter_note(f_tied, f_untied, ("t", "qwen2.5-coder-0.5b-instruct"))
    assert note.startswith("the parameter counts include a separate output head (draft 0.0 M)")
    assert "GGUF builds, which store the output head separately" in note
    assert "GGUF" not in parameter_note(f_untied, f_tied, ("t", "d"))


# ------------------------------------------------------------------------------------------ chat templates

# Each renders like the tiny tokenizer's ChatML template except where its name says.
DEFAULT_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    + TINY_CHAT_TEMPLATE)
EMPTY_THINK_TEMPLATE = TINY_CHAT_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}",
                                                  "<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}")
# Other source text (names, concatenation, whitespace control), the same rendering.
SAME_RENDERING_TEMPLATE = (
    "{%- for message in messages -%}{{ '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' }}"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}{{ '<|im_start|>' + 'assistant' + '\\n' }}{%- endif -%}")


def test_chat_templates_are_compared_by_what_they_render():
    """check said two templates were equal although one adds a default system prompt where the conversation has
    none: the one rendered conversation held a system message. Every probe conversation is rendered now."""
    from rich.console import Console

    from specdraft.models.check import PROBE_CONVERSATIONS, TEMPLATE_USE, compare_chat_templates

    base = tiny_tokenizer(64)
    r = check_compatible(base, tiny_tokenizer(64, chat_template=DEFAULT_SYSTEM_TEMPLATE))
    assert r.verdict == "identical" and r.chat_template_equal is False
    chat = r.chat_template
    assert [c["equal"] for c in chat["conversations"]] == [False, True, False, True]  # the system ones agree
    assert chat["first_difference"] == {"conversation": "user, generation prompt", "position": 12,
                                        "target": "_start|>user\nWrite hello world in Python",
                                        "draft": "_start|>system\nYou are a helpful assista"}
    (w,) = [w for w in r.warnings if "chat templates" in w]
    assert w.startswith("the chat templates render 2 of the 4 probe conversations differently; first in \"user, "
                        "generation prompt\" at character 12: target '_start|>user\\nWrite")
    assert w.endswith(TEMPLATE_USE) and "the dump, the evaluation and the export use the target's" in w

    think = compare_chat_templates(base, tiny_tokenizer(64, chat_template=EMPTY_THINK_TEMPLATE))
    assert [c["equal"] for c in think["conversations"]] == [False, False, False, True]  # only with the gen prompt
    f = think["first_difference"]
    rendered = base.apply_chat_template(PROBE_CONVERSATIONS[f["conversation"]][0], tokenize=False,
                                        add_generation_prompt=True)
    assert f["position"] == len(rendered) and f["target"] == "sistant\n" and f["draft"] == "sistant\n<think>\n\n</think>\n\n"

    other_source = tiny_tokenizer(64, chat_template=SAME_RENDERING_TEMPLATE)
    assert other_source.chat_template != base.chat_template
    r = check_compatible(base, other_source)
    assert r.chat_template_equal is True and r.chat_template["first_difference"] is None and r.warnings == []
    console = Console(record=True, width=200)
    print_report(r, console)
    text = " ".join(console.export_text().split())
    assert "chat template │ renders the same" in text
    assert ("chat templates: the 4 probe conversations render identically with both; the dump, the evaluation "
            "and the export use the target's chat template") in text


def test_eval_renders_prompts_with_the_targets_template(tmp_path, monkeypatch):
    """What check says about the template in use, for eval: the prompts it decodes are the target's rendering
    even when the draft's template differs (the draft reads the target's ids)."""
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    import specdraft.measuring.evaluate
    from specdraft.cli import app
    from specdraft.data.sources import Example, encode_prompts
    from specdraft.models.loading import load_tokenizer

    tdir, ddir = save_tiny_pair(tmp_path, 64)
    tiny_tokenizer(64, chat_template=DEFAULT_SYSTEM_TEMPLATE).save_pretrained(tdir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n")
    seen = []

    def capture(target, draft, tok, ids, *_a, **_k):
        seen.append(ids)
        raise KeyboardInterrupt  # stop before decoding: the prompts are what this test reads

    patch_everywhere(monkeypatch, specdraft.measuring.evaluate, "run_eval", capture)
    CliRunner().invoke(app, ["eval", "--target", tdir, "--draft", ddir, "--prompts", str(prompts),
                             "--dtype", "float32", "--out", str(tmp_path / "eval")])
    ex = [Example("p", [{"role": "user", "content": "a b"}])]
    targets, drafts = encode_prompts(AutoTokenizer.from_pretrained(tdir), ex), encode_prompts(load_tokenizer(ddir), ex)
    assert targets != drafts and seen == [targets]


def test_vocab_swap_rewrites_every_token_id_field_of_the_configs_or_drops_it_and_says_which():
    """Every token id in the draft's config and generation config is a draft id: after the swap each is the
    target id of the same string (a list stays a list), or, without a twin, dropped with a warning; the report
    names both."""
    import warnings

    from transformers import GenerationConfig

    draft_tok = tiny_tokenizer(64)
    words = tiny_words(59)
    target_words = words[::-1][:40] + [f"neu{i}" for i in range(10)]
    target_tok = word_tokenizer(target_words, eos="<|im_end|>")
    kept, gone = words[50], words[5]  # the target shares words[19:] only
    assert kept in target_words and gone not in target_words
    d_kept, d_gone, d_end = ids(draft_tok, [kept, gone, "<|im_end|>"])
    draft = tiny_model(vocab_size=64)
    draft.config.eos_token_id = [draft_tok.eos_token_id, d_end]  # a list: the chat turn's end too
    draft.generation_config = GenerationConfig(eos_token_id=[draft_tok.eos_token_id, d_end], suppress_tokens=[d_kept, d_gone],
                                               begin_suppress_tokens=[d_gone], decoder_start_token_id=d_kept)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, rep = vocab_swap(draft, draft_tok, target_tok)
    t_kept, t_end = ids(target_tok, [kept, "<|im_end|>"])
    gen = model.generation_config
    assert model.config.eos_token_id == [t_end]  # "<eos>" has no twin in the target; a list stays a list
    assert gen.eos_token_id == [t_end] and gen.suppress_tokens == [t_kept] and gen.decoder_start_token_id == t_kept
    assert gen.begin_suppress_tokens is None
    assert "generation_config.suppress_tokens" in rep.token_ids_rewritten
    assert "config.eos_token_id" in rep.token_ids_rewritten
    assert rep.token_ids_dropped["generation_config.begin_suppress_tokens"] == [d_gone]
    assert rep.token_ids_dropped["generation_config.suppress_tokens"] == [d_gone]
    assert any("begin_suppress_tokens" in str(w.message) for w in caught)


def test_differing_strings_are_split_so_the_union_count_reads_right():
    # Target and draft share 40 words (10 of them under other ids) and hold 20 words each the other lacks: the
    # differing strings count the union, more than either side's distinct words, so the split is printed with it.
    words = tiny_words(80)
    shared, only_t, only_d = words[:40], words[40:60], words[60:80]
    moved = shared[:10][::-1] + shared[10:]  # the first 10 shared words reversed: 10 ids move
    t = word_tokenizer(shared + only_t)
    d = word_tokenizer(moved + only_d)
    r = check_compatible(t, d)
    assert r.verdict == "mismatch"
    assert (r.n_strings_target_only, r.n_strings_draft_only, r.n_strings_moved) == (20, 20, 10)
    assert r.n_diff_strings == 50
    assert "20 only in the target's, 20 only in the draft's, 10 in both under different ids" in r.detail()
    assert CompatReport.from_dict(r.to_dict()).n_strings_moved == 10
