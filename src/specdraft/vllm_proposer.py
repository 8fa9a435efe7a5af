"""vLLM's entry point to the text proposer: the ``custom_class`` path every exported text speculator records
(:data:`specdraft.serving.vllm_proposer.PROPOSER_CLASS`), kept at the package's top so it outlives moves inside it.
The proposer itself lives in :mod:`specdraft.serving.vllm_proposer`."""

from specdraft.serving.vllm_proposer import ProposerError, TextProposer

__all__ = ["ProposerError", "TextProposer"]
