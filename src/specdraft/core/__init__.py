"""Settings, files, statistics, acceptance accounting, the sampling filter and the losses: the ground floor.

``config`` (every command's settings, pydantic), ``io`` (atomic writes, digests, machine facts), ``stats``
(bootstrap intervals), ``acceptance`` (counts → α, accepted length, speed-up), ``sampling`` (the top-k/top-p
filter), ``losses`` (soft_ce, tvd, tvd_deploy), ``progress``, ``embedded`` (the packaged models).

May import: nothing else of specdraft but its own modules. ``config``, ``acceptance`` and ``embedded`` are read
when ``specdraft --help`` starts, so they import no torch at their top.
"""
