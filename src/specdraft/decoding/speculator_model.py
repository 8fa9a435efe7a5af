"""The independent speculator at run time: a draft (q) wrapped with the verifier (target, p) it drafts for.

:class:`IndependentSpeculator` is transparent — every attribute it does not define is the draft's — and adds γ, the
verifier record, ``save_pretrained`` / ``from_pretrained`` in the :mod:`specdraft.models.speculator` format, and three ways to
attach the verifier: ``"detached"`` (its name only), ``"full"`` (the loaded model, so :meth:`generate` decodes
speculatively with :mod:`specdraft.decoding.decode`) and ``"train_only"`` (its final norm and output head,
:class:`VerifierHead`, for distillation). Saved files are the format's: a plain draft plus three config keys.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from specdraft.core.io import atomic_path
from specdraft.core.sampling import apply_final_logit_ops, final_logit_ops
from specdraft.decoding.decode import speculative_generate
from specdraft.decoding.draft_model import dense_draft
from specdraft.models.loading import load_causal_lm, load_model, local_reference, resolve
from specdraft.models.speculator import (
    SPECULATOR_KEYS,
    IndependentSpeculatorConfig,
    SpeculatorError,
    check_causal_lm_model,
    check_tokenizers,
    read_config_json,
    tokenizer_dir,
    verifier_config,
)
from specdraft.models.weights import check_model_weights, match_tie_flag

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel

VerifierMode = Literal["detached", "full", "train_only"]
VERIFIER_MODES: tuple[str, ...] = get_args(VerifierMode)


class VerifierHead:
    """The verifier's final norm and output head: ``head(hidden [B, S, H])`` → logits ``[B, S, V]`` in the head's
    dtype, final-logit transforms applied (:func:`specdraft.core.sampling.final_logit_ops`), as the verifier does."""

    def __init__(self, norm, lm_head, logit_ops=()):
        self.norm = norm
        self.lm_head = lm_head
        self.logit_ops = list(logit_ops)

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> VerifierHead:
        """The final norm and output embeddings of a causal LM (the modules, not copies).

        Raises:
            SpeculatorError: no output head or no final norm found (names the class).
        """
        lm_head = model.get_output_embeddings()
        base = getattr(model, model.base_model_prefix, None) or model.base_model
        norm = next(
            (getattr(base, n) for n in ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")
             if getattr(base, n, None) is not None),
            None,
        )
        if lm_head is None or norm is None:
            raise SpeculatorError(
                f"Cannot find the output head and final norm of {type(model).__name__}; attach it with "
                "mode='full' instead."
            )

        return cls(norm, lm_head, final_logit_ops(model.config))

    def __call__(self, hidden_states):

        return apply_final_logit_ops(self.lm_head(self.norm(hidden_states)), self.logit_ops)  # [B, S, V]

    def parameters(self):
        yield from self.norm.parameters()
        yield from self.lm_head.parameters()

    def to(self, *args, **kwargs) -> VerifierHead:
        self.norm.to(*args, **kwargs)
        self.lm_head.to(*args, **kwargs)
        return self


class IndependentSpeculator:
    """A transformers causal LM (the draft, q) that knows which verifier (p) it drafts for and its γ.

    Transparent: every attribute it does not define is the draft's, calling it calls the draft, and its
    ``state_dict()`` keys are the plain model's; it is no ``nn.Module`` (hand ``.draft`` to code that checks types).
    A held verifier is never saved, and ``.to()`` moves it along. Modes (the speculators library's): ``"full"``
    (:meth:`generate` decodes speculatively), ``"train_only"`` (:class:`VerifierHead`, for distillation),
    ``"detached"`` (the record only).

    Attributes:
        draft: the wrapped ``PreTrainedModel`` (no ``speculators_*`` config keys); ``speculator_config``: the
            verifier record and γ; ``verifier`` / ``verifier_head``: held in mode "full" / "train_only".
        compat_verdict: the last tokenizer check's verdict, or ``None``.
        corrections: ``{config key: (before, after)}`` set to match the tensors
            (:func:`specdraft.models.weights.match_tie_flag`), on loading or saving.
    """

    _OWN = frozenset(
        {"draft", "speculator_config", "verifier", "verifier_head", "verifier_mode", "draft_source", "tokenizer",
         "compat_verdict", "corrections", "last_counts"}
    )

    def __init__(
        self,
        draft: PreTrainedModel,
        config: IndependentSpeculatorConfig | None = None,
        *,
        num_speculative_tokens: int | None = None,
        draft_source: str | os.PathLike | None = None,
        tokenizer: Any = None,
    ):
        """Wrap ``draft``; ``config`` defaults to ``draft.config``'s ``speculators_*`` keys (else γ =
        ``num_speculative_tokens`` or 5); ``draft_source`` / ``tokenizer`` serve the compatibility check.

        Raises:
            SpeculatorError: ``draft`` is not a causal LM (names its class), or γ < 1.
        """
        check_causal_lm_model(draft)
        if config is None:
            config = IndependentSpeculatorConfig.from_pretrained(
                draft.config, num_speculative_tokens=num_speculative_tokens
            )
        elif num_speculative_tokens is not None:
            config = config.with_num_speculative_tokens(num_speculative_tokens)
        # AutoConfig puts a speculator's keys on the draft's config; they live in speculator_config instead.
        for k in SPECULATOR_KEYS:
            draft.config.__dict__.pop(k, None)
        own = self.__dict__
        own["draft"] = draft
        own["speculator_config"] = config
        own["verifier"] = None
        own["verifier_head"] = None
        own["verifier_mode"] = None
        own["draft_source"] = None if draft_source is None else str(draft_source)
        own["tokenizer"] = tokenizer
        own["compat_verdict"] = None
        own["corrections"] = {}
        own["last_counts"] = None

    # ---------------------------------------------------------------------------- transparency

    def __getattr__(self, name: str):
        # Guard "draft" so copy/pickle never recurse.
        draft = self.__dict__.get("draft")
        if draft is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(draft, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            if name == "speculator_config" and not isinstance(value, IndependentSpeculatorConfig):
                raise TypeError("speculator_config must be an IndependentSpeculatorConfig")
            self.__dict__[name] = value
        else:
            setattr(self.draft, name, value)

    def __call__(self, *args, **kwargs):
        return self.draft(*args, **kwargs)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(dir(self.draft)))

    def __repr__(self) -> str:
        v = self.speculator_config.verifier
        return (
            f"IndependentSpeculator(draft={type(self.draft).__name__}, γ={self.num_speculative_tokens}, "
            f"verifier={v.name_or_path if v else None!r}, verifier_mode={self.verifier_mode!r})"
        )

    def _held(self) -> list:
        return [m for m in (self.verifier, self.verifier_head) if m is not None]

    def to(self, *args, **kwargs) -> IndependentSpeculator:
        """``draft.to(...)`` and the same for a held verifier; returns the wrapper."""
        self.draft.to(*args, **kwargs)
        for m in self._held():
            m.to(*args, **kwargs)
        return self

    def cuda(self, device=None) -> IndependentSpeculator:
        import torch

        return self.to(torch.device("cuda", device) if isinstance(device, int) else (device or "cuda"))

    def cpu(self) -> IndependentSpeculator:
        return self.to("cpu")

    def train(self, mode: bool = True) -> IndependentSpeculator:
        """``draft.train(mode)``; returns the wrapper (a held verifier stays in eval mode)."""
        self.draft.train(mode)
        return self

    def eval(self) -> IndependentSpeculator:
        return self.train(False)

    @property
    def num_speculative_tokens(self) -> int:
        """γ."""
        return self.speculator_config.num_speculative_tokens

    # ---------------------------------------------------------------------------- decoding

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        """In mode ``"full"``, :func:`specdraft.decoding.decode.speculative_generate` of the verifier with this draft and γ
        (``input_ids [B, P] int64`` left-padded) → ``[B, P + N] int64``, shorter rows right-padded with the verifier's pad
        id, counts in :attr:`last_counts`; otherwise the draft's own ``generate``.

        Raises:
            specdraft.decoding.decode.DecodeError: see ``speculative_generate``.
        """
        if self.verifier_mode != "full" or self.verifier is None:
            return self.draft.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        import torch


        kwargs.setdefault("max_new_tokens", 20)
        rows, counts = speculative_generate(self.verifier, self.draft, input_ids, attention_mask,
                                            num_speculative_tokens=self.num_speculative_tokens, **kwargs)
        self.__dict__["last_counts"] = counts
        gc = getattr(self.verifier, "generation_config", None)
        pad = next((v for v in (getattr(gc, "pad_token_id", None), self.verifier.config.pad_token_id) if v is not None),
                   0)
        width = max((len(r) for r in rows), default=0)
        new = torch.full((len(rows), width), int(pad), dtype=torch.long, device=input_ids.device)
        for i, r in enumerate(rows):
            new[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return torch.cat([input_ids, new], dim=1)

    # ---------------------------------------------------------------------------- verifier

    def attach_verifier(
        self,
        model_or_reference: Any,
        mode: VerifierMode = "detached",
        *,
        name_or_path: str | None = None,
        tokenizer: Any = None,
        check_tokenizer: bool = True,
        dtype: Any = "auto",
        device: str | None = None,
    ) -> IndependentSpeculator:
        """Record the verifier (target, p) and, by ``mode``, hold it; returns ``self``.

        Args:
            model_or_reference: a reference, a ``PreTrainedModel``, or (mode "detached") a config.
            name_or_path: recorded instead of the reference's / model's name.
            check_tokenizer: compare the verifier's ``tokenizer`` with the draft's (a mismatch raises; an unknown
                tokenizer warns and skips).
            dtype, device: for loading a referenced verifier (:func:`specdraft.models.loading.load_model`).

        Raises:
            SpeculatorError: unknown mode; unreadable reference; no name to record; tokenizer mismatch;
                "full"/"train_only" given only a config.
        """
        if mode not in VERIFIER_MODES:
            raise SpeculatorError(f"mode must be one of {list(VERIFIER_MODES)}, got {mode!r}")
        record = verifier_config(model_or_reference, name_or_path)  # reads config.json only: cheap, fails early
        is_ref = isinstance(model_or_reference, (str, os.PathLike))
        is_model = hasattr(model_or_reference, "get_output_embeddings")
        if mode != "detached" and not (is_ref or is_model):
            raise SpeculatorError(f"mode={mode!r} needs the verifier's weights: pass a model or a reference.")

        model = model_or_reference if is_model else None
        if mode != "detached" and is_ref:

            model, loaded_tok = load_model(model_or_reference, dtype=dtype, device=device)
            tokenizer = tokenizer if tokenizer is not None else loaded_tok

        verdict = None
        if check_tokenizer:
            if tokenizer is None and is_ref:

                tokenizer = tokenizer_dir(resolve(model_or_reference))
            elif tokenizer is None and model is not None:
                tokenizer = tokenizer_dir(getattr(model, "name_or_path", None))
            verdict = check_tokenizers(tokenizer, self._draft_tokenizer_source(),
                                        str(model_or_reference) if is_ref else record.name_or_path, self.draft_source)

        self.speculator_config.verifier = record
        self.verifier = model if mode == "full" else None
        self.verifier_head = VerifierHead.from_model(model) if mode == "train_only" else None
        self.verifier_mode = mode
        self.compat_verdict = verdict
        return self

    def _draft_tokenizer_source(self):
        if self.tokenizer is not None:
            return self.tokenizer
        return tokenizer_dir(self.draft_source) or tokenizer_dir(getattr(self.draft, "name_or_path", None))

    # ---------------------------------------------------------------------------- save / load

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """The draft's own ``save_pretrained`` output (a prepared draft as :func:`specdraft.decoding.draft_model.dense_draft`
        gives it), then ``config.json`` with the three ``speculators_*`` keys added; a false tie flag is corrected
        (warned, :attr:`corrections`). ``kwargs`` go to ``save_pretrained``; ``push_to_hub`` is refused.

        Raises:
            SpeculatorError: no verifier named (nothing is written), or ``push_to_hub=True``.
            specdraft.models.weights.CheckpointWeightsError: the draft's state dict is not what its class loads back
                (names the tensors; nothing is written).
        """

        if kwargs.get("push_to_hub"):
            raise SpeculatorError("push_to_hub is not supported: save locally, then upload the directory.")
        self.speculator_config.speculators_config  # noqa: B018 - raises before any file is written

        # int8/int4 layers and a trimmed head are no weights its class loads: write the dense equivalent.
        draft = dense_draft(self.draft)
        if fixed := match_tie_flag(draft):
            warnings.warn(f"{type(draft).__name__}: the config claims tie_word_embeddings: true but the output "
                          "head differs from the input embeddings; saving tie_word_embeddings: false.", stacklevel=2)
            self.corrections.update(fixed)
        check_model_weights(draft)  # anything else its class would not reload: refused before a file is written
        draft.save_pretrained(save_directory, **kwargs)
        path = Path(save_directory) / "config.json"
        # Re-read what transformers wrote (it may set architectures / dtype): the plain config plus three keys.
        self.speculator_config.draft_config = json.loads(path.read_text(encoding="utf-8"))
        with atomic_path(path) as tmp:  # the mode of a plain write, as transformers gave config.json
            tmp.write_text(self.speculator_config.to_json_string(), encoding="utf-8")

    @classmethod
    def from_pretrained(
        cls,
        pretrained: str | os.PathLike,
        *,
        verifier: Any = None,
        verifier_mode: VerifierMode = "detached",
        num_speculative_tokens: int | None = None,
        dtype: Any = "auto",
        device: str | None = None,
        **model_kwargs,
    ) -> IndependentSpeculator:
        """Load a saved speculator, or convert a plain draft checkpoint (``verifier`` default: the recorded one,
        attached in ``verifier_mode``; ``dtype`` "auto" keeps the checkpoint's, byte-identical).

        Raises:
            SpeculatorError: not a causal LM (names its architecture), invalid speculator keys, γ < 1, a
                non-detached mode with no verifier recorded or given.
            specdraft.core.embedded.ModelResolutionError: the reference cannot be resolved.
            specdraft.models.weights.CheckpointWeightsError: weights missing from or left over in the checkpoint (named),
                never filled in at random (:func:`specdraft.models.loading.load_causal_lm`).
        """
        import torch


        path = resolve(pretrained)
        config = IndependentSpeculatorConfig.from_pretrained(
            read_config_json(path, role="draft"), num_speculative_tokens=num_speculative_tokens
        )
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        draft, corrections = load_causal_lm(path, dtype=dtype, **model_kwargs)
        spec = cls(draft.eval(), config, draft_source=path)
        spec.corrections.update(corrections)
        if verifier is None and verifier_mode != "detached":
            if config.verifier is None or not config.verifier.name_or_path:
                raise SpeculatorError(
                    f"verifier_mode={verifier_mode!r} needs a verifier: {pretrained} records none; pass verifier=."
                )

            verifier = local_reference(config.verifier.name_or_path)
        if verifier is not None:
            spec.attach_verifier(verifier, verifier_mode, device=device)
        if device is not None:
            spec.to(device)
        return spec
