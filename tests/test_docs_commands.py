"""Commands the documentation and the `--help` examples tell a user to run, where they once failed."""
from __future__ import annotations

import json

from ssmspec.cli.app import run
from ssmspec.tokenization import ByteTokenizer
from ssmspec.training.data import Tokenize


def test_chat_records_with_a_byte_vocabulary_use_the_default_template():
    """A tokenizer-less model (new-model's tiny presets) reads chat data: the default template, assistant turns trained."""
    record = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    ids, mask = Tokenize(ByteTokenizer(), 256, "chat")(record)
    assert bytes(ids).decode() == "<|user|>\nhi<|end|>\n<|assistant|>\nhello<|end|>\n"
    assert bytes(i for i, m in zip(ids, mask) if m).decode() == "hello<|end|>\n"


def test_sft_help_example_chat_fine_tuning_runs_on_a_byte_vocabulary_model(tmp_path, monkeypatch):
    """`ssmspec sft --student drafter --data sharegpt.json --format chat --out drafter-chat` (sft's --help example)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    assert run(["new-model", "--preset", "tiny", "--out", "drafter"]) == 0
    turns = [{"conversations": [{"from": "human", "value": f"what is {i} + {i}?"}, {"from": "gpt", "value": f"{2 * i}."}]}
             for i in range(40)]
    (tmp_path / "sharegpt.json").write_text(json.dumps(turns))
    assert run(["sft", "--student", "drafter", "--data", "sharegpt.json", "--format", "chat", "--out", "drafter-chat",
                "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--eval-every", "0", "--no-final-eval",
                "--save-every", "0"]) == 0
    assert (tmp_path / "drafter-chat" / "config.json").is_file()
