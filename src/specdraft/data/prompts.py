"""Prompt sources as every command names them: one spec, ``name[:offset[:limit[:stride]]]``, one parser, one loader.

Training flags read a missing offset as 0, limit as all, stride as 1; held-out flags start a spec without an offset
at the dataset's held-out split (:data:`specdraft.data.sources.HELD_OUT_OFFSET`) and take :data:`HELD_OUT_LIMIT` prompts
without a limit. A malformed spec is a :class:`PromptSpecError` naming the flag, the bad part and the grammar. No
torch import. Which flag means which: docs/architecture.md#specdraftdataprompts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from specdraft.data import sources as data
from specdraft.data.sources import DataError, Example, MissingSourceError

SPEC_GRAMMAR = "name[:offset[:limit[:stride]]]"
#: The grammar without a stride (``dump``).
SPEC_GRAMMAR_NO_STRIDE = "name[:offset[:limit]]"
#: Prompts a held-out spec without a limit takes.
HELD_OUT_LIMIT = 8

_PARTS = ("offset", "limit", "stride")
_LEAST = {"offset": 0, "limit": 1, "stride": 1}
_DIGITS = re.compile(r"[0-9]+")


class PromptSpecError(DataError):
    """A prompt spec that does not parse; the message names the flag, the bad part and the grammar."""


class PromptSource(NamedTuple):
    """One parsed spec: ``(name, offset, limit, stride)``, ``limit`` None = all.
    ``parse_source("humaneval:100:4") == ("humaneval", 100, 4, 1)``."""

    name: str
    offset: int = 0
    limit: int | None = None
    stride: int = 1

    @property
    def spec(self) -> str:
        """The shortest spec that parses back to this source (``humaneval:100:8``)."""
        parts = [self.name, str(self.offset)]
        if self.limit is not None or self.stride != 1:
            parts.append(str(self.limit if self.limit is not None else 10**9))
        if self.stride != 1:
            parts.append(str(self.stride))
        return ":".join(parts)

    def replace(self, **changes) -> PromptSource:
        return self._replace(**changes)

    def load(self) -> list[Example]:
        """The examples, in source order; :class:`DataError` for an unknown source, a bad line or none."""
        return [e for _, e in self._rows()[0][: self.limit]]

    def _rows(self) -> tuple[list[tuple[int, Example]], int]:
        """``([(row, example)] kept, the source's row count)``."""
        # Looked up at call time: tests may stand in for data.load_examples.
        examples = data.load_examples(self.name, offset=self.offset)
        return list(enumerate(examples, self.offset))[:: self.stride], self.offset + len(examples)


def _split(spec: str) -> tuple[str, list[str]]:
    """``(name, the parts after it)``; a path may hold ':' (the longest existing path prefix is the name)."""
    if Path(spec).expanduser().exists():
        return spec, []
    parts = spec.split(":")
    for i in range(len(parts) - 1, 0, -1):
        if Path(":".join(parts[:i])).expanduser().exists():
            return ":".join(parts[:i]), parts[i:]
    return parts[0], parts[1:]


def _parse(spec: str, flag: str, strides: bool) -> tuple[str, dict[str, int]]:
    """``(name, the numbers written, by part)``; :class:`PromptSpecError` for a malformed spec."""
    grammar = SPEC_GRAMMAR if strides else SPEC_GRAMMAR_NO_STRIDE
    example = "humaneval:100:8" + (" or mt-bench:0:27:3" if strides else "")

    def bad(what: str) -> PromptSpecError:
        return PromptSpecError(f"{flag} {spec!r}: {what}; write {grammar}, e.g. {example}")

    if not spec.strip():
        raise bad("the spec is empty")
    name, texts = _split(spec)
    if not name.strip():
        raise bad("the name is empty")
    allowed = _PARTS if strides else _PARTS[:2]
    if len(texts) > len(allowed):
        extra = texts[len(allowed):]
        many = "one part too many" if len(extra) == 1 else f"{len(extra)} parts too many"
        why = many if strides else "no stride here, every example of the range is kept"
        raise bad(f"{':'.join(extra)!r} after the {allowed[-1]}: {why}")
    written = {}
    for part, text in zip(allowed, texts, strict=False):
        if not text:
            raise bad(f"the {part} is empty")
        if not _DIGITS.fullmatch(text):
            raise bad(f"the {part} {text!r} is not a whole number >= {_LEAST[part]}")
        if int(text) < _LEAST[part]:
            raise bad(f"the {part} {text} is below {_LEAST[part]}" + (" (every stride-th example is kept)"
                                                                    if part == "stride" else ""))
        written[part] = int(text)
    return name, written


def _resolve(spec: str, held_out: bool, flag: str, strides: bool) -> tuple[PromptSource, int | None]:
    """``(the source as the flag means it, the limit the spec wrote)``."""
    name, written = _parse(spec, flag, strides)
    offset, limit, stride = written.get("offset", 0), written.get("limit"), written.get("stride", 1)
    if held_out:
        if "offset" not in written:
            offset, stride = data.held_out_offset(name), data.held_out_stride(name)
        if limit is None:
            limit = HELD_OUT_LIMIT
    return PromptSource(name, offset, limit, stride), written.get("limit")


def parse_source(spec: str, flag: str = "--prompts", strides: bool = True) -> PromptSource:
    """``spec`` as training reads it (offset 0, all, stride 1 by default); ``strides=False``: no stride part.
    Raises :class:`PromptSpecError` (names ``flag``, the bad part and the grammar)."""
    return _resolve(spec, False, flag, strides)[0]


def resolve_source(spec: str, held_out: bool = False, flag: str = "--prompts", strides: bool = True) -> PromptSource:
    """``spec`` as the flag means it: :func:`parse_source`, or with ``held_out`` the held-out defaults.
    Raises :class:`PromptSpecError`."""
    return _resolve(spec, held_out, flag, strides)[0]


@dataclass(frozen=True)
class SourcePick:
    """What one spec gave: as ``written``, the resolved ``source``, the ``limit`` written (None: a
    default), the rows kept (0-based), the source's row ``total`` and the ``repeats`` dropped."""

    written: str
    source: PromptSource
    limit: int | None
    rows: tuple[int, ...]
    total: int
    repeats: int = 0

    def spec(self, strides: bool = True) -> str:
        """The full spec of what was read, limit and stride written out: ``mt-bench:0:80:1``."""
        s = self.source
        parts = [s.name, str(s.offset), str(s.limit if s.limit is not None else len(self.rows))]
        return ":".join(parts + [str(s.stride)] if strides else parts)


@dataclass(frozen=True)
class PromptSet:
    """The examples one prompt ``flag`` selected (:func:`select_prompts`): per-spec ``picks``, the
    ``examples`` in order, and whether the flag is ``held_out`` and has ``strides``."""

    flag: str
    held_out: bool
    picks: tuple[SourcePick, ...]
    examples: list[Example]
    strides: bool = True

    @property
    def sources(self) -> list[PromptSource]:
        return [p.source for p in self.picks]

    def _held_out_note(self) -> str:
        """``, held out`` when every row is in its dataset's held-out split, else how many are not."""
        if not self.held_out:
            return ""
        verdicts = [(p.source.name, data.is_held_out(p.source.name, r)) for p in self.picks for r in p.rows]
        if verdicts and all(v for _, v in verdicts):
            return ", held out"
        outside = [name for name, v in verdicts if v is False]
        if not outside:
            return ""
        some = "not held out" if len(outside) == len(verdicts) else f"{len(outside)} not held out"
        return f"; {some}: {data.held_out_split_text(outside[0])}"

    def lines(self) -> list[str]:
        """What will run (``prompts: humaneval:100:8:1 (8 prompts, held out)``), then a ``warning:`` per
        spec that gave fewer prompts than its limit. None for an empty flag."""
        if not self.picks:
            return []
        label = self.flag.lstrip("-").replace("-", " ")
        n = len(self.examples)
        specs = " + ".join(p.spec(self.strides) for p in self.picks)
        out = [f"{label}: {specs} ({n} prompt{'' if n == 1 else 's'}{self._held_out_note()})"]
        for p in self.picks:
            if p.limit is not None and len(p.rows) < p.limit:
                why = f"{p.source.name} has {p.total} rows" + (f"; {p.repeats} repeated prompts dropped"
                                                                  if p.repeats else "")
                out.append(f"warning: {self.flag} {p.written} gives {len(p.rows)} prompt"
                           f"{'' if len(p.rows) == 1 else 's'}, not {p.limit} ({why})")
        return out


def select_prompts(specs: str | Sequence[str], flag: str = "--prompts", held_out: bool = False, unique: bool = False,
                   strides: bool = True) -> PromptSet:
    """The examples of one spec or several, in order, each as ``flag`` means it (:func:`resolve_source`).

    With ``unique`` a repeated prompt is dropped before the limit counts (greedy answers to it would repeat).
    Raises :class:`PromptSpecError` for a malformed spec and :class:`DataError` for an unknown source, a bad line, an
    offset past the end or a repeated prompt id (each named with its specs and rows).
    """
    specs = [specs] if isinstance(specs, str) else list(specs)
    resolved = [_resolve(spec, held_out, flag, strides) for spec in specs]  # every spec parsed before any read
    picks, examples, seen = [], [], set()
    for spec, (source, written_limit) in zip(specs, resolved, strict=True):
        try:
            rows, total = source._rows()
        except DataError as exc:
            if str(exc).startswith("Unknown prompt source"):  # a file's error names its path and line already
                raise DataError(f"{flag} {spec!r}: {exc}") from exc
            if isinstance(exc, MissingSourceError):  # `--prompts nosuch.jsonl: no such file`
                raise DataError(f"{flag} {exc}") from None
            raise
        repeats = 0
        if unique:
            fresh = []
            for row, e in rows:
                key = json.dumps(e.prompt_messages, sort_keys=True)
                if key in seen:
                    repeats += 1
                    continue
                seen.add(key)
                fresh.append((row, e))
            rows = fresh
        rows = rows[: source.limit]
        if not rows:
            raise DataError(f"{flag} {spec!r} gave no prompts ({source.name} has {total} rows"
                            f"{f'; {repeats} repeated prompts dropped' if repeats else ''}).")
        picks.append(SourcePick(spec, source, written_limit, tuple(r for r, _ in rows), total, repeats))
        examples += [e for _, e in rows]
    _check_unique_ids(flag, picks, examples)
    return PromptSet(flag, held_out, tuple(picks), examples, strides)


def teacher_prompts(data: str | os.PathLike | Sequence[str] | PromptSet | Sequence[Example], distinct: bool,
                    flag: str = "--prompts", strides: bool = True) -> PromptSet:
    """The prompts a teacher dump is made of: ``dump --prompts S`` and ``run --train-prompts S`` agree.

    ``data``: spec(s) as a training flag reads them, a :class:`PromptSet`, or examples kept as given (no ``picks``);
    ``distinct``: drop repeated prompts (the teacher answers greedily). Raises as :func:`select_prompts`.
    """
    if isinstance(data, PromptSet):
        return data
    if isinstance(data, (str, os.PathLike)):
        return select_prompts(str(data), flag, unique=distinct, strides=strides)
    data = list(data)
    if data and all(isinstance(d, (str, os.PathLike)) for d in data):
        return select_prompts([str(d) for d in data], flag, unique=distinct, strides=strides)
    return PromptSet(flag, False, (), data, strides)


def _check_unique_ids(flag: str, picks: Sequence[SourcePick], examples: list[Example]) -> None:
    """Refuse an id that occurs twice among a flag's examples, before any model loads: results pair
    by id. Raises :class:`DataError` naming each repeat's spec and row."""
    where: dict[str, list[str]] = {}
    it = iter(examples)
    for p in picks:
        for row in p.rows:
            where.setdefault(next(it).id, []).append(f"{p.written} row {row}")
    repeated = {eid: places for eid, places in where.items() if len(places) > 1}
    if not repeated:
        return
    named = "; ".join(f"{eid!r} at {', '.join(places)}" for eid, places in list(repeated.items())[:3])
    more = f" (and {len(repeated) - 3} more)" if len(repeated) > 3 else ""
    raise DataError(f"{flag}: {len(repeated)} prompt id(s) occur more than once: {named}{more}. Results are paired "
                    "by id, so each prompt needs its own: give the rows distinct 'id' fields, rename one of two "
                    "files that share a name, or name each file and row range once.")


def load_prompts(specs: str | Sequence[str], held_out: bool = False, unique: bool = False,
                 flag: str = "--prompts") -> list[Example]:
    """The examples of one spec or several, in order (:func:`select_prompts` without its account)."""
    return select_prompts(specs, flag, held_out, unique).examples
