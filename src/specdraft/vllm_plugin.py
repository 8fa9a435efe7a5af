"""specdraft's vLLM plugin: ``python -m vllm.entrypoints.openai.api_server --model SPECULATOR_DIR`` (or
``LLM(model=SPECULATOR_DIR)``) serves the verifier named in an independent speculator's config.json with that
speculator as its draft.

Installed as the ``vllm.general_plugins`` entry point ``specdraft = "specdraft.vllm_plugin:register"``. It wraps
vLLM's ``maybe_override_with_speculators`` and answers for ``speculators_model_type == "independent"``
(:func:`plan_independent`: vLLM's ``draft_model`` method, or ``custom_class`` with
:class:`specdraft.vllm_proposer.TextProposer` for a ``"text"`` speculator); every other model goes to vLLM untouched.
On vLLM's CPU build it also repairs the rejection sampler's ``expand_kernel`` (:func:`repair_cpu_expand`).
vLLM is imported inside :func:`register` and :func:`repair_cpu_expand` only, torch inside functions. What vLLM 0.32
does without the plugin and the CPU op's bug: docs/architecture.md, "vllm_plugin".
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A child of vLLM's "vllm" logger: vLLM configures that one (handler, level), so these lines show with its own.
logger = logging.getLogger("vllm.specdraft")

#: The speculators_model_type this plugin serves.
INDEPENDENT = "independent"
#: The kernel vLLM's CPU build replaces with a broken op (its name in vLLM's kernel-override registry).
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"

_cpu_expand: dict[str, bool | None] | None = None  # what repair_cpu_expand found, once per process


def plan_independent(config: dict[str, Any], model: str,
                     user_speculative_config: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """What vLLM should serve for the independent speculator at ``model``: ``(verifier, speculative_config)``.

    Args:
        config: the speculator's config.json dict.
        model: the speculator reference vLLM was given (becomes the draft, ``speculative_config["model"]``).
        user_speculative_config: ``--speculative-config`` as given, if any; its keys win (e.g.
            ``num_speculative_tokens``, ``use_heterogeneous_vocab``) except ``method`` and ``model``, which the
            checkpoint dictates (as vLLM does for its own speculators formats).

    Returns:
        The verifier to load (:func:`specdraft.models.serving_path` of the recorded ``name_or_path``) and
        vLLM's speculative config: ``draft_model`` with ``model``, or for a draft of another tokenizer
        ``custom_class`` with specdraft's proposer (the directory then reaches it through
        :data:`specdraft.vllm_proposer.SPECULATOR_ENV`, set by :func:`wrap`).

    Raises:
        specdraft.speculator.SpeculatorError: the config is not a valid independent speculator.
    """
    from specdraft.embedded import ModelResolutionError
    from specdraft.export import vllm_speculative_config, vocab_width
    from specdraft.models import serving_path
    from specdraft.speculator import IndependentSpeculatorConfig, SpeculatorError, read_config_json

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
    """The config.json dict of ``model`` (a directory, or a hub id through transformers' cache), or ``None``
    when it cannot be read (vLLM's own function then reports the problem)."""
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
            from specdraft.vllm_proposer import SPECULATOR_ENV

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
    """The rejection sampler's expand, written into ``output`` itself: request i's value (``replace_to`` where it is
    ``replace_from``) at each of its positions ``cu_num_tokens[i-1]:cu_num_tokens[i]``; the launch arguments of
    vLLM's Triton kernel (``MAX_NUM_TOKENS``: its block size, unused here)."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # tokens per request
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = vals.repeat_interleave(counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def _expand_writes(impl) -> bool | None:
    """Whether ``impl`` writes per-token temperatures into a float output; ``None`` when it cannot run here (vLLM's
    C++ ops not loaded yet in this process)."""
    import torch

    out = torch.full((3,), -1.0)
    try:
        impl(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 0)
    except Exception:  # noqa: BLE001 - any failure of the engine's op leaves it unproven, so it is replaced
        return None
    return out.tolist() == [0.5, 2.0, 2.0]


def repair_cpu_expand() -> dict[str, bool | None]:
    """On vLLM's CPU build, put :func:`expand_kernel_repaired` in place of the CPU expand op unless that op is seen
    writing its output (the module docstring); other platforms are left alone. Once per process: later calls return
    the first one's finding.

    The op is replaced where vLLM takes it from (``cpu_triton_utils._expand_kernel_impl``, and in place inside its
    ``expand_kernel`` wrapper, so a sampler that already holds the wrapper runs the repair), and in vLLM's
    kernel-override registry when the kernel is registered there already.

    Returns:
        ``{"broken": the op was seen not writing (None: it could not be tried), "repaired": the repair is in}``.
    """
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
    """The ``vllm.general_plugins`` entry point: install :func:`wrap` over vLLM's
    ``maybe_override_with_speculators``, and on the CPU build :func:`repair_cpu_expand`. Safe to call more than once
    (vLLM may, in several processes).

    ``vllm.engine.arg_utils`` imports the function by name, so its binding is replaced too when that module is
    already loaded (it is, when EngineArgs loads the plugins); if it is imported later it picks up the wrapped one.
    """
    import vllm
    import vllm.transformers_utils.config as vllm_config

    from specdraft.export import VLLM_TESTED_VERSION

    vllm_config.maybe_override_with_speculators = wrap(vllm_config.maybe_override_with_speculators)
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is not None and hasattr(arg_utils, "maybe_override_with_speculators"):
        arg_utils.maybe_override_with_speculators = wrap(arg_utils.maybe_override_with_speculators)
    if repair_cpu_expand()["repaired"]:
        logger.warning("specdraft: this vLLM CPU build's expand op does not write the per-token temperatures that "
                       "sampled speculative requests are verified with; specdraft's repaired op "
                       "(specdraft.vllm_plugin.expand_kernel_repaired) runs in its place in this process.")
    version = getattr(vllm, "__version__", "?")
    if version != VLLM_TESTED_VERSION:
        logger.warning("specdraft's vLLM plugin was tested with vLLM %s; this is %s.", VLLM_TESTED_VERSION, version)
