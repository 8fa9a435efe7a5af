"""Rules for text that specdraft writes for readers (docs, README, printed output): no machine's own paths, no
history. Used by the doc generators (``bench/run_all.py``, ``bench/llamacpp_check.py``, ``bench/module_map.py``)
and by ``tests/test_docs.py``, which greps the repository with the same patterns.

History (issue numbers, rounds, dates) lives in commit messages; result files under ``bench/results/`` keep the
date a measurement was taken as data, and the renderers leave it out.
"""

from __future__ import annotations

import re

#: "issue N", "Issue N's", "round N" (N a number): where a change came from, not what the code does.
HISTORY = re.compile(r"(?<![-\w])(issue|round)s? [0-9]+\b", re.IGNORECASE)
#: ISO dates (YYYY-MM-DD, digits).
DATE = re.compile(r"\b(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]\b")
#: A machine's own absolute paths: a reader's machine has other ones (docs use placeholders such as DIR, ~/.cache).
MACHINE_PATH = re.compile(r"(?<![\w.~$<>-])/(work|root|home|tmp|mnt|opt|Users)/[^\s`'\")\],;]*")


def history_hits(text: str) -> list[str]:
    """Every issue number, round number and ISO date in ``text``, in order."""
    return [m.group(0) for pat in (HISTORY, DATE) for m in pat.finditer(text)]


def machine_paths(text: str) -> list[str]:
    """Every absolute path of a particular machine in ``text``."""
    return [m.group(0) for m in MACHINE_PATH.finditer(text)]


def placeholders(text: str) -> str:
    """``text`` with a machine's own paths made general: a venv's ``…/.venv/bin/python`` → ``python``, a home
    directory's cache → ``~/.cache``, any other absolute path under /work, /root, /home, /tmp → its last part."""
    text = re.sub(r"(?<![\w.~-])/\S*?/\.venv[\w-]*/bin/", "", text)
    text = re.sub(r"(?<![\w.~-])/(root|home/[\w.-]+)/\.cache/", "~/.cache/", text)
    return MACHINE_PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1] or "DIR", text)


def without_history(text: str) -> str:
    """``text`` without the history that result files' free-text fields carry (a label's "(round N)", a note's
    "issue N item M: ", a source's ", YYYY-MM-DD morning"; N, M numbers): the data keep it, the docs do not."""
    text = re.sub(r"\s*\((issue|round)s? [0-9]+[^)]*\)", "", text, flags=re.IGNORECASE)
    text = re.sub(r"\b(issue|round)s? [0-9]+( item [0-9]+)?('s)?:?\s*", "", text, flags=re.IGNORECASE)
    text = re.sub(r"\(\s*" + DATE.pattern + r"[^;)]*;\s*", "(", text)
    text = re.sub(r",?\s*(on |measured )?" + DATE.pattern + r"( (morning|afternoon|evening|night))?", "", text)
    return text
