"""The head warm-up: a cheap first stage for a draft re-indexed into the target's tokenizer.

A vocabulary swap (:func:`specdraft.vocab.vocab_swap`) leaves the draft's body intact but its rows for target
tokens it lacked — merged line ends such as ``):\\n`` above all — untrained, and those rows are what the target
writes where code lives (:mod:`specdraft.segmentation` counts it). Training them through full distillation is
slow on a CPU: every step runs the whole body forward and backward for a few hundred tokens, with a
vocabulary-wide teacher. The warm-up does the part that needs no teacher first:

1. the head is untied from the input embedding (:func:`untie_head`), so output rows move without changing what
   the body reads;
2. the frozen body runs **once** over many tokens of text in the target's canonical segmentation
   (:func:`warmup_sequences`: the Python standard library's own sources shipped with the interpreter, ShareGPT
   replies through the target's chat template, the target's own answers), and its final hidden states are kept
   (:func:`hidden_features`);
3. the head alone is trained on them by cross-entropy on the next token (:func:`train_head`): softmax regression,
   no backward pass through the layers, at a learning rate that moves rows (1e-3; SmolLM2's own fine-tuning
   rate).

The stages follow the embeddings-first schedules of vocabulary transfer (de Vries & Nissim 2021, arXiv 2012.05628;
EEVE, arXiv 2402.14714; low-budget expansion, arXiv 2406.11477). Because the body is frozen, step 3 reaches
exactly the loss that training the head with the body run at every step would (the features are the same
tensors); distillation against the target follows (:func:`specdraft.distill.run_distill`).
"""

from __future__ import annotations

import glob
import json
import math
import random
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdraft.config import WarmupConfig


@dataclass
class WarmupResult:
    """What :func:`run_head_warmup` did; ``to_dict()`` is written as ``head_warmup.json`` beside the model.

    ``positions``: next-token targets the head trained on (from ``sequences`` sequences, ``by_source`` of them
    per source); ``loss_first`` / ``loss_last``: cross-entropy (nats) of the first and last step's batch;
    ``top1_first`` / ``top1_last``: the head's argmax agreement with the next token on those batches;
    seconds: the body's single pass and the head's training."""

    positions: int
    sequences: int
    by_source: dict[str, int]
    steps: int
    loss_first: float
    loss_last: float
    top1_first: float
    top1_last: float
    features_seconds: float
    train_seconds: float
    untied: bool
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field."""
        return asdict(self)


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


def stdlib_sources(seed: int = 0) -> list[Path]:
    """The top-level ``.py`` files of this interpreter's standard library, in a seeded shuffled order (real Python
    on every machine, nothing downloaded)."""
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
    random.Random(seed).shuffle(files)
    return [Path(f) for f in files]


def warmup_sequences(tokenizer, config: WarmupConfig, answers: Sequence[tuple[Sequence[int], Sequence[int]]] = ()):
    """Token sequences in the target's segmentation for the warm-up, with their loss masks.

    Args:
        tokenizer: the target's tokenizer (the swapped draft speaks it).
        config: how many ShareGPT turns (the assistant reply trained, through the chat template, at most
            ``chunk_tokens`` × 1.5 tokens), how many stdlib tokens (chunks of ``chunk_tokens``, at most
            ``chunks_per_file`` per file, for variety).
        answers: ``(prompt_ids, answer_ids)`` pairs the target wrote (the answer positions are trained).

    Returns:
        ``(sequences, by_source)``: :class:`specdraft.data.TokenSequence` list (``loss_mask[j]`` trains the
        prediction of token ``j + 1``) and the count per source.
    """
    from specdraft.data import TokenSequence, _shifted, encode_conversation, load_examples

    seqs, by_source = [], {"sharegpt": 0, "stdlib": 0, "answers": 0}
    if config.sharegpt_turns:
        for ex in load_examples("sharegpt", limit=config.sharegpt_turns, offset=0):
            ids, assistant = encode_conversation(tokenizer, ex.messages, ex.id)
            keep = int(config.chunk_tokens * 1.5)
            mask = _shifted(assistant)[:keep]
            if any(mask[:-1]):
                seqs.append(TokenSequence(ex.id, ids[:keep], mask[:-1] + [False], truncated=len(ids) > keep))
                by_source["sharegpt"] += 1
    got = 0
    for path in stdlib_sources(config.seed):
        if got >= config.stdlib_tokens:
            break
        ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        size = config.chunk_tokens
        for start in range(0, min(len(ids), config.chunks_per_file * size), size):
            chunk = ids[start:start + size][: config.stdlib_tokens - got]
            if len(chunk) < 32:
                continue
            seqs.append(TokenSequence(f"stdlib/{path.name}:{start}", chunk, [True] * (len(chunk) - 1) + [False]))
            by_source["stdlib"] += 1
            got += len(chunk)
    for i, (prompt, answer) in enumerate(answers):
        ids = list(prompt) + list(answer)
        seqs.append(TokenSequence(f"answer/{i}", ids, [False] * (len(prompt) - 1) + [True] * len(answer) + [False]))
        by_source["answers"] += 1
    return seqs, by_source


def hidden_features(model, sequences, batch_size: int = 8, progress: Callable[[int, int], None] | None = None):
    """The frozen body's final hidden states at trained positions, and the token each one predicts.

    Sequences are batched by length (sorted, right-padded) so little compute goes to padding.

    Args:
        model: a transformers causal LM whose ``model.model`` (the base model) returns ``last_hidden_state`` after
            the final norm (Llama, Qwen2, Mistral, Gemma: what the head multiplies).
        sequences: :class:`specdraft.data.TokenSequence` list.

    Returns:
        ``(hidden [N, H] in the model's dtype, labels [N] int64)``, N = the trained positions.
    """
    import torch
    from torch.nn.utils.rnn import pad_sequence

    body = model.get_base_model() if hasattr(model, "get_base_model") else model.model
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].ids))
    hidden, labels = [], []
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            chunk = [sequences[i] for i in order[start:start + batch_size]]
            ids = pad_sequence([torch.tensor(s.ids) for s in chunk], batch_first=True).to(device)
            attn = pad_sequence([torch.ones(len(s.ids), dtype=torch.long) for s in chunk], batch_first=True).to(device)
            mask = pad_sequence([torch.tensor(s.loss_mask, dtype=torch.bool) for s in chunk], batch_first=True)
            nxt = pad_sequence([torch.tensor(s.ids[1:] + [0]) for s in chunk], batch_first=True)
            h = body(input_ids=ids, attention_mask=attn).last_hidden_state  # [b, S, H]
            hidden.append(h[mask.to(device)].cpu())
            labels.append(nxt[mask])
            if progress:
                progress(min(start + batch_size, len(order)), len(order))
    return torch.cat(hidden), torch.cat(labels)


def train_head(model, hidden, labels, *, steps: int, batch_size: int, lr: float, real_vocab: int, seed: int = 0,
               progress: Callable[[int, int, float], None] | None = None) -> list[tuple[float, float]]:
    """Train the output head alone by cross-entropy on cached final hidden states (softmax regression).

    Each step draws ``batch_size`` positions (seeded), computes ``logits = hidden @ Wᵀ`` (bfloat16 autocast on a
    CPU, float32 master weights), and takes one AdamW step (β = (0.9, 0.98), no weight decay) on a cosine schedule
    with 10% warm-up. Only ids below ``real_vocab`` compete in the softmax (padding rows never win, as at decode
    time). The head's weight is replaced by the trained one at the end.

    Args:
        hidden: ``[N, H]`` (:func:`hidden_features`); labels: ``[N]`` int64 next-token ids.
        real_vocab: ``len(tokenizer)``.

    Returns:
        Per step ``(loss nats, top-1 agreement)`` on that step's batch.

    Raises:
        ValueError: the head is tied to the input embedding (training it would move what the cached features were
            computed from: :func:`untie_head` first), or no positions.
    """
    import torch

    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight.data_ptr() == emb.weight.data_ptr():
        raise ValueError("the output head is tied to the input embedding: untie_head(model) first")
    if len(labels) == 0:
        raise ValueError("no trained positions to warm the head up on")
    weight = head.weight.detach().float().clone().requires_grad_()  # [V, H]
    opt = torch.optim.AdamW([weight], lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    device_type = weight.device.type
    log = []
    for step in range(steps):
        idx = torch.randint(0, len(labels), (batch_size,), generator=gen)
        h, y = hidden[idx].to(weight.device), labels[idx].to(weight.device)
        with torch.autocast(device_type, dtype=torch.bfloat16):
            logits = h @ weight.t()  # [b, V]
        logits = logits.float()[:, :real_vocab]
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        log.append((float(loss.detach()), float((logits.detach().argmax(-1) == y).float().mean())))
        if progress:
            progress(step + 1, steps, log[-1][0])
    with torch.no_grad():
        head.weight.copy_(weight.to(head.weight.dtype))
    return log


def run_head_warmup(draft, out: str | Path, config: WarmupConfig | None = None,
                    answers: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
                    progress: Callable[[str, int, int], None] | None = None) -> WarmupResult:
    """The warm-up end to end: load a re-indexed draft, untie, one body pass, train the head, save.

    Args:
        draft: a reference to a draft that speaks the target's tokenizer (a ``specdraft vocab-swap`` output).
        out: directory for the warmed-up draft (HF checkpoint + the draft's tokenizer + ``head_warmup.json``),
            written atomically.
        answers: ``(prompt_ids, answer_ids)`` the target wrote (trained beside the text sources).
        progress: ``(phase, done, total)`` with phase ``"features"`` or ``"head"``.

    Returns:
        The :class:`WarmupResult`.

    Raises:
        ModelResolutionError: ``draft`` cannot be resolved.
    """
    import torch
    from transformers import AutoTokenizer

    from specdraft.io import atomic_directory
    from specdraft.models import load_model, resolve

    config = config or WarmupConfig()
    model, _ = load_model(draft, dtype="float32", device="cpu")
    tok = AutoTokenizer.from_pretrained(resolve(draft))
    untied = untie_head(model)
    seqs, by_source = warmup_sequences(tok, config, answers)
    t0 = time.perf_counter()
    model.to(torch.bfloat16)  # the body's one pass, as served (bf16)
    hidden, labels = hidden_features(model, seqs, config.batch_sequences,
                                     progress and (lambda d, n: progress("features", d, n)))
    model.to(torch.float32)
    t1 = time.perf_counter()
    log = train_head(model, hidden, labels, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                     real_vocab=len(tok), seed=config.seed,
                     progress=progress and (lambda d, n, _loss: progress("head", d, n)))
    t2 = time.perf_counter()
    result = WarmupResult(positions=len(labels), sequences=len(seqs), by_source=by_source, steps=config.steps,
                          loss_first=log[0][0], loss_last=log[-1][0], top1_first=log[0][1], top1_last=log[-1][1],
                          features_seconds=t1 - t0, train_seconds=t2 - t1, untied=untied, config=config.model_dump())
    with atomic_directory(Path(out)) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "head_warmup.json").write_text(json.dumps(result.to_dict(), indent=1), encoding="utf-8")
    return result
