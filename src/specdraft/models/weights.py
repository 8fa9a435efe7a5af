"""Checkpoint weight-layout checks: do a checkpoint's tensors fit the model its config names?

Read before loading (safetensors headers: :func:`weight_layout_problems`) and after (:func:`check_model_weights`,
:func:`match_tie_flag`), so a checkpoint whose weights would be initialised at random, dropped or served tied
against its tensors is refused or corrected by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.core.embedded import ModelResolutionError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel


class CheckpointWeightsError(ModelResolutionError):
    """A checkpoint's tensors do not fit its model: weights missing (random init) or left over."""


def name_list(keys: list[str], most: int = 8) -> str:
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more


#: Tensors only a draft prepared for decoding holds (int8/int4 layers, trimmed head).
PREPARED_TENSOR_SUFFIXES = (".weight_int8", ".weight_int4", ".scales", ".scales_and_zeros", ".token_ids",
                            ".proj.weight", ".proj.bias")


def weight_problems(model_cls, config, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Why tensors ``{name: shape}`` would not load into ``model_cls(config)`` as they are: one line per
    missing, unexpected or misshapen weight (buffers and tied weights may be absent); built on ``meta``, no memory."""
    import copy as _copy

    import torch

    with torch.device("meta"):
        ref = model_cls(_copy.deepcopy(config))
    allowed = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    required = {name for name, _ in ref.named_parameters()}  # one name per tied tensor, as save_pretrained writes
    missing = sorted(required - shapes.keys())
    unexpected = sorted(k for k in shapes if k not in allowed)
    mismatched = sorted(f"{k} {list(shapes[k])} (expects {list(allowed[k])})" for k in shapes
                        if k in allowed and tuple(shapes[k]) != allowed[k])
    problems = [f"{what} {name_list(keys)}" for what, keys in (
        ("missing (transformers would initialise them at random):", missing),
        ("unexpected (they would be dropped):", unexpected),
        ("of another shape:", mismatched)) if keys]
    if any(k.endswith(PREPARED_TENSOR_SUFFIXES) for k in unexpected):
        problems.append("these are the buffers of a draft prepared for decoding (int8/int4 layers, a trimmed head): "
                        "write it through specdraft.serving.export, which saves its dense equivalent "
                        "(specdraft.decoding.draft_model.dense_draft)")
    return problems


def check_model_weights(model: PreTrainedModel, what: str = "the draft") -> None:
    """Refuse to save ``model`` when its state dict is not what its class loads back or holds
    NaN/inf; raises :class:`CheckpointWeightsError` naming the tensors."""
    import torch

    state = model.state_dict()
    problems = weight_problems(type(model), model.config, {k: tuple(v.shape) for k, v in state.items()})
    if bad := [k for k, v in model.named_parameters() if v.is_floating_point() and not bool(torch.isfinite(v).all())]:
        problems.append(f"not finite (NaN or inf): {name_list(bad)}")
    if problems:
        raise CheckpointWeightsError(f"{what} ({type(model).__name__}) would not reload as it is — "
                                     f"{'; '.join(problems)}. Nothing was written.")


def safetensors_files(path: Path) -> list[Path] | None:
    """A checkpoint's safetensors files (those its index names, else ``model.safetensors``), or None."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))]
    return [path / "model.safetensors"] if (path / "model.safetensors").is_file() else None


def checkpoint_tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """``{tensor name: shape}`` from the safetensors headers, or None without safetensors."""
    from safetensors import safe_open

    files = safetensors_files(Path(path))
    if files is None:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def weight_layout_problems(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """``(refusals, warnings)`` about a checkpoint directory's weight layout, naming the files.

    Refused: a single file beside a sharded index, a missing shard, a tensor mapped to the wrong shard, several files
    without an index. Warned: files the index does not name, ``*.bin`` beside safetensors. Headers only.
    """
    from safetensors import safe_open

    path = Path(path)
    errors: list[str] = []
    warns: list[str] = []
    files = sorted(p.name for p in path.glob("*.safetensors") if not p.name.startswith("adapter_"))
    bins = sorted(p.name for p in path.glob("pytorch_model*.bin"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (OSError, ValueError) as exc:
            return [f"{index.name} cannot be read ({exc})"], warns
        shards = sorted(set(weight_map.values()))
        if "model.safetensors" in files and "model.safetensors" not in shards:
            errors.append(f"a model.safetensors lies beside the sharded index {index.name} ({len(shards)} shards: "
                          f"{name_list(shards, 3)}); transformers would load model.safetensors and ignore the shards. "
                          "Delete whichever is stale (or export the checkpoint again into an empty directory)")
        if missing := [f for f in shards if f not in files]:
            errors.append(f"{index.name} names shards that are not there: {name_list(missing)}")
        if stray := [f for f in files if f not in shards and f != "model.safetensors"]:
            warns.append(f"weight files {index.name} does not name (never loaded): {name_list(stray)}")
        held: dict[str, set[str]] = {}
        for f in shards:
            if f in files:
                with safe_open(str(path / f), framework="pt") as handle:
                    held[f] = set(handle.keys())
        unindexed = sorted(f"{k} ({f})" for f, keys in held.items() for k in keys if weight_map.get(k) != f)
        if unindexed:
            errors.append(f"shards hold tensors {index.name} does not map to them: {name_list(unindexed)}")
        if absent := sorted(f"{k} ({f})" for k, f in weight_map.items() if f in held and k not in held[f]):
            errors.append(f"{index.name} maps tensors to shards that do not hold them: {name_list(absent)}")
    elif len(files) > 1:
        errors.append(f"several weight files and no model.safetensors.index.json to say which tensors each holds: "
                      f"{name_list(files)}. Keep one layout (delete the stale files, or export again)")
    if files and bins:
        warns.append(f"PyTorch weights ({name_list(bins)}) beside safetensors ones ({name_list(files, 3)}): transformers "
                     "loads the safetensors; delete the stale files")
    return errors, warns


def check_weight_layout(path: str | os.PathLike) -> None:
    """Refuse a mixed or broken weight layout (:class:`CheckpointWeightsError`), warn about strays."""
    import warnings

    errors, warns = weight_layout_problems(path)
    for w in warns:
        warnings.warn(f"{path}: {w}", stacklevel=3)
    if errors:
        raise CheckpointWeightsError(f"{path}: more than one weight layout, or a broken one — {'; '.join(errors)}.")


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a checkpoint directory (``*.safetensors``, else ``*.bin``). Raises
    :class:`CheckpointWeightsError` for none, or a broken or mixed layout."""
    path = Path(path)
    check_weight_layout(path)
    for index in sorted(path.glob("*.index.json")):
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        except (OSError, ValueError) as exc:
            raise CheckpointWeightsError(f"{index} cannot be read: {exc}") from exc
        if missing := [f for f in shards if not (path / f).is_file()]:
            raise CheckpointWeightsError(f"{path} is missing weight files that {index.name} names: "
                                         f"{name_list(missing)}. Copy or export the checkpoint again.")
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise CheckpointWeightsError(f"{path} holds no weight files (*.safetensors or *.bin): the checkpoint is "
                                     "incomplete. Copy or export it again (specdraft export).")
    return files


def check_checkpoint_weights(path: str | os.PathLike) -> None:
    """Refuse a checkpoint whose safetensors tensors do not fit its config's causal LM (headers
    only; ``*.bin`` unchecked). Raises :class:`CheckpointWeightsError` naming the tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_weight_layout(path)
    shapes = checkpoint_tensor_shapes(path)
    if shapes is None:
        return
    config = AutoConfig.from_pretrained(path)
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    if problems := weight_problems(cls, config, shapes):
        raise CheckpointWeightsError(f"{path}: the checkpoint does not hold the weights {cls.__name__} expects — "
                                     f"{'; '.join(problems)}.")


def match_tie_flag(model: PreTrainedModel) -> dict[str, tuple[Any, Any]]:
    """Set ``tie_word_embeddings`` False in place when the config claims tied embeddings but the model
    holds two tensors (loaders such as vLLM would serve it tied). Returns ``{"tie_word_embeddings": (True, False)}``
    when corrected, else ``{}``."""
    import torch

    configs = [model.config]
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if text is not model.config:
        configs.append(text)
    claims = [c for c in configs if getattr(c, "tie_word_embeddings", False)]
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if not claims or inp is None or out is None:
        return {}
    w_in, w_out = inp.weight, out.weight
    if w_in is w_out or (w_in.shape == w_out.shape and torch.equal(w_in.detach().cpu(), w_out.detach().cpu())):
        return {}
    for c in claims:
        c.tie_word_embeddings = False
    return {"tie_word_embeddings": (True, False)}
