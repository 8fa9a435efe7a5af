"""Prompt sources by name and path, and their chat-template encoding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdraft.data import DataError, encode_prompts, load_examples, render_prompt
from specdraft.testing import tiny_tokenizer


def test_embedded_sources_have_their_documented_sizes():
    he = load_examples("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[0].reference
    assert "def " in he[0].messages[0]["content"]
    mt = load_examples("mt-bench")
    assert len(mt) == 80 and all(len(e.meta["turns"]) == 2 for e in mt)
    conv = load_examples("conversations")
    assert len(conv) == 500
    assert {m["role"] for e in conv for m in e.messages} == {"user", "assistant"}
    # Prompt messages stop before the first assistant turn.
    assert all(m["role"] == "user" for m in conv[0].prompt_messages)


def test_offset_and_limit():
    he = load_examples("humaneval", limit=8, offset=100)
    assert [e.id for e in he] == [f"HumanEval/{i}" for i in range(100, 108)]


def test_jsonl_and_saved_dataset(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a b"}) + "\n\n" +
                    json.dumps({"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]})
                    + "\n")
    ex = load_examples(path)
    assert [e.messages[0]["content"] for e in ex] == ["a b", "c"]
    assert ex[1].messages[1]["role"] == "assistant"
    from datasets import Dataset

    Dataset.from_list([{"prompt": "x"}, {"prompt": "y"}]).save_to_disk(str(tmp_path / "ds"))
    assert [e.messages[0]["content"] for e in load_examples(tmp_path / "ds")] == ["x", "y"]


def test_bad_sources_name_the_problem(tmp_path):
    with pytest.raises(DataError, match="humaneval"):
        load_examples("nonexistent-source")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        load_examples(bad)
    with pytest.raises(DataError, match="no examples"):
        load_examples("humaneval", offset=1000)


def test_chat_template_is_applied():
    tok = tiny_tokenizer(64)
    ex = load_examples("humaneval", limit=1)[0]
    text = render_prompt(tok, ex)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    ids = encode_prompts(tok, [ex])[0]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_cli_help_is_instant_and_imports_no_torch():
    code = "import sys, specdraft.cli; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "specdraft.cli", "--help"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0 and "check" in out.stdout and "models" in out.stdout
