"""The model answers prompts: responses generated with the decoder's target-only loop, for dumps and distillation.

A dump's responses are the target's (:func:`generate_responses`); on-policy distillation has the draft answer
(:func:`generate_from_ids`). Both run :func:`specdraft.decode.target_generate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from specdraft.data import Example


def answer_stop_ids(model, tokenizer) -> list[int]:
    """The ids that end an answer written as teacher signal: :func:`specdraft.tokens.stop_ids` of ``model`` and
    ``tokenizer``, and the end-of-turn token the tokenizer's chat template writes after an answer
    (:func:`specdraft.data.end_of_turn_ids`) where it is one token. A chat model ends its turn with its template's
    terminator (``<|im_end|>``, ``<end_of_turn>``) even where its EOS is another token; running on past it, the
    terminator vanishes from the decoded text and an invented next turn would be trained as answer. A terminator
    of several tokens is no stop id (its first piece may be ordinary text).

    Returns:
        sorted token ids.
    """
    from specdraft.data import end_of_turn_ids
    from specdraft.tokens import stop_ids

    eot = end_of_turn_ids(tokenizer) if getattr(tokenizer, "chat_template", None) else []
    return sorted(set(stop_ids(model, tokenizer)) | (set(eot) if len(eot) == 1 else set()))


def generate_responses(target, tokenizer, examples: list[Example], max_new_tokens: int, sampling=None,
                       seed: int = 0, real_vocab: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """The target answers each example's prompt (chat template, generation prompt), in one left-padded batch.

    Args:
        examples: prompts (messages up to the first assistant turn are used).
        others: as :func:`generate_from_ids`.

    Returns:
        ``(prompts, responses)``: per example the prompt ids and the generated ids.
    """
    from specdraft.data import encode_prompts
    from specdraft.decode import check_max_new_tokens
    from specdraft.dump_reader import DumpError

    check_max_new_tokens(max_new_tokens, error=DumpError)  # before the prompts are encoded
    prompts = encode_prompts(tokenizer, examples)
    return prompts, generate_from_ids(target, tokenizer, prompts, max_new_tokens, sampling, seed, real_vocab)


def generate_from_ids(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sampling=None, seed: int = 0,
                      real_vocab: int | None = None, stop_model=None, eos_token_id: list[int] | None = None,
                      ) -> list[list[int]]:
    """``model`` answers already-encoded prompts in one left-padded batch: the target for a dump's responses,
    the draft for on-policy distillation (:class:`specdraft.distill_data.DraftWriter`).

    Args:
        model: causal LM (in eval mode for the call; its training mode is restored after).
        tokenizer: the shared tokenizer (pad id; its EOS is one of the stop ids).
        prompts: ``[n]`` token-id lists (chat template already applied).
        max_new_tokens: response length bound N ≥ 1; a stop id (included) ends a response earlier.
        sampling: :class:`specdraft.config.SamplingConfig` (default greedy).
        seed: seed of the sampling generator.
        real_vocab: ids at or past it are padding rows and never generated.
        stop_model: the model whose stop ids end a response (:func:`answer_stop_ids` of it and ``tokenizer``): the
            target, also when ``model`` is the draft; default ``model``.
        eos_token_id: the stop ids instead (the evaluation's answers end where its decoding loops end a row,
            :func:`specdraft.tokens.stop_ids`).

    Returns:
        ``[n]`` generated id lists (prompt excluded, EOS included).

    Raises:
        DumpError: bad generation settings (N < 1, a prompt plus N beyond the context window).
    """
    import torch

    from specdraft.config import SamplingConfig
    from specdraft.data import tokenizer_pad_id
    from specdraft.decode import DecodeError, check_max_new_tokens, target_generate
    from specdraft.dump_reader import DumpError
    from specdraft.tokens import left_pad

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
