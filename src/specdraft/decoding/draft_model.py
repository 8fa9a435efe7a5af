"""A cheaper draft: transforms applied to the draft model before it drafts. Each changes only q.

Speculative decoding is exact for any q (Leviathan et al. 2023, Theorem 3.5), so a cheaper draft can lower
acceptance but never changes the output. :func:`prepare_draft` applies a trimmed output head (FR-Spec, Zhao et al.
2025: the N most frequent target tokens, every other q = 0) and weight-only int8 / int4 linear layers; a prepared
copy prefills dense and runs one-token attention as grouped matrix products (:func:`decode_attention_forward`).
Kernels and evidence: docs/architecture.md#specdraftdecodingdraft_model.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.core.config import EvalConfig
from specdraft.core.io import atomic_write_text
from specdraft.core.sampling import NEG_INF
from specdraft.data.sources import encode_prompts, held_out_offset, load_examples
from specdraft.decoding.decode import DecodeError
from specdraft.models.tokenizer_view import tokenizer_fingerprint

#: FR-Spec's default number of kept head rows.
HEAD_TOKENS = 32_768

#: ``draft_quantization="auto"`` trims a same-tokenizer draft's head of at least this many rows.
AUTO_HEAD_MIN_ROWS = 2 * HEAD_TOKENS

#: The optional token-set file beside an exported speculator (:func:`save_head_tokens`).
HEAD_TOKENS_FILE = "head_tokens.json"
#: Version of that file's layout (a new one re-runs the pipeline's export).
HEAD_TOKENS_FORMAT = 1

#: Rows from which a quantised layer with ``dense=True`` uses its dense weight (a prefill: the kernels are slower).
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
    """Weight-only int8 linear layer: ``y = x · (scale[n] · W_int8[n, :])ᵀ + b``, symmetric per output row
    (scale = max|W[n, :]| / 127), run by ``torch._weight_int8pack_mm``. :meth:`from_linear` reads ``linear``'s
    ``[N, K]`` weight; ``dtype`` is the activation dtype (bfloat16 for a float32 layer on CPU), cast back after."""

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
    """Weight-only int4 linear layer, asymmetric per group of ``group_size`` ∈ {32, 64, 128, 256} input columns
    (dividing K): ``W ≈ (q − 8) · scale[g, n] + zero[g, n]``, q ∈ 0..15; run by
    ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (bfloat16 activations)."""

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
    """Output head scoring only ``token_ids``: ``forward(h [.., H]) → [.., width]``, −inf (q = 0) elsewhere."""

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
    """Every id of ``tokenizer``'s vocabulary, most frequent first over ``texts`` / ``token_lists`` (FR-Spec's
    ranking); special tokens and ``always`` first, unseen ids by ascending id. Returns ``len(tokenizer)`` ids."""
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
    """The ``n`` first ids of :func:`rank_tokens` (same arguments) → ``[min(n, len(tokenizer))] int64``, ascending."""
    ranked = rank_tokens(tokenizer, texts, token_lists, always)
    return torch.tensor(sorted(ranked[: min(n, len(ranked))]), dtype=torch.long)


def save_head_tokens(directory: str | Path, ranked: Sequence[int], tokenizer, counted_over: str) -> Path:
    """Write the ranking to ``directory/head_tokens.json`` atomically: ``{"format": 1, "ranked_token_ids",
    "tokenizer_fingerprint", "counted_over"}``, so a later ``--draft-head-tokens N`` keeps the same N. Returns the path."""

    path = Path(directory) / HEAD_TOKENS_FILE
    atomic_write_text(path, json.dumps({"format": HEAD_TOKENS_FORMAT, "ranked_token_ids": [int(i) for i in ranked],
                                        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                                        "counted_over": counted_over}))
    return path


def load_head_tokens(directory: str | Path, n: int, tokenizer) -> torch.Tensor | None:
    """The ``n`` most frequent ids of ``directory``'s saved ranking, sorted by id; ``None`` without the file.

    Raises:
        ValueError: counted with another tokenizer (fingerprints differ), or not a ranking file.
    """

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


def head_tokens_info(directory: str | Path, tokenizer=None) -> dict[str, Any] | None:
    """The ranking beside a speculator, for ``specdraft inspect``; ``None`` without the file. Never raises.

    Returns:
        ``{"path", "size", "counted_over", "tokenizer_fingerprint", "tokenizer_matches"`` (None without
        ``tokenizer``), ``"error"}``; with an ``error`` every field but ``path`` is ``None``.
    """

    path = Path(directory) / HEAD_TOKENS_FILE
    if not path.is_file():
        return None
    info: dict[str, Any] = {"path": str(path), "size": None, "counted_over": None, "tokenizer_fingerprint": None,
                            "tokenizer_matches": None, "error": None}
    try:
        saved = json.loads(path.read_text())
        ranked = saved["ranked_token_ids"]
        if not isinstance(ranked, list):
            raise TypeError("ranked_token_ids is not a list")
    except (ValueError, KeyError, TypeError) as e:
        return info | {"error": f"not a specdraft token ranking ({e}); delete it or re-export"}
    fp = saved.get("tokenizer_fingerprint")
    return info | {"size": len(ranked), "counted_over": saved.get("counted_over"), "tokenizer_fingerprint": fp,
                   "tokenizer_matches": None if tokenizer is None else fp == tokenizer_fingerprint(tokenizer)}


@dataclass(frozen=True)
class HeadRanking:
    """Where a trimmed head's tokens came from: ``tokens`` (N kept) of a ranking of ``ranked`` ids, read from
    ``path`` (``head_tokens.json``; ``None``: counted over the embedded prompts), ``counted_over`` in words."""

    tokens: int
    ranked: int
    path: str | None
    counted_over: str

    @property
    def source(self) -> str:
        """``"saved ranking"`` or ``"embedded training prompts"``."""
        return "saved ranking" if self.path else "embedded training prompts"

    def sentence(self) -> str:
        """``"the 50 most frequent of 96 token ids ranked in DIR/head_tokens.json, counted over …"``."""
        where = f" ranked in {self.path}" if self.path else ""
        return f"the {self.tokens:,} most frequent of {self.ranked:,} token ids{where}, counted over {self.counted_over}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"source": self.source}


def default_head_corpus(tokenizer) -> list[list[int]]:
    """Token ids of the embedded prompt data the presets train on (never the evaluation split): the chat-templated
    ``conversations`` (500 chats) and ``humaneval:0:100`` prompts (:mod:`specdraft.data.sources`)."""

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

    Query heads sharing a key-value head are stacked and scored once (``repeat_kv``'s order, no cache copy), softmax
    in float32; the mask is transformers' sdpa mask, so windows and holes hold. Shapes as ``sdpa_attention_forward``:
    query ``[B, H, q, D]``, key/value ``[B, H_kv, L, D]`` → ``([B, q, H, D], None)``.
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
    """The draft with the requested transforms, on a copy sharing its tensors unless ``copy_model=False``.

    Args:
        quantization: :data:`specdraft.core.config.DraftQuantization` (``"int4"``: groups of 32, int8 where refused).
        head_tokens: ``[N] int64`` target ids the head keeps, or ``None``.
        dense_prefill: keep dense weights for inputs of ≥ :data:`DENSE_MIN_ROWS` rows (default: with ``copy_model``).

    Raises:
        ValueError: an unknown quantization, or a token id past the draft's head.
    """
    if quantization not in (None, "none", "auto", "int8", "int4"):
        raise ValueError(f"unknown draft quantization {quantization!r}; known: auto, none, int8, int4")
    if quantization == "auto":  # the layers' half of choose_draft_options (the head is given, or not, by the caller)
        quantization = "int4" if next(draft.parameters()).device.type == "cpu" else None
    quantization = None if quantization == "none" else quantization
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


@dataclass
class DraftPlan:
    """What :func:`choose_draft_options` decided: ``requested``, ``quantization`` (``None`` / ``"int8"`` /
    ``"int4"``), ``head_tokens`` (``None``: full head) and the ``reason``, one line."""

    requested: str
    quantization: str | None
    head_tokens: int | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_draft_options(draft: nn.Module, quantization: str | None = "auto", head_tokens: int | None = None,
                         same_tokenizer: bool = True) -> DraftPlan:
    """The preparation to run: ``quantization`` / ``head_tokens`` as asked, or chosen for ``"auto"``: on CPU int4
    (int8 where refused) and, for a draft of the target's tokenizer with ≥ :data:`AUTO_HEAD_MIN_ROWS` head rows, a
    head of :data:`HEAD_TOKENS`; elsewhere the draft as loaded. ``head_tokens`` 0: off; ``None``: auto's choice.

    Raises:
        ValueError: an unknown quantization.
    """
    if quantization not in (None, "auto", "none", "int8", "int4"):
        raise ValueError(f"unknown draft quantization {quantization!r}; known: auto, none, int8, int4")
    requested = "none" if quantization is None else quantization
    head = draft.get_output_embeddings()
    rows = int(head.weight.shape[0]) if isinstance(getattr(head, "weight", None), torch.Tensor) else 0
    explicit_head = head_tokens if head_tokens else None
    if requested != "auto":
        q = None if requested == "none" else requested
        what = "the draft as loaded" if q is None and explicit_head is None else \
            ", ".join(x for x in (q and f"{q} weight-only layers", explicit_head and f"head of {explicit_head:,} rows")
                      if x)
        return DraftPlan(requested, q, explicit_head, f"as requested (--draft-quantization {requested}): {what}")
    device = next(draft.parameters()).device
    if device.type != "cpu":
        return DraftPlan(requested, None, explicit_head, f"auto on {device.type}: the draft as loaded (the int8/int4 "
                         "weight-only kernels specdraft uses are CPU kernels)")
    parts = [("int4 weight-only layers (int8 where the int4 kernel refuses a shape): a CPU draft step ~0.37x of bf16 "
              "at equal top-1 agreement")]
    if head_tokens is None:
        if not same_tokenizer:
            parts.append("full head (a draft of another tokenizer)")
        elif rows >= AUTO_HEAD_MIN_ROWS:
            head_tokens = min(HEAD_TOKENS, rows)
            parts.append(f"head trimmed to the {head_tokens:,} most frequent of {rows:,} tokens (FR-Spec)")
        else:
            parts.append(f"full head ({rows:,} rows < {AUTO_HEAD_MIN_ROWS:,}: little to trim)")
    elif head_tokens == 0:
        head_tokens = None
        parts.append("full head (--draft-head-tokens 0)")
    else:
        parts.append(f"head of {head_tokens:,} rows (--draft-head-tokens)")
    return DraftPlan(requested, "int4", head_tokens, "auto on CPU: " + "; ".join(parts))


def is_prepared(draft: nn.Module) -> bool:
    """Whether ``draft`` holds any module :func:`prepare_draft` put in (a quantised layer or a trimmed head)."""
    return any(isinstance(m, (Int8Linear, Int4Linear, TrimmedHead)) for m in draft.modules())


@torch.no_grad()
def dense_draft(draft: nn.Module) -> nn.Module:
    """A prepared draft as a plain model of its own class computing the q it drafts with (on a copy; an unprepared
    draft as is): quantised layers → dequantised ``nn.Linear``, a trimmed head → full width with each excluded row the
    mean of the kept rows (never the argmax), ``tie_word_embeddings`` false, attention back to ``sdpa``. Why:
    docs/architecture.md#specdraftdecodingdraft_model."""
    if not is_prepared(draft):
        return draft
    shared = {id(t): t for t in (*draft.parameters(), *draft.buffers())}
    model = copy.deepcopy(draft, shared)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (Int8Linear, Int4Linear)):
                setattr(module, name, _dense_linear(child))
    head = model.get_output_embeddings()
    if isinstance(head, TrimmedHead):
        model.set_output_embeddings(_full_width_head(head))
    if model.get_output_embeddings() is not draft.get_output_embeddings():
        _untie(model)
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) == DECODE_ATTENTION:
            cfg._attn_implementation = "sdpa"
    return model


def _dense_linear(layer: Int8Linear | Int4Linear) -> nn.Linear:
    weight = layer.dequantized_weight().to(layer.out_dtype)  # [N, K]
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device=weight.device,
                      dtype=layer.out_dtype)
    dense.weight.copy_(weight)
    if layer.bias is not None:
        dense.bias.copy_(layer.bias)
    return dense


def _full_width_head(head: TrimmedHead) -> nn.Linear:
    kept = head.proj.weight  # [N, H]
    full = nn.Linear(kept.shape[1], head.width, bias=head.proj.bias is not None, device=kept.device, dtype=kept.dtype)
    full.weight.copy_(kept.float().mean(dim=0).to(kept.dtype).expand(head.width, -1))
    full.weight[head.token_ids] = kept
    if full.bias is not None:
        full.bias.fill_(float(head.proj.bias.float().mean()))
        full.bias[head.token_ids] = head.proj.bias
    return full


def _untie(model: nn.Module) -> None:
    # The head is no longer the input embedding: transformers must not re-tie it on a later tie_weights() call.
    configs = [model.config]
    if hasattr(model.config, "get_text_config"):
        configs.append(model.config.get_text_config(decoder=True))
    for cfg in configs:
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = {}


def describe_draft(draft: nn.Module) -> dict[str, Any]:
    """What was done to a draft, as it ran.

    Returns:
        ``{"quantization": "int4" | "int8" | "int4+int8" | None, "head_tokens": N | None, "layers": {"int4", "int8",
        "dense"}, "int8_fallback_shapes": [[out, in], …], "head_tokens_source": str | None, "head_ranking": dict |
        None}``.
    """
    head = draft.get_output_embeddings()
    counts = {"int4": 0, "int8": 0, "dense": 0}
    int8_shapes: set[tuple[int, int]] = set()
    for m in draft.modules():
        if isinstance(m, Int4Linear):
            counts["int4"] += 1
        elif isinstance(m, Int8Linear):
            counts["int8"] += 1
            int8_shapes.add((m.out_features, m.in_features))
        elif type(m) is nn.Linear:
            counts["dense"] += 1
    quantized = ("int4+int8" if counts["int4"] and counts["int8"] else "int4" if counts["int4"] else
                 "int8" if counts["int8"] else None)
    trimmed = isinstance(head, TrimmedHead)
    return {"quantization": quantized, "head_tokens": len(head.token_ids) if trimmed else None, "layers": counts,
            "int8_fallback_shapes": sorted([list(s) for s in int8_shapes]) if counts["int4"] else [],
            "head_tokens_source": getattr(head, "source", None) if trimmed else None,
            "head_ranking": ranking.to_dict() if trimmed and (ranking := getattr(head, "ranking", None)) else None}


def draft_label(info: dict[str, Any]) -> str:
    """:func:`describe_draft` as a short label: ``"int4 (168/169 layers; 1 int8) + head 32,768"``, ``"as loaded"``."""
    layers = info.get("layers") or {}
    total = sum(layers.values())
    parts = []
    if layers.get("int4"):
        extra = f"; {layers['int8']} int8" if layers.get("int8") else ""
        parts.append(f"int4 ({layers['int4']}/{total} layers{extra})")
    elif layers.get("int8"):
        parts.append(f"int8 ({layers['int8']}/{total} layers)")
    if info.get("head_tokens"):
        parts.append(f"head {info['head_tokens']:,}")
    return " + ".join(parts) or "as loaded (dense)"


def apply_draft_options(draft, tokenizer, config: EvalConfig, vocab_mapping=None, copy_model: bool = True):
    """``config``'s draft options applied (:func:`choose_draft_options`, :func:`prepare_draft`), the
    :class:`DraftPlan` kept as ``specdraft_plan``; a head's ranking from :data:`HEAD_TOKENS_FILE` beside the draft, else
    the embedded training prompts.

    Raises:
        DecodeError: a trimmed head for a draft of another tokenizer.
        ValueError: a saved ranking counted with another tokenizer.
    """

    if config.draft_head_tokens and vocab_mapping is not None:
        raise DecodeError("--draft-head-tokens keeps the most frequent *target* tokens in the draft's head: it needs "
                          "a draft of the target's tokenizer (not --map-vocab)")
    plan = choose_draft_options(draft, config.draft_quantization, config.draft_head_tokens,
                                same_tokenizer=vocab_mapping is None)
    head_ids, ranking = None, None
    if plan.head_tokens is not None:
        path = getattr(draft.config, "_name_or_path", "") or ""
        head_ids = load_head_tokens(path, plan.head_tokens, tokenizer) if Path(path).is_dir() else None
        if head_ids is not None:
            info = head_tokens_info(path) or {}
            ranking = HeadRanking(len(head_ids), info.get("size") or len(head_ids), info.get("path"),
                                  info.get("counted_over") or "an unrecorded source")
        else:
            corpus = default_head_corpus(tokenizer)
            head_ids = frequent_tokens(tokenizer, n=plan.head_tokens, token_lists=corpus)
            ranking = HeadRanking(len(head_ids), len(tokenizer), None, "the embedded training prompts "
                                  f"(conversations + humaneval:0:100, {len(corpus)} prompts)")
    model = prepare_draft(draft, plan.quantization, head_ids, copy_model=copy_model)
    head = model.get_output_embeddings()
    if ranking is not None and hasattr(head, "token_ids"):
        head.ranking, head.source = ranking, ranking.sentence()
    if model is not draft or not copy_model:
        model.specdraft_plan = plan
    return model


def draft_configuration(draft) -> dict[str, Any]:
    """The configuration a report names: :func:`describe_draft` of the model that ran, plus the plan's reason
    (``"reason"``) and its short label (``"label"``)."""
    info = describe_draft(draft)
    plan = getattr(draft, "specdraft_plan", None)
    return info | {"label": draft_label(info), "requested": plan.requested if plan else None,
                   "reason": plan.reason if plan else "the draft as given"}
