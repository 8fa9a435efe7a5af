"""A cheaper draft: transforms applied to the draft model before it drafts. Each changes only q.

Speculative decoding is exact for *any* draft distribution q (Leviathan et al. 2023, Theorem 3.5): every
proposal is verified against the target's p, so making the draft cheaper can lower acceptance but never
changes the output (greedy: the target's argmax; sampled: p's law). The target is never touched.

Two transforms, applied by :func:`prepare_draft` in this order (a trimmed head is then quantised too):

1. **A trimmed output head** (FR-Spec, Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language
   Models via Frequency-Ranked Speculative Sampling"): the draft scores only the N most frequent target
   tokens (:func:`frequent_tokens`). The head's logits are written into a full-width row filled with −inf,
   so every other token has q = 0 — the draft never proposes it, and when sampling q is the draft's
   distribution renormalised over the kept set (softmax of −inf is 0). The output keeps the full width, so the
   drafter and verification need no change. The 0.5B Qwen draft's 151,936-row head is about 27% of the
   weights it reads per step; keeping 32,768 rows (22% of the head) reads ~21% fewer weights per step.
2. **Weight-only int8 or int4 linear layers** (:class:`Int8Linear`, :class:`Int4Linear`): every ``nn.Linear`` of
   the draft (the output head included) holds its weight as int8 with one scale per output row, or as int4 with a
   scale and zero per group of 32 inputs, and runs ``torch._weight_int8pack_mm`` / ``torch.ops.aten.
   _weight_int4pack_mm_for_cpu``. Only weights are rounded; activations stay bfloat16. Chosen by measurement
   (``bench/bench_draft_kernels.py``: one-token steps of the 0.5B Qwen draft after a 64-token prefill, 2 threads,
   candidates interleaved; docs/benchmarks.md): per step, bf16 1.00, int8 weight-only ~0.48, int4 weight-only ~0.37,
   torch's fbgemm dynamic int8 (``torch.ao.quantization.quantize_dynamic`` on a float32 copy) ~0.37 — but fbgemm
   also rounds the activations (one scale per token), which cut the draft's top-1 agreement with the target from
   0.775 to 0.61–0.64, while both weight-only kernels kept it (0.780); and torch 2.13 marks ``torch.ao.quantization``
   and its quantised tensors deprecated. Int4 in groups of 32 lost no top-1 agreement on the embedded draft,
   plausibly because it is a dequantised Q4_K_M GGUF build whose weights already lie on a 4-bit grid of 32-weight
   blocks; weight-only int8 is the conservative choice for a draft trained in full precision (measure α).

Two more, always applied to a prepared copy, because a draft step is one token: quantised layers read inputs of
≥ :data:`DENSE_MIN_ROWS` rows (the prompt prefill) with the draft's own dense weights, shared with the original
(``dense_prefill``), and one-token attention runs as grouped matrix products instead of sdpa
(:func:`decode_attention_forward`). Both change only q, and only by rounding.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.sampling import NEG_INF

#: FR-Spec's default number of kept head rows.
HEAD_TOKENS = 32_768

#: The optional token-set file beside an exported speculator (:func:`save_head_tokens`).
HEAD_TOKENS_FILE = "head_tokens.json"

#: A quantised layer that kept its dense weight (``dense=True``) uses it for inputs of at least this many rows (a
#: prompt prefill): the weight-only kernels are built for one-token steps and are slower than a dense product on
#: many rows (the 0.5B int4 draft reads a 171-token prompt in 427 ms, the bf16 one in 247 ms, 2 cores).
DENSE_MIN_ROWS = 16


class _DenseForLongInputs:
    """Mixin: an optional reference to the original layer's weight and bias (shared, never copied, not a parameter
    or buffer: the state dict holds only the quantised tensors), used for inputs of ≥ :data:`DENSE_MIN_ROWS` rows."""

    dense_weight: torch.Tensor | None = None
    dense_bias: torch.Tensor | None = None

    def keep_dense(self, linear: nn.Linear):
        self.dense_weight = linear.weight.detach()
        self.dense_bias = None if linear.bias is None else linear.bias.detach()
        return self

    def _dense(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.dense_weight is None or x.numel() < DENSE_MIN_ROWS * x.shape[-1]:
            return None
        return F.linear(x.to(self.dense_weight.dtype), self.dense_weight, self.dense_bias).to(self.out_dtype)


class Int8Linear(_DenseForLongInputs, nn.Module):
    """Weight-only int8 linear layer: ``y = x · (scale[n] · W_int8[n, :])ᵀ + b``.

    Weights are rounded per output row (symmetric: scale = max|W[n, :]| / 127), activations are not quantised.
    The product runs in ``torch._weight_int8pack_mm`` (int8 weights, bfloat16/float16/float32 activations,
    one scale per output row; a CPU and CUDA kernel in torch ≥ 2.4).

    Args (of :meth:`from_linear`):
        linear: the layer to replace; its weight ``[N, K]`` is read, not kept.
        dtype: activation dtype (default the layer's own); the kernel is fast for bfloat16 on CPU and slow for
            float32 (measured 25× slower for a 896 × 4864 layer), so a float32 draft keeps bfloat16 activations
            inside the layer and casts the result back.
    """

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight_int8", weight_int8)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N] activation dtype
        self.register_buffer("bias", bias)  # [N] or None
        self.in_features, self.out_features = weight_int8.shape[1], weight_int8.shape[0]
        self.out_dtype = out_dtype

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype | None = None) -> Int8Linear:
        w = linear.weight.detach().float()  # [N, K]
        act = dtype or (torch.bfloat16 if w.device.type == "cpu" and linear.weight.dtype == torch.float32
                        else linear.weight.dtype)
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
        w_int8 = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        bias = None if linear.bias is None else linear.bias.detach().to(act).clone()
        return cls(w_int8, scales.to(act), bias, linear.weight.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """``[N, K] float32``: the weight the layer computes with (for tests and error bounds)."""
        return self.weight_int8.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (y := self._dense(x)) is not None:
            return y
        shape = x.shape
        a = x.reshape(-1, shape[-1]).to(self.scales.dtype)
        y = torch._weight_int8pack_mm(a, self.weight_int8, self.scales)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, " \
               f"{self.scales.dtype} activations"


class Int4Linear(_DenseForLongInputs, nn.Module):
    """Weight-only int4 linear layer, asymmetric per group of ``group_size`` input columns:
    ``W[n, g·G:(g+1)·G] ≈ (q − 8) · scale[g, n] + zero[g, n]``, q ∈ 0..15 (min/max rounding per group).

    Runs ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (packed int4 weights, bfloat16 activations, a CPU kernel in
    torch ≥ 2.6). Half the bytes of int8 per step; more rounding (16 levels per group instead of 255 per row).
    Args of :meth:`from_linear` as :class:`Int8Linear`; ``group_size`` ∈ {32, 64, 128, 256} must divide K.
    """

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, out_features: int, group_size: int, out_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight_int4", packed)  # kernel-specific packing of [N, K] 4-bit values
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K / G, N, 2] bfloat16
        self.register_buffer("bias", bias)
        self.in_features, self.out_features, self.group_size, self.out_dtype = in_features, out_features, \
            group_size, out_dtype

    @staticmethod
    def fits(linear: nn.Linear, group_size: int = 32) -> bool:
        """Whether the kernel takes this shape (K a multiple of the group size; N of 16, for the packing)."""
        return linear.in_features % group_size == 0 and linear.out_features % 16 == 0 and \
            linear.weight.device.type == "cpu"

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group_size: int = 32) -> Int4Linear:
        w = linear.weight.detach().float()  # [N, K]
        N, K = w.shape
        groups = w.reshape(N, K // group_size, group_size)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(N, K)
        zero = low + 8 * scale  # the kernel computes (q − 8) · scale + zero
        sz = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous()  # [K/G, N, 2]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()
        return cls(packed, sz.to(torch.bfloat16), bias, K, N, group_size, linear.weight.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """``[N, K] float32``: the weight the layer computes with (one identity pass through the kernel)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.scales_and_zeros.device)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight_int4, self.group_size,
                                                          self.scales_and_zeros).float().T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (y := self._dense(x)) is not None:
            return y
        shape = x.shape
        a = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(a, self.weight_int4, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 weights (groups of " \
               f"{self.group_size}), bfloat16 activations"


class TrimmedHead(nn.Module):
    """An output head that scores only ``token_ids`` and returns full-width logits, −inf elsewhere.

    ``forward(h [.., H]) → [.., width]``: ``logits[.., token_ids] = h · W[token_ids]ᵀ (+ b)``, every other id
    −inf (q = 0: never proposed; sampling renormalises over the kept set).
    """

    def __init__(self, head: nn.Module, token_ids: torch.Tensor, width: int):
        super().__init__()
        weight = head.weight.detach()
        self.proj = nn.Linear(weight.shape[1], len(token_ids), bias=getattr(head, "bias", None) is not None,
                              device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(weight[token_ids.to(weight.device)])
            if self.proj.bias is not None:
                self.proj.bias.copy_(head.bias.detach()[token_ids.to(weight.device)])
        self.register_buffer("token_ids", token_ids.to(weight.device, torch.long))  # [N] sorted ids
        self.width = width

    @property
    def out_features(self) -> int:
        return self.width

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kept = self.proj(h)  # [.., N]
        out = kept.new_full((*kept.shape[:-1], self.width), float("-inf"))
        out[..., self.token_ids] = kept
        return out


def rank_tokens(tokenizer, texts: Iterable[str] | None = None, token_lists: Iterable[Sequence[int]] | None = None,
                always: Iterable[int] = ()) -> list[int]:
    """Every id of ``tokenizer``'s vocabulary, most frequent first (FR-Spec's ranking).

    Frequencies are counted over ``texts`` encoded with ``tokenizer`` (no special tokens added) and/or over
    ``token_lists`` (already-encoded ids, e.g. chat-templated prompts or a teacher dump). Ties — in particular
    every id the corpus never shows — are broken by the lower id: byte-level BPE numbers merges in the order it
    learnt them, so a lower id is a more frequent piece of the tokenizer's own training corpus. The tokenizer's
    special tokens and ``always`` rank first (EOS must stay proposable).

    Returns:
        ``len(tokenizer)`` ids.
    """
    counts: Counter[int] = Counter()
    if texts is not None:
        for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
            counts.update(ids)
    for ids in token_lists or ():
        counts.update(int(i) for i in ids)
    vocab = len(tokenizer)
    forced = {i for i in (*tokenizer.all_special_ids, *always) if 0 <= i < vocab}
    return sorted(range(vocab), key=lambda i: (i not in forced, -counts.get(i, 0), i))


def frequent_tokens(tokenizer, texts: Iterable[str] | None = None, n: int = HEAD_TOKENS,
                    token_lists: Iterable[Sequence[int]] | None = None, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``n`` most frequent target-vocabulary ids (FR-Spec's token set; the first ``n`` of :func:`rank_tokens`,
    same arguments), sorted by id.

    Returns:
        ``[min(n, len(tokenizer))] int64`` ids, ascending.
    """
    ranked = rank_tokens(tokenizer, texts, token_lists, always)
    return torch.tensor(sorted(ranked[: min(n, len(ranked))]), dtype=torch.long)


def save_head_tokens(directory: str | Path, ranked: Sequence[int], tokenizer, counted_over: str) -> Path:
    """Write the token ranking beside a speculator (``directory/head_tokens.json``, atomically) so that a later
    ``--draft-head-tokens N`` keeps the N tokens counted where the speculator was made (e.g. the target-written
    answers of its teacher dump) rather than the embedded prompts.

    File: ``{"format": 1, "ranked_token_ids": [ids, most frequent first], "tokenizer_fingerprint": sha256,
    "counted_over": str}`` (fingerprint: :func:`specdraft.vocab.tokenizer_fingerprint`). Returns the path.
    """
    from specdraft.io import atomic_write_text
    from specdraft.vocab import tokenizer_fingerprint

    path = Path(directory) / HEAD_TOKENS_FILE
    atomic_write_text(path, json.dumps({"format": 1, "ranked_token_ids": [int(i) for i in ranked],
                                        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                                        "counted_over": counted_over}))
    return path


def load_head_tokens(directory: str | Path, n: int, tokenizer) -> torch.Tensor | None:
    """The ``n`` most frequent ids of the ranking saved in ``directory`` (:func:`save_head_tokens`), sorted by id;
    ``None`` when the directory holds no such file.

    Raises:
        ValueError: the file was counted with another tokenizer (fingerprints differ), or is not a ranking file.
    """
    from specdraft.vocab import tokenizer_fingerprint

    path = Path(directory) / HEAD_TOKENS_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        ranked = saved["ranked_token_ids"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a specdraft token ranking ({e}); delete it or re-export") from None
    if saved.get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer):
        raise ValueError(f"{path} was counted with another tokenizer than the target's; delete it or re-export")
    return torch.tensor(sorted(ranked[: min(n, len(ranked))]), dtype=torch.long)


def default_head_corpus(tokenizer) -> list[list[int]]:
    """Token ids of the embedded prompt data the presets train on (never the evaluation split): the chat-templated
    ``conversations`` (500 chats) and ``humaneval:0:100`` prompts (:mod:`specdraft.data`)."""
    from specdraft.data import encode_prompts, held_out_offset, load_examples

    examples = load_examples("conversations") + load_examples("humaneval", limit=held_out_offset("humaneval"))
    return encode_prompts(tokenizer, examples)


def trim_head(model: nn.Module, token_ids: torch.Tensor) -> nn.Module:
    """Replace ``model``'s output head by a :class:`TrimmedHead` over ``token_ids`` (in place; tied input
    embeddings keep their full table). Returns the model."""
    head = model.get_output_embeddings()
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"trim the head before quantising it; the draft's head is a {type(head).__name__}")
    width = head.weight.shape[0]
    if int(token_ids.max()) >= width:
        raise ValueError(f"token id {int(token_ids.max())} is past the draft's output head ({width} rows)")
    model.set_output_embeddings(TrimmedHead(head, token_ids, width))
    # The head is no longer the input embedding: transformers must not re-tie it on a later tie_weights() call.
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = {}
    return model


def quantize_int8(model: nn.Module, dense: bool = False) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (a trimmed head's projection included) by :class:`Int8Linear`,
    in place. Embeddings, norms and attention arithmetic keep the model's dtype. ``dense``: each layer keeps a
    reference to its dense weight for long inputs (:data:`DENSE_MIN_ROWS`). Returns the model."""
    return _replace_linears(model, Int8Linear.from_linear, dense)


def quantize_int4(model: nn.Module, group_size: int = 32, dense: bool = False) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by :class:`Int4Linear` (groups of ``group_size``), in place; a layer
    whose shape the int4 kernel does not take becomes :class:`Int8Linear`. ``dense`` as :func:`quantize_int8`.
    Returns the model."""
    return _replace_linears(model, lambda lin: Int4Linear.from_linear(lin, group_size)
                            if Int4Linear.fits(lin, group_size) else Int8Linear.from_linear(lin), dense)


def _replace_linears(model: nn.Module, make, dense: bool = False) -> nn.Module:
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                q = make(child)
                setattr(module, child_name, q.keep_dense(child) if dense else q)
    return model


#: The attention implementation a prepared draft uses (:func:`use_decode_attention`).
DECODE_ATTENTION = "specdraft_decode"


def decode_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers attention function: one query token by grouped matrix products, anything else by ``sdpa``.

    At one query token on CPU, ``torch.nn.functional.scaled_dot_product_attention`` costs 121 µs for the 0.5B Qwen
    draft's 14 query / 2 key-value heads over 200 cached positions, and this 45 µs (2 cores; 24 layers per step). The
    query heads sharing a key-value head are stacked (``[B, H_kv, H / H_kv, D]``), scored against that head's keys
    once, softmaxed in float32 and applied to its values: ``repeat_kv``'s head order (query head h reads key-value
    head h // (H / H_kv)), without copying the cache. The mask is transformers' sdpa mask (bool, True = attend, or
    additive float, ``[B, 1, 1, L]``), so windows and padding holes are honoured as with sdpa.

    Args/returns as transformers' ``sdpa_attention_forward``: query ``[B, H, q, D]``, key/value
    ``[B, H_kv, L, D]`` → ``([B, q, H, D], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, q_len, D = query.shape
    if q_len != 1 or dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None or \
            kwargs.get("s_aux") is not None or H % key.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads = key.shape[1]
    scores = torch.matmul(query.reshape(B, kv_heads, H // kv_heads, D), key.transpose(-1, -2))  # [B, H_kv, g, L]
    scores = scores * (D ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        mask = attention_mask[..., -key.shape[2]:]
        scores = scores.masked_fill(~mask, NEG_INF) if mask.dtype == torch.bool else scores + mask
    probs = scores.float().softmax(dim=-1).to(value.dtype)
    return torch.matmul(probs, value).reshape(B, 1, H, D), None


def use_decode_attention(model: nn.Module) -> bool:
    """Switch ``model`` (in place) from ``sdpa`` to :func:`decode_attention_forward` (registered with transformers'
    ``AttentionInterface`` and, for its masks, ``AttentionMaskInterface`` as sdpa's). Models on another
    implementation are left alone. Returns whether it switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(DECODE_ATTENTION, decode_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, sdpa_mask)
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) == "sdpa":
            cfg._attn_implementation = DECODE_ATTENTION
    return True


def prepare_draft(draft: nn.Module, quantization: str | None = None, head_tokens: torch.Tensor | None = None,
                  copy_model: bool = True, dense_prefill: bool | None = None) -> nn.Module:
    """The draft with the requested transforms (module docstring), on a copy unless ``copy_model=False``.

    The copy is a new module tree that shares the draft's tensors: the transforms never write into a tensor, they
    replace modules (a quantised layer holds new int8/int4 buffers, a trimmed head a copy of its rows), so the
    original draft is unchanged and only what differs costs memory (an int4 0.5B draft: ~0.25 GB, not another 1 GB).
    Do not train the copy in place.

    Args:
        draft: a causal LM (eval mode).
        quantization: ``None``, ``"int8"`` (:class:`Int8Linear`) or ``"int4"`` (:class:`Int4Linear`, groups of 32; a
            layer :meth:`Int4Linear.fits` refuses becomes int8); :data:`specdraft.config.DraftQuantization`.
        head_tokens: ``[N] int64`` target ids the draft keeps in its head (:func:`frequent_tokens`), or ``None``.
        dense_prefill: quantised layers keep a reference to their dense weights and use them for inputs of
            ≥ :data:`DENSE_MIN_ROWS` rows (the prompt prefill; one-token steps stay quantised). Default: with
            ``copy_model`` (the copy shares the draft's weights, so this costs no memory while the caller keeps the
            draft); off without it (it would keep the dense weights alive). Only q changes: decoding stays lossless.
            The prepared draft also runs one-token attention as :func:`decode_attention_forward` (a model on sdpa).

    Raises:
        ValueError: an unknown quantization, or a token id past the draft's head.
    """
    if quantization not in (None, "int8", "int4"):
        raise ValueError(f"unknown draft quantization {quantization!r}; known: int8, int4")
    if quantization is None and head_tokens is None:
        return draft
    if copy_model:
        shared = {id(t): t for t in (*draft.parameters(), *draft.buffers())}  # deepcopy's memo: keep these as they are
        model = copy.deepcopy(draft, shared)
    else:
        model = draft
    dense = copy_model if dense_prefill is None else dense_prefill
    use_decode_attention(model)
    if head_tokens is not None:
        trim_head(model, head_tokens)
    if quantization == "int8":
        quantize_int8(model, dense=dense)
    elif quantization == "int4":
        quantize_int4(model, dense=dense)
    return model.eval()


def describe_draft(draft: nn.Module) -> dict[str, Any]:
    """What was done to a draft: ``{"quantization": "int8" | None, "head_tokens": N | None}``."""
    head = draft.get_output_embeddings()
    kinds = {type(m) for m in draft.modules()}
    quantized = "int4" if Int4Linear in kinds else "int8" if Int8Linear in kinds else None
    return {"quantization": quantized,
            "head_tokens": len(head.token_ids) if isinstance(head, TrimmedHead) else None}
