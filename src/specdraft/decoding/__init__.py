"""Speculative decoding and its costs: the drafters, the decoding loop and verification, the draft as
prepared for decoding, the speed model, its calibration and the llama.cpp price.

May import: :mod:`specdraft.core`, :mod:`specdraft.data`, :mod:`specdraft.models`.
"""
