"""The transformers assisted-generation harness: ``generate(assistant_model=draft)`` under specdraft's settings.

transformers fills every field a call leaves unset from the model's own ``generation_config`` (a checkpoint's
``repetition_penalty``, ``top_k``…), which specdraft never applies; so a complete
:class:`~transformers.GenerationConfig` (:func:`hf_generation_config`) stands in for both models' own during the
call (:func:`assisted_generate`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys

import torch

from specdraft.config import SamplingConfig
from specdraft.decode import check_max_new_tokens


def hf_generation_config(sampling: SamplingConfig, max_new_tokens: int, eos_token_id: list[int], pad_token_id: int,
                         num_speculative_tokens: int, draft_confidence_threshold: float | None = None):
    """A complete, explicit ``transformers.GenerationConfig`` for assisted generation that matches specdraft's run.

    Every other field takes transformers' neutral global default (no penalty, no bias, one beam); then ours:
    sampling (``top_k`` 0 = off in both), EOS and pad ids, γ tokens per round on a constant schedule, and the
    draft confidence threshold (0 = off) instead of transformers' default 20 tokens and 0.4.

    ``eos_token_id``: :func:`specdraft.tokens.stop_ids` of the target and tokenizer, so transformers' rows end where
    specdraft's do; ``max_new_tokens`` ≥ 1.

    Raises:
        specdraft.decode.DecodeError: ``max_new_tokens`` < 1.
    """
    check_max_new_tokens(max_new_tokens)
    from transformers import GenerationConfig

    # transformers' own fallback table (5.x). The beam-group keys are deprecated and warn when set; max_length /
    # min_length beside max_new_tokens make every generate call (each drafting round too) warn, and left None
    # transformers derives them from the *_new_tokens it is given.
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


#: What transformers (5.x) logs about its own candidate generator's ``assistant_model.generate(generation_config=...,
#: max_new_tokens=...)`` each drafting round, however the caller configured generation: nothing a user can change.
_INTERNAL_NOTICE = "Passing `generation_config` together with generation-related arguments"
_CANDIDATE_GENERATOR = os.path.join("transformers", "generation", "candidate_generator.py")


class _CandidateGeneratorNotice(logging.Filter):
    """Drops :data:`_INTERNAL_NOTICE` when, and only when, transformers' candidate generator is on the stack that
    logs it (its own call to the assistant); every other record — that notice from a caller's own ``generate``
    call included — passes."""

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
    """Stand ``gc`` in for both models' ``generation_config`` during a ``generate`` call, then put theirs back.

    transformers builds the assistant's settings from ``assistant_model.generation_config``, hence both places.
    The draft keeps its own special-token ids (another tokenizer). :class:`_CandidateGeneratorNotice` filters the
    log for the call's duration.
    """
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
    """One transformers assisted-generation call for a batch of one row; returns the new token ids.

    Args:
        input_ids / attention_mask: ``[1, S]`` the prompt (left-padded).
        generation_config: from :func:`hf_generation_config`; stands in for both models' own during the call.
        seed: sampled decoding seeds the global torch RNG with it first (transformers samples from it).
        tokenizers: ``{"tokenizer", "assistant_tokenizer"}`` for a draft of another tokenizer (universal assisted
            generation).
    """
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad(), _models_generation_config(generation_config, target, draft):
        out = target.generate(input_ids=input_ids, attention_mask=attention_mask, assistant_model=draft,
                              generation_config=generation_config, **(tokenizers or {}))
    return out[0, input_ids.shape[1]:].tolist()
