"""specdraft's vLLM plugin: ``python -m vllm.entrypoints.openai.api_server --model SPECULATOR_DIR`` serves the
verifier named in an independent speculator's config.json with that speculator as its draft.

The ``vllm.general_plugins`` entry point ``specdraft`` wraps vLLM's ``maybe_override_with_speculators`` for
``speculators_model_type == "independent"`` (:func:`plan_independent`); other models pass untouched. On vLLM's CPU
build it also repairs ``expand_kernel`` (:func:`repair_cpu_expand`). vLLM is imported inside functions only.
Why: docs/architecture.md#specdraftservingvllm_plugin.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A child of vLLM's logger, so these lines show with its own.
logger = logging.getLogger("vllm.specdraft")

#: The speculators_model_type this plugin serves.
INDEPENDENT = "independent"
#: The kernel vLLM's CPU build replaces with a broken op (its override-registry name).
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"

_cpu_expand: dict[str, bool | None] | None = None  # what repair_cpu_expand found, once per process


def plan_independent(config: dict[str, Any], model: str,
                     user_speculative_config: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """What vLLM should serve for the speculator at ``model``: ``(verifier, speculative_config)``.

    The verifier is :func:`specdraft.models.loading.serving_path` of the recorded one; the method is ``draft_model``, or
    ``custom_class`` with specdraft's proposer for a text speculator. ``user_speculative_config``'s keys win except
    ``method`` and ``model``. Raises :class:`specdraft.models.speculator.SpeculatorError` for an invalid speculator.
    """
    from specdraft.core.embedded import ModelResolutionError
    from specdraft.models.loading import serving_path
    from specdraft.models.speculator import IndependentSpeculatorConfig, SpeculatorError, read_config_json
    from specdraft.serving.export import vllm_speculative_config, vocab_width

    recorded = IndependentSpeculatorConfig.from_speculator_dict(config).speculators_config.verifier.name_or_path
    verifier = serving_path(str(recorded))
    try:
        verifier_width = vocab_width(read_config_json(verifier, role="verifier"))
    except (SpeculatorError, ModelResolutionError):  # not readable here: vLLM reads it and checks the widths
        verifier_width = None
    spec = vllm_speculative_config(config, model, verifier_width)
    dictated = {k: spec[k] for k in ("method", "model")}
    spec.update(user_speculative_config or {})
    spec.update(dictated)
    return verifier, spec


def read_model_config(model: str, revision: str | None = None, token: Any = None) -> dict[str, Any] | None:
    """The config.json dict of ``model`` (directory or cached hub id), or None when unreadable."""
    path = Path(model).expanduser()
    if path.is_dir():
        try:
            d = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return d if isinstance(d, dict) else None
    try:
        import huggingface_hub
        from transformers import PretrainedConfig

        d, _ = PretrainedConfig.get_config_dict(model, revision=revision, token=token,
                                                local_files_only=huggingface_hub.constants.HF_HUB_OFFLINE)
    except (OSError, ValueError):
        return None
    return d


def wrap(original: Callable[..., tuple[str, str | None, dict[str, Any] | None]]):
    """``original`` (vLLM's ``maybe_override_with_speculators``) taught the ``independent`` type."""
    if getattr(original, "__specdraft__", False):
        return original

    def maybe_override_with_speculators(model, tokenizer, trust_remote_code, revision=None,
                                        vllm_speculative_config=None, hf_token=None, **kwargs):
        config = read_model_config(str(model), revision, hf_token)
        if config is None or config.get("speculators_model_type") != INDEPENDENT:
            return original(model, tokenizer, trust_remote_code, revision=revision,
                            vllm_speculative_config=vllm_speculative_config, hf_token=hf_token, **kwargs)
        user = vllm_speculative_config if isinstance(vllm_speculative_config, dict) else None
        verifier, spec = plan_independent(config, str(model), user)
        if spec["method"] == "custom_class":
            from specdraft.serving.vllm_proposer import SPECULATOR_ENV

            # The proposer is built in the engine core, spawned after this: it inherits the variable.
            local = Path(str(model)).expanduser()
            os.environ[SPECULATOR_ENV] = str(local.absolute()) if local.is_dir() else str(model)
        logger.info("specdraft: %s is an independent speculator; serving verifier %s with speculative config %s",
                    model, verifier, json.dumps(spec))
        return verifier, verifier, spec

    maybe_override_with_speculators.__specdraft__ = True  # type: ignore[attr-defined]
    maybe_override_with_speculators.__wrapped__ = original  # type: ignore[attr-defined]
    return maybe_override_with_speculators


def expand_kernel_repaired(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """The rejection sampler's expand, written into ``output``: request i's value (``replace_to``
    where it is ``replace_from``) at its positions ``cu_num_tokens[i-1]:cu_num_tokens[i]``; vLLM's kernel's arguments.
    """
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # tokens per request
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = vals.repeat_interleave(counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def _expand_writes(impl) -> bool | None:
    """Whether ``impl`` writes its float output; None when vLLM's C++ ops are not loaded yet."""
    import torch

    out = torch.full((3,), -1.0)
    try:
        impl(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 0)
    except Exception:  # noqa: BLE001 - any failure of the engine's op leaves it unproven, so it is replaced
        return None
    return out.tolist() == [0.5, 2.0, 2.0]


def repair_cpu_expand() -> dict[str, bool | None]:
    """On vLLM's CPU build, put :func:`expand_kernel_repaired` in place of the CPU expand op unless
    that op is seen writing its output; once per process. Returns ``{"broken": bool | None, "repaired": bool}``."""
    global _cpu_expand
    if _cpu_expand is not None:
        return _cpu_expand
    from vllm.platforms import current_platform

    cpu_tl = None
    if current_platform.is_cpu():
        try:
            import vllm.utils.cpu_triton_utils as cpu_tl
        except ImportError:  # a build without the CPU replacements: nothing of them to repair
            cpu_tl = None
    original = getattr(cpu_tl, "_expand_kernel_impl", None)
    writes = True if original is None else _expand_writes(original)
    if writes is True:
        _cpu_expand = {"broken": False, "repaired": False}
        return _cpu_expand
    cpu_tl._expand_kernel_impl = expand_kernel_repaired
    wrapper = getattr(cpu_tl, "expand_kernel", None)
    if getattr(wrapper, "func", None) is original:
        wrapper.func = expand_kernel_repaired
    dispatcher = sys.modules.get("vllm.triton_utils.dispatcher")
    if EXPAND_KERNEL in getattr(dispatcher, "_registry", {}):
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_repaired})
    _cpu_expand = {"broken": None if writes is None else True, "repaired": True}
    return _cpu_expand


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install :func:`wrap` and, on CPU, :func:`repair_cpu_expand`.
    Idempotent; rebinds the name in ``vllm.engine.arg_utils`` too when that module is already loaded."""
    import vllm
    import vllm.transformers_utils.config as vllm_config

    from specdraft.serving.export import VLLM_TESTED_VERSION

    vllm_config.maybe_override_with_speculators = wrap(vllm_config.maybe_override_with_speculators)
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is not None and hasattr(arg_utils, "maybe_override_with_speculators"):
        arg_utils.maybe_override_with_speculators = wrap(arg_utils.maybe_override_with_speculators)
    if repair_cpu_expand()["repaired"]:
        logger.warning("specdraft: this vLLM CPU build's expand op does not write the per-token temperatures that "
                       "sampled speculative requests are verified with; specdraft's repaired op "
                       "(specdraft.serving.vllm_plugin.expand_kernel_repaired) runs in its place in this process.")
    version = getattr(vllm, "__version__", "?")
    if version != VLLM_TESTED_VERSION:
        logger.warning("specdraft's vLLM plugin was tested with vLLM %s; this is %s.", VLLM_TESTED_VERSION, version)
