"""Speculative decoding and its costs.

``decode`` (the loop: draft, verify, roll back; greedy and sampled verification), ``drafters`` (who proposes:
the draft model, a mapped draft of another tokenizer), ``draft_model`` (the draft prepared: int8/int4, trimmed
head), ``replay`` (acceptance counted without decoding), ``responses`` (the target's answers), ``assisted``
(transformers' assisted generation), ``speculator_model`` (a speculator loaded as a model), ``speed`` (a round's
price and adaptive γ), ``calibration`` (the measured speed model), ``speed_run``, ``llama_cpp_price``.

May import: :mod:`specdraft.core`, :mod:`specdraft.data`, :mod:`specdraft.models`.
"""
