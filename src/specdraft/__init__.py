"""specdraft — speculative decoding with an independent draft model.

Notation, used everywhere in this package:

* **target** (verifier): the large model whose outputs must not change; its next-token distribution is **p**.
* **draft**: the small model that proposes tokens; its distribution is **q**.
* **γ** (``num_speculative_tokens``): draft tokens proposed per round, verified by one target pass.
* **α** = Σ_x min(p(x), q(x)) = 1 − TV(p, q): the probability that a drafted token is accepted under
  speculative sampling (Leviathan et al. 2023, §3.1; Chen et al. 2023).

Heavy modules (torch, transformers) are imported lazily by the submodules that need them.
"""

__version__ = "0.1.0"

# Public API, imported lazily (PEP 562) so that `import specdraft` and the CLI's --help stay instant.
_EXPORTS = {
    "load_model": "specdraft.models.loading",
    "resolve": "specdraft.models.loading",
    "load_examples": "specdraft.data.sources",
    "encode_prompts": "specdraft.data.sources",
    "check_compatible": "specdraft.models.check",
    "CompatReport": "specdraft.models.check",
    "VocabMapping": "specdraft.models.vocab",
    "build_vocab_mapping": "specdraft.models.vocab",
    "vocab_swap": "specdraft.models.vocab",
    "save_vocab_swap": "specdraft.models.vocab",
    "speculative_generate": "specdraft.decoding.decode",
    "target_generate": "specdraft.decoding.decode",
    "left_pad": "specdraft.models.tokens",
    "AcceptanceCounts": "specdraft.core.acceptance",
    "expected_speedup": "specdraft.core.acceptance",
    "best_gamma": "specdraft.core.acceptance",
    "run_eval": "specdraft.measuring.evaluate",
    "predicted_alpha": "specdraft.decoding.replay",
    "measure_speed_model": "specdraft.decoding.calibration",
    "SpeedModel": "specdraft.decoding.speed",
    "prepare_draft": "specdraft.decoding.draft_model",
    "frequent_tokens": "specdraft.decoding.draft_model",
    "ratio_ci": "specdraft.core.stats",
    "paired_difference_ci": "specdraft.core.stats",
    "SamplingConfig": "specdraft.core.config",
    "filter_logits": "specdraft.core.sampling",
    "LOSSES": "specdraft.core.losses",
    "run_dump": "specdraft.training.dump",
    "TeacherDataset": "specdraft.models.dump_reader",
    "DistillConfig": "specdraft.core.config",
    "DumpConfig": "specdraft.core.config",
    "EvalConfig": "specdraft.core.config",
    "ExportConfig": "specdraft.core.config",
    "PipelineConfig": "specdraft.core.config",
    "export_draft": "specdraft.serving.export",
    "export_speculator": "specdraft.serving.export",
    "export_gguf": "specdraft.serving.gguf_export",
    "rank_candidates": "specdraft.measuring.rank",
    "run_check": "specdraft.models.check",
    "run_distill": "specdraft.training.distill",
    "IndependentSpeculator": "specdraft.decoding.speculator_model",
    "IndependentSpeculatorConfig": "specdraft.models.speculator",
    "load_speculator_config": "specdraft.models.speculator",
    "run_pipeline": "specdraft.run.pipeline",
    "forecast_headroom": "specdraft.measuring.headroom",
    "run_headroom": "specdraft.measuring.headroom",
    "HeadroomConfig": "specdraft.core.config",
}
__all__ = ["__version__", *_EXPORTS]  # noqa: PLE0604 - keys of a str-keyed dict


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specdraft' has no attribute {name!r}")


def __dir__() -> list[str]:  # the lazy names too, for dir() and completion
    return sorted({*globals(), *_EXPORTS})
