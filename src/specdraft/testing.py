"""Tiny offline models and tokenizers for tests and examples, and the reference greedy replay they compare with.

Everything here is built from a config in code: no download, no file on disk unless asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from specdraft.core.sampling import align_logits, check_windows, filtered_probs
from specdraft.data.sources import Example
from specdraft.decoding.replay import replay_answer, tail_logits
from specdraft.models.tokens import left_pad

if TYPE_CHECKING:  # pragma: no cover
    from specdraft.core.acceptance import AcceptanceCounts

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<eos>"]


def tiny_words(n: int) -> list[str]:
    """``n`` distinct lowercase pseudo-words used as a WordLevel vocabulary."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = [c for c in letters] + ["\n", "def", "return", "(", ")", ":", "=", "+", "user", "assistant"]
    i = 0
    while len(words) < n:
        a, b = divmod(i, 26)
        words.append(letters[a % 26] + letters[b] + str(a // 26))
        i += 1
    return words[:n]


def tiny_tokenizer(vocab_size: int = 128, swap: tuple[int, int] | None = None, chat_template: str | None = None,
                   permute: int | None = None, newline: bool = True):
    """A ``PreTrainedTokenizerFast`` with a WordLevel model of exactly ``vocab_size`` ids (5 specials first).

    ``swap``: two ids whose strings are exchanged; ``permute``: seed renumbering the non-special ids; without
    ``newline`` any id sequence round-trips through decode and encode.
    """
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = tiny_words(vocab_size - len(SPECIAL_TOKENS) + (0 if newline else 1))
    if not newline:
        words.remove("\n")
    if permute is not None:
        random.Random(permute).shuffle(words)
    strings = SPECIAL_TOKENS + words
    if swap is not None:
        a, b = swap
        strings[a], strings[b] = strings[b], strings[a]
    vocab = {s: i for i, s in enumerate(strings)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<eos>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = chat_template or TINY_CHAT_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 128, layers: int = 2, hidden: int = 32, **kw: Any):
    """A tiny causal-LM config: llama, qwen2, gpt2, mistral, gemma, gemma2 or gemma3."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = {"vocab_size": vocab_size, "pad_token_id": 0, "eos_token_id": 4, "bos_token_id": None}
    if arch == "gpt2":
        cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=2, n_positions=256, **common)
    else:
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}.get(arch)
        if cls is None and arch == "gemma":
            from transformers import GemmaConfig as cls
        elif cls is None and arch == "gemma2":
            from transformers import Gemma2Config as cls
        elif cls is None and arch == "gemma3":
            from transformers import Gemma3TextConfig as cls
        if cls is None:
            raise ValueError(f"unknown tiny arch {arch!r}")
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            max_position_embeddings=256,
            **common,
        )
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(arch: str = "llama", vocab_size: int = 128, seed: int = 0, layers: int = 2, hidden: int = 32,
               dtype: str = "float32", **kw: Any):
    """A randomly initialised tiny causal LM (eval mode), deterministic for a given ``seed``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, vocab_size=vocab_size, layers=layers, hidden=hidden, **kw)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    # Sharper than default init so that argmax/top-k behave like a real model's (not near-uniform).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def perturbed(model, scale: float, seed: int = 123):
    """A copy of ``model`` with Gaussian noise of std ``scale`` on every parameter (partial acceptance)."""
    import copy

    import torch

    d = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))
    return d


def exact_two_token_law(target, prompt, sampling):
    """Exact joint law ``[V, V] float64`` of the first two tokens the target samples after ``prompt``."""
    import torch


    with torch.no_grad():
        ids = torch.tensor([list(prompt)])
        p1 = filtered_probs(target(ids).logits[0, -1], sampling.temperature, sampling.top_k, sampling.top_p)
        V = p1.shape[0]
        ext = torch.cat([ids.repeat(V, 1), torch.arange(V)[:, None]], dim=1)
        p2 = filtered_probs(target(ext).logits[:, -1], sampling.temperature, sampling.top_k, sampling.top_p)
    law = (p1[:, None].double() * p2.double()).numpy()  # [V, V]
    return law / law.sum()


def replay_greedy(
    draft,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos_token_id: Sequence[int] = (),
    real_vocab: int | None = None,
    batch_size: int = 4,
    pad_id: int = 0,
) -> list[AcceptanceCounts]:
    """Greedy speculative decoding's counts replayed from one teacher-forced draft pass per prompt: the
    reference tests compare decoding with (why:
    docs/architecture.md#specdrafttesting). ``responses``: the target's greedy
    answers. Returns ``[n]`` :class:`~specdraft.core.acceptance.AcceptanceCounts`; raises
    :class:`specdraft.core.sampling.ContextWindowError` before any pass."""
    import torch


    check_windows([len(p) + len(r) for p, r in zip(prompts, responses, strict=True)], [("draft", draft)],
                  "replay shorter prompts or answers (lower --max-new-tokens).")
    eos = set(eos_token_id)
    width = draft.get_output_embeddings().weight.shape[0]
    device = next(draft.parameters()).device
    out = []
    with torch.no_grad():  # one pass for the argmax, no graph (also when a bench swaps tail_logits)
        for start in range(0, len(prompts), batch_size):
            chunk = [(list(p), list(r)) for p, r in zip(prompts[start:start + batch_size],
                                                        responses[start:start + batch_size], strict=True)]
            ids, attn = left_pad([p + r for p, r in chunk], pad_id, device)
            pos = (attn.cumsum(1) - 1).clamp(min=0)
            keep = max(len(r) for _, r in chunk) + 1  # the head scores only the answers' predicting positions
            guess = align_logits(tail_logits(draft, ids, attn, pos, keep), width, real_vocab).argmax(-1)  # [b, keep]
            for i, (p, y) in enumerate(chunk):
                first = keep - len(y) - 1  # left padding: the last prompt position predicts y[0]
                out.append(replay_answer(guess[i, first:first + len(y)].tolist(), y, num_speculative_tokens,
                                          max_new_tokens, eos))
    return out


def save_tiny_pair(root, vocab_size: int = 128, target_vocab: int | None = None, draft_vocab: int | None = None,
                   arch: str = "llama", seed: int = 0, tokenizer=None):
    """Write a tiny target (3 layers) and draft (1 layer) sharing one tokenizer under ``root``; returns
    ``(target_dir, draft_dir)``. ``*_vocab`` set ``config.vocab_size`` (padding rows)."""
    from pathlib import Path

    root = Path(root)
    tok = tiny_tokenizer(vocab_size) if tokenizer is None else tokenizer
    ids = {} if tokenizer is None else {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                                        "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    vocab_size = ids.pop("vocab_size", vocab_size)
    dirs = []
    for name, layers, v, s in (("target", 3, target_vocab, seed), ("draft", 1, draft_vocab, seed + 1)):
        m = tiny_model(arch, vocab_size=v or vocab_size, seed=s, layers=layers, **ids)
        d = root / name
        m.save_pretrained(d)
        tok.save_pretrained(d)
        dirs.append(str(d))
    return dirs[0], dirs[1]


def add_default_system_turn(model_dir, text: str = "be brief") -> None:
    """Edit a saved model's chat template in place so it writes a system turn of ``text``
    before a conversation without one."""
    import json
    from pathlib import Path

    turn = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + text
            + "<|im_end|>\n{% endif %}")
    jinja, config = Path(model_dir) / "chat_template.jinja", Path(model_dir) / "tokenizer_config.json"
    if jinja.is_file():
        jinja.write_text(turn + jinja.read_text())
        return
    cfg = json.loads(config.read_text())
    cfg["chat_template"] = turn + cfg["chat_template"]
    config.write_text(json.dumps(cfg, indent=2))


TINY_CORPUS_WORDS = ["def", "return", "hello", "world", "value", "items", "print", "lambda", "for", "in",
                     "range", "total", "count", "index", "(", ")", ":", "=", "+", "\n", "    "]


def tiny_corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    """Deterministic code-like lines over :data:`TINY_CORPUS_WORDS` (training text for :func:`tiny_bpe_tokenizer`)."""
    import random

    rng = random.Random(seed)
    return ["".join(rng.choice(TINY_CORPUS_WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(4, 12)))
            for _ in range(n_lines)]


def tiny_bpe_tokenizer(vocab_size: int = 300, seed: int = 0, bos: bool = False):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on :func:`tiny_corpus` (no download).

    Another ``vocab_size`` or ``seed`` segments and numbers differently: a cross-tokenizer pair. Ids: the
    :data:`SPECIAL_TOKENS`, ``"<bos>"`` with ``bos``, the 256 bytes, then merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS + (["<bos>"] if bos else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tiny_corpus(seed=seed), trainer=trainer)
    return _tiny_fast_tokenizer(tok, bos)


def _tiny_fast_tokenizer(tok, bos: bool):
    """A trained ``tokenizers.Tokenizer`` wrapped as the tiny tokenizers' fast tokenizer."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                           special_tokens=[("<bos>", len(SPECIAL_TOKENS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>",
                                   bos_token="<bos>" if bos else None,
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_llama_tokenizer(vocab_size: int = 300, seed: int = 0, bos: bool = True):
    """A Llama-2-style BPE tokenizer (``▁``, byte fallback, ``<0xXX>`` tokens) that llama.cpp's
    converter reads from ``tokenizer.json`` alone, so tiny models convert to GGUF. Another ``seed`` gives other
    merges:
    a pair llama.cpp refuses."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    specials = SPECIAL_TOKENS + (["<bos>"] if bos else [])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    if vocab_size <= len(specials) + len(byte_tokens):
        raise ValueError(f"vocab_size {vocab_size} leaves no merges after {len(specials) + 256} special and byte tokens")
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = normalizer
    n_learned = vocab_size - len(specials) - len(byte_tokens)
    learner.train_from_iterator(tiny_corpus(seed=seed), trainer=trainers.BpeTrainer(
        vocab_size=n_learned, show_progress=False, limit_alphabet=1000))
    learned = json.loads(learner.to_str())["model"]
    strings = specials + byte_tokens + [t for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1])]
    strings = strings[:vocab_size]
    vocab = {t: i for i, t in enumerate(strings)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    merges = [m for m in merges if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return _tiny_fast_tokenizer(tok, bos)


#: Short code-and-prose prompts whose BPE pieces the tiny tokenizers share (:func:`tiny_examples`).
TINY_PROMPTS = ("def total(items):", "for index in range(count):", "hello world value", "print(lambda x: x + count)",
                "return items", "total = count + index")


def tiny_examples(n: int | None = None) -> list:
    """``n`` (default 6) distinct one-turn examples ``p0``, ``p1``, … cycling through :data:`TINY_PROMPTS`."""

    n = len(TINY_PROMPTS) if n is None else n
    return [Example(f"p{i}", [{"role": "user", "content": TINY_PROMPTS[i % len(TINY_PROMPTS)] + f" {i}"}])
            for i in range(n)]


def patch_everywhere(monkeypatch, module, name: str, value: Any) -> None:
    """``monkeypatch.setattr(module, name, value)`` and the same in every specdraft module that imported the
    original object by name (``from specdraft.x import name`` binds it at import), so a fake reaches every caller.

    Every specdraft module is imported first, so none binds the fake at its own import and keeps it after the test.
    ``module`` is a module object or its dotted name."""
    import importlib
    import pkgutil
    import sys
    from pathlib import Path

    if isinstance(module, str):
        module = importlib.import_module(module)
    for info in pkgutil.walk_packages([str(Path(__file__).parent)], "specdraft."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    original = getattr(module, name)
    for mod_name, mod in list(sys.modules.items()):
        if (mod_name == "specdraft" or mod_name.startswith("specdraft.")) and mod is not module \
                and getattr(mod, name, None) is original:
            monkeypatch.setattr(mod, name, value)
    monkeypatch.setattr(module, name, value)
