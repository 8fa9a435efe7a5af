"""Untying a draft's output head from its input embedding, so that distillation trains what the draft proposes
apart from what its body reads (``DistillConfig.untie_head``).

A vocabulary swap (:func:`specdraft.vocab.vocab_swap`) leaves rows for target tokens the draft lacked untrained; in
a tied model each such row is both an input and an output row, and one gradient step pulls it two ways. Untied, the
head's rows learn apart from the embedding's, as in the embeddings-first schedules of vocabulary transfer (de Vries &
Nissim 2021, arXiv 2012.05628; EEVE, arXiv 2402.14714).
"""

from __future__ import annotations


def untie_head(model) -> bool:
    """Give the output head its own copy of the input embedding when the two share one matrix.

    The config's ``tie_word_embeddings`` is set false, so ``save_pretrained`` writes both and transformers, vLLM
    and llama.cpp's converter load an untied head (a Llama/Qwen ``lm_head.weight``). Costs one ``[V, H]`` matrix
    of memory; no FLOPs.

    Returns:
        True when the head was tied (and is now untied); False when it already had its own weight.
    """
    import torch

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != emb.weight.data_ptr():
        return False
    head.weight = torch.nn.Parameter(emb.weight.detach().clone())
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        cfg.tie_word_embeddings = False
    return True
