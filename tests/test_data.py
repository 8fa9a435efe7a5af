"""Prompt sources by name and path, and their chat-template encoding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdraft.data.sources import DataError, encode_prompts, load_examples, render_prompt
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
    with pytest.raises(DataError, match="skips them all"):
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


# ------------------------------------------------------------------------------ ShareGPT


def _sharegpt_record(rid: str, human: str, gpt: str, first: str = "human") -> dict:
    second = "gpt" if first == "human" else "human"
    return {"id": rid, "conversations": [{"from": first, "value": human}, {"from": second, "value": gpt}]}


def _truncated_sharegpt_file(path) -> None:
    """A ShareGPT-shaped file with one record of every kind the reader drops, a record that does not decode in the
    middle, and the last record cut inside a two-byte UTF-8 character (as the embedded file is cut mid-string)."""
    long = "x" * 200
    good = [_sharegpt_record("a_0", "What is a tensor, in one paragraph?", "A tensor is " + long),
            _sharegpt_record("b_0", "Explain speculative decoding.", "Speculative decoding " + long),
            _sharegpt_record("c", "Write a haiku about the sea.", "Waves fold " + long)]  # no part suffix: a start
    dropped = [
        _sharegpt_record("a_1", "And what about a matrix then?", "A matrix is " + long),  # continuation
        _sharegpt_record("d_0", "Hello, I am a reply that comes first", "Hi " + long, first="gpt"),  # not human→gpt
        _sharegpt_record("e_0", "short", "Too short a prompt " + long),  # length
        _sharegpt_record("f_0", "Translate this into Greek please", "Ελληνικά " * 40),  # non-ASCII
        _sharegpt_record("g_0", "Explain speculative decoding.", "Again " + long),  # duplicate prompt
        {"id": "h_0", "conversations": "not a list"},  # wrong shape: malformed
        [1, 2, 3],  # not an object: malformed
    ]
    body = ",\n".join(json.dumps(r, indent=2) for r in [good[0], *dropped[:3]])
    body += ',\n{"id": "bad_0", "conversations": [{"from": "human", "value": "a bad \\q escape"}]}'  # does not decode
    body += ",\n" + ",\n".join(json.dumps(r, indent=2) for r in [good[1], *dropped[3:], good[2]])
    cut = json.dumps(_sharegpt_record("z_0", "A question cut short?", "é" * 300), ensure_ascii=False).encode()
    end = cut.index("é".encode()) + 2 * 5 + 1  # inside the sixth é (0xC3 0xA9)
    path.write_bytes(("[\n" + body + ",\n").encode() + cut[:end])


def test_sharegpt_reader_on_a_truncated_file(tmp_path):
    from specdraft.data.sources import decode_json_records, parse_sharegpt

    f = tmp_path / "sharegpt.json"
    _truncated_sharegpt_file(f)
    text = f.read_text(encoding="utf-8", errors="replace")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # as the real file: not valid JSON
    records, malformed = decode_json_records(text)
    assert malformed == 2  # the bad escape and the cut tail; every record after the bad one still decodes
    assert [r["id"] if isinstance(r, dict) else r for r in records] == [
        "a_0", "a_1", "d_0", "e_0", "b_0", "f_0", "g_0", "h_0", [1, 2, 3], "c"]
    index = parse_sharegpt(text)
    assert index["counts"] == {"records": 10, "malformed": 4, "continuation": 1, "not_human_gpt": 1, "length": 1,
                               "non_ascii": 1, "duplicate_prompt": 1, "kept": 3}
    assert [t["id"] for t in index["turns"]] == ["a_0", "b_0", "c"]
    assert index["turns"][1]["prompt"] == "Explain speculative decoding." and index["turns"][1]["reply"].startswith(
        "Speculative decoding x")
    assert decode_json_records("") == ([], 0) and decode_json_records("[]") == ([], 0)


def test_sharegpt_index_is_cached_atomically_and_rebuilt_when_stale(tmp_path, monkeypatch):
    from specdraft.data import sources as data

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "sharegpt.json"
    _truncated_sharegpt_file(f)
    first = data.sharegpt_index(f)
    [cached] = (tmp_path / "cache" / "data").glob("sharegpt-*.json")
    assert not list(cached.parent.glob(".tmp-*"))  # written through specdraft.core.io.atomic_path
    calls = []
    real_parse = data.parse_sharegpt
    monkeypatch.setattr(data, "parse_sharegpt", lambda text: calls.append(1) or real_parse(text))
    again = data.sharegpt_index(f)
    assert calls == [] and again["turns"] == first["turns"] and again["counts"] == first["counts"]
    cached.write_text("{ damaged")  # an unreadable cache is rebuilt, not trusted
    assert data.sharegpt_index(f)["counts"] == first["counts"] and calls == [1]
    assert json.loads(cached.read_text())["counts"] == first["counts"]
    _truncated_sharegpt_file(f)
    f.write_bytes(f.read_bytes()[:-30])  # another file (size changes): another key, parsed again
    data.sharegpt_index(f)
    assert calls == [1, 1] and len(list(cached.parent.glob("sharegpt-*.json"))) == 2


def test_sharegpt_examples_are_prompts_and_teacher_forced_first_turns(tmp_path, monkeypatch):
    from specdraft.data import sources as data
    from specdraft.data.prompts import load_prompts
    from specdraft.data.sources import build_sequences, source_counts

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "sharegpt.json"
    _truncated_sharegpt_file(f)
    monkeypatch.setattr(data, "data_file", lambda name: f)
    ex = load_examples("sharegpt")
    assert [e.id for e in ex] == ["sharegpt/a_0", "sharegpt/b_0", "sharegpt/c"]
    assert [m["role"] for m in ex[1].messages] == ["user", "assistant"]
    assert ex[1].prompt_messages == [{"role": "user", "content": "Explain speculative decoding."}]
    assert [e.id for e in load_prompts(["sharegpt:1:5:1"])] == ["sharegpt/b_0", "sharegpt/c"]
    assert [e.id for e in load_prompts(["sharegpt:0:2:2"])] == ["sharegpt/a_0", "sharegpt/c"]
    assert source_counts("sharegpt")["malformed"] == 4 and source_counts("humaneval") is None
    # Teacher-forced: the whole turn is the sequence; with answer_only the trained predictions are the reply's.
    tok = tiny_tokenizer(64)
    seq = build_sequences(tok, ex[:1], answer_only=True)[0]
    predicted = [seq.ids[j + 1] for j, m in enumerate(seq.loss_mask) if m]
    assert predicted[:-1] == tok(ex[0].messages[1]["content"], add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(predicted[-1:]) == ["<|im_end|>"]


def test_embedded_sharegpt_has_its_documented_counts_and_split():
    from specdraft.data.sources import HELD_OUT_OFFSET, source_counts

    ex = load_examples("sharegpt")
    c = source_counts("sharegpt")
    assert (c["records"], c["malformed"], c["kept"]) == (17671, 1, 6413) and len(ex) == 6413
    held = load_examples("sharegpt", offset=HELD_OUT_OFFSET["sharegpt"])
    assert len(held) == 413
    train_prompts = {e.messages[0]["content"] for e in ex[:HELD_OUT_OFFSET["sharegpt"]]}
    assert not any(e.messages[0]["content"] in train_prompts for e in held)


@pytest.mark.parametrize(("line", "says"), [
    ('["a", "b"]', "expected an object, got a list"),
    ('"text"', "expected an object, got a str"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}', "role \"wizard\"; a role is one of system, user, assistant"),
    ('{"messages": [{"role": "user"}]}', "messages[0] must be an object with a 'role' and a 'content' string"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "no user message before the first assistant message"),
    ('{"prompt": ""}', "'prompt' must be a non-empty string"),
    ('{"prompt": 3}', "'prompt' must be a non-empty string, got 3"),
])
def test_every_malformed_line_is_a_data_error_naming_file_and_line(tmp_path, line, says):
    """Valid JSON of the wrong shape used to end in AttributeError (exit 1) or crash after the models loaded."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError) as err:
        load_examples(path)
    assert str(err.value).startswith(f"{path}:2: ") and says in str(err.value)


def test_a_missing_source_is_named_as_what_it_is(tmp_path):
    with pytest.raises(DataError, match=r"^nope.jsonl: no such file$"):
        load_examples("nope.jsonl")
    with pytest.raises(DataError, match=r"humaneval.jsonl: no such file; for the embedded dataset, pass --prompts "
                                        "humaneval"):
        load_examples("humaneval.jsonl")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="is not a .jsonl file"):
        load_examples(tmp_path / "notes.txt")
    with pytest.raises(DataError, match="not a dataset written by datasets' save_to_disk"):
        load_examples(tmp_path)
    upper = tmp_path / "BAD.JSONL"  # the suffix's case does not matter
    upper.write_text(json.dumps({"prompt": "a"}) + "\n")
    assert [e.messages[0]["content"] for e in load_examples(upper)] == ["a"]


def test_an_offset_past_the_end_says_how_many_prompts_there_are(tmp_path):
    with pytest.raises(DataError, match=r"humaneval has 164 prompt\(s\): an offset of 10000 skips them all"):
        load_examples("humaneval", offset=10000)
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in "abc"))
    with pytest.raises(DataError, match=r"has 3 prompt\(s\): an offset of 3 skips them all \(use an offset below 3\)"):
        load_examples(path, offset=3)


def test_an_empty_think_block_the_template_inserts_is_not_trained_as_assistant_output():
    """A Qwen3-style template writes ``<think>\\n\\n</think>`` into an assistant turn by itself: the model did not
    write those tokens for this answer, so with answer_only they are not trained; the reply and its end are."""
    from specdraft.data.sources import encode_conversation
    from specdraft.testing import tiny_tokenizer

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{% if m['role'] == 'assistant' %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = tiny_tokenizer(chat_template=template)
    w = tok.convert_ids_to_tokens([10, 11, 12])
    ids, assistant = encode_conversation(tok, [{"role": "user", "content": w[0]},
                                               {"role": "assistant", "content": f"{w[1]} {w[2]}"}])
    trained = tok.convert_ids_to_tokens([i for i, a in zip(ids, assistant) if a])
    assert trained == [w[1], w[2], "<|im_end|>"]
    assert tok.unk_token_id in ids  # the think tags are in the sequence (unknown words here), just not trained


def _history(*turns: str) -> list[dict[str, str]]:
    """Messages alternating user and assistant, from the user: ``_history("a", "b", "c")`` ends with a user turn."""
    return [{"role": ("user", "assistant")[k % 2], "content": t} for k, t in enumerate(turns)]


def test_a_conversation_ending_with_a_user_turn_is_asked_with_its_whole_history():
    """What a chat server receives: the template over every message, with the generation prompt; never its first
    question alone. A conversation ending with an assistant turn still asks its first question."""
    from specdraft.data.sources import Example, build_sequences

    tok = tiny_tokenizer(64)
    w = tok.convert_ids_to_tokens(list(range(10, 15)))
    ex = Example("chat", _history(w[0], w[1], w[2]), reference=f"{w[3]} {w[4]}")
    shown = tok.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True)
    assert ex.prompt_messages == ex.messages and render_prompt(tok, ex) == shown
    prompt = encode_prompts(tok, [ex])[0]
    assert prompt == tok(shown, add_special_tokens=False)["input_ids"]
    # The training sequence's prompt part is what the target was shown: the reference's tokens follow it.
    (seq,) = build_sequences(tok, [ex], answer_only=True)
    assert seq.ids[: len(prompt)] == prompt
    assert tok.convert_ids_to_tokens(seq.ids[len(prompt):len(prompt) + 2]) == [w[3], w[4]]
    answered = Example("answered", _history(w[0], w[1], w[2], w[3]))
    assert answered.prompt_messages == answered.messages[:1]


def test_a_training_sequences_prompt_is_what_the_target_is_shown_when_the_template_renders_the_last_turn_apart():
    """A template that writes a think block into the last assistant turn only renders an earlier reply one way as
    history and another as the last turn: the sequence of a history with a reference starts with the prompt's ids
    (the reply as history), then the reference, which alone is trained. A template whose prompt rendering is no
    prefix of the answered conversation (the last user turn marked) is refused by name."""
    from specdraft.data.sources import Example, build_sequences

    think_last = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}"
                  "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = tiny_tokenizer(64, chat_template=think_last)
    w = tok.convert_ids_to_tokens(list(range(10, 15)))
    ex = Example("chat", _history(w[0], w[1], w[2]), reference=f"{w[3]} {w[4]}")
    prompt = encode_prompts(tok, [ex])[0]
    (seq,) = build_sequences(tok, [ex], answer_only=True)
    assert seq.ids[: len(prompt)] == prompt
    trained = [seq.ids[j + 1] for j, t in enumerate(seq.loss_mask) if t]
    assert tok.convert_ids_to_tokens(trained) == [w[3], w[4], "<|im_end|>"]
    assert seq.ids[len(prompt):].count(tok.unk_token_id) == 2  # the think tags follow the prompt, untrained
    (plain,) = build_sequences(tok, [ex], answer_only=False)
    assert plain.ids == seq.ids and all(plain.loss_mask[:-1])
    marked = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'user' and loop.last %}"
              "now {% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DataError, match=r"^chat: the chat template renders the prompt one way when it is asked .*"
                                        r"leave this row out"):
        build_sequences(tiny_tokenizer(64, chat_template=marked), [ex], answer_only=True)


def test_a_template_that_refuses_some_histories_names_and_counts_every_row_before_encoding():
    """A template that wants alternating roles refuses a history of two user turns: one DataError counting the
    rows, naming them and the fix, never the template's own exception from the middle of a batch."""
    from specdraft.data.sources import Example

    template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
                "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = tiny_tokenizer(chat_template=template)
    rows = [Example("fine", _history("a", "b", "c")),
            Example("mine:line-2", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
            Example("mine:line-3", _history("a", "b") + [{"role": "assistant", "content": "c"},
                                                         {"role": "user", "content": "d"}])]
    with pytest.raises(DataError) as err:
        encode_prompts(tok, rows)
    says = str(err.value)
    assert says.startswith("2 of 3 prompt(s) cannot be rendered: mine:line-2: the chat template refuses its 2 "
                           "prompt message(s) (user, user): Conversation roles must alternate"), says
    assert "(also mine:line-3)" in says and "alternate" in says.split(". ", 1)[1]
    assert len(encode_prompts(tok, rows[:1])) == 1


def test_rows_without_an_id_are_named_by_their_file_and_line(tmp_path):
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in "ab")
                                         + json.dumps({"id": "kept", "prompt": "c"}) + "\n")
    assert [e.id for e in load_examples(tmp_path / "mine.jsonl")] == ["mine:line-1", "mine:line-2", "kept"]
    from datasets import Dataset

    Dataset.from_list([{"prompt": "x"}]).save_to_disk(str(tmp_path / "saved"))
    assert [e.id for e in load_examples(tmp_path / "saved")] == ["saved:row-0"]
