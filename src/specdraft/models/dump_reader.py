"""Reading a teacher dump: the manifest, its check, the datasets distillation trains on, their mixes and collation.

The on-disk contract (what each shard holds and how it is checked):
docs/architecture.md#specdrafttrainingdump; :mod:`specdraft.training.dump` writes that layout, this module only reads it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.core.sampling import align_logits, apply_final_logit_ops
from specdraft.models.loading import load_tokenizer
from specdraft.models.tokenizer_view import tokenizer_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    import torch


# 2: the manifest records "logit_transform" (the target's final-logit transforms); 1 had none.
FORMAT_VERSION = 2
#: The manifest's ``teacher.kind`` of a self-teacher dump (:mod:`specdraft.training.self_teacher`).
SELF_TEACHER_KIND = "draft-as-given"
MANIFEST = "manifest.json"
HEAD_FILE = "head.safetensors"
# Names of the final norm module on a base model, tried in order when captured states are pre-norm.


_FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "norm_f", "final_norm")


class DumpError(ValueError):
    """A dump cannot be written, resumed or read (bad input, mismatched partner, corrupt shard)."""


# ------------------------------------------------------------------------------------ reading signals


def teacher_logits_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                               real_vocab: int | None = None, logit_ops=None) -> torch.Tensor:
    """Teacher logits from stored hidden states: ``lm_head(h)`` then the final-logit transforms, in the head's dtype.

    Args:
        hidden: ``[..., H]`` stored hidden states (any float dtype; cast to ``weight.dtype``).
        weight: ``[V, H]`` output-head weight (``TeacherDataset.head()["lm_head.weight"]``).
        bias: ``[V]`` or None.
        real_vocab: ids ``>= real_vocab`` are padding rows and get ``-inf`` (manifest ``real_vocab``).
        logit_ops: the manifest's ``logit_transform`` (:attr:`TeacherDataset.logit_ops`): soft-capping or
            scaling the target applies after its head (:func:`specdraft.core.sampling.final_logit_ops`).

    Returns:
        ``[..., V] float32`` logits; softmax gives p.
    """
    import torch.nn.functional as F


    logits = F.linear(hidden.to(device=weight.device, dtype=weight.dtype), weight, bias)
    logits = apply_final_logit_ops(logits, logit_ops).float()
    if real_vocab is not None and real_vocab < logits.shape[-1]:
        logits[..., real_vocab:] = float("-inf")
    return logits


def teacher_probs_from_topk(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, leftover_logmass: torch.Tensor,
                            vocab_width: int, real_vocab: int | None = None) -> torch.Tensor:
    """A full teacher distribution p̂ from the top-k signal: the leftover mass spread uniformly.

    p̂(x) = p(x) on the k stored ids; every other real-vocabulary id gets ``exp(leftover) / (real_vocab − k)``;
    padding rows (ids ≥ ``real_vocab``) get 0. The result is renormalised to sum to 1 (absorbing the float16
    rounding of the stored log-probs). Why uniform, and the error it bounds: :mod:`specdraft.training.dump`'s leftover rule.

    Args:
        topk_logprobs: ``[..., k]`` float16/float32 log-probabilities, nats.
        topk_ids: ``[..., k]`` int ids.
        leftover_logmass: ``[...]`` log of the mass outside the top-k (``-inf`` when there is none).
        vocab_width: V, the width of the distribution returned (the draft's logits width after alignment).
        real_vocab: ids at or past it are padding (default ``vocab_width``).

    Returns:
        ``[..., V] float32`` probabilities summing to 1.
    """
    import torch

    real = vocab_width if real_vocab is None else min(real_vocab, vocab_width)
    k = topk_ids.shape[-1]
    rest = max(real - k, 0)
    fill = leftover_logmass.float().exp() / rest if rest else torch.zeros_like(leftover_logmass, dtype=torch.float32)
    p = fill[..., None].expand(*fill.shape, vocab_width).clone()  # [..., V]
    if real < vocab_width:
        p[..., real:] = 0.0
    p.scatter_(-1, topk_ids.long(), topk_logprobs.float().exp())
    return p / p.sum(dim=-1, keepdim=True)


def sha256_file(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(16 * 1024 * 1024):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def find_final_norm(model):
    base = model.base_model
    for name in _FINAL_NORM_NAMES:
        mod = getattr(base, name, None)
        if mod is not None and getattr(mod, "weight", None) is not None:
            return mod
    return None


def head_tensors(model) -> dict[str, torch.Tensor]:
    """What turns the base model's last hidden state into logits: lm_head weight (+ bias), final norm weight."""
    head = model.get_output_embeddings()
    out = {"lm_head.weight": head.weight}
    if getattr(head, "bias", None) is not None:
        out["lm_head.bias"] = head.bias
    norm = find_final_norm(model)
    if norm is not None:
        out["final_norm.weight"] = norm.weight
    return {k: v.detach() for k, v in out.items()}


def head_fingerprint(tensors_or_model) -> str:
    """sha256 (hex) of the output head: ``lm_head.weight`` (+ ``lm_head.bias``) and ``final_norm.weight`` —
    names, dtypes, shapes and raw bytes, in that order. Depends on the dtype the target was loaded in (the
    manifest records it), so distillation can check that it uses the very head the dump was made with.

    Args:
        tensors_or_model: a causal LM, or the dict :meth:`TeacherDataset.head` returns.
    """
    import torch

    tensors = tensors_or_model if isinstance(tensors_or_model, dict) else head_tensors(tensors_or_model)
    digest = hashlib.sha256()
    for name in ("lm_head.weight", "lm_head.bias", "final_norm.weight"):
        if name not in tensors:
            continue
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{str(t.dtype).removeprefix('torch.')}:{list(t.shape)};".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def shard_problem(out: Path, rec: dict[str, Any]) -> str | None:
    """Why a recorded shard cannot be trusted (missing, size, sha256), or None."""
    if rec["file"] is None:  # a range whose rows truncation emptied: nothing was written
        return None
    path = out / rec["file"]
    if not path.is_file():
        return f"{rec['file']} is missing"
    size = path.stat().st_size
    if size != rec["bytes"]:
        return f"{rec['file']} has {size} bytes, the record says {rec['bytes']}"
    sha, _ = sha256_file(path)
    if sha != rec["sha256"]:
        return f"{rec['file']} is corrupt: sha256 {sha[:16]}…, the record says {rec['sha256'][:16]}…"
    return None


def answers_written_by(manifest: dict[str, Any]) -> str:
    """Who wrote a dump's trained answers, as its manifest records it: the draft as given (a self-teacher dump), the
    target (a dump with ``generate``), or the data (reference answers and conversations, teacher-forced)."""
    teacher = manifest.get("teacher") or {}
    if teacher.get("kind") == SELF_TEACHER_KIND:
        return f"the draft as given ({teacher.get('ref')})"
    if (manifest.get("config") or {}).get("generate") is not None:
        return "the target"
    return "the data (teacher-forced)"


def load_manifest(dump_dir: str | os.PathLike) -> dict[str, Any]:
    """Read ``DIR/manifest.json`` of a finished dump.

    Raises:
        DumpError: no manifest (not a dump, or a run that has not finished: resume it with the same command).
    """
    path = Path(dump_dir) / MANIFEST
    if not path.is_file():
        partial = sorted(p.name for p in Path(dump_dir).glob("rank-*.json")) if Path(dump_dir).is_dir() else []
        hint = (f" It holds {', '.join(partial)}: an unfinished run — rerun the same command to resume it."
                if partial else "")
        raise DumpError(f"{dump_dir} holds no {MANIFEST}: not a finished teacher dump.{hint}")
    manifest = json.loads(path.read_text())
    if manifest.get("kind") != "specdraft-teacher-dump":
        raise DumpError(f"{path} is not a specdraft teacher-dump manifest")
    return manifest


def verify_dump(dump_dir: str | os.PathLike) -> dict[str, Any]:
    """Check every shard (and the head file) of a finished dump against the manifest's sizes and sha256.

    Returns:
        The manifest.

    Raises:
        DumpError: naming every missing or corrupt file.
    """
    out = Path(dump_dir)
    manifest = load_manifest(out)
    records = list(manifest["shards"]) + ([manifest["head"]] if manifest.get("head") else [])
    problems = [p for rec in records if (p := shard_problem(out, rec))]
    if problems:
        raise DumpError(f"{out}: {len(problems)} of {len(records)} files cannot be trusted: " + "; ".join(problems)
                        + ". Rerun the dump command to redo them.")
    return manifest


# ------------------------------------------------------------------------------------------ the reader


class TeacherDataset:
    """A map-style torch dataset over a finished dump, one sequence per item, memory-mapped shard by shard.

    ``dataset[i]``: ``id`` (str), ``input_ids [S] int64``, ``loss_mask [S] bool`` and ``hidden [S, H]`` (stored
    dtype) or ``topk_logprobs [S, k] float32`` (float16 in older dumps), ``topk_ids [S, k] int32``,
    ``leftover_logmass [S] float32``; only those rows are read. ``DataLoader(ds, collate_fn=pad_collate)`` batches
    them, worker processes included.

    Args:
        dump_dir: the dump directory.
        draft_tokenizer: the draft's tokenizer (object or model reference); a fingerprint other than the
            manifest's is refused unless ``vocab_mapping`` is given.
        vocab_mapping: a :class:`specdraft.models.vocab.VocabMapping` target → draft, kept for the trainer.
        verify: check every shard's sha256 now (:func:`verify_dump`); sizes are always checked.
        prompt_positions: train ``shared_prefix ≤ j < S − 1`` too (:meth:`shared_prefix`): the prompt's
            predictions, whose signal is stored anyway; :meth:`tokens` keeps the stored mask.

    Raises:
        DumpError: no finished dump, a missing or truncated shard (named), a mismatched draft tokenizer
            (both fingerprints printed).
    """

    def __init__(self, dump_dir: str | os.PathLike, draft_tokenizer=None, vocab_mapping=None, verify: bool = False,
                 prompt_positions: bool = False):
        self.dir = Path(dump_dir)
        self.manifest = verify_dump(self.dir) if verify else load_manifest(self.dir)
        self.shards = [s for s in self.manifest["shards"] if s["file"]]
        for s in self.shards:
            path = self.dir / s["file"]
            if not path.is_file() or path.stat().st_size != s["bytes"]:
                raise DumpError(f"{self.dir}: shard {s['file']} is "
                                f"{'missing' if not path.is_file() else 'truncated or altered (size differs)'}; "
                                "rerun the dump command to redo it.")
        self.vocab_mapping = vocab_mapping
        if draft_tokenizer is not None:
            if isinstance(draft_tokenizer, (str, os.PathLike)):

                draft_tokenizer = load_tokenizer(draft_tokenizer)

            fp = tokenizer_fingerprint(draft_tokenizer)
            if fp != self.manifest["tokenizer_fingerprint"] and vocab_mapping is None:
                raise DumpError(
                    f"the draft's tokenizer differs from the target's this dump was made with: draft fingerprint {fp}, "
                    f"dump fingerprint {self.manifest['tokenizer_fingerprint']} (target "
                    f"{self.manifest['target']['ref']}). Ids would mean other strings to the draft; pass a "
                    "vocab_mapping (specdraft.models.vocab.build_vocab_mapping) to train across vocabularies.")
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + s["sequences"])
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}
        self._ids: dict[int, list[str]] = {}
        self.prompt_positions = prompt_positions
        self.shared_tokens = self.shared_prefix() if prompt_positions else 0

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _handles={})  # safe_open handles do not pickle: reopen in each worker

    def _open(self, si: int):
        if si not in self._handles:
            from safetensors import safe_open

            f = safe_open(str(self.dir / self.shards[si]["file"]), framework="pt")
            self._handles[si] = f
            self._offsets[si] = f.get_tensor("offsets").tolist()
            self._ids[si] = json.loads(f.metadata()["specdraft"])["ids"]
        return self._handles[si]

    def __getitem__(self, i: int) -> dict[str, Any]:
        item, (f, a, b) = self._tokens(i)
        for name in self.manifest["dtype"]:
            item[name] = f.get_slice(name)[a:b]
        if self.prompt_positions:
            mask = item["loss_mask"].clone()
            mask[self.shared_tokens:len(mask) - 1] = True
            item["loss_mask"] = mask
        return item

    def tokens(self, i: int) -> dict[str, Any]:
        """``self[i]`` without the teacher signal: ``id``, ``input_ids [S] int64``, ``loss_mask [S] bool`` (reads
        no hidden state: what on-policy distillation needs to find the prompts)."""
        return self._tokens(i)[0]

    def _tokens(self, i: int):
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} outside [0, {len(self)})")
        si = bisect.bisect_right(self._starts, i) - 1
        j = i - self._starts[si]
        f = self._open(si)
        a, b = self._offsets[si][j], self._offsets[si][j + 1]
        item: dict[str, Any] = {"id": self._ids[si][j],
                                "input_ids": f.get_slice("input_ids")[a:b].long(),
                                "loss_mask": f.get_slice("loss_mask")[a:b]}
        return item, (f, a, b)

    def longest(self) -> tuple[str, int]:
        """``(id, tokens)`` of the longest sequence (reads each shard's offsets only): what a model's context window
        must hold to be trained on every sequence."""
        best = ("", 0)
        for si in range(len(self.shards)):
            self._open(si)
            off = self._offsets[si]
            for j in range(len(off) - 1):
                if off[j + 1] - off[j] > best[1]:
                    best = (self._ids[si][j], off[j + 1] - off[j])
        return best

    def shared_prefix(self) -> int:
        """The length in tokens of the longest prefix every sequence of the dump starts with (the chat template's
        system prompt and the user turn's header, when every sequence is a chat); 0 for an empty dump, a lone
        sequence's length for a dump of one. Reads each shard's ``input_ids`` only."""
        first, n = None, 0
        for si in range(len(self.shards)):
            ids = self._open(si).get_tensor("input_ids")
            off = self._offsets[si]
            for j in range(len(off) - 1):
                seq = ids[off[j]:off[j + 1]]
                if first is None:
                    first, n = seq, len(seq)
                    continue
                m = min(n, len(seq))
                differ = (first[:m] != seq[:m]).nonzero()
                n = int(differ[0]) if len(differ) else m
        return n

    def token_ids_from(self, limit: int) -> list[int]:
        """The distinct token ids ≥ ``limit`` in the dump's sequences, ascending (reads each shard's ``input_ids``
        only): what a model of ``limit`` embedding rows could not read."""
        import torch

        found: set[int] = set()
        for si in range(len(self.shards)):
            ids = self._open(si).get_tensor("input_ids")
            found.update(torch.unique(ids[ids >= limit]).tolist())
        return sorted(found)

    @property
    def logit_ops(self) -> list[dict[str, Any]]:
        """The target's final-logit transforms (manifest ``logit_transform``), to apply after the head
        (:func:`teacher_logits_from_hidden`); a format-1 dump predates the field and recorded none."""
        return list(self.manifest.get("logit_transform") or [])

    def head(self) -> dict[str, torch.Tensor]:
        """The target's output head saved with a ``hidden`` dump: ``lm_head.weight [V, H]`` (+ ``lm_head.bias``)
        and ``final_norm.weight``, checked against the manifest's head fingerprint.

        Raises:
            DumpError: a ``topk`` dump (no head needed), or a head file that does not match the fingerprint.
        """
        from safetensors.torch import load_file

        if self.manifest["format"] != "hidden":
            raise DumpError("only hidden dumps carry the output head (top-k dumps store probabilities).")
        tensors = load_file(str(self.dir / HEAD_FILE))
        if head_fingerprint(tensors) != self.manifest["head_fingerprint"]:
            raise DumpError(f"{self.dir / HEAD_FILE} does not match the manifest's head fingerprint.")
        return tensors

    def teacher_probs(self, item: dict[str, Any], head: dict[str, torch.Tensor] | None = None,
                      vocab_width: int | None = None) -> torch.Tensor:
        """p for one item: ``[S, V] float32`` (softmax of ``lm_head(h)``, or the top-k completion).

        Args:
            item: ``self[i]``.
            head: ``self.head()`` (loaded once by the caller; loaded here when None).
            vocab_width: V of the result (default the target's logits width).
        """
        t = self.manifest["target"]
        width = vocab_width or t["vocab_width"]
        if self.manifest["format"] == "hidden":
            head = head if head is not None else self.head()
            logits = teacher_logits_from_hidden(item["hidden"], head["lm_head.weight"], head.get("lm_head.bias"),
                                                t["real_vocab"], self.logit_ops)

            return align_logits(logits, width).softmax(dim=-1)
        return teacher_probs_from_topk(item["topk_logprobs"], item["topk_ids"], item["leftover_logmass"], width,
                                       t["real_vocab"])


#: What every dump of a mix must share with the first: the same teacher (tokenizer, head, final-logit transform,
#: widths) in the same format, so one head and one loss read every sequence.
MIX_KEYS = ("tokenizer_fingerprint", "head_fingerprint", "format", "logit_transform")
#: What top-k dumps of a mix share: no head reads them (their p is stored), so the teachers may differ — the target's
#: dump beside the draft's own (:mod:`specdraft.training.self_teacher`) — while ids, k and widths must mean the same.
MIX_KEYS_TOPK = ("tokenizer_fingerprint", "format")


class TeacherMix:
    """Several finished dumps of one teacher read as one dataset: item ``i`` of dump k is ``mix[starts[k] + i]``.

    How teacher-forced and target-written sequences train together (weights: :func:`specdraft.training.distill_data.mixed_split`);
    ``manifest`` is the first dump's. Top-k dumps share tokenizer, k and widths (:data:`MIX_KEYS_TOPK`: a target's
    dump beside a self-teacher's), hidden dumps one head (:data:`MIX_KEYS`).

    Raises:
        DumpError: no dump given, or a dump whose teacher differs from the first's (the differing field named:
            tokenizer / head fingerprint, format, logit transform, top_logprobs, real vocabulary or logits width).
    """

    def __init__(self, datasets: list[TeacherDataset]):
        if not datasets:
            raise DumpError("a mix needs at least one dump")
        first = datasets[0].manifest
        keys = MIX_KEYS_TOPK if first["format"] == "topk" else MIX_KEYS
        for ds in datasets[1:]:
            m = ds.manifest
            facts = [(k, first.get(k), m.get(k)) for k in keys]
            facts += [(f"target.{k}", first["target"].get(k), m["target"].get(k)) for k in ("real_vocab", "vocab_width")]
            if first["format"] == "topk":
                facts.append(("top_logprobs", first.get("top_k"), m.get("top_k")))  # the header's on-disk key
            for name, a, b in facts:
                if a != b:
                    raise DumpError(f"{ds.dir} cannot be mixed with {datasets[0].dir}: their {name} differ ({b!r} vs "
                                    f"{a!r}); dump both with the same target and --teacher-format")
        self.datasets = datasets
        self.manifest = first
        self.vocab_mapping = datasets[0].vocab_mapping
        self._starts = [0]
        for ds in datasets:
            self._starts.append(self._starts[-1] + len(ds))

    @property
    def lengths(self) -> list[int]:
        return [len(ds) for ds in self.datasets]

    def __len__(self) -> int:
        return self._starts[-1]

    def _locate(self, i: int) -> tuple[TeacherDataset, int]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} outside [0, {len(self)})")
        k = bisect.bisect_right(self._starts, i) - 1
        return self.datasets[k], i - self._starts[k]

    def __getitem__(self, i: int) -> dict[str, Any]:
        ds, j = self._locate(i)
        return ds[j]

    def tokens(self, i: int) -> dict[str, Any]:
        ds, j = self._locate(i)
        return ds.tokens(j)

    def longest(self) -> tuple[str, int]:
        return max((ds.longest() for ds in self.datasets), key=lambda x: x[1])

    def token_ids_from(self, limit: int) -> list[int]:
        return sorted({t for ds in self.datasets for t in ds.token_ids_from(limit)})

    @property
    def logit_ops(self) -> list[dict[str, Any]]:
        return self.datasets[0].logit_ops

    def head(self) -> dict[str, torch.Tensor]:
        return self.datasets[0].head()  # one head fingerprint for all (checked at construction)

    def teacher_probs(self, item: dict[str, Any], head: dict[str, torch.Tensor] | None = None,
                      vocab_width: int | None = None) -> torch.Tensor:
        return self.datasets[0].teacher_probs(item, head, vocab_width)


def pad_collate(batch: list[dict[str, Any]], pad_id: int = 0) -> dict[str, Any]:
    """Right-pad dataset items into a batch: every tensor gets a leading ``[B]`` and is padded to ``S_max``
    along its first dimension (``loss_mask`` with False, ``input_ids`` with ``pad_id``, signals with 0), plus
    ``attention_mask [B, S] int64`` and ``ids`` (list of str, when the items carry an ``id``)."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    out: dict[str, Any] = {"ids": [x["id"] for x in batch]} if "id" in batch[0] else {}
    for name in [k for k in batch[0] if k != "id"]:
        out[name] = pad_sequence([x[name] for x in batch], batch_first=True,
                                 padding_value=pad_id if name == "input_ids" else 0, padding_side="right")
    out["attention_mask"] = pad_sequence([torch.ones(len(x["input_ids"]), dtype=torch.long) for x in batch],
                                         batch_first=True, padding_side="right")
    return out
