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
    "load_model": "specdraft.models",
    "resolve": "specdraft.models",
    "load_examples": "specdraft.data",
    "encode_prompts": "specdraft.data",
    "check_compatible": "specdraft.check",
    "CompatReport": "specdraft.check",
    "VocabMapping": "specdraft.vocab",
    "build_vocab_mapping": "specdraft.vocab",
    "vocab_swap": "specdraft.vocab",
    "save_vocab_swap": "specdraft.vocab",
    "speculative_generate": "specdraft.decode",
    "target_generate": "specdraft.decode",
    "left_pad": "specdraft.tokens",
    "AcceptanceCounts": "specdraft.acceptance",
    "expected_speedup": "specdraft.acceptance",
    "best_gamma": "specdraft.acceptance",
    "run_eval": "specdraft.evaluate",
    "predicted_alpha": "specdraft.replay",
    "measure_speed_model": "specdraft.calibration",
    "SpeedModel": "specdraft.speed",
    "prepare_draft": "specdraft.draft_model",
    "frequent_tokens": "specdraft.draft_model",
    "ratio_ci": "specdraft.stats",
    "paired_difference_ci": "specdraft.stats",
    "SamplingConfig": "specdraft.config",
    "filter_logits": "specdraft.sampling",
    "LOSSES": "specdraft.losses",
    "run_dump": "specdraft.dump",
    "TeacherDataset": "specdraft.dump_reader",
    "DistillConfig": "specdraft.config",
    "DumpConfig": "specdraft.config",
    "EvalConfig": "specdraft.config",
    "ExportConfig": "specdraft.config",
    "PipelineConfig": "specdraft.config",
    "export_draft": "specdraft.export",
    "export_speculator": "specdraft.export",
    "run_check": "specdraft.check",
    "run_distill": "specdraft.distill",
    "IndependentSpeculator": "specdraft.speculator_model",
    "IndependentSpeculatorConfig": "specdraft.speculator",
    "load_speculator_config": "specdraft.speculator",
    "run_pipeline": "specdraft.pipeline",
    "forecast_headroom": "specdraft.headroom",
    "run_headroom": "specdraft.headroom",
    "HeadroomConfig": "specdraft.config",
}
__all__ = ["__version__", *_EXPORTS]  # noqa: PLE0604 - keys of a str-keyed dict


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specdraft' has no attribute {name!r}")
