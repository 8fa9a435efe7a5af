"""Progress as plain lines, for where no terminal draws bars (CI logs, ``nohup``, a pipe): the first item, then at
most every ``every_s`` seconds, and the last."""

from __future__ import annotations

import time
from collections.abc import Callable


def progress_lines(log: Callable[[str], None], label: str, unit: str = "prompts", every_s: float = 30.0,
                   clock: Callable[[], float] = time.monotonic) -> Callable[..., None]:
    """A ``progress(done, total, *rest)`` callback writing ``"{label}: {done}/{total} {unit} ({s} s)"``."""
    start = clock()
    last: list[float | None] = [None]

    def progress(done: int, total: int, *_: object) -> None:
        now = clock()
        if last[0] is None or done >= total or now - last[0] >= every_s:
            last[0] = now
            log(f"{label}: {done}/{total} {unit} ({now - start:.0f} s)")

    return progress
