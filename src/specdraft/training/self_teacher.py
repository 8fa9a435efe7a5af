"""The draft as given teaches its re-indexed copy: a teacher dump whose teacher is the draft in its own tokenizer.

A draft re-indexed into the target's tokenizer (:func:`specdraft.models.vocab.save_vocab_swap`) forgets much of what it knew;
the draft as given still has it and costs no target compute. q = the draft as given, in its own ids. Per prompt it
answers greedily under its own chat template; the answer's text, encoded with the target's tokenizer after the
target's rendered prompt (plus the target's end of turn when the draft stopped), is the stored sequence, trained on its
answer positions. The signal is :mod:`specdraft.training.dump`'s top-k format (``top_logprobs`` slots): a hard label, or with
``token_level`` the draft's own next-token distribution moved to string twins where both tokenizations have a
boundary; ``texts`` adds plain files cut into hard-labelled sequences. The manifest is :func:`specdraft.training.dump.write_dump`'s
with the *target's* tokenizer fingerprint and the draft named by content; no target weights are read.

Why each label is exact, and what the token level approximates: docs/architecture.md#specdrafttrainingself_teacher.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.core.config import SelfTeacherConfig
from specdraft.core.io import sha256_json, versions
from specdraft.core.sampling import apply_final_logit_ops, final_logit_ops
from specdraft.data.prompts import PromptSet, teacher_prompts
from specdraft.data.sources import (
    Example,
    TokenSequence,
    encode_answer,
    encode_prompts,
    end_of_turn_ids,
    render_prompt,
    sequences_from_responses,
)
from specdraft.decoding.responses import answer_stop_ids, generate_responses
from specdraft.models.dump_reader import FORMAT_VERSION, SELF_TEACHER_KIND, DumpError
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
from specdraft.training.teacher import TOPK_STORAGE

if TYPE_CHECKING:  # pragma: no cover
    import torch


# ------------------------------------------------------------------------------------------- text and ids


def decode_text(tokenizer, ids: Sequence[int]) -> str:
    """The text of ``ids``: special tokens left out, no clean-up of spaces (the one decoding every boundary uses)."""
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def well_formed_prefix(text: str) -> tuple[str, bool]:
    """``text`` up to its first U+FFFD, the mark of bytes that are no UTF-8 (a byte-level model can write them) in a
    decoding with replacement; trained, that mark would be encoded back as a real character the model never wrote.
    A trailing run of them is an answer cut inside a character (the budget ran out): its whole characters are kept.

    Returns:
        ``(prefix, cut)``: cut is True where well-formed text followed the first ill-formed byte (it is dropped).
    """
    at = text.find("\ufffd")
    if at < 0:
        return text, False
    return text[:at], bool(text[at:].strip("\ufffd"))


def text_boundaries(tokenizer, ids: Sequence[int], text: str) -> list[int | None]:
    """``[len(ids) + 1]``: for each i the number of characters of ``text`` that ``ids[:i]`` decode to
    (:func:`decode_text`), or None where they do not decode to a prefix of ``text`` or end inside a character
    (U+FFFD): the clean token boundaries of one segmentation of ``text``."""
    out: list[int | None] = []
    for i in range(len(ids) + 1):
        s = decode_text(tokenizer, ids[:i])
        out.append(len(s) if text.startswith(s) and not s.endswith("\ufffd") else None)
    return out


def aligned_positions(draft_tokenizer, draft_answer: Sequence[int], target_tokenizer, target_answer: Sequence[int],
                      text: str, target_twins: Sequence[bool], ended: bool = False,
                      end_of_turn: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Where the draft's own distribution is the token-level teacher: ``[(k, i)]``, k the index in ``target_answer``
    of the token predicted, i the number of draft answer ids of its context.

    Args:
        draft_answer: the draft's answer ids before its stop id.
        target_answer: the target's ids of ``text`` followed by ``end_of_turn`` when ``ended``.
        text: the answer text (:func:`decode_text` of ``draft_answer``).
        target_twins: per target id, whether it has a draft twin (``VocabMapping.target_to_draft >= 0``).
        ended: the draft stopped (its stop id followed ``draft_answer``): the first end-of-turn id is aligned with
            the draft's stop at the end of the text.
    """
    drafted = {}
    for i, c in enumerate(text_boundaries(draft_tokenizer, draft_answer, text)):
        if c is not None:
            drafted[c] = i  # the longest context ending at c (a token that decodes to nothing stays in it)
    n_text = len(target_answer) - (len(end_of_turn) if ended else 0)
    bounds = text_boundaries(target_tokenizer, target_answer[:n_text], text)
    out = []
    for k in range(n_text + (1 if ended and end_of_turn else 0)):
        c = bounds[k] if k <= n_text else None
        if k == n_text and c != len(text):
            continue
        y = int(target_answer[k])
        if c is not None and c in drafted and y < len(target_twins) and target_twins[y]:
            out.append((k, drafted[c]))
    return out


def hard_labels(ids: Sequence[int], k: int, real_vocab: int) -> dict[str, torch.Tensor]:
    """The hard-label signal of a sequence (docs/architecture.md): position j holds ``ids[j + 1]`` with log-prob 0 in slot
    0, ids ``label + 1, label + 2, …`` (mod ``real_vocab``) at −inf in the others, leftover −inf; the last position its
    own token.

    Returns:
        ``{"topk_logprobs" [S, k] float32, "topk_ids" [S, k] int32, "leftover_logmass" [S] float32}``.
    """
    import torch

    if k > real_vocab:
        raise DumpError(f"--top-logprobs {k} exceeds the real vocabulary ({real_vocab})")
    t = torch.tensor(list(ids), dtype=torch.long)
    labels = torch.cat([t[1:], t[-1:]])  # [S]
    slots = (labels[:, None] + torch.arange(k)[None, :]) % real_vocab  # [S, k], distinct, slot 0 the label
    lp = torch.full((len(t), k), float("-inf"))
    lp[:, 0] = 0.0
    return {"topk_logprobs": lp, "topk_ids": slots.to(torch.int32),
            "leftover_logmass": torch.full((len(t),), float("-inf"))}


def mapped_topk(draft_logprobs: torch.Tensor, mapping, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft's distribution in target ids, top-k of its twins (the token level: docs/architecture.md).

    ``draft_logprobs [N, V_d] float32`` (log q, padding rows −inf) → ``(logprobs [N, k] float32, target ids [N, k]
    int64, leftover [N] float32)``: the k likeliest draft tokens with a twin (``mapping``), at their twins' ids, and
    log Σ q over every other draft id.
    """
    import torch

    mapped = mapping.map_draft_logits(draft_logprobs)  # [N, V_t], −inf where no twin
    top = mapped.topk(k, dim=-1)
    src = mapping.target_to_draft.to(draft_logprobs.device)[top.indices]  # [N, k] draft ids (−1: no twin)
    finite = torch.isfinite(top.values)
    src = torch.where(finite & (src >= 0), src, src[:, :1].clamp(min=0))  # a row's extra slots repeat its first id
    rest = draft_logprobs.scatter(-1, src, float("-inf"))
    return top.values.float(), top.indices, rest.logsumexp(dim=-1).float()


def text_sequences(tokenizer, paths: Sequence[str | os.PathLike], max_length: int) -> list[TokenSequence]:
    """Plain text files → sequences of at most ``max_length`` target tokens, every prediction trained (the last
    position of each is not: no token follows it). A file is read as UTF-8 and encoded whole, then cut; a piece of
    one token trains nothing and is left out. Ids: ``text:<file name>:<piece>``.

    Raises:
        DumpError: a file that does not exist, or one that is not UTF-8 (named with its first bad line: a replaced
            byte would be trained as U+FFFD, a character the file does not hold).
    """

    out = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DumpError(f"--text {path}: no such file")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[:exc.start].count(b"\n") + 1
            raise DumpError(f"--text {path}: line {line} is not UTF-8 (byte {exc.start}: {exc.reason}); convert the "
                            f"file to UTF-8 (iconv -f <its encoding> -t UTF-8 {path.name}) and run again.") from None
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for n, a in enumerate(range(0, len(ids), max_length)):
            piece = list(ids[a:a + max_length])
            if len(piece) > 1:
                out.append(TokenSequence(f"text:{path.name}:{n}", piece, [True] * (len(piece) - 1) + [False]))
    return out


# ------------------------------------------------------------------------------------------- the teacher


class DraftTeacher:
    """The draft as given, writing and scoring one batch of work items (``rows_of`` of
    :func:`specdraft.training.dump.write_dump`): prompts are answered and re-encoded, text pieces pass through.

    Args:
        draft: the draft as given (causal LM, its own tokenizer).
        draft_tokenizer / target_tokenizer: the two tokenizers.
        config: the :class:`~specdraft.core.config.SelfTeacherConfig`.
        mapping: a :class:`~specdraft.models.vocab.VocabMapping` of the pair (needed with ``token_level``).
    """

    def __init__(self, draft, draft_tokenizer, target_tokenizer, config: SelfTeacherConfig, mapping=None):

        self.draft, self.dtok, self.ttok, self.config, self.mapping = draft, draft_tokenizer, target_tokenizer, config, \
            mapping
        self.stops = set(answer_stop_ids(draft, draft_tokenizer))
        self.eot = end_of_turn_ids(target_tokenizer)
        self.draft_real = int(tokenizer_view(draft_tokenizer).real)
        self.target_real = int(tokenizer_view(target_tokenizer).real)
        self.ops = final_logit_ops(draft.config)
        self.twins = (mapping.target_to_draft >= 0).tolist() if mapping is not None else None
        self.stats = {"answers": 0, "ended": 0, "cut_ill_formed": 0, "soft_positions": 0, "hard_positions": 0}

    def __call__(self, batch: list, first: int) -> TeacherBatch:

        examples = [x for x in batch if isinstance(x, Example)]
        made: dict[int, tuple] = {}
        dropped = generated = 0
        seconds = 0.0
        if examples:
            answered, dropped, generated, seconds = self.answer(examples)
            made.update({id(ex): r for ex, r in zip(examples, answered, strict=True)})
        rows = []
        for x in batch:
            if isinstance(x, Example):
                if made[id(x)] is not None:
                    rows.append(made[id(x)])
            else:
                rows.append((x, hard_labels(x.ids, self.config.top_logprobs, self.target_real)))
        self.stats["hard_positions"] += sum(int(sum(q.loss_mask)) for q, _ in rows)
        return TeacherBatch(rows, dropped, generated, seconds)

    def answer(self, examples: list[Example]) -> tuple[list, int, int, float]:
        """The draft answers ``examples`` → per example ``(TokenSequence, signal)`` or None (truncation emptied it),
        the count of those, the tokens generated and the seconds generating took."""

        t0 = time.perf_counter()
        d_prompts, d_responses = generate_responses(self.draft, self.dtok, examples, self.config.generate,
                                                    real_vocab=self.draft_real)
        seconds = time.perf_counter() - t0
        t_prompts = encode_prompts(self.ttok, examples)
        answers, texts, endings = [], [], []
        for ex, r in zip(examples, d_responses, strict=True):
            ended = bool(r) and int(r[-1]) in self.stops
            body = list(r[:-1]) if ended else list(r)
            text, cut = well_formed_prefix(decode_text(self.dtok, body))
            ended = ended and not cut  # the stop came after the ill-formed bytes, not after the text kept
            self.stats["cut_ill_formed"] += cut
            ids = encode_answer(self.ttok, render_prompt(self.ttok, ex), text) + (self.eot if ended else [])
            answers.append(ids)
            texts.append((body, text))
            endings.append(ended)
        self.stats["answers"] += len(examples)
        self.stats["ended"] += sum(endings)
        # An answer the draft wrote nothing of (no text, no stop) trains nothing: its sequence is dropped, not refused.
        keep = [i for i, a in enumerate(answers) if a]
        seqs = sequences_from_responses([examples[i].id for i in keep], [t_prompts[i] for i in keep],
                                        [answers[i] for i in keep], True, self.config.max_length, self.config.truncate)
        out: list = [None] * len(examples)
        soft_jobs = []
        for i, q in zip(keep, seqs, strict=True):
            if q is None:
                continue
            signal = hard_labels(q.ids, self.config.top_logprobs, self.target_real)
            out[i] = (q, signal)
            if self.config.token_level:
                body, text = texts[i]
                pairs = aligned_positions(self.dtok, body, self.ttok, answers[i], text, self.twins, endings[i],
                                          self.eot)
                p_t, p_d = len(t_prompts[i]), len(d_prompts[i])
                n_text = len(answers[i]) - (len(self.eot) if endings[i] else 0)
                pairs = [(p_t + k - 1, p_d + j - 1, k == n_text) for k, j in pairs if p_t + k - 1 < len(q.ids) - 1
                         and q.loss_mask[p_t + k - 1]]
                self.stats["soft_positions"] += len(pairs)
                self.stats["hard_positions"] -= len(pairs)
                if pairs:
                    soft_jobs.append((signal, list(d_prompts[i]) + list(d_responses[i]), pairs))
        self._soften(soft_jobs)
        return out, len(examples) - sum(o is not None for o in out), sum(map(len, d_responses)), seconds

    def _soften(self, jobs: list) -> None:
        """Overwrite the hard labels at the aligned positions with the draft's mapped distribution: one right-padded
        draft pass over the draft sequences, the head applied at those positions only. ``jobs``: ``(signal, draft
        ids, [(target position, draft position, end of turn)])``."""
        import torch
        import torch.nn.functional as F
        from torch.nn.utils.rnn import pad_sequence


        if not jobs:
            return
        device = next(self.draft.parameters()).device
        ids = pad_sequence([torch.tensor(seq, dtype=torch.long) for _, seq, _ in jobs], batch_first=True,
                           padding_side="right").to(device)
        attn = pad_sequence([torch.ones(len(seq), dtype=torch.long) for _, seq, _ in jobs], batch_first=True,
                            padding_side="right").to(device)
        head = self.draft.get_output_embeddings()
        with torch.no_grad():
            h = self.draft.base_model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state  # [B,S,H]
            rows = torch.tensor([b for b, (_, _, pairs) in enumerate(jobs) for _ in pairs], device=device)
            cols = torch.tensor([d for _, _, pairs in jobs for _, d, _ in pairs], device=device)
            ends = torch.tensor([e for _, _, pairs in jobs for _, _, e in pairs], device=device)
            logits = apply_final_logit_ops(F.linear(h[rows, cols], head.weight, getattr(head, "bias", None)),
                                           self.ops).float()  # [N, V_d]
            logits[:, self.draft_real:] = float("-inf")
            logq = logits.log_softmax(dim=-1)
            if bool(ends.any()):
                # The draft stops by any of its stop ids; the stored sequence ends its turn with one token, so the
                # probability of stopping goes to that token's twin and none is left on another stop id's twin.
                stops = torch.tensor(sorted(s for s in self.stops if s < self.draft_real), device=device)
                twin = int(self.mapping.target_to_draft[self.eot[0]])
                stopping = logq[ends][:, stops].logsumexp(dim=-1)
                pooled = logq[ends].index_fill(1, stops, float("-inf"))
                pooled[:, twin] = stopping
                logq[ends] = pooled
            lp, tid, left = mapped_topk(logq, self.mapping, self.config.top_logprobs)
        n = 0
        for signal, _, pairs in jobs:
            at = torch.tensor([t for t, _, _ in pairs])
            signal["topk_logprobs"][at] = lp[n:n + len(pairs)].cpu()
            signal["topk_ids"][at] = tid[n:n + len(pairs)].to("cpu", torch.int32)
            signal["leftover_logmass"][at] = left[n:n + len(pairs)].cpu()
            n += len(pairs)


# ------------------------------------------------------------------------------------------- the dump



def run_self_teacher(draft_ref: str | os.PathLike, target_ref: str | os.PathLike,
                     data: str | os.PathLike | Sequence[str] | PromptSet | list[Example] | None,
                     out: str | os.PathLike,
                     config: SelfTeacherConfig | None = None, texts: Sequence[str | os.PathLike] = (),
                     progress: ProgressFn | None = None, command: str | None = None) -> dict[str, Any]:
    """Write a self-teacher dump: the draft as given answers ``data``'s prompts, its answers re-encoded in the
    target's tokenizer, plus ``texts``; resumes a killed run.

    Args:
        draft_ref: the draft as given (embedded name, local directory, cached hub id): the teacher.
        target_ref: the target, for its tokenizer, chat template and config only (no weights are read).
        data: the prompts, as :func:`specdraft.training.dump.run_dump` takes them (a repeated one dropped: the draft answers
            greedily); None with ``texts`` alone.
        out: the dump directory (new, empty, or a dump of this very plan: resumed or verified).
        config: settings (default :class:`SelfTeacherConfig`).
        texts: plain text files, extra sequences with hard labels at every position.
        progress: ``progress(done_items, total_items, tokens_this_run)`` after each batch.
        command: recorded in the manifest (default ``sys.argv``).

    Returns:
        The manifest (``out/manifest.json``) plus ``this_run`` (:func:`specdraft.training.dump.run_dump`'s) and ``signal``:
        the counts of this run (``answers``, ``ended`` by a stop id, trained ``soft_positions`` / ``hard_positions``).

    Raises:
        DumpError: nothing to dump, a directory holding other files or a dump of another teacher, tokenizer, prompts,
            texts or settings (each differing field named; nothing touched), ``top_logprobs`` at or past the real vocabulary,
            ``token_level`` for a pair with no usable overlap.
        specdraft.data.sources.DataError: a malformed spec, an unknown source or a spec that gives no prompts
            (:func:`specdraft.data.prompts.select_prompts`), a template that refuses a prompt.
    """
    from transformers import AutoConfig


    config = config or SelfTeacherConfig()
    t_start = time.time()
    chosen = teacher_prompts(data, config.distinct_prompts) if data is not None else None
    examples = chosen.examples if chosen is not None else []
    d_path, t_path = resolve(draft_ref), resolve(target_ref)
    ttok = load_tokenizer(t_path)
    t_real = int(tokenizer_view(ttok).real)
    if config.top_logprobs >= t_real:
        raise DumpError(f"--top-logprobs {config.top_logprobs} must be below the real vocabulary ({t_real})")
    pieces = text_sequences(ttok, texts, config.max_length)
    items: list = [*examples, *pieces]
    if not items:
        raise DumpError("no prompts and no text: nothing to dump.")
    tcfg = AutoConfig.from_pretrained(t_path)
    width = int(getattr(tcfg.get_text_config(decoder=True), "vocab_size", None) or t_real)
    t_facts = {"architectures": getattr(tcfg, "architectures", None), "model_type": tcfg.model_type,
               "hidden_size": getattr(tcfg, "hidden_size", None),
               "num_hidden_layers": getattr(tcfg, "num_hidden_layers", None)}
    text_files = [[Path(p).name, hashlib.sha256(Path(p).read_bytes()).hexdigest()] for p in texts]
    teacher = {"kind": SELF_TEACHER_KIND, "ref": str(draft_ref), "weights": model_fingerprint(d_path),
               "revision": model_revision(d_path), "tokenizer_fingerprint": tokenizer_fingerprint(load_tokenizer(d_path)),
               "rendering": rendering_identity(d_path)}  # the draft renders its prompts and ends its answers
    identity = {"teacher": teacher, "tokenizer_fingerprint": tokenizer_fingerprint(ttok), "target_config": t_facts,
                "settings": config.plan_settings(), "topk_storage": TOPK_STORAGE,
                "data_fingerprint": sha256_json([[[e.id, e.messages, e.reference] for e in examples], text_files]),
                **{f"target_{k}": v for k, v in rendering_identity(t_path).items()}}  # the target renders the prompt
    header = {
        "kind": "specdraft-teacher-dump", "format_version": FORMAT_VERSION,
        "target": {"ref": str(target_ref), "resolved": t_path, "revision": model_revision(t_path), **t_facts,
                   "dtype": None, "vocab_width": width, "real_vocab": min(t_real, width)},
        "teacher": teacher,
        "tokenizer_fingerprint": identity["tokenizer_fingerprint"], "head_fingerprint": None,
        "format": "topk", "dtype": dict(TOPK_STORAGE), "top_k": config.top_logprobs,
        "final_norm_applied": None, "final_norm": None, "logit_transform": [],
        "loss_mask_convention": LOSS_MASK_CONVENTION,
        "leftover_rule": ("uniform over the real-vocabulary ids outside the top-k (teacher_probs_from_topk); 0 at hard "
                          "labels"),
        "signal": ("hard labels (slot 0 the next token at log-prob 0, leftover -inf)"
                   + ("; the draft's mapped distribution where twins and boundaries align" if config.token_level
                      else "")),
        **(data_record(chosen) if chosen is not None else {"data": None, "data_counts": None}),
        "texts": text_files, "config": config.model_dump(),
        "command": command if command is not None else " ".join(sys.argv), "versions": versions(),
    }
    made: dict[str, DraftTeacher] = {}

    def load_teacher():
        draft, dtok = load_model(d_path, dtype=config.dtype)
        mapping = build_vocab_mapping(t_path, d_path) if config.token_level else None
        made["teacher"] = DraftTeacher(draft, dtok, ttok, config, mapping)
        return made["teacher"]

    manifest = write_dump(out, items, load_teacher, identity, header, config, progress=progress, t_start=t_start)
    manifest["signal"] = dict(made["teacher"].stats) if made else None
    return manifest
