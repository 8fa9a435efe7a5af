"""Untying the head: the output rows get their own copy of the embedding, and the saved checkpoint says so."""

import torch

from specdraft.testing import tiny_model
from specdraft.training.head_warmup import untie_head


def _tied_model():
    model = tiny_model("llama", tie_word_embeddings=True)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    return model


def test_untie_head_copies_the_embedding_and_says_so_in_the_config(tmp_path):
    model = _tied_model()
    assert untie_head(model) is True
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() != emb.data_ptr() and torch.equal(head, emb)
    assert model.config.tie_word_embeddings is False
    assert untie_head(model) is False  # already untied: nothing to do
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.get_output_embeddings().weight.data_ptr() != back.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(back.get_output_embeddings().weight, head)
