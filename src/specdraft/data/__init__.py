"""Prompt and conversation sources by name, and the prompt selector every command reads its prompts through.

``sources`` (the registry of datasets, chat encoding, training sequences), ``prompts`` (``NAME:START:N:STRIDE``
specs, held-out splits). Both are read when ``specdraft --help`` starts: no torch at their top.

May import: :mod:`specdraft.core`.
"""
