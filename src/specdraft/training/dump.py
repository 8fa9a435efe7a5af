"""Teacher dump writer: the target's distribution p over many sequences, computed once and stored in shards.

Many drafts (q) are distilled from one dump later, on other machines. :func:`run_dump` picks the sequences (the
prompts' own replies, or the target's answers with ``generate``), runs :class:`specdraft.training.teacher.Teacher` over them in
batches and writes shards plus a manifest; :func:`write_dump` is the same writer for another teacher
(:mod:`specdraft.training.self_teacher`, :mod:`specdraft.training.as_given_teacher`). Row position j holds p(· | ids[0..j]) and
``loss_mask[j]`` says whether it is trained. A killed run resumes (shards verified by sha256), a directory of another
plan is refused naming what differs, and under ``accelerate launch`` / ``torchrun`` each rank writes its own shards
that rank 0 merges. Memory: one batch plus one shard buffer. Reading is :mod:`specdraft.models.dump_reader`.

The on-disk contract (formats ``hidden`` / ``topk``, the leftover and cut rules, files, manifest):
docs/architecture.md#specdrafttrainingdump.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.core.config import DumpConfig, SamplingConfig, recorded_settings
from specdraft.core.io import atomic_path, atomic_write_text, sha256_json, versions
from specdraft.core.sampling import check_context, check_token_ids, check_windows
from specdraft.data.prompts import PromptSet, teacher_prompts
from specdraft.data.sources import (
    DataError,
    TokenSequence,
    build_sequences,
    encode_prompts,
    sequences_from_responses,
    source_counts,
)
from specdraft.decoding.responses import generate_responses
from specdraft.models.dump_reader import (
    FORMAT_VERSION,
    HEAD_FILE,
    MANIFEST,
    DumpError,
    head_fingerprint,
    head_tensors,
    load_manifest,
    sha256_file,
    shard_problem,
)
from specdraft.models.loading import (
    load_model,
    load_tokenizer,
    model_fingerprint,
    model_revision,
    rendering_identity,
    resolve,
)
from specdraft.models.tokenizer_view import tokenizer_fingerprint
from specdraft.training.teacher import TOPK_STORAGE, Row, Teacher, real_vocab_size, signal_rows

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from specdraft.data.sources import Example


LOSS_MASK_CONVENTION = "loss_mask[j]: the prediction made at position j (of token j+1) is trained"


# --------------------------------------------------------------------------------------------- helpers



def split_work(n: int, rank: int, world_size: int, batch_size: int = 1) -> range:
    """The items of one rank: a contiguous block of whole batches, so ranks in order cover 0..n−1 in order.

    Batch b is items ``[b·B, (b+1)·B)`` whatever W, and rank r takes batches ``[nb·r // W, nb·(r+1) // W)`` of
    ``nb = ⌈n / B⌉``: W ranks write what one process writes, at most one batch apart.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
    nb = -(-n // batch_size)
    lo, hi = nb * rank // world_size, nb * (rank + 1) // world_size
    return range(min(lo * batch_size, n), min(hi * batch_size, n))


_COUNTS = ("sequences", "tokens", "trained_tokens", "truncated", "dropped", "bytes")


def merge_manifests(rank_states: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the per-rank states of one dump into its manifest (pure: no file is read).

    Shards listed rank by rank (global order = example order), counts summed, rank 0's header kept.

    Raises:
        DumpError: a rank missing, duplicated or unfinished, or ranks of different plans.
    """
    if not rank_states:
        raise DumpError("no rank states to merge")
    states = sorted(rank_states, key=lambda s: s["rank"])
    world = states[0]["world_size"]
    ranks = [s["rank"] for s in states]
    if ranks != list(range(world)):
        raise DumpError(f"expected one state per rank 0..{world - 1}, got ranks {ranks}")
    for s in states:
        if s["plan"] != states[0]["plan"] or s["world_size"] != world:
            raise DumpError(f"rank {s['rank']} belongs to another dump plan than rank 0")
        if s["status"] != "complete":
            raise DumpError(f"rank {s['rank']} has not finished ({len(s['shards'])} shards so far)")
    shards = [dict(sh, rank=s["rank"]) for s in states for sh in s["shards"]]
    manifest = dict(states[0]["header"])
    manifest.update(status="complete", plan=states[0]["plan"], world_size=world,
                    **{c: sum(sh[c] for sh in shards) for c in _COUNTS})
    # Sequences dropped while building them (before the split) are counted once, by rank 0.
    manifest["dropped"] += sum(s.get("dropped_before_split", 0) for s in states)
    manifest["bytes_per_token"] = manifest["bytes"] / manifest["tokens"] if manifest["tokens"] else None
    for s in states:
        if s["header"].get("final_norm"):
            manifest["final_norm"] = s["header"]["final_norm"]
            manifest["final_norm_applied"] = s["header"]["final_norm_applied"]
            break
    manifest["shards"] = shards
    manifest["runs"] = [dict(r, rank=s["rank"]) for s in states for r in s.get("runs", [])]
    return manifest


# ------------------------------------------------------------------------------------------ the writer


def _shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:05d}-{index:05d}.safetensors"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _write_shard(path: Path, rows: list[Row], meta: dict[str, Any]) -> tuple[str, int]:
    """Concatenate rows into one safetensors file, written atomically; returns (sha256, bytes)."""
    import torch
    from safetensors.torch import save_file

    lens = torch.tensor([0] + [len(r.seq.ids) for r in rows], dtype=torch.int64)
    tensors = {
        "offsets": lens.cumsum(0),
        "input_ids": torch.tensor([i for r in rows for i in r.seq.ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for r in rows for m in r.seq.loss_mask], dtype=torch.bool),
    }
    for name in rows[0].signal:
        tensors[name] = torch.cat([r.signal[name] for r in rows]).contiguous()
    # One metadata key: safetensors writes several in hash order, and shards should be byte-reproducible.
    meta = {"specdraft": json.dumps(dict(meta, ids=[r.seq.id for r in rows]), sort_keys=True)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
        sha, size = sha256_file(tmp)
    return sha, size


def _own_file(name: str) -> bool:
    return (name in (MANIFEST, HEAD_FILE) or name.startswith((".tmp-", "rank-", "shard-")))


def _identity_problems(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Each field of ``new`` that ``old`` (a dump's recorded identity) holds otherwise, named with both values; the
    settings on both sides are read without fields since retired (:func:`specdraft.core.config.recorded_settings`)."""
    old, new = ({**d, "settings": recorded_settings(d["settings"])} if isinstance(d.get("settings"), dict) else d
                for d in (old, new))
    return [f"{k}: the directory holds {old.get(k)!r}, this run has {new.get(k)!r}"
            for k in new if old.get(k) != new.get(k)]


ProgressFn = Callable[[int, int, int], None]


@dataclass
class TeacherBatch:
    """What another teacher made of one batch of work items (:func:`write_dump`'s ``rows_of``).

    Attributes:
        rows: per kept sequence ``(TokenSequence, signal)``, ``signal`` the row's tensors on the CPU in their
            storage dtypes (:data:`specdraft.training.teacher.TOPK_STORAGE`).
        dropped: items of the batch that became no sequence (truncation emptied them).
        generated_tokens: tokens the teacher generated for the batch.
        generate_seconds: wall seconds of that generation (the rest of the call counts as teacher forward time).
    """

    rows: list[tuple[TokenSequence, dict[str, torch.Tensor]]]
    dropped: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0


RowsOf = Callable[[list, int], TeacherBatch]


def write_dump(out: str | os.PathLike, items: list, load_teacher: Callable[[], RowsOf], identity: dict[str, Any],
               header: dict[str, Any], config, progress: ProgressFn | None = None, dropped_before_split: int = 0,
               t_start: float | None = None) -> dict[str, Any]:
    """Write a teacher dump whose teacher is not the target: the shards, rank states, manifest, resume and refusals
    of :func:`run_dump`.

    Args:
        out: the dump directory (new, empty, or a dump of the very same plan: resumed or verified).
        items: the work items, split over ranks in whole batches of ``config.batch_size`` (:func:`split_work`).
        load_teacher: called once ``out`` is known to hold nothing of another plan (so a refused directory costs no
            model load); returns ``rows_of(batch, first) -> TeacherBatch``, ``first`` the index of the batch's first
            item in ``items`` (a redone shard sees the same batches as the first run).
        identity: what a resumed run must match (teacher, tokenizer, settings, data); ``world_size`` is added here.
        header: the manifest header as :func:`run_dump` writes it (``kind``, ``format``, ``dtype``, ``top_k``…).
        config: a settings model with ``teacher_format``, ``batch_size``, ``shard_size_mb`` and ``max_length``.
        progress: as :func:`run_dump`'s.

    Returns:
        The manifest plus ``this_run``, as :func:`run_dump` returns it.

    Raises:
        DumpError: a directory holding files of another kind or a dump of another identity (nothing touched), a dump
            every sequence of which truncation emptied.
    """
    t_start = time.time() if t_start is None else t_start
    out = Path(out)
    rank, world, barrier, _device = _distributed()
    mine = split_work(len(items), rank, world, config.batch_size)
    identity = dict(identity, world_size=world)
    if world > 1:
        identity["split_batch_size"] = config.batch_size
    identity = _check_out_dir(out, identity)
    rows_of = load_teacher()
    plan = sha256_json(identity)
    header = dict(header, identity=identity)
    writer = _RankWriter(out, rank, world, plan, identity, header, config, items, mine, dropped_before_split,
                         None, None, None, progress, rows_of=rows_of)
    writer.write_all(len(mine))
    return writer.finish(barrier, t_start)


def run_dump(target_ref: str | os.PathLike, data: str | os.PathLike | Sequence[str] | PromptSet | list[Example],
             out: str | os.PathLike,
             config: DumpConfig | None = None, progress: ProgressFn | None = None,
             command: str | None = None) -> dict[str, Any]:
    """Run the target once over each sequence and write the teacher dump (resuming a killed run).

    Args:
        target_ref: embedded name, local HF directory or cached hub id (:func:`specdraft.models.loading.resolve`).
        data: the prompts (:func:`specdraft.data.prompts.teacher_prompts`): one spec or several, read as ``dump
            --prompts`` reads them (with ``generate`` at temperature 0 a repeated prompt is dropped before the limit
            counts, as ``run --train-prompts`` drops it), a :class:`~specdraft.data.prompts.PromptSet`, or a list of
            :class:`specdraft.data.sources.Example` dumped as given.
        out: output directory (created; may hold an unfinished or finished dump of the same plan).
        config: settings (default :class:`DumpConfig`).
        progress: called after each batch as ``progress(done_items, total_items, tokens_this_run)`` — this
            rank's work items (sequences, or prompts with ``generate``) and tokens processed by this call.
        command: recorded in the manifest (default: ``sys.argv``).

    Returns:
        The manifest (``out/manifest.json``) plus ``"this_run"``: seconds, tokens and tokens/s of the forward
        passes and of generation, shards written / skipped / redone.

    Raises:
        DumpError: empty data, a directory holding another dump (nothing touched), a head input that cannot be
            captured, token ids past the target's rows, a sequence past its context window (named, before loading).
        specdraft.data.sources.DataError: a malformed or empty spec, a sequence over ``max_length`` with ``truncate=False``.
    """

    config = config or DumpConfig()
    out = Path(out)
    t_start = time.time()
    rank, world, barrier, device = _distributed()

    # ---- data ----------------------------------------------------------------------------------------------
    chosen = teacher_prompts(data, config.distinct_prompts)
    examples = chosen.examples
    if not examples:
        raise DumpError("the dataset is empty: nothing to dump.")
    resolved = resolve(target_ref)
    tokenizer = load_tokenizer(resolved)
    tok_fp, real_vocab = tokenizer_fingerprint(tokenizer), real_vocab_size(tokenizer)
    if config.teacher_format == "topk" and config.top_logprobs >= real_vocab:
        raise DumpError(f"--top-logprobs {config.top_logprobs} must be below the real vocabulary ({real_vocab}); use "
                        "--teacher-format hidden to keep whole distributions.")
    items, dropped_before_split = _work_items(tokenizer, examples, config)
    _check_token_widths(resolved, tokenizer, items, config)  # from the config: before any weight is loaded
    _check_windows(resolved, tokenizer, items, config)
    mine = split_work(len(items), rank, world, config.batch_size)
    n_mine = len(mine)

    # ---- identity: what a resumed run must match ----------------------------------------------------------
    target_facts = _target_facts(resolved)
    identity = {"tokenizer_fingerprint": tok_fp, "target_config": target_facts,
                "settings": config.plan_settings(), "world_size": world,
                "data_fingerprint": sha256_json([[e.id, e.messages, e.reference] for e in examples]),
                # The vocabulary's fingerprint leaves out how a conversation is rendered and where an answer ends: an
                # edited template or stop id resumed beside the old shards would mix two renderings in one dump.
                **{f"target_{k}": v for k, v in rendering_identity(resolved).items()}}
    if config.teacher_format == "topk":  # shards of another storage dtype (an older dump's float16) never mix with these
        identity["topk_storage"] = TOPK_STORAGE
    if world > 1:
        # Several ranks split the work in whole batches: another batch size would hand a resumed rank other items.
        identity["split_batch_size"] = config.batch_size
    identity = _check_out_dir(out, identity)  # before loading weights: fails fast on another target's dump

    # ---- the target -----------------------------------------------------------------------------------------
    model, _ = load_model(resolved, dtype=config.dtype, device=str(device) if device is not None else None)
    identity["head_fingerprint"] = head_fingerprint(model)  # dtype-dependent: also catches "auto" on new hardware
    # The whole target, not its head alone: a fine-tune of the body saved in place keeps path, config and head, and
    # its shards must not be resumed beside the old ones (nor a finished dump of it taken for this one's).
    identity["target_weights"], identity["target_revision"] = model_fingerprint(resolved), model_revision(resolved)
    identity = _check_out_dir(out, identity)
    plan = sha256_json(identity)
    teacher = Teacher(model, real_vocab)
    header = _header(target_ref, resolved, target_facts, teacher, tok_fp, identity, config, chosen, command)
    if rank == 0 and config.teacher_format == "hidden":
        header["head"] = _write_head(out, model)

    # ---- resume, write, save, finish ---------------------------------------------------------------------------
    writer = _RankWriter(out, rank, world, plan, identity, header, config, items, mine, dropped_before_split,
                         model, tokenizer, teacher, progress)
    writer.write_all(n_mine)
    return writer.finish(barrier, t_start)


class _RankWriter:
    """One rank's shards and state file: :meth:`resume` (trust only verified shards), :meth:`write_range` (items
    → shards), :meth:`save_state` (``rank-*.json``), :meth:`finish` (rank 0 merges the manifest)."""

    def __init__(self, out: Path, rank: int, world: int, plan: str, identity: dict[str, Any], header: dict[str, Any],
                 config: DumpConfig, items: list, mine: range, dropped_before_split: int, model, tokenizer,
                 teacher: Teacher | None, progress: ProgressFn | None, rows_of: RowsOf | None = None):

        self.out, self.rank, self.world, self.plan = out, rank, world, plan
        self.identity, self.header, self.config = identity, header, config
        self.items, self.mine, self.n_mine, self.dropped_before_split = items, mine, len(mine), dropped_before_split
        self.model, self.tokenizer, self.teacher, self.progress = model, tokenizer, teacher, progress
        self.rows_of = rows_of  # another teacher's batches (write_dump); None: the target's (teacher)
        self.sampling = SamplingConfig(temperature=config.temperature) if rows_of is None else None
        self.limit = config.shard_size_mb * 1e6

    def write_all(self, n_mine: int) -> None:
        """Resume, redo the shards found bad, write the rest of this rank's ``n_mine`` items, mark it complete."""
        self.resume()
        t_work = time.time()
        self.report()
        for rec in self.bad:
            self.records.remove(rec)
            self.write_range(rec["start"], rec["end"], rec["index"], one_shard=True)
        if self.next_item < n_mine:
            self.write_range(self.next_item, n_mine, self.next_index, one_shard=False)
        self.run["seconds"] = round(time.time() - t_work, 3)
        self.save_state("complete")

    def resume(self) -> None:
        """Read this rank's state: shards that verify are kept, the others are to be redone (:attr:`bad`); temporary
        files of a killed writer are removed; this run's record is started."""
        out, rank, header = self.out, self.rank, self.header
        state = _load_rank_state(out, rank, self.plan)
        if state and state["header"].get("final_norm"):
            header["final_norm"] = state["header"]["final_norm"]
            header["final_norm_applied"] = state["header"]["final_norm_applied"]
        records: list[dict[str, Any]] = list(state["shards"]) if state else []
        bad = []
        for rec in records:
            if problem := shard_problem(out, rec):
                warnings.warn(f"specdraft dump: {problem}; redoing it", stacklevel=3)
                bad.append(rec)
        stale = [*out.glob(f".tmp-shard-r{rank:05d}-*"), *out.glob(f".tmp-rank-{rank:05d}*")]
        if rank == 0:
            stale += [*out.glob(f".tmp-{MANIFEST}-*"), *out.glob(f".tmp-{HEAD_FILE}-*")]
        for tmp in stale:
            tmp.unlink(missing_ok=True)  # left by a killed writer; never read
        self.records, self.bad = records, bad
        self.next_item = max((r["end"] for r in records), default=0)
        self.next_index = max((r["index"] + 1 for r in records), default=0)
        self.run = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": header["command"], "tokens": 0,
                    "forward_seconds": 0.0, "generated_tokens": 0, "generate_seconds": 0.0, "shards_written": 0,
                    "shards_skipped": len(records) - len(bad), "shards_redone": len(bad)}
        self.runs = (state.get("runs", []) if state else []) + [self.run]
        self.done = sum(r["end"] - r["start"] for r in records if r not in bad)

    def save_state(self, status: str) -> None:
        header = self.header
        if self.teacher is not None and self.teacher.checked:
            header["final_norm"], header["final_norm_applied"] = self.teacher.final_norm, True
        body = {"kind": "specdraft-teacher-dump-rank", "rank": self.rank, "world_size": self.world, "plan": self.plan,
                "status": status, "identity": self.identity, "header": header, "items": self.n_mine,
                "dropped_before_split": self.dropped_before_split if self.rank == 0 else 0,
                "shards": sorted(self.records, key=lambda r: r["start"]), "runs": self.runs}
        atomic_write_text(self.out / _rank_file(self.rank), json.dumps(body, indent=1))

    def report(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.n_mine, self.run["tokens"])

    def write_range(self, start: int, end: int, index: int, one_shard: bool) -> None:
        """This rank's items [start, end) → shards numbered from ``index`` (exactly one when redoing)."""
        config, run, teacher = self.config, self.run, self.teacher
        buf: list[Row] = []
        buf_start, dropped = start, 0
        for s in range(start, end, config.batch_size):
            stop = min(s + config.batch_size, end)
            batch = [self.items[self.mine[i]] for i in range(s, stop)]
            t0 = time.perf_counter()
            if self.rows_of is not None:
                made = self.rows_of(batch, self.mine[s])
                seqs = [q for q, _ in made.rows]
                buf.extend(Row(q, signal) for q, signal in made.rows)
                dropped += made.dropped
                run["generated_tokens"] += made.generated_tokens
                run["generate_seconds"] += made.generate_seconds
                run["forward_seconds"] += time.perf_counter() - t0 - made.generate_seconds
            else:
                if config.generate is None:
                    seqs = batch
                else:
                    seqs, n_drop, n_new = _generated(self.model, self.tokenizer, batch, config, self.sampling,
                                                     self.mine[s], teacher.real_vocab)
                    dropped += n_drop
                    run["generated_tokens"] += n_new
                    run["generate_seconds"] += time.perf_counter() - t0
                t1 = time.perf_counter()
                buf.extend(signal_rows(teacher, seqs, config))
                run["forward_seconds"] += time.perf_counter() - t1
            self.done += len(batch)
            run["tokens"] += sum(len(q.ids) for q in seqs)
            if stop == end or (not one_shard and sum(r.nbytes for r in buf) >= self.limit):
                self.records.append(_flush(self.out, self.rank, index, buf, buf_start, stop, dropped, config))
                run["shards_written"] += bool(buf)
                buf, buf_start, index, dropped = [], stop, index + 1, 0
                self.save_state("running")
            self.report()

    def finish(self, barrier: Callable[[], None], t_start: float) -> dict[str, Any]:
        """After every rank: rank 0 merges the manifest (when a shard was written or none exists); all read it back,
        with ``this_run`` of this process added."""
        out, run = self.out, self.run
        barrier()
        if self.rank == 0 and (run["shards_written"] or not (out / MANIFEST).is_file()):
            states = [json.loads((out / _rank_file(r)).read_text()) for r in range(self.world)]
            merged = merge_manifests(states)
            if not merged["sequences"]:
                merged["status"] = "empty"  # never "complete": a reader must not take it for data to train on
            atomic_write_text(out / MANIFEST, json.dumps(merged, indent=1))
        barrier()
        manifest = load_manifest(out)
        if manifest.get("status") == "empty":  # every rank reads it, so all of them stop together
            raise DumpError(f"every one of the {manifest['dropped']} sequences lost its trained positions to "
                            f"truncation at --max-length {self.config.max_length} (with --generate, the target's "
                            f"answers were cut away): {out} holds nothing to train on. Raise --max-length or give "
                            "shorter prompts, with a new --out.")
        fwd, gen = run["forward_seconds"], run["generate_seconds"]
        manifest["this_run"] = {
            "seconds": time.time() - t_start, "work_seconds": run["seconds"], "tokens": run["tokens"],
            "tokens_per_s": run["tokens"] / fwd if fwd else None,  # teacher forward passes only
            "generated_tokens": run["generated_tokens"],
            "generate_tokens_per_s": run["generated_tokens"] / gen if gen else None,
            **{k: run[k] for k in ("shards_written", "shards_skipped", "shards_redone")}}
        return manifest


def data_record(chosen: PromptSet) -> dict[str, Any]:
    """The manifest's account of a dump's prompts: ``data``, the specs as written (``conversations:0:32``; joined by
    `` + ``) or ``"<examples>"`` for examples given as a list, and ``data_counts``, what the reader of a source read
    record by record skipped and kept (:func:`specdraft.data.sources.source_counts`; None for the others)."""

    counts = next((c for p in chosen.picks if (c := source_counts(p.source.name))), None)
    return {"data": " + ".join(p.written for p in chosen.picks) or "<examples>", "data_counts": counts}


def _work_items(tokenizer, examples: list, config: DumpConfig) -> tuple[list, int]:
    """What the ranks split: token sequences (teacher-forced data), or the examples themselves (the target writes
    the answers, ``generate``); and how many examples were dropped before the split."""

    if config.generate is None:
        items = [_compact(q) for q in
                 build_sequences(tokenizer, examples, config.answer_only, config.max_length, config.truncate)]
        if not items:
            raise DumpError(f"all {len(examples)} sequences lost every trained position to truncation at "
                            f"--max-length {config.max_length}: nothing to dump.")
        return items, len(examples) - len(items)
    prompts = encode_prompts(tokenizer, examples)
    if not config.truncate:
        for ex, p in zip(examples, prompts, strict=True):
            if len(p) + config.generate > config.max_length:
                raise DataError(f"{ex.id}: prompt ({len(p)} tokens) + --generate {config.generate} may exceed "
                                f"--max-length {config.max_length} (pass --truncate, or raise --max-length).")
    # A prompt of --max-length tokens or more keeps no generated token once cut: known now, before the target loads.
    full = [ex.id for ex, p in zip(examples, prompts, strict=True) if len(p) >= config.max_length]
    if full:
        shortest = min(map(len, prompts))
        what = (f"all {len(examples)} prompts are" if len(full) == len(examples) else
                f"{len(full)} of {len(examples)} prompts ({', '.join(full[:3])}{', …' if len(full) > 3 else ''}) are")
        problem = (f"{what} --max-length {config.max_length} tokens or longer: the target's answers to them would be "
                   "truncated away")
        if len(full) == len(examples):
            raise DumpError(f"{problem}, leaving nothing to dump. Raise --max-length above {shortest} + --generate "
                            f"({shortest + config.generate}) or give shorter prompts.")
        warnings.warn(f"specdraft dump: {problem} and those rows dropped (raise --max-length to keep them)",
                      stacklevel=3)
    return examples, 0


def _check_token_widths(resolved: str, tokenizer, items: list, config: DumpConfig) -> None:
    """Refuse token ids past the target's embedding / head rows (``vocab_size``): named, before loading it."""
    from transformers import AutoConfig


    tcfg = AutoConfig.from_pretrained(resolved)
    width = getattr(tcfg.get_text_config(decoder=True), "vocab_size", None)
    if width is None:
        return
    ids = [q.ids for q in items] if config.generate is None else encode_prompts(tokenizer, items)
    check_token_ids(ids, [("target", (int(width), int(width)))], what="the sequences to dump", error=DumpError)


def _check_windows(resolved: str, tokenizer, items: list, config: DumpConfig) -> None:
    """Refuse sequences past the target's context window (:func:`specdraft.core.sampling.check_context`, the rule decoding
    applies): the longest named with both lengths, before loading it. With ``generate`` the target's own decoding
    needs each prompt + N + 1 positions."""
    from transformers import AutoConfig


    tcfg = AutoConfig.from_pretrained(resolved)
    if config.generate is None:
        check_windows([q.ids for q in items], [("target", tcfg)], f"lower --max-length (now {config.max_length}) to "
                      "fit it.", names=[q.id for q in items], error=DumpError)
        return
    prompts = encode_prompts(tokenizer, items)
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    need = len(prompts[i]) + config.generate + 1
    check_context(need, [("target", tcfg)], f"prompt {items[i].id!r} ({len(prompts[i])} tokens) + --generate "
                  f"({config.generate}) + 1 = {need}", "lower --generate or shorten the prompts.", error=DumpError)


def _target_facts(resolved: str) -> dict[str, Any]:
    """The target's architecture facts a resumed dump must match (read from its config, no weights)."""
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(resolved)
    return {"architectures": getattr(tcfg, "architectures", None), "model_type": tcfg.model_type,
            "hidden_size": getattr(tcfg, "hidden_size", None),
            "num_hidden_layers": getattr(tcfg, "num_hidden_layers", None)}


def _header(target_ref, resolved: str, target_facts: dict, teacher, tok_fp: str, identity: dict,
            config: DumpConfig, chosen: PromptSet, command: str | None) -> dict[str, Any]:
    """The manifest header: what made the dump and how to read it (see the on-disk contract above)."""
    return {
        "kind": "specdraft-teacher-dump", "format_version": FORMAT_VERSION,
        "target": {"ref": str(target_ref), "resolved": resolved, "revision": identity["target_revision"],
                   **target_facts, "dtype": str(teacher.weight.dtype).removeprefix("torch."),
                   "vocab_width": teacher.width, "real_vocab": teacher.real_vocab},
        "tokenizer_fingerprint": tok_fp, "head_fingerprint": identity["head_fingerprint"],
        "format": config.teacher_format,
        "dtype": ({"hidden": config.hidden_dtype} if config.teacher_format == "hidden" else
                  dict(TOPK_STORAGE)),
        "top_k": config.top_logprobs if config.teacher_format == "topk" else None,
        "final_norm_applied": None, "final_norm": None,  # known after the first batch (Teacher.hidden)
        "logit_transform": teacher.ops,  # applied to lm_head(h) by every reader (teacher_logits_from_hidden)
        "loss_mask_convention": LOSS_MASK_CONVENTION,
        "leftover_rule": ("uniform over the real-vocabulary ids outside the top-k (teacher_probs_from_topk)"
                          if config.teacher_format == "topk" else None),
        **data_record(chosen), "config": config.model_dump(), "identity": identity,
        "command": command if command is not None else " ".join(sys.argv), "versions": versions(),
    }


def _distributed() -> tuple[int, int, Callable[[], None], Any]:
    """(rank, world size, barrier, device): accelerate's PartialState under ``accelerate launch`` / ``torchrun``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, (lambda: None), None
    import torch
    from accelerate import PartialState

    # Without cpu=True accelerate leaves CPU-only launches undistributed: every process would be rank 0.
    state = PartialState(cpu=not torch.cuda.is_available())
    if state.num_processes != world:
        raise DumpError(f"WORLD_SIZE is {world} but accelerate set up {state.num_processes} process(es); "
                        "refusing to let several processes write as one rank.")
    return state.process_index, state.num_processes, state.wait_for_everyone, state.device


def _check_out_dir(out: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """Refuse a directory holding anything but a dump of this very plan; touch nothing in it.

    Returns:
        ``identity``, or where the directory's dump records settings that differ from it only by fields since retired
        (:func:`specdraft.core.config.recorded_settings`), ``identity`` with those recorded settings: its plan is the
        recorded one, so that dump verifies and resumes.
    """
    if out.exists() and not out.is_dir():
        raise DumpError(f"--out {out} is a file, not a directory.")
    if not out.is_dir():
        return identity
    foreign = sorted(p.name for p in out.iterdir() if not _own_file(p.name))
    if foreign:
        raise DumpError(f"--out {out} holds files that are not part of a teacher dump ({', '.join(foreign[:5])}); "
                        "choose an empty or new directory. Nothing was changed.")
    for path in [out / MANIFEST, *sorted(out.glob("rank-*.json"))]:
        if not path.is_file():
            continue
        old = json.loads(path.read_text()).get("identity", {})
        problems = _identity_problems(old, identity)
        if problems:
            other_target = any(p.startswith(("target_", "head_fingerprint", "tokenizer")) for p in problems)
            what = "a dump of another target" if other_target else "a dump made with other settings or data"
            raise DumpError(f"--out {out} holds {what} ({path.name}): " + "; ".join(problems)
                            + ". Choose another --out; nothing was changed.")
        if "settings" in identity:
            identity = dict(identity, settings=old["settings"])
    return identity


def _load_rank_state(out: Path, rank: int, plan: str) -> dict[str, Any] | None:
    path = out / _rank_file(rank)
    if path.is_file():
        state = json.loads(path.read_text())
        return state if state.get("plan") == plan else None
    if (out / MANIFEST).is_file():  # rank file lost: its shard records are in the manifest
        m = json.loads((out / MANIFEST).read_text())
        if m.get("plan") == plan:
            return {"shards": [r for r in m["shards"] if r["rank"] == rank], "header": m,
                    "runs": [r for r in m.get("runs", []) if r.get("rank") == rank]}
    return None


def _write_head(out: Path, model) -> dict[str, Any]:
    """Save the output head (and final norm weight) beside the shards so the dump needs no target to read."""
    from safetensors.torch import save_file

    tensors = {k: v.cpu().contiguous() for k, v in head_tensors(model).items()}
    path = out / HEAD_FILE
    if path.is_file():
        from safetensors.torch import load_file

        if head_fingerprint(load_file(str(path))) != head_fingerprint(tensors):
            raise DumpError(f"--out {out} holds the output head of another target ({HEAD_FILE}); choose another "
                            "--out. Nothing was changed.")
        sha, size = sha256_file(path)
        return {"file": HEAD_FILE, "sha256": sha, "bytes": size}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
        sha, size = sha256_file(tmp)
    return {"file": HEAD_FILE, "sha256": sha, "bytes": size}


def _compact(seq: TokenSequence) -> TokenSequence:
    """The same sequence with its ids as int32 and its mask as bytes (5 bytes per token), so the work list of a
    large dataset stays small."""
    from array import array


    return TokenSequence(seq.id, array("i", seq.ids), array("b", seq.loss_mask), seq.truncated)  # type: ignore[arg-type]


def _generated(model, tokenizer, batch: list[Example], config: DumpConfig, sampling, first: int, real_vocab: int,
               ) -> tuple[list[TokenSequence], int, int]:
    """The target answers the batch → (kept sequences, dropped by truncation, tokens generated)."""

    # The seed depends on the batch's first item, so a resumed run regenerates a redone shard the same way.
    prompts, responses = generate_responses(model, tokenizer, batch, config.generate, sampling,
                                            seed=config.seed + first, real_vocab=real_vocab)
    seqs = sequences_from_responses([e.id for e in batch], prompts, responses, config.answer_only,
                                    config.max_length, config.truncate)
    kept = [s for s in seqs if s is not None]
    return kept, len(seqs) - len(kept), sum(map(len, responses))


def _flush(out: Path, rank: int, index: int, rows: list[Row], start: int, end: int, dropped: int,
           config: DumpConfig) -> dict[str, Any]:
    """Write one shard and return its record. With no rows (truncation emptied them all) no file is written,
    but the record keeps the range done and its drop count."""
    name, sha, size = None, None, 0
    if rows:
        name = _shard_name(rank, index)
        sha, size = _write_shard(out / name, rows, {"format": config.teacher_format, "rank": rank})
    return {"file": name, "index": index, "start": start, "end": end, "sha256": sha, "bytes": size,
            "sequences": len(rows), "tokens": sum(len(r.seq.ids) for r in rows),
            "trained_tokens": sum(sum(r.seq.loss_mask) for r in rows),
            "truncated": sum(r.seq.truncated for r in rows), "dropped": dropped}

