"""Certifying sampled speculative decoding on a pair: a χ² test of the first token against the target's law.

:func:`certify_sampling` backs ``specdraft eval --certify`` (:func:`specdraft.measuring.evaluate.run_eval`); greedy decoding
is certified token by token there instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdraft.core.acceptance import AcceptanceCounts
from specdraft.core.config import SamplingConfig
from specdraft.core.sampling import align_logits, filtered_probs, output_width
from specdraft.core.stats import chi2_goodness_of_fit
from specdraft.decoding.decode import speculative_generate
from specdraft.models.tokens import left_pad


@torch.no_grad()
def certify_sampling(target, draft, prompt: Sequence[int], sampling: SamplingConfig, draws: int,
                     num_speculative_tokens: int, *, real_vocab: int | None = None, pad_id: int = 0,
                     batch_size: int = 64, seed: int = 0, vocab_mapping=None) -> dict[str, Any]:
    """Is sampled speculative decoding exact on this pair? A χ² goodness-of-fit test of the first sampled token:
    ``draws`` rows decode two tokens each (the first round drafts one), and the first tokens' counts are tested against
    the target's filtered law p (Leviathan et al. 2023, Thm 3.5). Design: docs/architecture.md#specdraftmeasuringcertify.

    Returns:
        ``{"draws", "p_value", "outside_support", "cells", "top_tokens", "proposals", "accepted", "rejections",
        "bonus_draws", "target_draws", "valid", "invalid_reason", "passed"}``.

    Raises:
        ValueError: greedy ``sampling`` or ``draws`` < 1.
    """
    import numpy as np


    if sampling.greedy:
        raise ValueError("--certify tests sampled decoding; greedy output is certified token by token")
    if draws < 1:
        raise ValueError(f"--certify needs at least 1 draw (got {draws})")
    device = next(target.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    logits = align_logits(target(ids).logits[0, -1].float(), output_width(target), real_vocab)
    law = filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p).double().cpu().numpy()
    law = law / law.sum()
    gen = torch.Generator(device=device).manual_seed(seed)
    first: list[int] = []
    counts = AcceptanceCounts(num_speculative_tokens)
    while len(first) < draws:
        b = min(batch_size, draws - len(first))
        inp, mask = left_pad([list(prompt)] * b, pad_id, device)
        out, c = speculative_generate(target, draft, inp, mask, num_speculative_tokens=num_speculative_tokens,
                                      sampling=sampling, max_new_tokens=2, eos_token_id=[], real_vocab=real_vocab,
                                      generator=gen, vocab_mapping=vocab_mapping)
        counts = counts.merge(c)
        first += [row[0] for row in out]
    # Position 0 of a round is the first token here: only the first round drafts (the second has no room).
    # Each accepted first draft is followed by that round's bonus draw (two tokens per row, no stop ids).
    proposals, accepted = counts.proposed[0], counts.accepted[0]
    rejections = counts.reached[0] - accepted
    invalid = None
    if proposals == 0:
        invalid = (f"speculation proposed no token in {draws} draws: the target alone drew them, so nothing of "
                   "speculative decoding was tested (does the draft give finite logits, and read this prompt?)")
    elif rejections == 0:
        invalid = (f"no proposal was rejected in {draws} draws: the residual draw never ran, so a verifier that "
                   "accepts everything would pass as well; give more draws (--certify), or certify a draft that "
                   "differs from the target")
    counts_first = np.bincount(first, minlength=law.shape[0])
    outside = int(counts_first[law == 0].sum())
    # A draw of a token p gives no mass is proof enough (and scipy's χ² refuses unequal totals).
    p_value = 0.0 if outside else chi2_goodness_of_fit([[t] for t in first], law)[0]
    top = np.argsort(-law)[:5]
    cells = int((law * draws >= 5).sum()) + int((law * draws < 5).any())
    return {"draws": draws, "p_value": p_value, "outside_support": outside, "cells": cells,
            "top_tokens": [[int(t), float(law[t]), float(counts_first[t] / draws)] for t in top],
            "proposals": proposals, "accepted": accepted, "rejections": rejections, "bonus_draws": accepted,
            "target_draws": draws - proposals, "valid": invalid is None, "invalid_reason": invalid,
            "passed": invalid is None and p_value >= 1e-3 and outside == 0}
