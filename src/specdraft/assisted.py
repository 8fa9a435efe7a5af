"""The transformers assisted-generation harness: ``generate(assistant_model=draft)`` under specdraft's settings.

Like with like: transformers would otherwise fill every field a call leaves unset from the model's own
``generation_config`` (a checkpoint's ``repetition_penalty``, ``top_k``, ``do_sample``…), which specdraft never
applies; so assisted generation runs with a complete :class:`~transformers.GenerationConfig`
(:func:`hf_generation_config`) standing in for both models' own during the call (:func:`assisted_generate`, the one
call eval and the speed stage make).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys

import torch

from specdraft.config import SamplingConfig


def hf_generation_config(sampling: SamplingConfig, max_new_tokens: int, eos_token_id: list[int], pad_token_id: int,
                         num_speculative_tokens: int, draft_confidence_threshold: float | None = None):
    """A complete, explicit ``transformers.GenerationConfig`` for assisted generation that matches specdraft's run.

    Every field transformers would otherwise default is set to its neutral global default (no penalty, no bias,
    no suppressed token, one beam), then ours: sampling (``top_k`` 0 = off in both), max new tokens, EOS and
    padding ids, and the drafting rule — γ tokens per round with a constant schedule, and the draft confidence
    threshold (0 = off, like ``draft_confidence_threshold=None``) instead of transformers' default 20 tokens
    and 0.4. Used with :func:`_models_generation_config`, so nothing comes from either model's own config.
    """
    from transformers import GenerationConfig

    # transformers' own table of the values it falls back to (5.x); the deprecated beam-group keys warn when set.
    # The length is max_new_tokens alone: a max_length / min_length beside it (the table's 20 and 0) makes every
    # generate call — the target's and each drafting round of the assistant's — warn "Both `max_new_tokens` and
    # `max_length` seem to have been set"; left None, transformers derives both from the *_new_tokens it is given.
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


#: The one notice transformers logs about its own assisted-generation internals (5.x): its candidate generator calls
#: ``assistant_model.generate(generation_config=..., max_new_tokens=..., min_new_tokens=...)`` each drafting round,
#: which its deprecation check reports however the caller configured generation. Nothing a user can change.
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

    transformers fills every field a call leaves at ``None`` from ``self.generation_config`` and builds the
    assistant's settings from ``assistant_model.generation_config``; with ``gc`` in both places nothing of the
    checkpoints' own generation settings is used. The draft keeps its own special-token ids (another tokenizer).
    With a complete ``gc`` (:func:`hf_generation_config`) the call itself warns of nothing; the one notice about
    transformers' own drafting call is dropped for the call's duration (:class:`_CandidateGeneratorNotice`).
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
