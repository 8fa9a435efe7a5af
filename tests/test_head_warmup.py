"""The head warm-up: untying, the body's one pass, and head training on the cached states."""

import math

import pytest
import torch

from specdraft.data import TokenSequence
from specdraft.head_warmup import hidden_features, train_head, untie_head
from specdraft.testing import tiny_model


def _sequences(n=6, length=12, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append(TokenSequence(f"s{i}", ids, [j >= 3 for j in range(length - 1)] + [False]))
    return out


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


def test_a_tied_head_is_refused_before_training():
    model = _tied_model()
    hidden, labels = torch.zeros(4, 32), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="untie_head"):
        train_head(model, hidden, labels, steps=1, batch_size=2, lr=1e-3, real_vocab=128)


def test_features_are_the_final_states_at_trained_positions_and_their_next_tokens():
    model = tiny_model("llama").eval()
    seqs = _sequences()
    hidden, labels = hidden_features(model, seqs, batch_size=4)
    assert hidden.shape == (6 * 8, 32) and labels.shape == (6 * 8,)
    with torch.no_grad():
        ref = model.model(input_ids=torch.tensor([s.ids for s in seqs])).last_hidden_state  # [6, 12, 32]
        logits = model(input_ids=torch.tensor([s.ids for s in seqs])).logits
    mask = torch.tensor([s.loss_mask for s in seqs])
    torch.testing.assert_close(hidden, ref[mask], rtol=1e-5, atol=1e-5)
    assert labels.tolist() == torch.tensor([s.ids[1:] + [0] for s in seqs])[mask].tolist()
    # the head applied to the cached states is the model's own logits there
    head = model.get_output_embeddings().weight
    torch.testing.assert_close(hidden @ head.t(), logits[mask], rtol=1e-4, atol=1e-5)


def test_head_training_on_cached_states_reaches_the_loss_of_running_the_body_every_step():
    seqs = _sequences()
    steps, batch, lr = 12, 16, 3e-2
    cached = tiny_model("llama").eval()
    untie_head(cached)
    hidden, labels = hidden_features(cached, seqs)
    emb_before = cached.get_input_embeddings().weight.detach().clone()
    log = train_head(cached, hidden, labels, steps=steps, batch_size=batch, lr=lr, real_vocab=128, seed=5)

    # Reference: the frozen body runs at every step; the same draws, the same update rule.
    ref = tiny_model("llama").eval()
    untie_head(ref)
    weight = ref.get_output_embeddings().weight.detach().float().clone().requires_grad_()
    opt = torch.optim.AdamW([weight], lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(5)
    mask = torch.tensor([s.loss_mask for s in seqs])
    ids = torch.tensor([s.ids for s in seqs])
    nxt = torch.tensor([s.ids[1:] + [0] for s in seqs])[mask]
    ref_losses = []
    for _ in range(steps):
        idx = torch.randint(0, int(mask.sum()), (batch,), generator=gen)
        with torch.no_grad():
            h = ref.model(input_ids=ids).last_hidden_state[mask]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = h[idx] @ weight.t()
        loss = torch.nn.functional.cross_entropy(logits.float(), nxt[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ref_losses.append(float(loss))
    assert [round(x, 4) for x, _ in log] == [round(x, 4) for x in ref_losses]
    assert log[-1][0] < log[0][0] - 0.5  # it learns: the head moves rows at this rate
    torch.testing.assert_close(cached.get_output_embeddings().weight, weight.detach())
    assert torch.equal(cached.get_input_embeddings().weight, emb_before)  # what the body reads never moved
