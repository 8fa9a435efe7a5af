"""The target as a teacher: one forward pass per batch gives its signal, exact hidden states or top-k log-probs.

:class:`Teacher` captures the input of the target's output head and checks, every batch, that the head and the
architecture's final-logit transforms reproduce the target's own logits bit for bit; :func:`signal_rows` turns a batch
of sequences into the rows a shard stores (:mod:`specdraft.training.dump` writes them, :func:`teacher_items` gives them to
on-policy distillation without a file). The formats and the cut rule: docs/architecture.md#specdrafttrainingdump.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdraft.core.sampling import apply_final_logit_ops, final_logit_ops
from specdraft.models.dump_reader import DumpError, find_final_norm
from specdraft.models.loading import takes_logits_to_keep
from specdraft.models.tokenizer_view import tokenizer_view

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from specdraft.core.config import DumpConfig
    from specdraft.data.sources import TokenSequence

#: Storage dtypes of a top-k dump's tensors (the manifest's ``dtype``). Log-probs in float32, the dtype they are
#: computed in: a narrower one would make and break ties at the serving cut (the cut rule: docs/architecture.md).
TOPK_STORAGE = {"topk_logprobs": "float32", "topk_ids": "int32", "leftover_logmass": "float32"}
# Bytes of float32 logits materialised at once when computing top-k (positions per chunk = this / V).
_LOGIT_CHUNK_BYTES = 256 * 1024 * 1024


def real_vocab_size(tokenizer) -> int:
    """Ids below this are tokens; the rest (GGUF ``[PAD<id>]`` placeholders, holes) are padding rows."""
    return int(tokenizer_view(tokenizer).real)


def _capture_module(model):
    """The module whose output is captured: the base model, whose last hidden state feeds ``lm_head``."""
    base = model.base_model
    if base is model:
        raise DumpError(f"{type(model).__name__} has no separate base model to capture hidden states from")
    return base


class Teacher:
    """The target plus a capture of its output head's input, checked against its own logits every batch.

    The teacher is ``apply_final_logit_ops(lm_head(h), ops)``; every batch requires the target's last-position
    logits to **equal** it, bit for bit (the hidden format is exact): a capture that is not the head's input is
    refused too.
    """

    def __init__(self, model, real_vocab: int):

        self.model = model
        head = model.get_output_embeddings()
        self.weight, self.bias = head.weight, getattr(head, "bias", None)
        self.width = int(self.weight.shape[0])
        self.real_vocab = min(real_vocab, self.width)
        self.capture = _capture_module(model)
        self.ops = final_logit_ops(model.config)  # [{"op", "key", "value"}]: the manifest's "logit_transform"
        self.norm = None  # the final norm, when specdraft has to apply it
        self.final_norm = "model"  # "model": captured states are the head's input; "applied": norm applied here
        self.checked = False  # set once a batch has confirmed that the recorded teacher equals the logits
        self.keep_arg = takes_logits_to_keep(model)
        self.device = next(model.parameters()).device

    def logits(self, h):
        """``h [..., H]`` → the target's logits ``[..., V]`` in its dtype: head, then the final-logit ops."""
        import torch.nn.functional as F


        return apply_final_logit_ops(F.linear(h, self.weight, self.bias), self.ops)

    def _difference(self, h, ref) -> float | None:
        """``None`` when :meth:`logits` of the last ``ref.shape[1]`` positions of ``h`` equal ``ref`` exactly
        (the same operations on the same tensors: no rounding to excuse), else the max relative difference."""
        mine = self.logits(h[:, -ref.shape[1]:])
        if mine.dtype == ref.dtype and mine.shape == ref.shape and bool((mine == ref).all()):
            return None
        return float(((mine.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).detach())

    def _non_finite(self, what: str) -> DumpError:
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return DumpError(f"the target ({type(self.model).__name__}, {dtype}) gave non-finite {what} (NaN or inf): its "
                         "activations overflow in this dtype or its weights are not finite. Nothing of this batch is "
                         "stored (a dump of NaNs would train the draft on nothing); dump with --dtype bfloat16 or "
                         "float32.")

    def _refusal(self, err: float) -> DumpError:
        applied = ", ".join(f"{o['op']} {o['key']}={o['value']}" for o in self.ops) or "none"
        hints = sorted(k for k, v in vars(self.model.config).items()
                       if "logit" in k and isinstance(v, (int, float)) and not isinstance(v, bool)
                       and k not in {o["key"] for o in self.ops})
        hint = f"; config keys that may name another one: {', '.join(hints)}" if hints else ""
        return DumpError(
            f"lm_head(h) with this architecture's known final-logit transforms ({applied}) does not reproduce "
            f"{type(self.model).__name__}'s own logits (max relative difference {err:.3g}){hint}: it transforms "
            "its logits in a way the dump does not record, so no exact teacher can be stored. Refusing rather "
            "than storing a near match.")

    def hidden(self, ids, attn):
        """``ids, attn [B, S]`` → ``h [B, S, H]``, the input of the output head (model dtype)."""
        import torch

        box: dict[str, Any] = {}

        def hook(_mod, _args, out):
            box["h"] = out if isinstance(out, torch.Tensor) else out[0]

        handle = self.capture.register_forward_hook(hook)
        try:
            with torch.no_grad():
                kw = {"logits_to_keep": 1} if self.keep_arg else {}
                out = self.model(input_ids=ids, attention_mask=attn, use_cache=False, **kw)
        finally:
            handle.remove()
        h = box["h"]
        ref = out.logits  # [B, 1, V] (all positions without logits_to_keep), the model's dtype
        if not bool(torch.isfinite(h[attn.bool()]).all()):  # real positions only: padding is never stored as signal
            raise self._non_finite("hidden states")
        if bool((torch.isnan(ref) | torch.isposinf(ref)).any()):  # else the exactness check reports a NaN difference
            raise self._non_finite("logits")
        with torch.no_grad():
            if self.norm is not None:
                h = self.norm(h)
            err = self._difference(h, ref)
            if err is not None and not self.checked:  # first batch: perhaps the capture is before the final norm
                norm = find_final_norm(self.model)
                if norm is None:
                    raise DumpError(
                        f"the captured hidden states do not reproduce the target's logits (max relative difference "
                        f"{err:.3g}) and the model has no final norm to apply: a pre-norm capture cannot give exact "
                        "teacher logits, in either format.")
                if self._difference(norm(h), ref) is None:
                    self.norm, self.final_norm = norm, "applied"
                    h, err = norm(h), None
            if err is not None:
                raise self._refusal(err)
        self.checked = True
        return h

    def topk(self, h, k: int):
        """``h [N, H]`` → ``(logprobs [N, k] float32, ids [N, k] int64, leftover [N] float32)``, padding masked."""
        import torch

        chunk = max(1, _LOGIT_CHUNK_BYTES // (4 * self.width))
        lps, ids, left = [], [], []
        with torch.no_grad():
            for s in range(0, h.shape[0], chunk):
                logits = self.logits(h[s:s + chunk]).float()  # [n, V]
                if self.real_vocab < self.width:
                    logits[:, self.real_vocab:] = float("-inf")
                lse = logits.logsumexp(dim=-1, keepdim=True)  # [n, 1]
                top = logits.topk(k, dim=-1)
                lps.append(top.values - lse)
                ids.append(top.indices)
                rest = logits.scatter(-1, top.indices, float("-inf"))
                left.append(rest.logsumexp(dim=-1) - lse[:, 0])
                if not bool(torch.isfinite(lps[-1]).all()) or bool(torch.isnan(left[-1]).any()):
                    raise self._non_finite("logits")  # a logit of inf (head overflow) makes every log-prob NaN
        return torch.cat(lps), torch.cat(ids), torch.cat(left)


@dataclass
class Row:
    """One sequence and its teacher signal, as a shard stores them."""

    seq: TokenSequence
    signal: dict[str, torch.Tensor]  # per-format tensors of this row, CPU, storage dtypes

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.signal.values()) + 5 * len(self.seq.ids)


def signal_rows(teacher: Teacher, seqs: list[TokenSequence], config: DumpConfig) -> list[Row]:
    """One right-padded forward over ``seqs`` → per-row teacher signal in storage dtypes, on the CPU."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    if not seqs:
        return []
    ids = pad_sequence([torch.tensor(q.ids, dtype=torch.long) for q in seqs], batch_first=True, padding_side="right")
    attn = pad_sequence([torch.ones(len(q.ids), dtype=torch.long) for q in seqs], batch_first=True,
                        padding_side="right")
    # Right padding: each real position attends only to the real tokens before it, at its own position id,
    # so a row's values do not depend on what else is in the batch.
    h = teacher.hidden(ids.to(teacher.device), attn.to(teacher.device))  # [B, S, H]
    lens = [len(q.ids) for q in seqs]
    if config.teacher_format == "hidden":
        dt = getattr(torch, config.hidden_dtype)
        stored = h.to(device="cpu", dtype=dt)
        if not bool(torch.isfinite(stored[attn.bool()]).all()):  # finite in the model's dtype (checked), not in dt
            raise DumpError(f"the target's hidden states overflow --hidden-dtype {config.hidden_dtype} (|h| up to "
                            f"{float(h[attn.to(h.device).bool()].abs().max()):.4g}); store them in bfloat16 or float32.")
        return [Row(q, {"hidden": stored[i, :n]}) for i, (q, n) in enumerate(zip(seqs, lens))]
    flat = h[attn.to(h.device).bool()]  # [N, H], rows in order
    lp, tid, left = teacher.topk(flat, config.top_logprobs)
    rows, a = [], 0
    for q, n in zip(seqs, lens):
        rows.append(Row(q, {name: t[a:a + n].to("cpu", getattr(torch, TOPK_STORAGE[name]))
                             for name, t in (("topk_logprobs", lp), ("topk_ids", tid), ("leftover_logmass", left))}))
        a += n
    return rows


def teacher_items(teacher: Teacher, seqs: list[TokenSequence], config: DumpConfig) -> list[dict[str, Any]]:
    """The teacher signal of ``seqs`` from one target forward pass, as :class:`TeacherDataset` items.

    The code a dump writes its shards with, for sequences that never go to disk (on-policy distillation).

    Args:
        teacher: a :class:`Teacher` around the target.
        seqs: token sequences with their loss masks (:func:`specdraft.data.sources.sequences_from_responses`).
        config: the dump settings the signal follows (``format``, ``hidden_dtype``, ``top_logprobs``): the dump's own.

    Returns:
        Per sequence ``{"id", "input_ids" [S] int64, "loss_mask" [S] bool, "hidden" [S, H] | "topk_logprobs",
        "topk_ids", "leftover_logmass"}``, CPU tensors, as ``TeacherDataset[i]`` gives them.
    """
    import torch

    return [{"id": r.seq.id, "input_ids": torch.tensor(list(r.seq.ids), dtype=torch.long),
             "loss_mask": torch.tensor([bool(m) for m in r.seq.loss_mask], dtype=torch.bool), **r.signal}
            for r in signal_rows(teacher, seqs, config)]
