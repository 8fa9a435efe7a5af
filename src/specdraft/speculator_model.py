"""The independent speculator at run time: a draft (q) wrapped with the verifier (target, p) it drafts for.

:class:`IndependentSpeculator` is transparent — every attribute it does not define is the draft's — and adds γ, the
verifier record, ``save_pretrained`` / ``from_pretrained`` in the :mod:`specdraft.speculator` format, and three ways to
attach the verifier: ``"detached"`` (its name only), ``"full"`` (the loaded model, so :meth:`generate` decodes
speculatively with :mod:`specdraft.decode`) and ``"train_only"`` (its final norm and output head,
:class:`VerifierHead`, for distillation). Saved files are the format's: a plain draft plus three config keys.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from specdraft.speculator import (
    SPECULATOR_KEYS,
    IndependentSpeculatorConfig,
    SpeculatorError,
    check_causal_lm_model,
    check_tokenizers,
    read_config_json,
    tokenizer_dir,
    verifier_config,
)

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel

VerifierMode = Literal["detached", "full", "train_only"]
VERIFIER_MODES: tuple[str, ...] = get_args(VerifierMode)


class VerifierHead:
    """The verifier's final norm and output head: what distillation needs of p, without its layers.

    ``head(hidden_states)`` maps the verifier's last hidden states ``[B, S, H]`` (before the final norm) to
    logits ``[B, S, V]`` in the head's dtype, then applies the architecture's final-logit transforms
    (soft-capping, scaling: :func:`specdraft.sampling.final_logit_ops`), as the verifier does.
    """

    def __init__(self, norm, lm_head, logit_ops=()):
        self.norm = norm
        self.lm_head = lm_head
        self.logit_ops = list(logit_ops)

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> VerifierHead:
        """Take the final norm and output embeddings of a causal LM (the modules, not copies).

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
        from specdraft.sampling import final_logit_ops

        return cls(norm, lm_head, final_logit_ops(model.config))

    def __call__(self, hidden_states):
        from specdraft.sampling import apply_final_logit_ops

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

    Transparent: every attribute the wrapper does not define — ``forward``, ``generate``, ``config``,
    ``state_dict`` / ``load_state_dict``, ``named_parameters``, ``device`` … — is the draft's, and calling
    the wrapper calls the draft. ``state_dict()`` keys are the plain model's. The wrapper is not itself an
    ``nn.Module``: hand ``speculator.draft`` to code that checks types (``Trainer``).

    A held verifier (``attach_verifier(mode="full" | "train_only")``) is never part of the draft's
    state_dict or saved files; ``.to()`` / ``.cuda()`` / ``.cpu()`` move it along with the draft. What each mode
    is for (the modes mirror the speculators library's):

    * ``"full"`` — :meth:`generate` runs specdraft's lossless speculative decoding of the verifier with this
      draft (the verifier's output, token for token, when greedy).
    * ``"train_only"`` — holds only the verifier's final norm and output head (:class:`VerifierHead`), the teacher
      side of distillation: :meth:`specdraft.distill.DistillModel.from_speculator` turns stored hidden states into p
      without the verifier's layers.
    * ``"detached"`` — records the verifier's name and architectures only (what ``export`` writes).

    Attributes:
        draft: the wrapped ``PreTrainedModel``; its config holds no ``speculators_*`` keys.
        speculator_config: :class:`IndependentSpeculatorConfig` (verifier record, γ).
        verifier: the loaded verifier model in mode "full", else ``None``.
        verifier_head: :class:`VerifierHead` in mode "train_only", else ``None``.
        verifier_mode: the last attachment mode, or ``None``.
        draft_source: the directory the draft was loaded from (tokenizer source for the compatibility check).
        compat_verdict: verdict of the last tokenizer check ("identical", "identical-up-to-padding"), or
            ``None`` when none ran.
        corrections: ``{config key: (before, after)}`` for draft config values set to match its tensors (a
            ``tie_word_embeddings: true`` next to an untied output head becomes false:
            :func:`specdraft.weights.match_tie_flag`), on loading or saving; the saved ``config.json`` then differs
            from the draft's own in those keys.
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
        """Wrap ``draft``.

        Args:
            draft: a transformers causal LM.
            config: speculator metadata; default: read from ``draft.config`` (its ``speculators_*`` keys when
                loaded from a speculator, else converted with γ = ``num_speculative_tokens`` or 5).
            num_speculative_tokens: γ, replacing the config's.
            draft_source: where the draft's tokenizer lives (for the compatibility check).
            tokenizer: the draft's tokenizer (for the compatibility check).

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
        # The metadata lives in speculator_config; the draft stays a plain model whose own save_pretrained
        # writes a plain config.json (AutoConfig puts unknown keys of a speculator's config.json on it).
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
        # Only reached when normal lookup fails; guard "draft" so copy/pickle never recurse.
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
        """With a verifier attached in mode ``"full"``: specdraft's lossless speculative decoding of the verifier
        with this draft and γ = :attr:`num_speculative_tokens` (:func:`specdraft.decode.speculative_generate`);
        otherwise the draft's own ``generate`` (the wrapper is transparent).

        In mode ``"full"``:

        Args:
            input_ids: ``[B, P] int64`` prompts, left-padded; attention_mask ``[B, P]`` (default all ones).
            max_new_tokens: new tokens per row (default 20, as transformers); ``sampling``
                (:class:`specdraft.config.SamplingConfig`, default greedy), ``generator``, ``eos_token_id``,
                ``real_vocab`` (``len(tokenizer)``) as in ``speculative_generate``.

        Returns:
            ``[B, P + N] int64``: the prompts followed by the new tokens, rows shorter than the longest (EOS)
            right-padded with the verifier's pad id — the layout of transformers' ``generate``. The acceptance
            counts of the call are in :attr:`last_counts`.

        Raises:
            specdraft.decode.DecodeError: see ``speculative_generate``.
        """
        if self.verifier_mode != "full" or self.verifier is None:
            return self.draft.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        import torch

        from specdraft.decode import speculative_generate

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
        """Record the verifier (target, p) in the config and, by ``mode``, hold it.

        Args:
            model_or_reference: a reference (embedded name, local dir, cached hub id), a ``PreTrainedModel``,
                or (mode "detached" only) a ``PretrainedConfig`` / ``VerifierConfig``.
            mode: "detached" records ``name_or_path`` and ``architectures`` only; "full" also holds the loaded
                verifier (``self.verifier``) for decoding; "train_only" holds only its final norm and output
                head (``self.verifier_head``), which distillation needs.
            name_or_path: recorded instead of the reference / the model's ``name_or_path``.
            tokenizer: the verifier's tokenizer (object or reference) for the compatibility check.
            check_tokenizer: run :func:`specdraft.check.check_compatible` between the verifier's and the draft's
                tokenizers (a mismatch raises; an unknown tokenizer warns and skips the check).
            dtype, device: for loading a referenced verifier (see :func:`specdraft.models.load_model`).

        Returns:
            ``self``.

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
            from specdraft.models import load_model

            model, loaded_tok = load_model(model_or_reference, dtype=dtype, device=device)
            tokenizer = tokenizer if tokenizer is not None else loaded_tok

        verdict = None
        if check_tokenizer:
            if tokenizer is None and is_ref:
                from specdraft.models import resolve

                tokenizer = tokenizer_dir(resolve(model_or_reference))
            elif tokenizer is None and model is not None:
                tokenizer = tokenizer_dir(getattr(model, "name_or_path", None))
            # The error names the verifier as the caller gave it (an embedded name), not the recorded hub id.
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
        """Write the speculator: the draft's own ``save_pretrained`` output, then ``config.json`` rewritten
        with the three ``speculators_*`` keys added (same formatting, every other key unchanged).

        Weight files are byte-identical to ``draft.save_pretrained``; no held verifier is written. A draft prepared
        for decoding (:func:`specdraft.draft_model.prepare_draft`) is written as
        :func:`specdraft.draft_model.dense_draft` gives it: dequantised layers, a full-width head whose excluded rows
        never win, so ``AutoModelForCausalLM`` reloads the q that was evaluated. A draft whose
        config claims tied embeddings while its output head differs is saved with ``tie_word_embeddings: false``
        (warned; recorded in :attr:`corrections`): a loader that trusts the flag would otherwise serve the
        input embeddings as the head.

        Args:
            save_directory: target directory (created).
            kwargs: passed to the draft's ``save_pretrained`` (e.g. ``max_shard_size``); ``push_to_hub`` is
                refused (it would upload the plain config first).

        Raises:
            SpeculatorError: no verifier named (nothing is written), or ``push_to_hub=True``.
            specdraft.weights.CheckpointWeightsError: the draft's state dict is not what its class loads back
                (names the tensors; nothing is written).
        """
        from specdraft.io import atomic_path

        if kwargs.get("push_to_hub"):
            raise SpeculatorError("push_to_hub is not supported: save locally, then upload the directory.")
        self.speculator_config.speculators_config  # noqa: B018 - raises before any file is written
        from specdraft.draft_model import dense_draft
        from specdraft.weights import check_model_weights, match_tie_flag

        # A draft prepared for decoding (int8/int4 layers, a trimmed head) is written as its dense equivalent: its
        # own buffers are not weights its class loads, and transformers would initialise those layers at random.
        draft = dense_draft(self.draft)
        if fixed := match_tie_flag(draft):
            warnings.warn(f"{type(draft).__name__}: the config claims tie_word_embeddings: true but the output "
                          "head differs from the input embeddings; saving tie_word_embeddings: false.", stacklevel=2)
            self.corrections.update(fixed)
        check_model_weights(draft)  # anything else its class would not reload: refused before a file is written
        draft.save_pretrained(save_directory, **kwargs)
        path = Path(save_directory) / "config.json"
        # Re-read what transformers wrote (it may set architectures / dtype on save) so the speculator's
        # config is exactly the plain one plus three keys.
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
        """Load a saved speculator, or convert a plain draft checkpoint.

        Args:
            pretrained: embedded name, local directory or cached hub id.
            verifier: names (and with ``verifier_mode`` "full"/"train_only" loads) the verifier; default the
                recorded one.
            verifier_mode: see :meth:`attach_verifier`. "detached" with ``verifier=None`` keeps the record
                as is and runs no check.
            num_speculative_tokens: γ (default: recorded, or 5 when converting).
            dtype: ``"auto"`` keeps the checkpoint's dtype (what makes a converted speculator's weights
                byte-identical); or a torch dtype / name.
            device: moves the draft (and a held verifier) there.
            model_kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.

        Raises:
            SpeculatorError: not a causal LM (names its architecture), invalid speculator keys, γ < 1, a
                non-detached mode with no verifier recorded or given.
            specdraft.embedded.ModelResolutionError: the reference cannot be resolved.
            specdraft.weights.CheckpointWeightsError: weights missing from or left over in the checkpoint (named),
                never filled in at random (:func:`specdraft.models.load_causal_lm`).
        """
        import torch

        from specdraft.models import load_causal_lm, resolve

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
            from specdraft.models import local_reference

            # A recorded hub id of an embedded model opens its embedded build when the hub copy is not here.
            verifier = local_reference(config.verifier.name_or_path)
        if verifier is not None:
            spec.attach_verifier(verifier, verifier_mode, device=device)
        if device is not None:
            spec.to(device)
        return spec
