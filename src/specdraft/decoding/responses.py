"""The model answers prompts: responses from the decoder's target-only loop, for dumps and distillation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdraft.core.config import SamplingConfig
from specdraft.data.sources import encode_prompts, end_of_turn_ids, tokenizer_pad_id
from specdraft.decoding.decode import DecodeError, check_max_new_tokens, target_generate
from specdraft.models.dump_reader import DumpError
from specdraft.models.tokens import left_pad, stop_ids

if TYPE_CHECKING:  # pragma: no cover
    from specdraft.data.sources import Example


def answer_stop_ids(model, tokenizer) -> list[int]:
    """Sorted ids that end an answer used as teacher signal: :func:`specdraft.models.tokens.stop_ids` plus the
    chat template's one-token end of turn (:func:`specdraft.data.sources.end_of_turn_ids`). Past it a chat model invents the
    next turn, which would be trained as answer."""

    eot = end_of_turn_ids(tokenizer) if getattr(tokenizer, "chat_template", None) else []
    return sorted(set(stop_ids(model, tokenizer)) | (set(eot) if len(eot) == 1 else set()))


def generate_responses(target, tokenizer, examples: list[Example], max_new_tokens: int, sampling=None,
                       seed: int = 0, real_vocab: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """The target answers each example's prompt (chat template) in one left-padded batch: ``(prompts, responses)``."""

    check_max_new_tokens(max_new_tokens, error=DumpError)  # before the prompts are encoded
    prompts = encode_prompts(tokenizer, examples)
    return prompts, generate_from_ids(target, tokenizer, prompts, max_new_tokens, sampling, seed, real_vocab)


def generate_from_ids(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sampling=None, seed: int = 0,
                      real_vocab: int | None = None, stop_model=None, eos_token_id: list[int] | None = None,
                      ) -> list[list[int]]:
    """``model`` answers encoded prompts in one left-padded batch: ``[n]`` new id lists (stop included).

    ``stop_model``: whose stop ids end a response (the target, also when ``model`` is the draft); ``eos_token_id``
    overrides them. Raises :class:`DumpError` for N < 1 or a prompt plus N beyond the context window.
    """
    import torch


    check_max_new_tokens(max_new_tokens, error=DumpError)
    sampling = sampling or SamplingConfig()
    device = next(model.parameters()).device
    pad = tokenizer_pad_id(tokenizer)
    ids, mask = left_pad(prompts, pad, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    eos_ids = (answer_stop_ids(model if stop_model is None else stop_model, tokenizer) if eos_token_id is None
               else list(eos_token_id))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            responses, _ = target_generate(model, ids, mask, sampling=sampling, max_new_tokens=max_new_tokens,
                                           eos_token_id=eos_ids, real_vocab=real_vocab,
                                           generator=gen)
    except DecodeError as exc:
        raise DumpError(f"the target cannot write {max_new_tokens} new tokens here (dump --generate, or the "
                        f"evaluation's --max-new-tokens): {exc}") from exc
    finally:
        model.train(was_training)
    return responses
