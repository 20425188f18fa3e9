"""Prompt sets for `ssmspec bench`: the vendored sets, prompt files, and how prompts are encoded."""
from __future__ import annotations

import gzip
import json

import pytest

from ssmspec.benchmark.prompts import DATASETS, Prompt, encode, load_prompts, read_prompts_file
from ssmspec.errors import InputError
from ssmspec.tokenization import ByteTokenizer


@pytest.mark.parametrize("name, count, chat", [("humaneval", 164, False), ("mt-bench", 80, True), ("sharegpt", 200, True)])
def test_vendored_sets_load_with_their_licences(name, count, chat):
    shown, prompts = load_prompts(name)
    assert shown == name and len(prompts) == count
    assert len({p.id for p in prompts}) == count
    for p in prompts:
        assert (p.messages is not None) == chat
        text = p.messages[0]["content"] if chat else p.text
        assert text.strip()
    assert (DATASETS[name].parent / "LICENSE").is_file()


def test_sharegpt_sample_is_small():
    assert DATASETS["sharegpt"].stat().st_size < 500_000


def test_jsonl_prompts_and_messages(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "prompt": "hello"}, {"prompt": "   "}, {"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "user"}]}, {"other": 1}, [1, 2], {"task_id": "t", "prompt": "x"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    unusable = []
    prompts = read_prompts_file(path, unusable)
    assert [(p.id, p.text, p.messages) for p in prompts] == [
        ("a", "hello", None), ("line3", None, [{"role": "user", "content": "hi"}]), ("t", "x", None)]
    assert [u["prompt_id"] for u in unusable] == ["p.jsonl:2", "p.jsonl:4", "p.jsonl:5", "p.jsonl:6"]  # each said
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert [p.id for p in read_prompts_file(gz)] == ["a", "line3", "t"]
    assert load_prompts(str(path))[0] == "p.jsonl"


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{broken\n')
    with pytest.raises(InputError, match=r"p.jsonl:2"):
        read_prompts_file(path)


def test_txt_is_one_prompt_a_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first\n\n  \nsecond line\n")
    assert [(p.id, p.text) for p in read_prompts_file(path)] == [("line1", "first"), ("line4", "second line")]


class TemplatedTokenizer(ByteTokenizer):
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return {"input_ids": [1] + self.encode("|".join(m["content"] for m in messages)) + [2]}


def test_encode_uses_the_chat_template_when_there_is_one():
    chat = Prompt("c", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert encode(ByteTokenizer(), chat) == list(b"be brief\n\nhi")
    assert encode(TemplatedTokenizer(), chat) == [1, *b"be brief|hi", 2]
    assert encode(TemplatedTokenizer(), Prompt("t", text="def f")) == list(b"def f")  # raw text is never templated
