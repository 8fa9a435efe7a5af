"""``specdraft check``: can these two checkpoints work together?

:func:`check_compatible` compares both tokenizers over the whole vocabulary (no weights loaded) and returns a
:class:`CompatReport` with one of :data:`VERDICTS`; :func:`run_check` adds both models' facts and a greedy
continuation. Verification compares p and q id by id, so an id meaning different strings silently breaks
acceptance. Padding-only width differences go through :func:`specdraft.core.sampling.align_logits`, another family
through a :class:`specdraft.models.vocab.VocabMapping`.
"""

from __future__ import annotations

import heapq
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args

from specdraft.core.embedded import EMBEDDED, cache_root
from specdraft.data.sources import tokenizer_pad_id
from specdraft.models.loading import load_model
from specdraft.models.tokenizer_view import (
    SPECIAL_ROLES,
    TokenizerView,
    load_tokenizer_view,
    view_fingerprint,
)
from specdraft.models.vocab import (
    MIN_COVERAGE,
    PROBE_TEXT,
    CompatibilityError,
    encode_text,
    mapping_from_views,
    vocab_differences,
)

Verdict = Literal["identical", "identical-up-to-padding", "mismatch"]
#: The verdicts of :func:`check_compatible`, most agreeing first.
VERDICTS: tuple[str, ...] = get_args(Verdict)

#: Differences listed by name in a report (all of them are counted).
MAX_DIFFERENCES = 10

_SYSTEM = {"role": "system", "content": "You are a careful assistant."}
_USER = {"role": "user", "content": "Write hello world in Python."}
_REPLY = {"role": "assistant", "content": "print('hello world')"}
_AGAIN = {"role": "user", "content": "Now in C."}

#: Conversations both chat templates render (``name → (messages, add_generation_prompt)``).
PROBE_CONVERSATIONS: dict[str, tuple[list[dict[str, str]], bool]] = {
    "user, generation prompt": ([_USER], True),
    "system + user, generation prompt": ([_SYSTEM, _USER], True),
    "multi-turn, generation prompt": ([_USER, _REPLY, _AGAIN], True),
    "system + multi-turn, no generation prompt": ([_SYSTEM, _USER, _REPLY], False),
}

#: Which chat template specdraft's stages render with (always the target's).
TEMPLATE_USE = ("the dump, the evaluation and the export use the target's chat template (prompts and training "
                "sequences are rendered with the target's tokenizer; an exported speculator carries the target's "
                "template where the draft's renders differently)")

_EXCERPT = 40


def _render(tok, messages: list[dict[str, str]], add_generation_prompt: bool) -> str | None:
    """The template's text, None without a template, ``"error: ..."`` when it fails (a rendering too)."""
    if not getattr(tok, "chat_template", None):
        return None
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001
        return f"error: {type(exc).__name__}: {exc}"


def compare_chat_templates(target_tok, draft_tok) -> dict[str, Any]:
    """Render every :data:`PROBE_CONVERSATIONS` entry with both chat templates and compare texts.

    Returns ``{"equal": bool | None, "target_has_template", "draft_has_template", "conversations": [{"name",
    "equal"}],
    "first_difference": None | {"conversation", "position", "target", "draft"}}`` (excerpts up to 40 characters).
    """
    has_t, has_d = bool(getattr(target_tok, "chat_template", None)), bool(getattr(draft_tok, "chat_template", None))
    out: dict[str, Any] = {"equal": None, "target_has_template": has_t, "draft_has_template": has_d,
                           "conversations": [], "first_difference": None}
    if not has_t and not has_d:
        return out
    for name, (messages, gen) in PROBE_CONVERSATIONS.items():
        a, b = _render(target_tok, messages, gen), _render(draft_tok, messages, gen)
        same = a == b
        out["conversations"].append({"name": name, "equal": same})
        if not same and out["first_difference"] is None:
            k = 0 if a is None or b is None else _first_list_difference(a, b)
            start = max(0, k - 8)
            out["first_difference"] = {"conversation": name, "position": k,
                                       "target": None if a is None else a[start: start + _EXCERPT],
                                       "draft": None if b is None else b[start: start + _EXCERPT]}
    out["equal"] = all(c["equal"] for c in out["conversations"])
    return out


def template_difference(chat: dict[str, Any]) -> str:
    """One line for :func:`compare_chat_templates`'s result: equal, or the first difference with both excerpts."""
    if chat["equal"] is None:
        return "neither tokenizer has a chat template"
    if chat["equal"]:
        return f"the {len(chat['conversations'])} probe conversations render identically with both"
    if not chat["draft_has_template"]:
        return "only the target has a chat template"
    if not chat["target_has_template"]:
        return "only the draft has a chat template"
    f = chat["first_difference"]
    n = sum(not c["equal"] for c in chat["conversations"])
    return (f"the chat templates render {n} of the {len(chat['conversations'])} probe conversations differently; "
            f"first in \"{f['conversation']}\" at character {f['position']}: target {f['target']!r} vs draft "
            f"{f['draft']!r}")


def _first_list_difference(a: list | str, b: list | str) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length for a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))



# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


@dataclass
class TokenDifference:
    """One id whose string differs: ``None`` where the id is past that tokenizer's real vocabulary."""

    id: int
    target: str | None
    draft: str | None


@dataclass
class CompatReport:
    """Result of :func:`check_compatible`: counts complete, example lists capped.

    Verdicts: ``identical`` (every id means the same string both ways, same logits width), ``identical-up-to-padding``
    (widths differ; q goes through :func:`align_logits`), ``mismatch``. Other differences are warnings (why:
    docs/architecture.md#specdraftmodelscheck).
    """

    verdict: Verdict
    target: str  # the reference or tokenizer name
    draft: str
    target_len: int  # len(tokenizer)
    draft_len: int
    target_real_vocab: int  # len(tokenizer) less GGUF placeholders / trailing holes
    draft_real_vocab: int
    target_config_vocab: int | None  # config.vocab_size, None without a config
    draft_config_vocab: int | None
    target_width: int  # logits width: config.vocab_size, else the tokenizer's id range
    draft_width: int
    real_vocab: int | None  # shared real vocabulary length when the vocabularies agree, else None
    n_diff_ids: int  # ids in [0, max real) whose strings differ (or exist on one side only)
    n_diff_strings: int  # strings whose ids differ (or exist on one side only)
    differences: list[TokenDifference]  # first MAX_DIFFERENCES differing ids, ascending
    string_differences: list[dict[str, Any]]  # first differing strings: {"string", "target", "draft"} ids
    special_tokens: dict[str, dict[str, Any]]  # role → {"target": [str, id], "draft": [str, id], "equal"}
    special_tokens_equal: bool  # roles and special flags agree
    probe_equal: bool  # PROBE_TEXT encodes to the same ids (add_special_tokens=False)
    probe_detail: dict[str, Any] | None  # first differing position and the ids around it
    chat_template_equal: bool | None  # rendered alike (compare_chat_templates); None when neither has a template
    target_fingerprint: str
    draft_fingerprint: str
    warnings: list[str] = field(default_factory=list)
    mapping: dict[str, Any] | None = None  # on a mismatch: what a VocabMapping would cover
    chat_template: dict[str, Any] | None = None  # compare_chat_templates(target, draft): per conversation, first diff
    template_use: str = TEMPLATE_USE  # which template the dump, the evaluation and the export use
    seconds: float = 0.0  # wall time of the check, loading included
    # n_diff_strings split three ways: it counts the union of both vocabularies, so it can exceed either one's size
    n_strings_target_only: int = 0
    n_strings_draft_only: int = 0
    n_strings_moved: int = 0  # in both vocabularies under different ids

    @property
    def compatible(self) -> bool:
        """True unless the verdict is ``mismatch``."""
        return self.verdict != "mismatch"

    def detail(self) -> str:
        """The counts behind the verdict, and the first differing ids with both strings."""
        if self.verdict == "identical":
            return f"{self.real_vocab} ids agree, logits width {self.target_width}"
        if self.verdict == "identical-up-to-padding":
            return (f"{self.real_vocab} ids agree; logits widths target {self.target_width}, draft "
                    f"{self.draft_width} (rows past {self.real_vocab} are padding)")
        first = "; ".join(f"id {d.id}: target {d.target!r} vs draft {d.draft!r}" for d in self.differences[:3])
        n = max(self.target_real_vocab, self.draft_real_vocab)
        strings = (f"{self.n_diff_strings:,} strings of the two vocabularies' union differ "
                   f"({self.n_strings_target_only:,} only in the target's, {self.n_strings_draft_only:,} only in the "
                   f"draft's, {self.n_strings_moved:,} in both under different ids)")
        return (f"{self.n_diff_ids:,} of the {n:,} ids below the larger real vocabulary (target {self.target_real_vocab:,}, "
                f"draft {self.draft_real_vocab:,}) and {strings} (first: {first})")

    def summary(self) -> str:
        """One line: the verdict and :meth:`detail`."""
        return f"{self.verdict}: {self.detail()}"

    def raise_for_mismatch(self) -> CompatReport:
        """Raise :class:`CompatibilityError` on a ``mismatch`` (naming the first differing
        ids); return ``self`` otherwise."""
        if self.verdict != "mismatch":
            return self
        hint = ""
        if self.mapping and self.mapping.get("usable"):
            hint = (f" A VocabMapping could translate between them (target coverage "
                    f"{self.mapping['target_coverage']:.1%}, draft coverage {self.mapping['draft_coverage']:.1%}).")
        raise CompatibilityError(
            f"Target {self.target} and draft {self.draft} tokenizers disagree — {self.summary()}. "
            "Speculative decoding compares p and q id by id, so they cannot be paired as is." + hint
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field plus ``compatible`` and ``summary``."""
        d = asdict(self)
        d["compatible"] = self.compatible
        d["summary"] = self.summary()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompatReport:
        """The report back from :meth:`to_dict` (derived keys ignored)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["differences"] = [TokenDifference(**x) for x in kw.get("differences", [])]
        return cls(**kw)


def check_compatible(target, draft, *, target_config=None, draft_config=None,
                     max_differences: int = MAX_DIFFERENCES, with_mapping: bool = True) -> CompatReport:
    """Compare the target's and the draft's tokenizers over the whole vocabulary (no weights loaded).

    Compares ids both ways, special tokens, :data:`PROBE_TEXT` encodings, chat templates and logits widths.
    ``target``/``draft``: references or tokenizer objects (then ``*_config`` or an int gives the width). A mismatch is
    reported, not raised (:func:`require_compatible` raises). Raises :class:`ModelResolutionError` for an unresolvable
    reference or unloadable tokenizer/config.
    """
    t0 = time.perf_counter()
    t = load_tokenizer_view(target, target_config, "target")
    d = load_tokenizer_view(draft, draft_config, "draft")

    diff_ids, diff_strings = vocab_differences(t, d)
    n = max(t.real, d.real)
    tv = {s: i for s, i in t.vocab.items() if i < t.real}
    dv = {s: i for s, i in d.vocab.items() if i < d.real}
    first_strings = heapq.nsmallest(max_differences, diff_strings, key=lambda s: (min(tv.get(s, n), dv.get(s, n)), s))

    def tok_at(v: TokenizerView, i: int) -> str | None:
        return v.tokens[i] if i < v.real else None

    differences = [TokenDifference(i, tok_at(t, i), tok_at(d, i)) for i in diff_ids[:max_differences]]
    string_differences = [{"string": s, "target": tv.get(s), "draft": dv.get(s)}
                          for s in first_strings]
    vocab_equal = not diff_ids and not diff_strings
    n_target_only = sum(1 for s in diff_strings if s not in dv)
    n_draft_only = sum(1 for s in diff_strings if s not in tv)

    warnings: list[str] = []
    special = {}
    for role in SPECIAL_ROLES:
        a, b = t.roles[role], d.roles[role]
        special[role] = {"target": list(a), "draft": list(b), "equal": a == b}
        if a != b and vocab_equal:  # on a mismatch the table shows them; the ids differ anyway
            warnings.append(f"{role} token differs: target {a[0]!r} (id {a[1]}), draft {b[0]!r} (id {b[1]})")
    flags_equal = t.special_ids == d.special_ids
    if not flags_equal and vocab_equal:
        only_t = sorted(set(t.special_ids) - set(d.special_ids))[:5]
        only_d = sorted(set(d.special_ids) - set(t.special_ids))[:5]
        warnings.append(f"special flags differ: special only for the target {only_t}, only for the draft {only_d}")
    special_equal = all(s["equal"] for s in special.values()) and flags_equal

    probe_t, probe_d = encode_text(t.tok, PROBE_TEXT, False), encode_text(d.tok, PROBE_TEXT, False)
    probe_equal = probe_t == probe_d
    probe_detail = None
    if not probe_equal:
        if isinstance(probe_t, list) and isinstance(probe_d, list):
            k = _first_list_difference(probe_t, probe_d)
            probe_detail = {"position": k, "target_len": len(probe_t), "draft_len": len(probe_d),
                            "target_ids": probe_t[max(0, k - 2): k + 4], "draft_ids": probe_d[max(0, k - 2): k + 4],
                            "target_tokens": [tok_at(t, i) for i in probe_t[max(0, k - 2): k + 4]],
                            "draft_tokens": [tok_at(d, i) for i in probe_d[max(0, k - 2): k + 4]]}
        else:
            probe_detail = {"target": probe_t if isinstance(probe_t, str) else "ok",
                            "draft": probe_d if isinstance(probe_d, str) else "ok"}
        if vocab_equal:
            warnings.append(f"the probe text encodes differently (normaliser / pre-tokeniser differ) from "
                            f"token {probe_detail.get('position', 0)}: the draft will see text segmented "
                            "unlike its training")
    elif vocab_equal and encode_text(t.tok, PROBE_TEXT, True) != encode_text(d.tok, PROBE_TEXT, True):
        warnings.append("the tokenizers add different special tokens (bos/eos) when encoding")

    chat = compare_chat_templates(t.tok, d.tok)
    chat_equal = chat["equal"]
    if chat_equal is False and vocab_equal:
        warnings.append(f"{template_difference(chat)}; {TEMPLATE_USE}")

    for v, role in ((t, "target"), (d, "draft")):
        if v.config_vocab is not None and v.config_vocab < v.real:
            warnings.append(f"{role} config.vocab_size {v.config_vocab} < its real vocabulary {v.real}: ids "
                            f">= {v.config_vocab} can never be produced")

    if not vocab_equal:
        verdict: Verdict = "mismatch"
    elif t.width == d.width:
        verdict = "identical"
    else:
        verdict = "identical-up-to-padding"

    mapping = None
    if verdict == "mismatch" and with_mapping:
        m = mapping_from_views(t, d)
        mapping = m.to_dict()
        mapping["usable"] = m.usable_error(MIN_COVERAGE) is None

    return CompatReport(
        verdict=verdict, target=t.name, draft=d.name,
        target_len=len(t.tok), draft_len=len(d.tok),
        target_real_vocab=t.real, draft_real_vocab=d.real,
        target_config_vocab=t.config_vocab, draft_config_vocab=d.config_vocab,
        target_width=t.width, draft_width=d.width,
        real_vocab=t.real if vocab_equal else None,
        n_diff_ids=len(diff_ids), n_diff_strings=len(diff_strings),
        n_strings_target_only=n_target_only, n_strings_draft_only=n_draft_only,
        n_strings_moved=len(diff_strings) - n_target_only - n_draft_only,
        differences=differences, string_differences=string_differences,
        special_tokens=special, special_tokens_equal=special_equal,
        probe_equal=probe_equal, probe_detail=probe_detail, chat_template_equal=chat_equal,
        target_fingerprint=view_fingerprint(t), draft_fingerprint=view_fingerprint(d),
        warnings=warnings, mapping=mapping, chat_template=chat, seconds=round(time.perf_counter() - t0, 3),
    )


def require_compatible(target, draft, **kwargs) -> CompatReport:
    """:func:`check_compatible`, raising :class:`CompatibilityError` on a ``mismatch``."""
    return check_compatible(target, draft, **kwargs).raise_for_mismatch()


def print_report(report: CompatReport, console) -> None:
    """Print ``report`` on a rich ``console``: a side-by-side table, the differing ids, the warnings."""
    from rich.markup import escape
    from rich.table import Table

    def fmt(x) -> str:
        return escape(repr(x) if isinstance(x, str) else str(x))

    def short(name: str) -> str:  # embedded models resolve to their cache entry: show the name

        p = os.path.abspath(name)
        return os.path.basename(p) if p.startswith(str(cache_root().resolve() / "models") + os.sep) else name

    table = Table(title="Tokenizer compatibility")
    table.add_column("")
    table.add_column(f"target: {escape(short(report.target))}")
    table.add_column(f"draft: {escape(short(report.draft))}")
    table.add_row("len(tokenizer)", str(report.target_len), str(report.draft_len))
    table.add_row("real vocabulary", str(report.target_real_vocab), str(report.draft_real_vocab))
    table.add_row("config.vocab_size", str(report.target_config_vocab), str(report.draft_config_vocab))
    table.add_row("logits width", str(report.target_width), str(report.draft_width))
    table.add_row("fingerprint", report.target_fingerprint[:16], report.draft_fingerprint[:16])
    for role, s in report.special_tokens.items():
        style = "" if s["equal"] else "[yellow]"
        table.add_row(f"{style}{role}", *(f"{style}{fmt(s[k][0])} ({s[k][1]})" for k in ("target", "draft")))
    table.add_row("probe encoding", "same" if report.probe_equal else "[yellow]differs", "")
    chat = {None: "none", True: "renders the same", False: "[yellow]renders differently"}[report.chat_template_equal]
    table.add_row("chat template", chat, "")
    console.print(table)
    if report.chat_template is not None and report.chat_template["equal"] is not None:
        said = template_difference(report.chat_template)
        if not any(w.startswith(said) for w in report.warnings):  # a difference is a warning below: said once
            console.print(f"chat templates: {escape(said)}; {escape(report.template_use)}.", highlight=False)

    if report.differences:
        diff = Table(title=f"First differing ids (of {report.n_diff_ids})")
        for col in ("id", "target", "draft"):
            diff.add_column(col)
        for x in report.differences:
            diff.add_row(str(x.id), fmt(x.target), fmt(x.draft))
        console.print(diff)
    colour = {"identical": "green", "identical-up-to-padding": "green", "mismatch": "red"}[report.verdict]
    console.print(f"[bold {colour}]{report.verdict}[/]: {escape(report.detail())}")
    for w in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    if report.mapping:
        m = report.mapping
        console.print(mapping_line(report), highlight=False, soft_wrap=True)
        if m["usable"] and report.verdict == "mismatch":
            console.print("Decode through it with [bold]specdraft eval/generate --map-vocab[/], or re-index the draft "
                          "into the target's tokenizer with [bold]specdraft vocab-swap[/] and distil it.")


def mapping_line(report: CompatReport) -> str:
    """The sentence on what a vocabulary mapping would pair (rich markup); its count is of twins (same
    decoded text), not the verdict's raw shared strings."""
    m = report.mapping or {}
    moved = (f"; the {report.n_strings_moved:,} strings above are the raw vocabulary entries found in both under "
             "different ids, while a twin may also sit at the same id, or be spelt another way (a space as '▁' in "
             "one, 'Ġ' in the other)" if report.verdict == "mismatch" else "")
    return (f"A vocabulary mapping would pair {m['n_mapped']:,} twin tokens (the same text in both, matched by "
            f"decoded text{moved}): {m['target_coverage']:.1%} of the target vocabulary reachable, "
            f"{m['draft_coverage']:.1%} of the draft vocabulary mapped"
            + ("" if m["usable"] else " [red](no usable overlap)[/]"))


@dataclass
class ModelFacts:
    """Parameters, dtype, architecture and vocabulary sizes of a loaded model (:func:`model_facts`)."""

    architecture: str
    model_type: str
    parameters: int  # every parameter, a separate output head included
    output_head_parameters: int  # a separate (untied) output head; 0 when it is the input embeddings
    dtype: str  # e.g. "bfloat16"
    config_vocab_size: int
    tokenizer_len: int
    layers: int | None
    hidden_size: int | None
    max_position_embeddings: int | None
    tie_word_embeddings: bool | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_facts(model, tokenizer) -> ModelFacts:
    """Parameters, dtype, architecture and vocabulary sizes of a loaded model; ``output_head_parameters``
    counts an untied head (included in ``parameters``), else 0."""
    cfg = model.config
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    untied = out is not None and inp is not None and out.weight is not inp.weight
    return ModelFacts(
        architecture=(cfg.architectures or [type(model).__name__])[0],
        model_type=cfg.model_type,
        parameters=sum(p.numel() for p in model.parameters()),
        output_head_parameters=out.weight.numel() if untied else 0,
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        config_vocab_size=cfg.vocab_size,
        tokenizer_len=len(tokenizer),
        layers=getattr(cfg, "num_hidden_layers", None),
        hidden_size=getattr(cfg, "hidden_size", None),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None),
        tie_word_embeddings=getattr(cfg, "tie_word_embeddings", None),
    )


def parameter_note(target: ModelFacts | None, draft: ModelFacts | None, refs: tuple[str, str] = ("", "")) -> str | None:
    """Why parameter counts can exceed a published size (an untied output head, as in the embedded GGUF
    builds), or None when both heads are tied."""

    heads = {role: f.output_head_parameters if f else 0 for role, f in (("target", target), ("draft", draft))}
    if not any(heads.values()):
        return None
    sides = ", ".join(f"{role} {n / 1e6:,.1f} M" for role, n in heads.items() if n)
    gguf = any(ref in EMBEDDED for ref in refs)
    return (f"the parameter counts include a separate output head ({sides}); a checkpoint that ties the head to "
            "the input embeddings holds that many fewer, as published sizes of tied models count them"
            + ("; the embedded models are GGUF builds, which store the output head separately, so their counts "
               "exceed the published sizes" if gguf else ""))


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """``max_new_tokens`` greedy tokens after ``prompt`` rendered with the chat template (if any)."""
    import torch


    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    enc = {k: v.to(model.device) for k, v in enc.items()}
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer_pad_id(tokenizer))
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


@dataclass
class CheckResult:
    """What :func:`run_check` found: the tokenizer report and, unless a ``mismatch``, both models' facts
    and greedy continuations."""

    target_ref: str  # the references as the user typed them
    draft_ref: str
    compat: CompatReport
    target: ModelFacts | None = None
    draft: ModelFacts | None = None
    prompt: str | None = None
    continuations: dict[str, str] | None = None  # "target" / "draft" → the decoded greedy text

    @property
    def loaded(self) -> bool:
        """Both models were loaded and continued the prompt."""
        return self.continuations is not None

    def parameter_note(self) -> str | None:
        """:func:`parameter_note` of both models."""
        return parameter_note(self.target, self.draft, (self.target_ref, self.draft_ref))

    def to_dict(self) -> dict[str, Any]:
        """``{"target_ref", "draft_ref", "compat"}``, plus facts, prompt and continuations if loaded."""
        d: dict[str, Any] = {"target_ref": self.target_ref, "draft_ref": self.draft_ref,
                             "compat": self.compat.to_dict()}
        if self.loaded:
            d |= {"target": self.target.to_dict() if self.target else None,
                  "draft": self.draft.to_dict() if self.draft else None, "prompt": self.prompt,
                  "continuations": self.continuations}
        return d


def run_check(target_path: str, draft_path: str, prompt: str, max_new_tokens: int = 16, dtype: str = "auto",
              target_name: str | None = None, draft_name: str | None = None) -> CheckResult:
    """Compare tokenizers (before loading weights), then load both models and continue ``prompt`` greedily.
    On a ``mismatch`` the models are not loaded. Raises :class:`ModelResolutionError`."""

    report = CheckResult(target_name or target_path, draft_name or draft_path,
                         check_compatible(target_path, draft_path))
    if report.compat.verdict == "mismatch":
        return report
    facts, conts = {}, {}
    for role, path in (("target", target_path), ("draft", draft_path)):
        model, tok = load_model(path, dtype=dtype)
        facts[role] = model_facts(model, tok)
        conts[role] = greedy_continuation(model, tok, prompt, max_new_tokens)
        del model
    report.target, report.draft = facts["target"], facts["draft"]
    report.prompt, report.continuations = prompt, conts
    return report
