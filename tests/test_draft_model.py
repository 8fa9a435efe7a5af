"""A cheaper draft (int8 linears, a trimmed head) changes only q: decoding stays exactly the target's."""

from __future__ import annotations

import copy

import pytest
import torch

from specdraft.core.config import SamplingConfig
from specdraft.core.sampling import output_width
from specdraft.core.stats import chi2_goodness_of_fit
from specdraft.decoding.decode import speculative_generate, target_generate
from specdraft.decoding.draft_model import (
    Int4Linear,
    Int8Linear,
    TrimmedHead,
    describe_draft,
    frequent_tokens,
    load_head_tokens,
    prepare_draft,
    quantize_int4,
    quantize_int8,
    rank_tokens,
    save_head_tokens,
)
from specdraft.models.tokens import left_pad
from specdraft.testing import exact_two_token_law, perturbed, tiny_model, tiny_tokenizer

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("qwen2", 128, seed=0, layers=3)
    return target, perturbed(target, 0.04)


def test_int8_linear_rounds_each_weight_by_at_most_half_a_step():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 48, bias=True)
    q = Int8Linear.from_linear(lin, dtype=torch.float32)
    w = lin.weight.detach()
    step = w.abs().amax(dim=1, keepdim=True) / 127  # one int8 step per output row
    assert ((q.dequantized_weight() - w).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(3, 5, 256)
    ref = x @ q.dequantized_weight().T + lin.bias
    # The kernel computes exactly x · W_deq + b up to float32 summation order.
    assert torch.allclose(q(x), ref, atol=1e-4) and q(x).shape == (3, 5, 48)


def test_int4_linear_matches_its_dequantized_weight_and_falls_back_to_int8():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True)
    q = Int4Linear.from_linear(lin, group_size=32)
    w, deq = lin.weight.detach(), q.dequantized_weight()
    # 16 levels per group of 32: each weight within half a step (+ bfloat16 rounding of scale and zero).
    step = (w.reshape(48, 2, 32).amax(-1) - w.reshape(48, 2, 32).amin(-1)) / 15
    assert ((deq - w).abs().reshape(48, 2, 32) <= (step / 2 * 1.05 + 2e-3)[..., None]).all()
    x = torch.randn(2, 3, 64)
    ref = x.bfloat16().float() @ deq.T + lin.bias
    assert torch.allclose(q(x), ref, atol=2e-2) and q(x).dtype == torch.float32
    odd = torch.nn.Sequential(torch.nn.Linear(48, 16))  # K = 48: not a multiple of 32
    assert isinstance(quantize_int4(odd)[0], Int8Linear)
    assert not Int4Linear.fits(torch.nn.Linear(64, 40))  # N = 40: not a multiple of 16
    assert not Int4Linear.fits(torch.nn.Linear(64, 48, device="meta"))  # not on the CPU (a CUDA weight): int8


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantised_layers_read_long_inputs_with_the_shared_dense_weight(kind, pair):
    from specdraft.decoding.draft_model import DENSE_MIN_ROWS

    _, draft = pair
    q = prepare_draft(draft, kind)  # a copy: keeps references to the draft's own dense weights
    layers = [(name, m) for name, m in q.named_modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert layers and all(m.dense_weight is not None for _, m in layers)
    name, layer = layers[0]
    original = draft.get_submodule(name)
    assert layer.dense_weight.data_ptr() == original.weight.data_ptr()  # shared, not copied
    assert not any("dense" in k for k in q.state_dict())  # the checkpoint holds the quantised tensors only
    long = torch.randn(1, DENSE_MIN_ROWS, layer.in_features)
    short = long[:, : DENSE_MIN_ROWS - 1]
    with torch.no_grad():
        assert torch.equal(layer(long), original(long))  # a prefill: the dense product
        assert not torch.equal(layer(short), original(short))  # a step: the quantised kernel
        deq = short.bfloat16().float() @ layer.dequantized_weight().T + (0 if original.bias is None else original.bias)
        err = (layer(short) - deq).abs().max() / deq.abs().max()
        assert err < 0.02, err  # ... of the quantised weight (bfloat16 activations)
    # Without a copy the draft's dense weights would be kept alive: off by default there, on when asked.
    alone = prepare_draft(copy.deepcopy(draft), kind, copy_model=False)
    assert all(m.dense_weight is None for m in alone.modules() if isinstance(m, (Int8Linear, Int4Linear)))
    forced = prepare_draft(draft, kind, dense_prefill=False)
    assert all(m.dense_weight is None for m in forced.modules() if isinstance(m, (Int8Linear, Int4Linear)))


def test_int8_draft_copy_leaves_the_original_alone(pair):
    _, draft = pair
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    q = prepare_draft(draft, "int8")
    info = describe_draft(q)
    assert q is not draft and (info["quantization"], info["head_tokens"]) == ("int8", None)
    n_linear = sum(type(m) is torch.nn.Linear for m in draft.modules())
    assert info["layers"] == {"int4": 0, "int8": n_linear, "dense": 0} and info["int8_fallback_shapes"] == []
    assert all(isinstance(m, Int8Linear) for m in q.modules() if "proj" in type(m).__name__.lower())
    assert not any(type(m) is torch.nn.Linear for m in q.modules())
    assert all(torch.equal(before[k], v) for k, v in draft.state_dict().items())
    plain = describe_draft(draft)
    assert (plain["quantization"], plain["head_tokens"], plain["layers"]["dense"]) == (None, None, n_linear)
    assert prepare_draft(draft) is draft  # no option: nothing to copy
    with pytest.raises(ValueError, match="int2"):
        prepare_draft(draft, "int2")


@pytest.mark.parametrize("options", [{"quantization": "int8"}, {"quantization": "int4"}, {"head": 1.0}, {"head": 0.6},
                                     {"quantization": "int8", "head": 0.6}, {"quantization": "int4", "head": 0.6}],
                         ids=["int8", "int4", "head-all-emitted", "head-most-emitted", "int8+head", "int4+head"])
@pytest.mark.parametrize("gamma", [2, 5])
def test_cheaper_draft_greedy_equals_target_only_batched_and_solo(pair, options, gamma):
    """The target itself made cheaper is the draft: int8 rounding and a head missing some of the tokens the target
    emits both cause rejections, and the output is still the target's, batched and solo."""
    target, _ = pair
    ids, mask = left_pad(PROMPTS, 0)
    base, _ = target_generate(target, ids, mask, max_new_tokens=21, eos_token_id=[])
    head = None
    if "head" in options:  # the most frequent share of the tokens the target emits (FR-Spec's token set, in small)
        tok = tiny_tokenizer(128)
        emitted = {t for row in base for t in row} - set(tok.all_special_ids)
        n = len(tok.all_special_ids) + round(options["head"] * len(emitted))
        head = frequent_tokens(tok, token_lists=base, n=n)
    cheap = prepare_draft(target, options.get("quantization"), head)
    spec, counts = speculative_generate(target, cheap, ids, mask, num_speculative_tokens=gamma, max_new_tokens=21,
                                        eos_token_id=[])
    assert spec == base
    for i, p in enumerate(PROMPTS):
        solo, _ = speculative_generate(target, cheap, *left_pad([p], 0), num_speculative_tokens=gamma,
                                       max_new_tokens=21, eos_token_id=[])
        assert solo[0] == base[i]
    if options == {"head": 1.0}:  # every token the target emits is kept: q's argmax is p's
        assert counts.acceptance_rate == 1.0
    else:  # rejections happen (the invariant is tested where it can fail) but the cheaper draft is still useful
        # (int4 rounds a random tiny model's near-tied logits harder than a trained model's: lower bar)
        assert (0.15 if options.get("quantization") == "int4" else 0.4) < counts.acceptance_rate < 1.0


def test_trimmed_head_scores_only_the_kept_tokens(pair):
    _, draft = pair
    keep = torch.tensor([3, 7, 8, 50, 127])
    trimmed = prepare_draft(draft, head_tokens=keep)
    assert isinstance(trimmed.get_output_embeddings(), TrimmedHead) and output_width(trimmed) == 128
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        full, cut = draft(x).logits, trimmed(x).logits
    assert cut.shape == full.shape
    assert torch.allclose(cut[..., keep], full[..., keep], atol=1e-5)  # the same rows, the same logits
    others = torch.ones(128, dtype=torch.bool)
    others[keep] = False
    assert torch.isinf(cut[..., others]).all() and (cut[..., others] < 0).all()
    # Quantised after trimming: the head's projection is int8 and only 5 rows wide.
    both = prepare_draft(draft, "int8", keep)
    assert isinstance(both.get_output_embeddings().proj, Int8Linear)
    assert both.get_output_embeddings().proj.out_features == 5
    info = describe_draft(both)
    assert (info["quantization"], info["head_tokens"]) == ("int8", 5)
    with pytest.raises(TypeError, match="trim the head before"):
        prepare_draft(quantize_int8(prepare_draft(draft, "int8")), head_tokens=keep)


def test_trimmed_draft_never_proposes_a_dropped_token(pair):
    target, draft = pair
    keep = torch.arange(5, 45)
    ids, mask = left_pad(PROMPTS, 0)
    proposed = []
    trimmed = prepare_draft(draft, head_tokens=keep)
    orig_forward = trimmed.forward

    def spy(*a, **kw):  # record the draft's argmax at every step
        out = orig_forward(*a, **kw)
        proposed.extend(out.logits[:, -1].argmax(-1).tolist())
        return out

    trimmed.forward = spy
    base, _ = target_generate(target, ids, mask, max_new_tokens=15, eos_token_id=[])
    spec, _ = speculative_generate(target, trimmed, ids, mask, num_speculative_tokens=3, max_new_tokens=15,
                                   eos_token_id=[])
    assert spec == base and proposed and set(proposed) <= set(keep.tolist())


@pytest.mark.parametrize("options", [{"quantization": "int8"}, {"quantization": "int4"},
                                     {"quantization": "int8", "head": 9}], ids=["int8", "int4", "int8+head"])
def test_cheaper_draft_sampled_output_follows_target_law(options):
    """χ² of the first two tokens against the target's exact law: q is the int8 draft's, renormalised over the
    kept head rows when trimmed (tokens outside them have q = 0 and can still be emitted by the correction)."""
    V, N = 12, 6000
    sampling = SamplingConfig(temperature=1.0)
    target = tiny_model("llama", V + 5, seed=0, layers=2, hidden=32)  # K = 32: one int4 group per row
    draft = perturbed(target, 0.08, seed=5)
    head = torch.arange(0, options["head"]) if "head" in options else None
    cheap = prepare_draft(draft, options["quantization"], head)
    law = exact_two_token_law(target, [5, 6, 7], sampling)
    out, counts = speculative_generate(target, cheap, torch.tensor([[5, 6, 7]] * N), None, num_speculative_tokens=3,
                                       sampling=sampling, max_new_tokens=2, eos_token_id=[],
                                       generator=torch.Generator().manual_seed(4321))
    assert 0.05 < counts.acceptance_rate < 0.95
    pvalue, outside = chi2_goodness_of_fit(out, law)
    assert outside == 0 and pvalue > 1e-3, f"p={pvalue:.2e}"


def test_frequent_tokens_ranks_by_count_then_id_and_keeps_special_tokens():
    tok = tiny_tokenizer(64)
    words = tok.convert_ids_to_tokens(list(range(64)))
    text = " ".join([words[40]] * 5 + [words[30]] * 3 + [words[50]] * 3)
    ids = frequent_tokens(tok, [text], n=8)
    # The 5 specials, then 40 (5×), then 30 and 50 (3× each).
    assert ids.tolist() == [0, 1, 2, 3, 4, 30, 40, 50]
    # Unseen ids rank by id: after the specials and 60, the next is 5 (and 63 is forced).
    assert frequent_tokens(tok, token_lists=[[60]], n=8, always=[63]).tolist() == [0, 1, 2, 3, 4, 5, 60, 63]
    more = frequent_tokens(tok, token_lists=[[60, 60, 61]], n=7, always=[63])
    assert more.tolist() == sorted([0, 1, 2, 3, 4, 63, 60])
    assert len(frequent_tokens(tok, [text], n=10_000)) == len(tok)


def test_a_saved_token_ranking_is_reused_beside_its_speculator(tmp_path):
    from specdraft.core.config import EvalConfig
    from specdraft.decoding.draft_model import apply_draft_options

    tok = tiny_tokenizer(64)
    ranked = rank_tokens(tok, token_lists=[[60, 60, 60, 61, 61, 62]])
    assert ranked[:8] == [0, 1, 2, 3, 4, 60, 61, 62] and sorted(ranked) == list(range(64))
    assert load_head_tokens(tmp_path, 8, tok) is None  # no file: nothing saved here
    save_head_tokens(tmp_path, ranked, tok, "test answers")
    assert load_head_tokens(tmp_path, 7, tok).tolist() == [0, 1, 2, 3, 4, 60, 61]
    # A draft loaded from that directory keeps the saved tokens; elsewhere the embedded prompts are counted.
    draft = tiny_model("llama", 64, seed=1)
    draft.config._name_or_path = str(tmp_path)
    trimmed = apply_draft_options(draft, tok, EvalConfig(draft_head_tokens=7, dtype="float32"))
    assert trimmed.get_output_embeddings().token_ids.tolist() == [0, 1, 2, 3, 4, 60, 61]
    # Counted with another tokenizer: refused, naming the file.
    other = tiny_tokenizer(80)
    with pytest.raises(ValueError, match="head_tokens.json was counted with another tokenizer"):
        load_head_tokens(tmp_path, 7, other)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_decode_attention_equals_sdpa_on_one_token_steps_with_padding(arch, monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa_module
    from transformers import DynamicCache

    from specdraft.decoding.draft_model import DECODE_ATTENTION, use_decode_attention

    model = tiny_model(arch, 96, seed=2, layers=2)  # 4 query heads share 2 key-value heads
    fast = copy.deepcopy(model)
    assert use_decode_attention(fast) and fast.config._attn_implementation == DECODE_ATTENTION
    assert model.config._attn_implementation == "sdpa"  # the original is untouched
    assert not use_decode_attention(fast)  # not on sdpa any more: left alone
    ids, mask = left_pad([[5, 9, 11, 12, 30, 31], [7, 8, 40]], 0)  # row 2 is left-padded
    caches = [DynamicCache(), DynamicCache()]
    fallback_queries = []  # query lengths the decode attention handed to sdpa
    real_sdpa = sdpa_module.sdpa_attention_forward

    def counting(module, query, *a, **k):
        if module.config is fast.config:
            fallback_queries.append(query.shape[2])
        return real_sdpa(module, query, *a, **k)

    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", counting)
    with torch.no_grad():
        outs = [m(input_ids=ids, attention_mask=mask, cache=c, use_cache=True).logits
                for m, c in zip((model, fast), caches)]
        torch.testing.assert_close(outs[0], outs[1])  # the prefill (several queries) is sdpa in both
        for step in range(3):  # one-token steps read the padded cache through the mask
            nxt = outs[0][:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            outs = [m(input_ids=nxt, attention_mask=mask, cache=c, use_cache=True).logits
                    for m, c in zip((model, fast), caches)]
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert fallback_queries == [6, 6]  # only the prefill (2 layers) went to sdpa; the steps were grouped products
    base, _ = target_generate(model, ids, left_pad([[5, 9, 11, 12, 30, 31], [7, 8, 40]], 0)[1], max_new_tokens=10)
    again, _ = target_generate(fast, ids, left_pad([[5, 9, 11, 12, 30, 31], [7, 8, 40]], 0)[1], max_new_tokens=10)
    assert base == again


def test_auto_picks_int4_where_the_kernel_takes_the_layer_and_int8_where_it_refuses():
    from specdraft.decoding.draft_model import choose_draft_options, draft_label

    # hidden 64 (int4 takes K = 64), intermediate 80 (N = 80 is a multiple of 16): down_proj has K = 80, not a
    # multiple of 32 → int8.
    draft = tiny_model("qwen2", 128, seed=0, layers=2, hidden=64, intermediate_size=80)
    plan = choose_draft_options(draft, "auto", None)
    assert (plan.quantization, plan.head_tokens) == ("int4", None)  # 128 rows: too small a head to trim
    assert "auto on CPU" in plan.reason and "full head (128 rows" in plan.reason
    info = describe_draft(prepare_draft(draft, plan.quantization))
    n_linear = sum(type(m) is torch.nn.Linear for m in draft.modules())
    assert info["layers"] == {"int4": n_linear - 2, "int8": 2, "dense": 0}  # one down_proj per layer
    assert info["int8_fallback_shapes"] == [[64, 80]] and info["quantization"] == "int4+int8"
    assert draft_label(info) == f"int4 ({n_linear - 2}/{n_linear} layers; 2 int8)"
    # The head is trimmed only for a large head of the target's tokenizer; 0 turns it off; explicit choices stay.
    big = tiny_model("qwen2", 70_000, seed=0, layers=1, hidden=32)
    assert choose_draft_options(big, "auto", None).head_tokens == 32_768
    assert choose_draft_options(big, "auto", None, same_tokenizer=False).head_tokens is None
    assert choose_draft_options(big, "auto", 0).head_tokens is None
    assert choose_draft_options(big, "auto", 1000).head_tokens == 1000
    assert (choose_draft_options(big, "none", None).quantization, choose_draft_options(big, "none").head_tokens) == \
        (None, None)
    assert choose_draft_options(big, "int8", None).head_tokens is None  # explicit quantization: no automatic head
    with pytest.raises(ValueError, match="int2"):
        choose_draft_options(big, "int2")
