"""The target teaches the draft as given: a teacher dump in the draft's own token ids, for a draft of another tokenizer.

p = the target, q = the draft as given (its own tokenizer and head, drafting through text at serving). Per prompt the
draft (``answers="draft"``, on-policy) or the target writes a greedy answer; the target scores it teacher-forced, and
its top-k is carried onto draft ids (:func:`carry_topk`) where a draft position's context ends at a target token
boundary (:func:`aligned_pairs`); elsewhere a hard label or nothing (``unaligned``). The dump is
:mod:`specdraft.training.dump`'s top-k format with the *draft's* tokenizer fingerprint, so
:func:`specdraft.training.distill.run_distill` trains the draft as given on it. Source: DistillSpec (Zhou et al., 2024).
Details: docs/architecture.md#specdrafttrainingas_given_teacher.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.core.config import AsGivenTeacherConfig
from specdraft.core.io import atomic_path, atomic_write_text, sha256_json, versions
from specdraft.data.prompts import PromptSet, teacher_prompts
from specdraft.data.sources import (
    TokenSequence,
    encode_answer,
    encode_prompts,
    end_of_turn_ids,
    render_prompt,
)
from specdraft.decoding.responses import answer_stop_ids, generate_from_ids
from specdraft.models.dump_reader import FORMAT_VERSION, DumpError
from specdraft.models.loading import (
    load_model,
    load_tokenizer,
    model_fingerprint,
    model_revision,
    rendering_identity,
    resolve,
)
from specdraft.models.tokenizer_view import tokenizer_fingerprint, tokenizer_view
from specdraft.models.vocab import build_vocab_mapping
from specdraft.training.dump import LOSS_MASK_CONVENTION, ProgressFn, TeacherBatch, data_record, write_dump
from specdraft.training.self_teacher import decode_text, hard_labels, text_boundaries, well_formed_prefix
from specdraft.training.teacher import TOPK_STORAGE, Teacher

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from specdraft.data.sources import Example

#: The manifest's ``teacher.kind``: the target, its signal carried onto the draft's own ids.
TARGET_FOR_AS_GIVEN_KIND = "target-for-draft-as-given"


def carry_topk(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, leftover_logmass: torch.Tensor,
               carry_to: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's top-k at N positions, carried onto draft ids.

    Each stored target id y with ``carry_to[y] >= 0`` gives its probability to draft id ``carry_to[y]`` (ids carried
    to the same draft id add up); every other stored id's mass joins the leftover. The k most probable draft ids are
    kept; the slots left empty hold ids not otherwise stored at log-prob −inf.

    Args:
        topk_logprobs: ``[N, k_t] float32`` log p of the stored target ids (nats).
        topk_ids: ``[N, k_t] int64`` target ids.
        leftover_logmass: ``[N] float32`` log of the target's mass outside them (−inf: none).
        carry_to: ``[V_t] int64`` draft id per target id, −1 where none.
        k: slots of the result.

    Returns:
        ``(logprobs [N, k] float32, draft ids [N, k] int64, leftover [N] float32)``; per row the stored mass and the
        leftover add up to what the target's did (1, up to float rounding): nothing is renormalised.
    """
    import torch

    n = topk_logprobs.shape[0]
    to = carry_to.to(topk_ids.device)[topk_ids.long()]  # [N, k_t] draft ids, −1: none
    carried = to >= 0
    p = topk_logprobs.double().exp()  # [N, k_t]
    same = (to[:, :, None] == to[:, None, :]) & carried[:, :, None] & carried[:, None, :]  # [N, k_t, k_t]
    mass = (same.double() * p[:, None, :]).sum(-1)  # [N, k_t]: each slot's draft id's whole carried mass
    first = ~torch.tril(same, diagonal=-1).any(-1)  # the first slot of each draft id holds it
    mass = torch.where(carried & first, mass, torch.zeros_like(mass))
    top = mass.topk(min(k, mass.shape[1]), dim=-1)
    out_ids = to.gather(1, top.indices).clamp(min=0)
    out_lp = torch.where(top.values > 0, top.values.log(), torch.full_like(top.values, float("-inf"))).float()
    lost = torch.where(carried, torch.zeros_like(p), p).sum(-1)
    left = torch.logaddexp(leftover_logmass.double(), lost.log()).float()
    if out_ids.shape[1] < k:
        pad = k - out_ids.shape[1]
        out_ids = torch.cat([out_ids, out_ids.new_zeros(n, pad)], 1)
        out_lp = torch.cat([out_lp, out_lp.new_full((n, pad), float("-inf"))], 1)
    return (*_distinct_empty_slots(out_lp, out_ids), left)


def _distinct_empty_slots(lp: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Give each slot at −inf an id no other slot of its row holds (a reader scatters the slots: a repeated id would
    overwrite a real one's probability with 0)."""
    import torch

    empty = ~torch.isfinite(lp)
    if not bool(empty.any()):
        return lp, ids
    ids = ids.clone()
    for r in torch.nonzero(empty.any(-1)).flatten().tolist():
        taken = {int(i) for i, e in zip(ids[r].tolist(), empty[r].tolist()) if not e}
        free = (i for i in range(len(taken) + ids.shape[1] + 1) if i not in taken)
        for c in torch.nonzero(empty[r]).flatten().tolist():
            ids[r, c] = next(free)
    return lp, ids


def first_piece_ids(target_tokenizer, draft_tokenizer, twins: torch.Tensor) -> torch.Tensor:
    """``[V_t] int64``: per target id, its twin (``twins >= 0``) or else the first draft token of the draft's encoding
    of its text (−1 for a token whose text is empty, special or not well-formed)."""
    import torch

    out = twins.clone().long()
    special = set(target_tokenizer.all_special_ids)
    for y in torch.nonzero(out < 0).flatten().tolist():
        if y in special:
            continue
        text = target_tokenizer.convert_tokens_to_string([target_tokenizer.convert_ids_to_tokens(y)])
        if not text or "\ufffd" in text:
            continue
        ids = draft_tokenizer(text, add_special_tokens=False)["input_ids"]
        if ids:
            out[y] = int(ids[0])
    return out


def aligned_pairs(draft_offsets: Sequence[tuple[int, int]], answer_start: int, answer_bounds: Sequence[int | None],
                  target_prompt_len: int, answer_end: int | None, n_text: int) -> tuple[list[int], dict[int, int]]:
    """Which draft positions are trained, and which of them meet a target boundary.

    Args:
        draft_offsets: ``[S_d]`` (start, end) characters of each draft token in the sequence's text.
        answer_start: the character the answer starts at (its prompt's text length).
        answer_bounds: :func:`specdraft.training.self_teacher.text_boundaries` of the target's answer ids over the answer text.
        target_prompt_len: the target prompt's ids.
        answer_end: the character the answer's text ends at when an end of turn follows it (its first token is trained
            too), else None.
        n_text: the target's answer ids that spell the text (its end-of-turn ids after them).

    Returns:
        ``(trained, aligned)``: trained draft positions i (predicting token i + 1, which starts in the answer), and
        ``{i: j}`` for those whose context ends at a clean boundary both share, j the target position predicting the
        target's token there.
    """
    at = {c: kk for kk, c in enumerate(answer_bounds) if c is not None}
    trained, aligned = [], {}
    for i in range(len(draft_offsets) - 1):
        s_next = draft_offsets[i + 1][0]
        if s_next < answer_start or (answer_end is not None and s_next > answer_end):
            continue
        trained.append(i)
        end = draft_offsets[i][1]
        if end != s_next:  # the draft's boundary falls inside a character or overlaps: not clean
            continue
        kk = at.get(end - answer_start)
        if kk is not None and kk <= n_text:
            aligned[i] = target_prompt_len + kk - 1
    return trained, aligned


class TargetForDraftTeacher:
    """The target scoring sequences written by the draft as given (or by itself), labels carried onto draft ids:
    ``rows_of`` of :func:`specdraft.training.dump.write_dump`.

    Args:
        target / draft: the two models (the draft only writes, with ``answers="draft"``).
        target_tokenizer / draft_tokenizer: their tokenizers; ``mapping``: the pair's
            :class:`~specdraft.models.vocab.VocabMapping` (tokenizers attached).
        config: the :class:`~specdraft.core.config.AsGivenTeacherConfig`.
    """

    def __init__(self, target, draft, target_tokenizer, draft_tokenizer, mapping, config: AsGivenTeacherConfig,
                 cache: str | os.PathLike | None = None):

        self.target, self.draft, self.ttok, self.dtok = target, draft, target_tokenizer, draft_tokenizer
        self.mapping, self.config = mapping, config
        self.t_real = int(tokenizer_view(target_tokenizer).real)
        self.d_real = int(tokenizer_view(draft_tokenizer).real)
        self.scorer = Teacher(target, self.t_real)
        self.eot = end_of_turn_ids(target_tokenizer)
        writer = draft if config.answers == "draft" else target
        self.writer_tok = draft_tokenizer if config.answers == "draft" else target_tokenizer
        self.stops = set(answer_stop_ids(writer, self.writer_tok))
        twins = mapping.target_to_draft.long()
        self.carry_to = first_piece_ids(target_tokenizer, draft_tokenizer, twins) if config.carry == "first_piece" \
            else twins
        # A work cache (written answers, the target's scores) lets settings that only change how the signal is carried
        # reuse the costly part; greedy answers and teacher-forced scores are functions of the prompt alone.
        self.cache = Path(cache) if cache is not None else None
        self.answers_file = (self.cache / f"answers-{config.answers}-{config.generate}.json") if self.cache else None
        self.written = json.loads(self.answers_file.read_text()) if self.answers_file and self.answers_file.is_file() \
            else {}
        self.stats = {"answers": 0, "ended": 0, "answer_positions": 0, "trained_positions": 0, "aligned_positions": 0,
                      "carried_mass": 0.0, "text_mismatch": 0}

    def __call__(self, batch: list, first: int) -> TeacherBatch:

        t_prompts = encode_prompts(self.ttok, batch)
        t0 = time.perf_counter()
        todo = [i for i, ex in enumerate(batch) if ex.id not in self.written]
        generated = 0
        if todo:
            if self.config.answers == "draft":
                ctx = self.mapping.reencode_batch_for_draft([t_prompts[i] for i in todo])
                new = generate_from_ids(self.draft, self.dtok, ctx, self.config.generate, real_vocab=self.d_real)
            else:
                new = generate_from_ids(self.target, self.ttok, [t_prompts[i] for i in todo], self.config.generate,
                                        real_vocab=self.t_real)
            self.written.update({batch[i].id: [int(t) for t in r] for i, r in zip(todo, new, strict=True)})
            generated = sum(map(len, new))
            if self.answers_file:
                self.answers_file.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(self.answers_file, json.dumps(self.written))
        written = [self.written[ex.id] for ex in batch]
        seconds = time.perf_counter() - t0
        jobs = []
        for ex, tp, r in zip(batch, t_prompts, written, strict=True):
            job = self._sequence(ex, tp, r)
            if job is not None:
                jobs.append(job)
        rows = self._score(jobs)
        return TeacherBatch(rows, len(batch) - len(rows), generated, seconds)

    def _sequence(self, ex, t_prompt: list[int], written: list[int]):
        """One answer → ``(id, target ids, target prompt length, answer text, n_text, ended)`` or None (no text)."""

        ended = bool(written) and int(written[-1]) in self.stops
        body = list(written[:-1]) if ended else list(written)
        text, cut = well_formed_prefix(decode_text(self.writer_tok, body))
        ended = ended and not cut
        self.stats["answers"] += 1
        self.stats["ended"] += ended
        if not text and not ended:
            return None
        answer = encode_answer(self.ttok, render_prompt(self.ttok, ex), text) if text else []
        ids = list(t_prompt) + answer + (self.eot if ended else [])
        ids = ids[: self.config.max_length]
        return ex.id, ids, len(t_prompt), text, len(answer), ended

    def _score(self, jobs: list) -> list:
        """The target's top-k over each job's answer positions (from ``p_len − 1``), cached by the sequence's ids."""
        import torch
        from torch.nn.utils.rnn import pad_sequence


        scores: dict[int, tuple] = {}
        files = [self._score_file(job[1]) for job in jobs]
        todo = []
        for n, f in enumerate(files):
            if self.config.carry == "none":
                scores[n] = None
            elif f is not None and f.is_file():
                scores[n] = tuple(torch.load(f).values())
            else:
                todo.append(n)
        for b in range(0, len(todo), self.config.score_batch_size):
            part = [jobs[n] for n in todo[b:b + self.config.score_batch_size]]
            ids = pad_sequence([torch.tensor(j[1], dtype=torch.long) for j in part], batch_first=True,
                               padding_side="right")
            attn = pad_sequence([torch.ones(len(j[1]), dtype=torch.long) for j in part], batch_first=True,
                                padding_side="right")
            h = self.scorer.hidden(ids.to(self.scorer.device), attn.to(self.scorer.device))  # [B, S, H]
            for r, (n, job) in enumerate(zip(todo[b:b + self.config.score_batch_size], part, strict=True)):
                a = max(job[2] - 1, 0)
                lp, tid, left = self.scorer.topk(h[r, a:len(job[1])], self.config.top_logprobs)
                scores[n] = (lp.cpu(), tid.cpu().int(), left.cpu())
                if files[n] is not None:
                    with atomic_path(files[n]) as tmp:
                        torch.save(dict(zip(("lp", "tid", "left"), scores[n], strict=True)), tmp)
        rows = []
        for n, job in enumerate(jobs):
            row = self._carry(job, *(scores[n] or (None, None, None)))
            if row is not None:
                rows.append(row)
        return rows

    def _score_file(self, ids: Sequence[int]) -> Path | None:
        if self.cache is None:
            return None
        key = sha256_json([list(map(int, ids)), self.config.top_logprobs, self.config.dtype])
        return self.cache / "scores" / f"{key[:32]}.pt"

    def _carry(self, job, lp, tid, left):
        """The draft sequence and its signal for one scored target sequence."""
        import torch


        seq_id, t_ids, p_len, _, n_text, ended = job
        # The text the drafter reads: the target ids decoded (special tokens as text), a target BOS the tokenizer adds
        # by itself left out, a trailing unfinished character too (VocabMapping.reencode_batch_for_draft).
        full = self.ttok.decode(t_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        prompt_text = self.ttok.decode(t_ids[:p_len], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        t_bos = self.ttok.bos_token if self.mapping._bos("target") else None
        if t_bos and full.startswith(t_bos):
            full, prompt_text = full[len(t_bos):], prompt_text[len(t_bos):]
        full = full.rstrip("\ufffd")
        draft_ids = self.mapping.reencode_batch_for_draft([t_ids])[0]
        enc = self.dtok(full, add_special_tokens=False, return_offsets_mapping=True)
        bos = draft_ids[: len(draft_ids) - len(enc["input_ids"])]
        if list(bos) + list(enc["input_ids"]) != list(draft_ids):
            raise DumpError("the draft tokenizer's offsets encoding differs from the text drafter's re-encoding")
        offsets = [(0, 0)] * len(bos) + [tuple(o) for o in enc["offset_mapping"]]
        kept_answer = t_ids[p_len:p_len + n_text]
        a_text = decode_text(self.ttok, kept_answer)
        if not full.startswith(prompt_text) or full[len(prompt_text):len(prompt_text) + len(a_text)] != a_text:
            self.stats["text_mismatch"] += 1
            return None
        bounds = text_boundaries(self.ttok, kept_answer, a_text)
        has_eot = ended and len(t_ids) > p_len + n_text
        trained, aligned = aligned_pairs(offsets, len(prompt_text), bounds, p_len,
                                         len(prompt_text) + len(a_text) if has_eot else None, n_text)
        aligned = {i: j for i, j in aligned.items() if j < len(t_ids) - 1}
        if self.config.max_length and len(draft_ids) > self.config.max_length:
            draft_ids = draft_ids[: self.config.max_length]
            trained = [i for i in trained if i < len(draft_ids) - 1]
            aligned = {i: j for i, j in aligned.items() if i < len(draft_ids) - 1}
        signal = hard_labels(draft_ids, self.config.top_logprobs, self.d_real)
        if self.config.carry == "none":
            aligned = {}
        mask = [False] * len(draft_ids)
        for i in trained if self.config.unaligned == "hard" or self.config.carry == "none" else aligned:
            mask[i] = True
        if aligned:
            at_d = torch.tensor(sorted(aligned))
            at_t = torch.tensor([aligned[i] for i in sorted(aligned)]) - max(p_len - 1, 0)
            c_lp, c_ids, c_left = carry_topk(lp[at_t], tid[at_t].long(), left[at_t], self.carry_to,
                                             self.config.top_logprobs)
            signal["topk_logprobs"][at_d] = c_lp
            signal["topk_ids"][at_d] = c_ids.to(torch.int32)
            signal["leftover_logmass"][at_d] = c_left
            self.stats["carried_mass"] += float(c_lp.exp().sum())
        if not any(mask):
            return None
        self.stats["answer_positions"] += len(trained)
        self.stats["trained_positions"] += sum(mask)
        self.stats["aligned_positions"] += len(aligned)
        return TokenSequence(seq_id, list(draft_ids), mask), signal



def run_as_given_teacher(target_ref: str | os.PathLike, draft_ref: str | os.PathLike,
                         data: str | os.PathLike | Sequence[str] | PromptSet | list[Example], out: str | os.PathLike,
                         config: AsGivenTeacherConfig | None = None, progress: ProgressFn | None = None,
                         command: str | None = None, cache: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write the target's teacher dump for the draft as given; resumes a killed run.

    Args:
        target_ref / draft_ref: references (embedded name, local directory, cached hub id); the draft must be of
            another tokenizer than the target (a draft of the target's own tokenizer takes :func:`specdraft.training.dump.run_dump`).
        data: the prompts, as :func:`specdraft.training.dump.run_dump` takes them (a repeated one dropped: answers are greedy).
        out: the dump directory (new, empty, or a dump of this very plan).
        config: settings (default :class:`~specdraft.core.config.AsGivenTeacherConfig`).
        progress: ``progress(done_items, total_items, tokens_this_run)`` after each batch.
        cache: a directory keeping the written answers and the target's scores across dumps that differ only in
            ``carry`` / ``unaligned`` (optional).

    Returns:
        The manifest plus ``this_run`` and ``signal`` (answers, ended, trained and aligned positions, carried mass).

    Raises:
        DumpError: no prompts, a pair of one tokenizer, ``top_logprobs`` at or past the draft's vocabulary, a directory
            holding something else (nothing touched).
        specdraft.data.sources.DataError: a malformed spec, an unknown source or a spec that gives no prompts
            (:func:`specdraft.data.prompts.select_prompts`).
    """
    from transformers import AutoConfig


    config = config or AsGivenTeacherConfig()
    t_start = time.time()
    chosen = teacher_prompts(data, config.distinct_prompts)
    examples = chosen.examples
    if not examples:
        raise DumpError("no prompts: nothing to dump.")
    t_path, d_path = resolve(target_ref), resolve(draft_ref)
    ttok, dtok = load_tokenizer(t_path), load_tokenizer(d_path)
    d_fp = tokenizer_fingerprint(dtok)
    if d_fp == tokenizer_fingerprint(ttok):
        raise DumpError(f"{draft_ref} has the target's tokenizer: dump the target's signal directly "
                        f"(specdraft dump --target {target_ref}).")
    d_real = int(tokenizer_view(dtok).real)
    if config.top_logprobs >= d_real:
        raise DumpError(f"--top-logprobs {config.top_logprobs} must be below the draft's real vocabulary ({d_real})")
    dcfg = AutoConfig.from_pretrained(d_path).get_text_config(decoder=True)
    width = int(getattr(dcfg, "vocab_size", None) or d_real)
    tcfg = AutoConfig.from_pretrained(t_path)
    t_facts = {"architectures": getattr(tcfg, "architectures", None), "model_type": tcfg.model_type}
    teacher = {"kind": TARGET_FOR_AS_GIVEN_KIND, "ref": str(target_ref), "weights": model_fingerprint(t_path),
               "revision": model_revision(t_path), "draft": str(draft_ref), "draft_weights": model_fingerprint(d_path),
               "rendering": rendering_identity(t_path)}
    identity = {"teacher": teacher, "tokenizer_fingerprint": d_fp, "settings": config.plan_settings(),
                "topk_storage": TOPK_STORAGE,
                "data_fingerprint": sha256_json([[e.id, e.messages, e.reference] for e in examples])}
    header = {
        "kind": "specdraft-teacher-dump", "format_version": FORMAT_VERSION,
        "target": {"ref": str(target_ref), "resolved": t_path, "revision": model_revision(t_path), **t_facts,
                   "dtype": config.dtype, "ids": "draft", "vocab_width": width, "real_vocab": min(d_real, width)},
        "teacher": teacher, "tokenizer_fingerprint": d_fp, "head_fingerprint": None,
        "format": "topk", "dtype": dict(TOPK_STORAGE), "top_k": config.top_logprobs,
        "final_norm_applied": None, "final_norm": None, "logit_transform": [],
        "loss_mask_convention": LOSS_MASK_CONVENTION,
        "leftover_rule": "uniform over the draft's real-vocabulary ids outside the top-k (teacher_probs_from_topk)",
        "signal": (f"the target's top-{config.top_logprobs} carried onto draft ids ({config.carry}) where boundaries meet; "
                   + ("hard labels elsewhere" if config.unaligned == "hard" else "nothing trained elsewhere")
                   + f"; answers written by the {config.answers}"),
        **data_record(chosen), "config": config.model_dump(),
        "command": command if command is not None else " ".join(sys.argv), "versions": versions(),
    }
    made: dict[str, TargetForDraftTeacher] = {}

    def load_teacher():
        target, _ = load_model(t_path, dtype=config.dtype)
        draft = load_model(d_path, dtype=config.dtype)[0] if config.answers == "draft" else None
        made["t"] = TargetForDraftTeacher(target, draft, ttok, dtok, build_vocab_mapping(t_path, d_path), config,
                                         cache)
        return made["t"]

    manifest = write_dump(out, list(examples), load_teacher, identity, header, config, progress=progress,
                          t_start=t_start)
    manifest["signal"] = dict(made["t"].stats) if made else None
    return manifest


__all__ = ["TARGET_FOR_AS_GIVEN_KIND", "TargetForDraftTeacher", "aligned_pairs", "carry_topk", "first_piece_ids",
           "run_as_given_teacher"]
