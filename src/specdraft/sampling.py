"""The serving filter and the logits alignment that decoding, α and the losses share.

The filter: temperature → top-k → renormalise → top-p (the order of vLLM's and transformers' samplers). It always keeps the argmax, its output sums to 1, and with both filters off
it equals the plain softmax at that temperature.

:func:`align_logits` brings a model's logits to the target's width: ``config.vocab_size`` may exceed
``len(tokenizer)`` and differ between two models of one tokenizer (Qwen2.5: 151936 vs 152064); rows past the real
vocabulary are padding and get zero probability.

:func:`final_logit_ops` / :func:`apply_final_logit_ops`: what some architectures do to ``lm_head(h)`` before
returning logits (soft-capping, scaling), read from the config and redone with the model's own operations, so
that logits recomputed from the head's input are the model's, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


#: Candidates read by the full-vocabulary top-p filter before it falls back to more (:func:`_top_p_threshold`).
NUCLEUS_CANDIDATES = 1024


def _nucleus_threshold(sorted_logits: torch.Tensor, top_p: float, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Smallest logit kept by top-p, given logits sorted in descending order ``[..., K]`` → ``[..., 1]``.

    Keeps the smallest prefix whose probability mass reaches ``top_p``: token j is kept when the mass of the
    tokens before it is < ``top_p`` (so the argmax, with zero mass before it, is always kept). The mass is
    renormalised over the K values given (after top-k, as serving stacks do), unless ``probs [..., K]`` — their
    probabilities within a wider vocabulary — is given.
    """
    if probs is None:
        probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = mass_before < top_p
    keep[..., 0] = True
    # keep is a prefix (probs sorted descending), so its count − 1 is the last kept index.
    last = keep.sum(dim=-1, keepdim=True) - 1
    return sorted_logits.gather(-1, last)


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Apply temperature → top-k → renormalise → top-p; return float32 logits with ``-inf`` outside the kept set.

    ``softmax`` of the result is the sampling distribution. Ties at the k-th value are all kept (threshold
    semantics, as transformers' ``TopKLogitsWarper``), so more than k tokens survive on exact ties. A top-k teacher
    dump keeps exactly its k: where this filter keeps its last stored value, the dump cannot tell which unstored
    ids tie with it (:func:`specdraft.distill.cut_ties`; the cut rule of :mod:`specdraft.dump`).

    No full-vocabulary sort: with ``top_k > 0`` the nucleus is taken over the ``torch.topk`` values; with
    ``top_k = 0`` by :func:`_top_p_threshold`.

    Args:
        logits: ``[..., V]`` any float dtype (upcast to float32).
        temperature: > 0 (greedy decoding does not call this function).
        top_k: keep the k largest; 0 disables.
        top_p: nucleus mass in (0, 1]; 1 disables.

    Returns:
        ``[..., V] float32`` filtered, temperature-scaled logits.

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
            threshold = torch.maximum(threshold, _nucleus_threshold(top_vals, top_p))
        return x.masked_fill(x < threshold, NEG_INF)
    if top_p < 1.0:
        return x.masked_fill(x < _top_p_threshold(x, top_p), NEG_INF)
    return x


@torch.no_grad()
def _top_p_threshold(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus threshold of ``x [..., V]`` over the whole vocabulary (``[..., 1]``) without sorting it.

    Exact: the kept prefix ends inside the top K exactly when those K tokens hold at least ``top_p`` of the mass,
    so the threshold found among them is the full sort's; rows where they do not read 8× more candidates, up to
    the whole vocabulary. Masses are float64. The cost against a sort: docs/benchmarks.md, "A cheaper draft — the
    default configuration".
    """
    vocab = x.shape[-1]
    log_norm = torch.logsumexp(x.double(), dim=-1, keepdim=True)
    k = min(NUCLEUS_CANDIDATES, vocab)
    while True:
        top = torch.topk(x, k, dim=-1).values  # [..., k], descending
        probs = (top.double() - log_norm).exp()
        if k == vocab or bool((probs.sum(dim=-1) >= top_p).all()):
            return _nucleus_threshold(top, top_p, probs)
        k = min(k * 8, vocab)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row from ``probs [..., V]`` (non-negative; rows need not sum to 1) → ``[...] int64``.

    Inverse-CDF sampling: u ~ U[0, 1) from ``generator``, then the first id whose cumulative mass (float64) exceeds
    u · total. The distribution is ``torch.multinomial(probs, 1)``'s (the draws from one seed differ; faster:
    docs/benchmarks.md, as :func:`_top_p_threshold`); ids of zero probability are never drawn. ``u``
    (``[..., 1] float64`` in [0, 1)) gives the uniforms instead of ``generator`` (the decode loop's per-row streams).

    Raises:
        ValueError: a row holding NaN or inf, or summing to 0 (no id could be drawn).
    """
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[..., -1:]
    # A NaN/inf or empty row would be "drawn" as an id past the vocabulary (an IndexError later): refuse it here.
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
    """Rows of ``model``'s output head (its logits' width): ``config.vocab_size`` as loaded, which may exceed
    ``len(tokenizer)``. Reads ``out_features`` where a head keeps no float weight (an int8 or trimmed draft head,
    :mod:`specdraft.draft_model`)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else int(head.out_features)


def input_width(model) -> int:
    """Rows of ``model``'s input embedding: the ids it can read."""
    return int(model.get_input_embeddings().weight.shape[0])


def token_width_problem(ids, models, what: str = "input_ids") -> str | None:
    """Why ``ids`` cannot go through ``models``, or ``None`` when every id fits.

    An id must be below each model's input embedding rows and output head rows: past either, torch fails later
    with an ``IndexError`` inside the model, or a width that cannot be aligned.

    Args:
        ids: a tensor of token ids (any shape; only the ids that count, e.g. ``input_ids[attention_mask == 1]``), or
            an iterable of id sequences.
        models: ``[(name, model), ...]`` (``"target"``, ``"draft"``), or ``[(name, (embedding rows, head rows))]``
            for a model not loaded yet.
        what: what ``ids`` are, for the message.

    Returns:
        one line naming the offending ids (at most 10, then a count) and the widths, with the fixes.
    """
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
    """The most positions a model reads: its position table (``max_position_embeddings``, GPT-2's ``n_positions``)
    from its (text) config, or ``None`` when the config names none.

    Past it an absolute position table fails with an ``IndexError`` (a device assert on CUDA) and rotary positions
    extrapolate silently to where the model was never trained. A sliding window is no bound here: a teacher-forced
    or decoded pass applies it through the attention mask, the same in training as in serving (decoding refuses
    only batches whose holes would shift it, :func:`specdraft.decode.speculative_generate`).
    """
    cfg = getattr(model_or_config, "config", model_or_config)
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def context_problem(positions: int, models, what: str, fix: str) -> str | None:
    """Why a pass over ``positions`` positions does not fit ``models``, or ``None``: the one window rule of decoding,
    dump, distillation, the headroom forecast and replay.

    Args:
        positions: the positions the pass reads (a teacher-forced sequence: its length; decoding: prompt + new
            tokens + γ + 1).
        models: ``[(name, model | config | window int | None), ...]``; ``None`` entries are skipped.
        what: what needs them, naming the length (``"sequence 'a' (40 tokens)"``).
        fix: how to make it fit (the flag to lower).

    Returns:
        ``"{what} exceeds the {name}'s context window ({window}); {fix}"`` for the first model it does not fit.
    """
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
    """Refuse, before any pass, teacher-forced ``sequences`` of which the longest exceeds a model's context window
    (:func:`check_context`), naming that sequence (``names[i]``, else its index), its length and the window.

    Args:
        sequences: token id lists (or their lengths as ints), each read in one pass from position 0.
        models / fix / error: as :func:`check_context`.
    """
    lengths = [s if isinstance(s, int) else len(s) for s in sequences]
    if not lengths:
        return
    i = max(range(len(lengths)), key=lengths.__getitem__)
    name = repr(str(names[i])) if names is not None else str(i)
    check_context(lengths[i], models, f"sequence {name} ({lengths[i]} tokens)", fix, error)


def align_logits(logits, width: int, real_vocab: int | None = None):
    """Bring draft (or target) logits to the target's vocabulary width, masking padding rows.

    Ids at or past ``real_vocab`` get ``-inf`` (the module docstring's padding rule); columns are dropped or
    ``-inf``-padded to ``width``.

    Args:
        logits: ``[..., V] float`` logits of one model.
        width: the width wanted (the target's ``config.vocab_size`` / logits width).
        real_vocab: ``len(tokenizer)``; ids ``>= real_vocab`` are masked. ``None`` masks nothing.

    Returns:
        ``[..., width]`` logits, same dtype; a view-free new tensor only when something changes.
    """
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


#: Final-logit transforms of transformers' causal LMs, as (config key, operation), in the order they apply. Each
#: operation is the modeling code's own, in the logits' dtype (so the result is the model's bit for bit):
#: ``mul``: ``logits * v`` (Cohere, Cohere2 ``logit_scale``; Falcon-H1 ``lm_head_multiplier``);
#: ``div``: ``logits / v`` (Granite, GraniteMoE ``logits_scaling``);
#: ``softcap``: ``tanh(logits / v) * v`` (Gemma 2/3, VaultGemma, nanochat ``final_logit_softcapping``).
#: A key that is absent or ``None`` does nothing. Any other transform is not known here: a caller that needs
#: exact logits compares against the model's own and refuses a mismatch (``specdraft.dump``).
FINAL_LOGIT_KEYS: tuple[tuple[str, str], ...] = (
    ("logit_scale", "mul"),
    ("lm_head_multiplier", "mul"),
    ("logits_scaling", "div"),
    ("final_logit_softcapping", "softcap"),
)
#: Architectures that use one of those keys with another operation (HyperCLOVA X multiplies by logits_scaling).
FINAL_LOGIT_OVERRIDES: dict[tuple[str, str], str] = {("hyperclovax", "logits_scaling"): "mul"}


def final_logit_ops(config) -> list[dict]:
    """The transforms a model applies after its output head, from its config: ``[{"op", "key", "value"}]`` in
    the order applied (empty for most architectures). JSON-ready: a dump's manifest records it."""
    model_type = getattr(config, "model_type", None)
    ops = []
    for key, op in FINAL_LOGIT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            ops.append({"op": FINAL_LOGIT_OVERRIDES.get((model_type, key), op), "key": key, "value": value})
    return ops


def apply_final_logit_ops(logits: torch.Tensor, ops) -> torch.Tensor:
    """Apply :func:`final_logit_ops` ``ops`` to ``lm_head(h)`` ``[..., V]``, in its dtype (as the model does).

    Raises:
        ValueError: an operation this version does not know (e.g. a manifest written by a newer specdraft).
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
