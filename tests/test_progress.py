"""Progress lines where no terminal draws bars."""

from __future__ import annotations

from specdraft.core.progress import progress_lines


def test_progress_lines_write_the_first_the_last_and_one_per_interval():
    now, lines = [0.0], []
    cb = progress_lines(lines.append, "[eval_before] held_out", every_s=30, clock=lambda: now[0])
    for k, t in enumerate((1, 10, 31, 40, 62, 63), start=1):
        now[0] = t
        cb(k, 6, 123)  # a dump passes a token count too
    assert lines == ["[eval_before] held_out: 1/6 prompts (1 s)", "[eval_before] held_out: 3/6 prompts (31 s)",
                     "[eval_before] held_out: 5/6 prompts (62 s)", "[eval_before] held_out: 6/6 prompts (63 s)"]

