"""Models, tokenizers and their files: loading, the compatibility check, vocabulary maps, the speculator
format and the teacher dump's reader.

``loading`` (references → HF models), ``weights`` (checkpoint layouts), ``tokens`` (padding, stop ids,
detokenizing), ``tokenizer_view`` (one tokenizer read once), ``vocab`` (two tokenizers: the mapping and
vocab-swap), ``segmentation``, ``check`` (can two checkpoints work together), ``restricted_head``,
``speculator`` (the on-disk ``speculators_*`` contract), ``dump_reader`` (teacher dumps).

May import: :mod:`specdraft.core`, :mod:`specdraft.data`.
"""
