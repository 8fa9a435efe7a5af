"""The serving filter and the logits alignment that decoding, α and the losses share.

The filter is temperature → top-k → renormalise → top-p (vLLM's and transformers' order); :func:`align_logits`
brings logits to the target's width with padding rows at zero probability; :func:`final_logit_ops` redoes an
architecture's post-head transforms bit for bit. Width and context checks live here too.
Derivations: docs/architecture.md#specdraftcoresampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


#: Candidates read by the full-vocabulary top-p filter before it falls back to more (:func:`_top_p_threshold`).
NUCLEUS_CANDIDATES = 1024


def nucleus_threshold(sorted_logits: torch.Tensor, top_p: float, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Smallest logit top-p keeps, from logits sorted descending ``[..., K]`` → ``[..., 1]``; mass renormalised
    over the K given unless ``probs [..., K]`` (their share of a wider vocabulary) is given."""
    if probs is None:
        probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = mass_before < top_p
    keep[..., 0] = True
    last = keep.sum(dim=-1, keepdim=True) - 1
    return sorted_logits.gather(-1, last)


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature → top-k → renormalise → top-p on ``logits [..., V]`` (any float) → ``[..., V] float32``,
    ``-inf`` outside the kept set. Ties at the k-th value are all kept (transformers' ``TopKLogitsWarper``).

    ``temperature`` > 0; ``top_k`` 0 and ``top_p`` 1 disable their filter.

    Raises:
        ValueError: temperature <= 0, top_k < 0 or top_p outside (0, 1].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for a filtered distribution (got {temperature}); "
                         "temperature 0 means greedy decoding, which takes the argmax.")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        top_vals = torch.topk(x, top_k, dim=-1).values  # [..., k], descending
        threshold = top_vals[..., -1:]
        if top_p < 1.0:
            threshold = torch.maximum(threshold, nucleus_threshold(top_vals, top_p))
        return x.masked_fill(x < threshold, NEG_INF)
    if top_p < 1.0:
        return x.masked_fill(x < _top_p_threshold(x, top_p), NEG_INF)
    return x


@torch.no_grad()
def _top_p_threshold(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus threshold of ``x [..., V]`` → ``[..., 1]`` without a full sort: exact, from the top K
    candidates, 8× more where they hold less than ``top_p`` (float64 masses)."""
    vocab = x.shape[-1]
    log_norm = torch.logsumexp(x.double(), dim=-1, keepdim=True)
    k = min(NUCLEUS_CANDIDATES, vocab)
    while True:
        top = torch.topk(x, k, dim=-1).values  # [..., k], descending
        probs = (top.double() - log_norm).exp()
        if k == vocab or bool((probs.sum(dim=-1) >= top_p).all()):
            return nucleus_threshold(top, top_p, probs)
        k = min(k * 8, vocab)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One inverse-CDF draw per row of ``probs [..., V]`` (non-negative, unnormalised) → ``[...] int64``; the law
    of ``torch.multinomial(probs, 1)``. ``u [..., 1] float64`` in [0, 1) replaces ``generator``'s uniforms.

    Raises:
        ValueError: a row holding NaN or inf, or summing to 0.
    """
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[..., -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("sample: a distribution holds NaN or inf, or no mass: a model's logits are not finite "
                         "(e.g. float16 activations that overflow); load it in bfloat16 or float32")
    if u is None:
        u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device)
    # u < 1, but u · total may round up to total: stay strictly below it, so the id found has positive mass.
    v = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True).squeeze(-1)


def filtered_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``softmax(filter_logits(...))``: the distribution a sampler draws from, ``[..., V] float32``, sums to 1."""
    return filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)


def greedy_probs(logits: torch.Tensor) -> torch.Tensor:
    """One-hot distribution at the argmax ``[..., V] float32`` (the 'distribution' of greedy decoding)."""
    return F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()


def output_width(model) -> int:
    """Rows of ``model``'s output head (its logits' width; ``out_features`` for an int8 or trimmed head)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else int(head.out_features)


def input_width(model) -> int:
    """Rows of ``model``'s input embedding: the ids it can read."""
    return int(model.get_input_embeddings().weight.shape[0])


def token_width_problem(ids, models, what: str = "input_ids") -> str | None:
    """Why ``ids`` (a tensor of any shape, or id sequences) cannot go through ``models``, or ``None``: an id must
    lie below each model's embedding and head rows. ``models``: ``[(name, model | (embedding rows, head rows))]``.
    Returns one line naming the offending ids (at most 10) and the widths, with the fixes."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.cat([torch.zeros(0, dtype=torch.long), *(torch.tensor(list(seq), dtype=torch.long) for seq in ids)])
    ids = ids.reshape(-1)
    for name, model in models:
        emb, head = model if isinstance(model, tuple) else (input_width(model), output_width(model))
        bad = torch.unique(ids[(ids >= min(emb, head)) | (ids < 0)]).tolist() if ids.numel() else []
        if bad:
            shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            return (f"{what} hold token ids the {name} cannot read or score: {shown} (its input embedding has {emb} "
                    f"rows, its output head {head}). Tokens added to the tokenizer after the {name} was made? Resize "
                    "its embeddings (model.resize_token_embeddings(len(tokenizer))) and train them, or keep those "
                    "tokens out of the prompts.")
    return None


class TokenWidthError(ValueError):
    """Token ids past a model's input embedding or output head (:func:`check_token_ids`)."""


def check_token_ids(ids, models, what: str = "input_ids", error: type[Exception] = TokenWidthError) -> None:
    """Raise ``error`` (:class:`TokenWidthError` by default) with :func:`token_width_problem`'s message, if any."""
    if (problem := token_width_problem(ids, models, what)) is not None:
        raise error(problem)


class ContextWindowError(ValueError):
    """A sequence longer than a model's position range (:func:`check_context`)."""


def context_window(model_or_config) -> int | None:
    """The most positions a model reads (``max_position_embeddings``, GPT-2's ``n_positions``), or ``None``.
    A sliding window is no bound: the attention mask applies it alike in training and serving."""
    cfg = getattr(model_or_config, "config", model_or_config)
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def context_problem(positions: int, models, what: str, fix: str) -> str | None:
    """The one window rule: why a pass over ``positions`` (decoding: prompt + new tokens + γ + 1) does not fit
    ``models`` (``[(name, model | config | window int | None)]``), or ``None``. Returns
    ``"{what} exceeds the {name}'s context window ({window}); {fix}"``."""
    for name, m in models:
        if m is None:
            continue
        window = m if isinstance(m, int) else context_window(m)
        if window is not None and positions > window:
            return f"{what} exceeds the {name}'s context window ({window}); {fix}"
    return None


def check_context(positions: int, models, what: str, fix: str, error: type[Exception] = ContextWindowError) -> None:
    """Raise ``error`` (:class:`ContextWindowError` by default) with :func:`context_problem`'s message, if any."""
    if (problem := context_problem(positions, models, what, fix)) is not None:
        raise error(problem)


def check_windows(sequences, models, fix: str, names=None, error: type[Exception] = ContextWindowError) -> None:
    """:func:`check_context` on the longest of ``sequences`` (id lists or lengths), named by ``names[i]`` or index."""
    lengths = [s if isinstance(s, int) else len(s) for s in sequences]
    if not lengths:
        return
    i = max(range(len(lengths)), key=lengths.__getitem__)
    name = repr(str(names[i])) if names is not None else str(i)
    check_context(lengths[i], models, f"sequence {name} ({lengths[i]} tokens)", fix, error)


def align_logits(logits, width: int, real_vocab: int | None = None):
    """``logits [..., V]`` → ``[..., width]`` same dtype: ids ≥ ``real_vocab`` (``len(tokenizer)``; None: none)
    set to ``-inf``, columns dropped or ``-inf``-padded to ``width`` (the target's logits width)."""
    v = logits.shape[-1]
    if real_vocab is not None and real_vocab < v:
        logits = logits.clone()
        logits[..., real_vocab:] = float("-inf")
    if v > width:
        logits = logits[..., :width]
    elif v < width:
        pad = logits.new_full((*logits.shape[:-1], width - v), float("-inf"))
        logits = torch.cat([logits, pad], dim=-1)
    return logits


#: Final-logit transforms of transformers' causal LMs, (config key, op) in the order applied, each in the modeling
#: code's own form (the table of architectures: docs/architecture.md#specdraftcoresampling).
FINAL_LOGIT_KEYS: tuple[tuple[str, str], ...] = (
    ("logit_scale", "mul"),
    ("lm_head_multiplier", "mul"),
    ("logits_scaling", "div"),
    ("final_logit_softcapping", "softcap"),
)
#: Architectures that use one of those keys with another operation.
FINAL_LOGIT_OVERRIDES: dict[tuple[str, str], str] = {("hyperclovax", "logits_scaling"): "mul"}


def final_logit_ops(config) -> list[dict]:
    """The transforms after ``config``'s output head: ``[{"op", "key", "value"}]`` in order (JSON-ready)."""
    model_type = getattr(config, "model_type", None)
    ops = []
    for key, op in FINAL_LOGIT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            ops.append({"op": FINAL_LOGIT_OVERRIDES.get((model_type, key), op), "key": key, "value": value})
    return ops


def apply_final_logit_ops(logits: torch.Tensor, ops) -> torch.Tensor:
    """Apply :func:`final_logit_ops` ``ops`` to ``lm_head(h) [..., V]`` in its dtype.

    Raises:
        ValueError: an unknown operation (a manifest of a newer specdraft).
    """
    for o in ops or ():
        v = o["value"]
        if o["op"] == "mul":
            logits = logits * v
        elif o["op"] == "div":
            logits = logits / v
        elif o["op"] == "softcap":  # three steps, as Gemma's code: one fused expression could round differently
            logits = logits / v
            logits = torch.tanh(logits)
            logits = logits * v
        else:
            raise ValueError(f"unknown final-logit operation {o['op']!r}")
    return logits
