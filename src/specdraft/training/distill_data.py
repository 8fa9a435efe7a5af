"""What distillation trains and validates on: the held-out split of the dumps by prompt (:func:`prompt_keyed_split`)
and, for ``on_policy_fraction`` λ > 0, the stream that mixes the draft's own answers, scored by the target, into every
step (:class:`OnPolicyStream`); :func:`collate` batches both. Rules in full:
docs/architecture.md#specdrafttrainingdistill_data.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch.utils.data import IterableDataset

from specdraft.core.config import DistillConfig, DumpConfig, recorded_settings
from specdraft.core.sampling import check_context
from specdraft.data.sources import sequences_from_responses
from specdraft.decoding.decode import check_max_new_tokens
from specdraft.decoding.responses import generate_from_ids
from specdraft.models.dump_reader import head_fingerprint, pad_collate
from specdraft.models.loading import load_model, model_fingerprint
from specdraft.training.teacher import Teacher, teacher_items


class DistillError(RuntimeError):
    """Distillation cannot start or continue (bad input, non-finite loss)."""


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad per-sequence dicts into a batch with ``attention_mask`` (:func:`specdraft.models.dump_reader.pad_collate`),
    keeping tensors only, as the Trainer feeds them to ``forward``. Padding has loss_mask 0, so it never
    changes the token-weighted loss."""

    out = pad_collate(rows)
    out.pop("ids", None)
    return out


def split_held_out(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic split of ``range(n)`` into (train, held-out); at least one of each when n ≥ 2."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g).tolist()
    k = round(n * fraction)
    if fraction > 0 and n >= 2:
        k = min(max(k, 1), n - 1)
    return sorted(order[k:]), sorted(order[:k])


def mixed_split(lengths: list[int], weights: list[int] | None, fraction: float,
                seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices into a :class:`specdraft.models.dump_reader.TeacherMix` of dumps of ``lengths`` sequences.

    Raises:
        DistillError: a weight count other than the dump count, or a weight below 1.
    """
    weights = [1] * len(lengths) if weights is None else list(weights)
    if len(weights) != len(lengths):
        raise DistillError(f"{len(weights)} dump weights for {len(lengths)} dumps: give one weight per dump")
    if any(int(w) != w or w < 1 for w in weights):
        raise DistillError(f"dump weights must be whole numbers >= 1 (repeats per epoch), got {weights}")
    train_idx: list[int] = []
    held_idx: list[int] = []
    start = 0
    for n, w in zip(lengths, weights):
        tr, he = split_held_out(n, fraction, seed)
        train_idx += [start + i for i in tr] * int(w)
        held_idx += [start + i for i in he]
        start += n
    return train_idx, held_idx


def prompt_keyed_split(parts: list, weights: list[int] | None, fraction: float,
                       seed: int) -> tuple[list[int], list[int], dict[str, Any]]:
    """(train, held-out) indices into the concatenation of ``parts`` (the dumps of a mix), split by prompt.

    Returns:
        ``(train, held, counts)``; ``counts`` (for training.json): ``keyed_by``, ``prompts``, ``held_out_prompts``,
        ``rows_sharing_a_prompt`` (rows whose prompt is another row's too) and ``train_held_overlap`` (prompts on
        both sides: 0).
    """
    weights = [1] * len(parts) if weights is None else list(weights)
    mixed_split([len(p) for p in parts], weights, fraction, seed)  # the weights' checks, one place
    keys: list[tuple] = []
    for p in parts:
        read = getattr(p, "tokens", p.__getitem__)
        for i in range(len(p)):
            item = read(i)
            prompt = prompt_of(item)
            keys.append(("prompt", *prompt) if prompt is not None else ("id", str(item.get("id", i))))
    distinct = list(dict.fromkeys(keys))
    _, held_k = split_held_out(len(distinct), fraction, seed)
    held_keys = {distinct[k] for k in held_k}
    rows_of: dict[tuple, int] = {}
    for k in keys:
        rows_of[k] = rows_of.get(k, 0) + 1
    train_idx: list[int] = []
    held_idx: list[int] = []
    start = 0
    for p, w in zip(parts, weights):
        for i in range(start, start + len(p)):
            if keys[i] in held_keys:
                held_idx.append(i)
            else:
                train_idx += [i] * int(w)
        start += len(p)
    overlap = len(held_keys & {keys[i] for i in train_idx})
    counts = {"keyed_by": "prompt", "prompts": len(distinct), "held_out_prompts": len(held_keys),
              "rows_sharing_a_prompt": sum(1 for k in keys if rows_of[k] > 1), "train_held_overlap": overlap}
    return train_idx, held_idx, counts


def prompt_of(item: dict[str, Any]) -> list[int] | None:
    """The prompt of a dump sequence: its ids up to and including the first trained position (that position
    predicts the first answer token), or ``None`` when the very first position is trained (no prompt to answer)."""
    mask = item["loss_mask"].bool()
    if not bool(mask.any()) or bool(mask[0]):
        return None
    first = int(mask.nonzero()[0, 0])
    return item["input_ids"][: first + 1].tolist()


def dataset_prompts(dataset) -> list[tuple[str, list[int]]]:
    """``[(id, prompt ids)]`` of every sequence of ``dataset`` that has a prompt (:func:`prompt_of`).

    Reads token ids only (``TeacherDataset.tokens``, also through a ``Subset``); a plain list of items works too.
    """
    from torch.utils.data import Subset

    base, idx = (dataset.dataset, list(dataset.indices)) if isinstance(dataset, Subset) else \
        (dataset, list(range(len(dataset))))
    read = getattr(base, "tokens", base.__getitem__)
    out = []
    for i in idx:
        item = read(i)
        p = prompt_of(item)
        if p is not None:
            out.append((str(item.get("id", i)), p))
    return out


class DraftWriter:
    """Writes on-policy training sequences: the draft answers prompts, the target scores the answers.

    Args:
        teacher: a :class:`specdraft.training.dump.Teacher` around the target (the model the dump was made with).
        tokenizer: the shared tokenizer (pad and EOS ids).
        dump_config: the dump's :class:`~specdraft.core.config.DumpConfig`: the signal format and ``max_length``.
        sampling: the serving filter the draft samples with (``temperature`` > 0, ``top_k``, ``top_p``).
        max_new_tokens: length bound of an answer (≥ 1; a stop id of the target,
            :func:`specdraft.decoding.responses.answer_stop_ids`, ends it earlier).
    """

    def __init__(self, teacher, tokenizer, dump_config, sampling, max_new_tokens: int):
        self.teacher = teacher
        self.tokenizer = tokenizer
        self.dump_config = dump_config
        self.sampling = sampling
        self.max_new_tokens = max_new_tokens
        check_max_new_tokens(max_new_tokens, error=DistillError)
        self.stats = {"refreshes": 0, "sequences": 0, "generated_tokens": 0, "generate_seconds": 0.0,
                      "teacher_tokens": 0, "teacher_seconds": 0.0, "dropped": 0}

    def check_windows(self, draft, prompts: list[tuple[str, list[int]]]) -> None:
        """Refuse, before training, prompts whose answers cannot fit a window (the rule of
        :func:`specdraft.core.sampling.check_context`): the draft decodes up to ``max_new_tokens`` after the longest
        prompt (prompt + N + 1 positions, as decoding counts them) and the target scores prompt + answer cut to
        the dump's ``max_length``."""
        if not prompts:
            return
        pid, ids = max(prompts, key=lambda x: len(x[1]))
        n, new = len(ids), self.max_new_tokens
        fix = "lower --on-policy-max-new-tokens (or shorten the dump's prompts)."
        check_context(n + new + 1, [("draft", draft)], f"prompt {pid!r} ({n} tokens) + the draft's answer ({new}) + 1 "
                      f"= {n + new + 1}", fix, error=DistillError)
        scored = min(n + new, self.dump_config.max_length)
        check_context(scored, [("target", self.teacher.model)], f"prompt {pid!r} + its answer ({scored} tokens)", fix,
                      error=DistillError)

    def __call__(self, draft, prompts: list[tuple[str, list[int]]], seed: int) -> list[dict[str, Any]]:

        if not prompts:
            return []
        t0 = time.perf_counter()
        # The draft's answers end where the target's would (its stop ids), not at the draft's own EOS config.
        responses = generate_from_ids(draft, self.tokenizer, [p for _, p in prompts], self.max_new_tokens,
                                      self.sampling, seed=seed, real_vocab=self.teacher.real_vocab,
                                      stop_model=self.teacher.model)
        t1 = time.perf_counter()
        seqs = sequences_from_responses([f"on-policy/{i}" for i, _ in prompts], [p for _, p in prompts], responses,
                                        answer_only=True, max_length=self.dump_config.max_length, truncate=True)
        kept = [q for q in seqs if q is not None]
        items = teacher_items(self.teacher, kept, self.dump_config)
        t2 = time.perf_counter()
        st = self.stats
        st["refreshes"] += 1
        st["sequences"] += len(items)
        st["dropped"] += len(seqs) - len(kept)
        st["generated_tokens"] += sum(map(len, responses))
        st["teacher_tokens"] += sum(len(q.ids) for q in kept)
        st["generate_seconds"] += t1 - t0
        st["teacher_seconds"] += t2 - t1
        return items


class OnPolicyStream(IterableDataset):
    """The training stream for λ > 0: per optimizer step, the draft's own sequences and the dump's, in order.

    Args:
        dataset: the dump's training sequences (map-style).
        prompts: ``[(id, prompt ids)]`` (:func:`dataset_prompts`).
        writer: a :class:`DraftWriter` (any callable ``(draft, prompts, seed) -> items``).
        draft: the model being trained (the same object, so each refresh sees the current weights).
        fraction: λ in [0, 1]; ``every``: steps between refreshes; ``per_step``: G; ``seed``: orders and sampling.
        max_steps: the last step trained; no answer is written for steps past it.
    """

    def __init__(self, dataset, prompts, writer, draft, fraction: float, every: int, per_step: int, seed: int,
                 max_steps: int | None = None):
        if fraction > 0 and not prompts:
            raise DistillError("on-policy training needs prompts: every training sequence of the dump is trained "
                               "from its first position (make the dump with --answer-only, as specdraft run does)")
        if fraction < 1 and len(dataset) == 0:
            raise DistillError("no dump sequences to train on")
        if fraction > 0 and hasattr(writer, "check_windows"):
            writer.check_windows(draft, prompts)
        self.dataset, self.prompts, self.writer, self.draft = dataset, prompts, writer, draft
        self.fraction, self.every, self.per_step, self.seed = fraction, every, per_step, seed
        self.max_steps = max_steps
        self.start_step = 0  # set to the resumed step before iteration (stream_start_callback)
        self.refresh_steps: list[int] = []

    def on_policy_before(self, step: int) -> int:
        """Draft-written sequences in steps 0..step−1: ⌊λ·G·step⌋, from the product (never a running sum, so
        rounding cannot drift; the 1e-9 keeps λ·G·step = 3.0000000001 vs 2.9999999999 on the same side)."""
        return math.floor(self.fraction * self.per_step * step + 1e-9)

    def _order(self, n: int, salt: int):
        """An endless seeded order over range(n): a fresh permutation every pass."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + salt)
        while True:
            yield from torch.randperm(n, generator=g).tolist()

    def __iter__(self):
        step = self.start_step
        before = self.on_policy_before(step)
        dump_order = self._order(len(self.dataset), 0) if len(self.dataset) else iter(())
        prompt_order = self._order(len(self.prompts), 1) if self.prompts else iter(())
        for _ in range(step * self.per_step - before):  # a resumed run continues both orders where they were
            next(dump_order)
        for _ in range(before):
            next(prompt_order)
        pool: list[dict[str, Any]] = []
        while True:
            if step == self.start_step or step % self.every == 0:
                end = (step // self.every + 1) * self.every
                if self.max_steps is not None:  # the loader reads a batch ahead: nothing past the last step
                    end = max(min(end, self.max_steps), step)
                n = self.on_policy_before(end) - self.on_policy_before(step)
                chosen = [self.prompts[next(prompt_order)] for _ in range(n)] if n else []
                pool = self.writer(self.draft, chosen, self.seed + step) if chosen else []
                if chosen:
                    self.refresh_steps.append(step)
            k = self.on_policy_before(step + 1) - self.on_policy_before(step)
            take, pool = pool[:k], pool[k:]
            yield from take
            for _ in range(self.per_step - len(take)):
                yield self.dataset[next(dump_order)]
            step += 1


def stream_start_callback(stream: OnPolicyStream):
    """A TrainerCallback that tells the stream the step training starts from (0, or a resumed checkpoint's)."""
    from transformers import TrainerCallback

    class _StreamStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stream.start_step = state.global_step

    return _StreamStart()


def load_draft_writer(target_ref: str, manifest: dict[str, Any], tokenizer, config: DistillConfig,
                      device: str | None) -> DraftWriter:
    """The target the dump was made with wrapped as the scorer of the draft's answers, for λ > 0: the same model
    (its whole content, :func:`specdraft.models.loading.model_fingerprint`, against the dump's ``identity.target_weights``:
    the head alone would pass a body fine-tuned since), checked before it loads, and loaded in the same dtype (its
    output head's fingerprint).

    Raises:
        DistillError: a dump not made with ``answer_only``; a dump that records no whole-model fingerprint (made by
            an older specdraft: dump again); a target whose weights or head differ from the dump's.
    """

    dump_cfg = DumpConfig.model_validate(recorded_settings(manifest["config"]))  # an older dump's too
    if not dump_cfg.answer_only:
        raise DistillError("--on-policy-fraction needs a dump made with --answer-only: its sequences mark where the "
                           "prompt ends, and the draft answers those prompts")
    recorded = manifest.get("identity", {}).get("target_weights")
    if recorded is None:
        raise DistillError(f"the dump records no fingerprint of its whole target (target_weights), only of its head: "
                           f"{target_ref} cannot be checked to be the teacher that made it. Dump again to train with "
                           "--on-policy-fraction > 0.")
    if (found := model_fingerprint(target_ref)) != recorded:
        raise DistillError(f"{target_ref} is not the target the dump was made with (target_weights: the dump holds "
                           f"{recorded[:16]}…, this target has {found[:16]}…; its weights changed since, e.g. a "
                           "fine-tune saved in place): on-policy sequences would be scored by another teacher than "
                           "the dump's")
    target, _ = load_model(target_ref, dtype=manifest["target"]["dtype"], device=device or "cpu")
    if head_fingerprint(target) != manifest.get("head_fingerprint"):
        raise DistillError(f"{target_ref} loaded in {manifest['target']['dtype']} is not the target the dump was made "
                           "with (output-head fingerprints differ): on-policy sequences would be scored by another "
                           "teacher than the dump's")
    n = config.on_policy_max_new_tokens or dump_cfg.generate or 128
    return DraftWriter(Teacher(target, int(manifest["target"]["real_vocab"])), tokenizer, dump_cfg, config.serving, n)
