"""The transformers assisted-generation harness: ``generate(assistant_model=draft)`` under specdraft's settings.

transformers fills unset fields from each model's own ``generation_config`` (a checkpoint's ``repetition_penalty``,
``top_k``…), which specdraft never applies; so a complete :class:`~transformers.GenerationConfig`
(:func:`hf_generation_config`) stands in for both during the call.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys

import torch

from specdraft.core.config import SamplingConfig
from specdraft.decoding.decode import check_max_new_tokens


def hf_generation_config(sampling: SamplingConfig, max_new_tokens: int, eos_token_id: list[int], pad_token_id: int,
                         num_speculative_tokens: int, draft_confidence_threshold: float | None = None):
    """A complete ``transformers.GenerationConfig`` matching specdraft's run: transformers' neutral
    defaults, then our sampling, stop ids (:func:`specdraft.models.tokens.stop_ids`), pad id, γ per round on a constant
    schedule and the confidence threshold. Raises :class:`specdraft.decoding.decode.DecodeError` when ``max_new_tokens`` < 1.
    """
    check_max_new_tokens(max_new_tokens)
    from transformers import GenerationConfig

    # transformers' fallback table; max_length / min_length stay None (set, each generate call warns).
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    for deprecated_or_length in ("num_beam_groups", "diversity_penalty", "max_length", "min_length"):
        defaults.pop(deprecated_or_length, None)
    gc = GenerationConfig(**defaults)
    gc.update(do_sample=not sampling.greedy, max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_id),
              pad_token_id=pad_token_id, num_assistant_tokens=num_speculative_tokens,
              num_assistant_tokens_schedule="constant", assistant_confidence_threshold=draft_confidence_threshold or 0.0)
    if not sampling.greedy:
        gc.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return gc


#: What transformers logs each drafting round, whatever the caller configured.
_INTERNAL_NOTICE = "Passing `generation_config` together with generation-related arguments"
_CANDIDATE_GENERATOR = os.path.join("transformers", "generation", "candidate_generator.py")


class _CandidateGeneratorNotice(logging.Filter):
    """Drops :data:`_INTERNAL_NOTICE` only when transformers' candidate generator logs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_INTERNAL_NOTICE):
            return True
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.endswith(_CANDIDATE_GENERATOR):
                return False
            frame = frame.f_back
        return True


@contextlib.contextmanager
def _models_generation_config(gc, target, draft):
    """Stand ``gc`` in for both models' ``generation_config`` during a call (transformers reads
    the assistant's own), the draft keeping its special-token ids, and filter the candidate generator's notice."""
    saved = [(m, m.generation_config) for m in (target, draft)]
    notice = _CandidateGeneratorNotice()
    log = logging.getLogger("transformers.generation.utils")
    log.addFilter(notice)
    try:
        if draft is not target:
            dgc = copy.deepcopy(gc)
            for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
                own = getattr(draft.generation_config, key, None)
                setattr(dgc, key, own if own is not None else getattr(gc, key))
            draft.generation_config = dgc
        target.generation_config = gc
        yield
    finally:
        log.removeFilter(notice)
        for m, own in reversed(saved):
            m.generation_config = own


def assisted_generate(target, draft, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config,
                      seed: int | None = None, tokenizers: dict | None = None) -> list[int]:
    """One transformers assisted-generation call for a ``[1, S]`` prompt; returns the new token ids.

    ``seed`` seeds the global torch RNG (transformers samples from it); ``tokenizers``
    (``{"tokenizer", "assistant_tokenizer"}``) for a draft of another tokenizer.
    """
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad(), _models_generation_config(generation_config, target, draft):
        out = target.generate(input_ids=input_ids, attention_mask=attention_mask, assistant_model=draft,
                              generation_config=generation_config, **(tokenizers or {}))
    return out[0, input_ids.shape[1]:].tolist()
