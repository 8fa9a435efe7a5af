"""Shipping a draft: the speculator and plain exports, GGUF for llama.cpp, vLLM's plugin and text proposer.

``export`` (the speculator checkpoint), ``gguf_export`` and ``llama_cpp`` (llama.cpp's ``-md`` draft),
``vllm_plugin`` (vLLM's entry point: the ``independent`` speculator type), ``vllm_proposer`` (the text
proposer; ``specdraft/vllm_proposer.py`` at the package's top is only its stable class path).

May import: the layers below (core, data, models, decoding).
"""
