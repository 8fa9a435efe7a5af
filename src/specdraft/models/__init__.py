"""Models, tokenizers and their files: loading, the compatibility check, vocabulary maps, the speculator
format and the teacher dump's reader.

May import: :mod:`specdraft.core`, :mod:`specdraft.data`.
"""
