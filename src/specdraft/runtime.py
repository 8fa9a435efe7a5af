"""Process settings that must be made before torch is imported.

CPU decoding runs thousands of small operations per second: a one-token step of the 0.5B int4 draft is about 170
matrix products and 24 attention calls, each a parallel region of torch's OpenMP thread pool. Threads that sleep
between regions (GNU libgomp's behaviour here: ``OMP_WAIT_POLICY`` unset behaves like ``PASSIVE``) pay a wake-up at
every region. Measured on 2 cores (``bench/bench_decode.py``): the draft step 29 ms passive vs 18.5 ms active; the
1.5B target's token 145–150 ms vs 135–150 ms. Spinning threads only pay off when the process has the cores to
itself: on a machine shared with other busy processes they compete for the cores (a draft step was once measured at
1.55 s), so set ``OMP_WAIT_POLICY=PASSIVE`` there. The user's own setting always wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping


def prefer_active_wait(environ: MutableMapping[str, str] | None = None) -> str:
    """Set ``OMP_WAIT_POLICY=ACTIVE`` unless it is set already or this process is one rank of several
    (``WORLD_SIZE`` > 1: torchrun / accelerate launch, whose ranks share the cores).

    Only has an effect before torch (libgomp) is loaded; the CLI calls it at import. Libraries importing specdraft
    are never changed by it.

    Args:
        environ: the environment to edit (default ``os.environ``).

    Returns:
        The policy in effect for a torch loaded afterwards (``"ACTIVE"``, the user's value, or ``"unset"``).
    """
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" not in env and int(env.get("WORLD_SIZE", "1") or 1) <= 1:
        env["OMP_WAIT_POLICY"] = "ACTIVE"
    return env.get("OMP_WAIT_POLICY", "unset")
