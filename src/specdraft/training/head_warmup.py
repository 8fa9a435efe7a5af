"""Untying a draft's output head from its input embedding before distillation (``DistillConfig.untie_head``);
why: docs/architecture.md#specdrafttraininghead_warmup.
"""

from __future__ import annotations


def untie_head(model) -> bool:
    """Give the output head its own copy of the input embedding when the two share one matrix.

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
