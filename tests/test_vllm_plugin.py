"""specdraft's vLLM plugin without vLLM: the pure plan (speculator config.json → verifier + vLLM speculative
config), the wrapper around vLLM's maybe_override_with_speculators (a stand-in with vLLM's signature), the
registration against stand-in vLLM modules, and the entry point. `make test-vllm` runs it inside a real vLLM."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from specdraft.models.speculator import SpeculatorError
from specdraft.serving import vllm_plugin
from specdraft.serving.export import export_draft
from specdraft.testing import save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def speculator(tmp_path):
    target_dir, draft_dir = save_tiny_pair(tmp_path / "models", 96)
    res = export_draft(draft_dir, target_dir, tmp_path / "spec", num_speculative_tokens=4)
    return target_dir, str(res.out), res.config


def test_plan_serves_the_recorded_verifier_with_draft_model(speculator):
    target_dir, spec_dir, config = speculator
    verifier, spec = vllm_plugin.plan_independent(config, spec_dir)
    assert verifier == target_dir
    assert spec == {"method": "draft_model", "model": spec_dir, "num_speculative_tokens": 4}


def test_plan_user_config_wins_except_method_and_model(speculator):
    _, spec_dir, config = speculator
    _, spec = vllm_plugin.plan_independent(config, spec_dir, {"num_speculative_tokens": 2, "method": "eagle3",
                                                              "model": "/elsewhere", "draft_tensor_parallel_size": 1})
    assert spec == {"method": "draft_model", "model": spec_dir, "num_speculative_tokens": 2,
                    "draft_tensor_parallel_size": 1}


def test_plan_padded_draft_gets_use_heterogeneous_vocab(tmp_path):
    target_dir, draft_dir = save_tiny_pair(tmp_path / "models", 96, draft_vocab=112)
    config = export_draft(draft_dir, target_dir, tmp_path / "spec").config
    assert vllm_plugin.plan_independent(config, "/s")[1]["use_heterogeneous_vocab"] is True


def test_plan_refuses_an_invalid_speculator(speculator):
    _, spec_dir, config = speculator
    config["speculators_config"]["proposal_methods"] = []
    with pytest.raises(SpeculatorError):
        vllm_plugin.plan_independent(config, spec_dir)


def _vllm_original(calls):
    """A stand-in with the signature of vLLM 0.32's maybe_override_with_speculators."""

    def maybe_override_with_speculators(model, tokenizer, trust_remote_code, revision=None,
                                        vllm_speculative_config=None, hf_token=None, **kwargs):
        calls.append(model)
        return model, tokenizer, vllm_speculative_config

    return maybe_override_with_speculators


def test_wrapper_answers_independent_and_delegates_everything_else(speculator):
    target_dir, spec_dir, _ = speculator
    calls: list[str] = []
    wrapped = vllm_plugin.wrap(_vllm_original(calls))
    assert vllm_plugin.wrap(wrapped) is wrapped  # idempotent
    model, tokenizer, spec = wrapped(model=spec_dir, tokenizer=None, trust_remote_code=False,
                                     vllm_speculative_config={"num_speculative_tokens": 3})
    assert (model, tokenizer) == (target_dir, target_dir) and calls == []
    assert spec == {"method": "draft_model", "model": spec_dir, "num_speculative_tokens": 3}
    # A plain model (and a reference that cannot be read) goes to vLLM's own function unchanged.
    assert wrapped(target_dir, None, False) == (target_dir, None, None)
    assert wrapped("org/not-cached", None, False, vllm_speculative_config={"a": 1}) == ("org/not-cached", None,
                                                                                         {"a": 1})
    assert calls == [target_dir, "org/not-cached"]


def _stand_in_vllm(monkeypatch, original, cpu: bool = False, expand=None):
    """Stand-in vLLM modules laid out as vLLM 0.32 lays them out: the speculators hook, the platform, and (``expand``)
    the CPU build's replacement for the rejection sampler's expand kernel, wrapped as vLLM wraps it."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.32.0"
    tu = types.ModuleType("vllm.transformers_utils")
    tu_config = types.ModuleType("vllm.transformers_utils.config")
    tu_config.maybe_override_with_speculators = original
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.maybe_override_with_speculators = original  # imported by name, as arg_utils does
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: cpu)
    utils = types.ModuleType("vllm.utils")
    cpu_tl = types.ModuleType("vllm.utils.cpu_triton_utils")

    class FuncWrapper:  # vllm.utils.cpu_triton_utils._FuncWrapper: kernel[grid](...) calls func
        def __init__(self, func):
            self.func = func

        def __getitem__(self, grid):
            return self.func

    cpu_tl._expand_kernel_impl = expand
    cpu_tl.expand_kernel = FuncWrapper(expand)
    vllm.transformers_utils, tu.config, vllm.platforms, vllm.utils, utils.cpu_triton_utils = (tu, tu_config,
                                                                                               platforms, utils, cpu_tl)
    for name, mod in {"vllm": vllm, "vllm.transformers_utils": tu, "vllm.transformers_utils.config": tu_config,
                      "vllm.engine.arg_utils": arg_utils, "vllm.platforms": platforms, "vllm.utils": utils,
                      "vllm.utils.cpu_triton_utils": cpu_tl}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(vllm_plugin, "_cpu_expand", None)  # what an earlier register() in this process found
    return tu_config, arg_utils, cpu_tl


def test_register_patches_vllm_once(monkeypatch, speculator):
    """register() against stand-in modules laid out as vLLM 0.32 lays them out."""
    calls: list[str] = []
    original = _vllm_original(calls)
    tu_config, arg_utils, _ = _stand_in_vllm(monkeypatch, original)
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may call it again in the same process
    for mod in (tu_config, arg_utils):
        fn = mod.maybe_override_with_speculators
        assert fn.__specdraft__ and fn.__wrapped__ is original
    target_dir, spec_dir, _ = speculator
    assert arg_utils.maybe_override_with_speculators(spec_dir, None, False)[0] == target_dir


def _expand_into_a_copy(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM 0.32's CPU expand: the C++ kernel writes an int64 copy of a float ``output``, never ``output`` itself."""
    import torch

    copy = output.to(torch.int64)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    copy[: int(counts.sum())] = input_val.long().repeat_interleave(counts)


def _expand_right(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    output[: int(counts.sum())] = input_val.repeat_interleave(counts).to(output.dtype)


def _temperatures_per_draft_token(kernel):
    """What the rejection sampler's expand gives: each request's temperature at each of its draft positions."""
    import torch

    out = torch.full((4,), -1.0)
    kernel[(2,)](out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 0)
    return out.tolist()


def test_loading_the_plugin_on_a_cpu_build_with_the_broken_expand_installs_the_repaired_one(monkeypatch):
    """The CPU build's expand never writes the per-token temperatures, so a sampled request's drafts would be
    verified against garbage logits whatever the proposer: the plugin puts the repaired op in its place."""
    _, _, cpu_tl = _stand_in_vllm(monkeypatch, _vllm_original([]), cpu=True, expand=_expand_into_a_copy)
    held_by_the_sampler = cpu_tl.expand_kernel  # taken before the plugin loads, as the CPU model runner may
    assert _temperatures_per_draft_token(held_by_the_sampler) == [-1.0] * 4
    vllm_plugin.register()
    assert cpu_tl._expand_kernel_impl is vllm_plugin.expand_kernel_repaired
    assert held_by_the_sampler.func is vllm_plugin.expand_kernel_repaired
    assert _temperatures_per_draft_token(held_by_the_sampler) == [0.5, 2.0, 2.0, -1.0]
    assert vllm_plugin.repair_cpu_expand() == {"broken": True, "repaired": True}  # once per process


def test_loading_the_plugin_leaves_a_gpu_build_and_a_working_cpu_expand_alone(monkeypatch):
    for cpu, expand in ((False, _expand_into_a_copy), (True, _expand_right)):
        _, _, cpu_tl = _stand_in_vllm(monkeypatch, _vllm_original([]), cpu=cpu, expand=expand)
        vllm_plugin.register()
        assert cpu_tl._expand_kernel_impl is expand and cpu_tl.expand_kernel.func is expand
        assert vllm_plugin.repair_cpu_expand()["repaired"] is False


def test_the_repaired_expand_replaces_the_placeholder_value():
    import torch

    out = torch.zeros(4)
    vllm_plugin.expand_kernel_repaired(out, torch.tensor([0.0, 2.0, 0.5]), torch.tensor([2, 2, 4]), 0.0, 1.0)
    assert out.tolist() == [1.0, 1.0, 0.5, 0.5]  # request 1 has no draft tokens; 0 (greedy) becomes 1


def test_entry_point_is_declared_and_loads():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["specdraft"]
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func))
    assert "vllm" in project["optional-dependencies"]


def test_plugin_module_imports_without_vllm_or_torch():
    code = ("import sys, specdraft.serving.vllm_plugin as p; "
            "print(json.dumps(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert json.loads(out.stdout) == []


def test_the_installed_entry_point_is_the_declared_one():
    """vLLM loads the entry point recorded at install time, not pyproject.toml's: a module moved since the install
    leaves vLLM a path that no longer imports."""
    import importlib.metadata

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert installed.get("specdraft") == declared["specdraft"], "reinstall specdraft (`make setup`): its installed " \
        f"entry point is {installed.get('specdraft')!r}, pyproject.toml declares {declared['specdraft']!r}"
