"""Prompt sources as every command names them: one spec, ``name[:offset[:limit[:stride]]]``.

The syntax is the pipeline's (:func:`specdraft.pipeline.parse_source`): every ``stride``-th example of ``name`` from
``offset`` on, at most ``limit`` of them. An evaluation (``held_out=True``) reads a spec without an offset from an
embedded dataset's held-out split (:data:`specdraft.data.HELD_OUT_OFFSET`: humaneval 100, the prompts before it are
the presets' training prompts), a file from its first line; training reads it from the first example.

No torch import: a command checks its prompts before any model is prepared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from specdraft import data
from specdraft.data import Example


@dataclass(frozen=True)
class PromptSource:
    """One parsed spec: ``name`` (an embedded dataset, a ``.jsonl``, a saved dataset), the examples skipped first
    (``offset``), the most kept (``limit``, ``None`` = all) and the step between kept examples (``stride``)."""

    name: str
    offset: int = 0
    limit: int | None = None
    stride: int = 1

    @property
    def spec(self) -> str:
        """The spec that parses back to this source (``humaneval:100:8``)."""
        parts = [self.name, str(self.offset)]
        if self.limit is not None or self.stride != 1:
            parts.append(str(self.limit if self.limit is not None else 10**9))
        if self.stride != 1:
            parts.append(str(self.stride))
        return ":".join(parts)

    def replace(self, **changes) -> PromptSource:
        return dataclasses.replace(self, **changes)

    def load(self) -> list[Example]:
        """The examples, in source order.

        Raises:
            DataError: an unknown source, a malformed line (named), or an empty result.
        """
        # Looked up at call time (data.load_examples), as every command reads it: tests may stand in for it.
        if self.stride == 1:
            return data.load_examples(self.name, limit=self.limit, offset=self.offset)
        return data.load_examples(self.name, offset=self.offset)[::self.stride][:self.limit]


def resolve_source(spec: str, held_out: bool = False) -> PromptSource:
    """``spec`` parsed; with ``held_out`` a spec without an offset starts at the source's held-out split."""
    from specdraft.pipeline import parse_source

    name, offset, limit, stride = parse_source(spec)
    if held_out and name == spec:  # no offset written
        offset = data.held_out_offset(name)
    return PromptSource(name, offset, limit, stride)


def load_prompts(specs: str | Sequence[str], held_out: bool = False) -> list[Example]:
    """The examples of one spec or several, in order (:func:`resolve_source`, :meth:`PromptSource.load`).

    Raises:
        DataError: as :meth:`PromptSource.load`.
    """
    specs = [specs] if isinstance(specs, str) else specs
    return [e for spec in specs for e in resolve_source(spec, held_out).load()]
