"""The main job's stage runner: a stage declared once (:class:`Stage`), walked in order (:func:`walk`); a stage done
with the same inputs is skipped, one whose inputs changed refused (or redone), each timed, and a failure names the
stage and the resume command (:class:`Runner`)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.core.io import atomic_write_text

_LOG = logging.getLogger("specdraft")


class PipelineError(RuntimeError):
    """A stage failed; the message names the stage and the command that resumes."""


def stage_key(obj: Any) -> str:
    """A stage's cache key: the first 16 hex digits of the SHA-256 of its inputs as sorted-key JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def as_record(result: Any) -> Any:
    """A stage's result as ``stage.json`` and ``report.json`` hold it: a typed result's ``to_dict()``, a dict as is."""
    return result.to_dict() if hasattr(result, "to_dict") else result


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
        atomic_write_text(marker, json.dumps({"key": key, "inputs": inputs, "seconds": seconds, "result": as_record(result)},
                                             indent=2, default=str))
        self.timings[name] = {"seconds": seconds, "skipped": False}
        self.log(f"[{name}] finished in {seconds:.1f} s")
        return result


@dataclass(frozen=True)
class Input:
    """One part of a stage's cache key, read from the job: ``{key: value(job)}``, or with ``key`` None the dict
    ``value(job)`` merged in; left out where ``when(job)`` is false."""

    key: str | None
    value: Callable[[Any], Any]
    when: Callable[[Any], bool] | None = None

    def of(self, job: Any) -> dict[str, Any]:
        if self.when is not None and not self.when(job):
            return {}
        value = self.value(job)
        return value if self.key is None else {self.key: value}


def _dump(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


def config(key: str, path: str | None = None, when: Callable[[Any], bool] | None = None) -> Input:
    """The config field at ``path`` (dotted, default ``key``) of ``job.cfg``, a settings model as its dict."""
    def value(job: Any) -> Any:
        obj = job.cfg
        for part in (path or key).split("."):
            obj = getattr(obj, part)
        return _dump(obj)

    return Input(key, value, when)


def computed(key: str | None, value: Callable[[Any], Any], when: Callable[[Any], bool] | None = None) -> Input:
    """A value the job derives (an identity, a prompt list, an upstream result's field)."""
    return Input(key, value, when)


def upstream(stage: str) -> Input:
    """An earlier stage's whole key under its name: this stage is redone whenever that one is."""
    return Input(stage, lambda job: job.inputs[stage])


def extends(stage: str) -> Input:
    """An earlier stage's key merged in: this stage reads what that one read, and more."""
    return Input(None, lambda job: job.inputs[stage])


@dataclass(frozen=True)
class Stage:
    """A stage of the main job, declared once: everything that runs, caches, resumes and reports it reads this.

    ``inputs`` form the cache key (:func:`stage_key` of their merged dict, recorded in ``stage.json``); ``run(job,
    d)`` writes into ``OUT/<name>/`` and returns the result (a dict, or a ``result`` type with ``to_dict`` /
    ``from_dict``); ``section(report)`` gives the stage's lines of ``report.md``; ``when(job)`` false skips it (its
    result None); ``after(job, result)`` runs on a fresh or a recorded result alike (checks, the next stages'
    settings)."""

    name: str
    inputs: tuple[Input, ...]
    run: Callable[[Any, Path], Any]
    result: type | None = None
    section: Callable[[dict[str, Any]], list[str]] | None = None
    when: Callable[[Any], bool] | None = None
    after: Callable[[Any, Any], None] | None = None

    def key_inputs(self, job: Any) -> dict[str, Any]:
        return {k: v for part in self.inputs for k, v in part.of(job).items()}


def walk(runner: Runner, stages: tuple[Stage, ...], job: Any) -> None:
    """Run ``stages`` in order through ``runner``, each result in ``job.results[name]`` and each key's inputs in
    ``job.inputs[name]`` (what later stages' :func:`upstream` / :func:`extends` read)."""
    for s in stages:
        if s.when is not None and not s.when(job):
            job.results[s.name] = None
            continue
        job.inputs[s.name] = s.key_inputs(job)
        job.results[s.name] = runner.stage(s.name, job.inputs[s.name], lambda d, s=s: s.run(job, d),
                                           parse=s.result.from_dict if s.result else None)
        if s.after is not None:
            s.after(job, job.results[s.name])
