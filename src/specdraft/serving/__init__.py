"""Shipping a draft: the speculator and plain exports, GGUF for llama.cpp, vLLM's plugin and text proposer.

May import: the layers below (core, data, models, decoding).
"""
