"""The embedded Qwen2.5-Coder pair end to end: compatibility, lossless greedy decoding, α."""

from __future__ import annotations

import pytest

from specdraft.models import DEFAULT_DRAFT, DEFAULT_TARGET

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def real_pair():
    from specdraft.models import load_model

    target, tok = load_model(DEFAULT_TARGET, dtype="float32", device="cpu")
    draft, _ = load_model(DEFAULT_DRAFT, dtype="float32", device="cpu")
    return target, draft, tok


def test_greedy_speculative_equals_target_on_real_pair(real_pair):
    from specdraft.data import encode_prompts, load_examples
    from specdraft.evaluate import run_eval

    target, draft, tok = real_pair
    examples = load_examples("humaneval", limit=2, offset=100) + load_examples("mt-bench", limit=1)
    ids = encode_prompts(tok, examples)
    res = run_eval(target, draft, tok, ids, [e.id for e in examples], num_speculative_tokens=4, max_new_tokens=24)
    s = res.summary()
    # fp32: a multi-token pass may differ from a one-token pass only in the last bits; any divergence must be
    # a near-tie within the fp32 tolerance, and none is expected.
    assert s["divergences_beyond_tolerance"] == 0, res.divergences
    assert s["divergences"] == 0, [(d.prompt_id, d.margin) for d in res.divergences]
    assert res.spec_tokens == res.target_tokens == 3 * 24
    # A same-family 0.5B draft agrees with its 1.5B sibling most of the time on code.
    assert s["acceptance_rate"] > 0.5
    assert s["mean_accepted_length"] > 2.0
    assert 0.5 < s["predicted_alpha_response"] <= 1.0
