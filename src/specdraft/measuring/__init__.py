"""Measuring a pair: acceptance and speed evaluation, headroom, the llama.cpp ranking, the engine
recommendation and the reports.

``evaluate`` (``specdraft eval``), ``certify`` (sampled decoding's χ² test), ``headroom`` (what distillation
can add), ``rank`` (drafts, best first), ``recommend`` (what to serve where), ``pair`` (a loaded pair for
generate), ``report`` and ``eval_report`` (the main job's and eval's reports).

May import: the layers below (core, data, models, decoding, serving); not training.
"""
