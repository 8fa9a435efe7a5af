"""Measuring a pair: acceptance and speed evaluation, headroom, the llama.cpp ranking, the engine
recommendation and the reports.

May import: the layers below (core, data, models, decoding, serving); not training.
"""
