"""The main job's stage runner: skip a stage done with the same inputs, refuse (or redo) one whose inputs changed,
time each, and name the stage and the resume command when one fails (:class:`Runner`)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdraft.io import atomic_write_text

_LOG = logging.getLogger("specdraft")


class PipelineError(RuntimeError):
    """A stage failed; the message names the stage and the command that resumes."""


def stage_key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def changed_inputs(old: Any, new: Any, path: str = "") -> list[str]:
    """What differs between a stage's recorded inputs and today's, one ``path: before → after`` per leaf (dicts by
    key; a list by its items: how many were added and removed). Under ``prompt_texts`` only the prompts on both
    sides are compared: one added or removed is already counted by the ``prompts`` id list beside it."""
    new = json.loads(json.dumps(new, sort_keys=True, default=str))  # as recorded in stage.json
    if isinstance(old, dict) and isinstance(new, dict):
        # A prompt (or set) added or removed is named by the id list beside its texts ("prompts").
        keys = set(old) & set(new) if path.split(".")[0] == "prompt_texts" else set(old) | set(new)
        return [c for k in sorted(keys, key=str)
                for c in changed_inputs(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))]
    if old == new:
        return []
    # A list of ids (a prompt set) by its counts; one of numbers (stop ids) by its values.
    if isinstance(old, list) and isinstance(new, list) and not all(isinstance(x, int) for x in old + new):
        added = sum(1 for x in new if x not in old)
        removed = sum(1 for x in old if x not in new)
        return [f"{path or 'inputs'}: {len(old)} → {len(new)} items ({added} new, {removed} gone)"]
    short = lambda v: (s if len(s := json.dumps(v, default=str)) <= 40 else s[:37] + "...")
    return [f"{path or 'inputs'}: {short(old)} → {short(new)}"]


class Runner:
    """Runs stages with skip-if-done, timing and clear failure messages.

    A stage already finished in ``out`` with other inputs is refused (naming what changed), or redone from an
    emptied directory with ``overwrite``: two runs' files never mix in one stage directory (a dump of other prompts
    would otherwise meet the old one's shards)."""

    def __init__(self, out: Path, command: str, log: Callable[[str], None] = _LOG.info, overwrite: bool = False):
        self.out = out
        self.command = command
        self.log = log
        self.overwrite = overwrite
        self.timings: dict[str, dict[str, Any]] = {}

    def stage(self, name: str, inputs: Any, fn: Callable[[Path], Any], parse: Callable[[dict[str, Any]], Any] | None = None
              ) -> Any:
        """``fn(d)``'s result (a dict, or a typed result whose ``to_dict`` is written to ``stage.json``); a stage
        finished earlier with the same inputs gives back its recorded result, through ``parse`` (the typed result's
        ``from_dict``) when given."""
        d = self.out / name
        marker = d / "stage.json"
        key = stage_key(inputs)
        if marker.is_file():
            saved = json.loads(marker.read_text())
            if saved.get("key") == key:
                self.timings[name] = {"seconds": saved.get("seconds", 0.0), "skipped": True}
                self.log(f"[{name}] done earlier with the same inputs — skipped")
                return parse(saved["result"]) if parse else saved["result"]
            changes = changed_inputs(saved.get("inputs"), inputs) or ["the stage's key (inputs not recorded)"]
            what = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
            if not self.overwrite:
                raise PipelineError(f"{self.out} holds a finished '{name}' stage made from other inputs ({what}). "
                                    f"Pass --overwrite to redo '{name}' and the stages after it there, or choose a "
                                    "new --out.")
            self.log(f"[{name}] inputs changed ({what}) — --overwrite: redoing it")
            shutil.rmtree(d)
        left = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
        d.mkdir(parents=True, exist_ok=True)
        # A stage killed before its marker was written left its files: the stage continues from them (distill
        # resumes its newest checkpoint, dump keeps its verified shards), so the line says so.
        self.log(f"[{name}] resuming: an unfinished run left files in {d} ({', '.join(left[:3])}"
                 f"{' …' if len(left) > 3 else ''})" if left else f"[{name}] running…")
        t0 = time.time()
        try:
            result = fn(d)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            raise PipelineError(f"stage '{name}' failed: {type(exc).__name__}: {exc}\n"
                                f"Fix the cause, then resume with: {self.command}") from exc
        seconds = time.time() - t0
        record = result.to_dict() if hasattr(result, "to_dict") else result
        atomic_write_text(marker, json.dumps({"key": key, "inputs": inputs, "seconds": seconds, "result": record},
                                             indent=2, default=str))
        self.timings[name] = {"seconds": seconds, "skipped": False}
        self.log(f"[{name}] finished in {seconds:.1f} s")
        return result
