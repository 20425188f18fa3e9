"""Training data: readers, malformed records (file and line), chat masking on the labels, packing, split."""
from __future__ import annotations

import json

import pytest
import torch

from ssmspec.errors import DataError
from ssmspec.training.config import DataConfig
from ssmspec.training.data import BadRecords, Blocks, Tokenize, is_held_out, iter_records, pack
from test_training_common import char_tokenizer


def _records(spec, policy="error"):
    bad = BadRecords(policy)
    return [r for r, _ in iter_records(str(spec), bad)], bad


def test_readers_jsonl_json_txt_parquet_and_folders(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    (tmp_path / "b.json").write_text(json.dumps([{"text": "three"}, {"text": "four"}]))
    (tmp_path / "c.txt").write_text("five\nsix\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["seven", "eight"]}), tmp_path / "d.parquet")
    (tmp_path / "ignored.csv").write_text("x")
    recs, _ = _records(tmp_path)
    texts = [r["text"] for r in recs]
    assert texts == ["one", "two", "three", "four", "five\nsix\n", "seven", "eight"]
    both, _ = _records(f"{tmp_path / 'a.jsonl'},{tmp_path / 'c.txt'}")
    assert len(both) == 3


def test_malformed_jsonl_reports_file_and_line_under_error_and_skip(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"text": broken\n{"text": "fine"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        _records(f, "error")
    messages = []
    bad = BadRecords("skip", report=messages.append)
    recs = [r for r, _ in iter_records(str(f), bad)]
    assert [r["text"] for r in recs] == ["ok", "fine"]
    assert bad.count == 1 and "bad.jsonl:2" in messages[0]


def test_record_with_wrong_fields_is_reported_by_line(tmp_path):
    """A valid JSON line without the fields the format needs is malformed too, never silently dropped."""
    f = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    f.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    cfg = DataConfig(spec=str(f), seq_len=4, held_out_fraction=0.0)
    tok = char_tokenizer()
    with pytest.raises(DataError, match=r"chat\.jsonl:2"):
        Blocks(cfg, Tokenize(tok, 64, "chat"), 0, BadRecords("error"))
    bad = BadRecords("skip")
    Blocks(cfg, Tokenize(tok, 64, "chat"), 0, bad)
    assert bad.count == 1 and "chat.jsonl:2" in bad.examples[0]


def test_truncated_json_array_keeps_whole_records_and_reports_where(tmp_path):
    f = tmp_path / "trunc.json"
    f.write_text('[\n {"text": "a"},\n {"text": "b"},\n {"text": "c')
    with pytest.raises(DataError, match=r"trunc\.json:4"):
        _records(f, "error")
    recs, bad = _records(f, "skip")
    assert [r["text"] for r in recs] == ["a", "b"] and bad.count == 1


def test_tokens_out_of_vocabulary_are_malformed(tmp_path):
    f = tmp_path / "ids.jsonl"
    f.write_text(json.dumps({"input_ids": [1, 2, 3, 4, 5, 6]}) + "\n" + json.dumps({"input_ids": [1, 99]}) + "\n")
    with pytest.raises(DataError, match=r"ids\.jsonl:2.*outside the vocabulary"):
        Blocks(DataConfig(spec=str(f), seq_len=2, held_out_fraction=0.0), Tokenize(None, 64), 0, BadRecords("error"))


def test_missing_path_and_hub_name_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="no such file"):
        _records(tmp_path / "nope.jsonl")
    # Not a local path: tried as a datasets name. Offline mode stands in for "no hub here" without
    # waiting for network retries; the error names both readings of the spec.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets

        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    except ImportError:
        pass
    with pytest.raises(DataError, match="neither a local file"):
        _records("surely-not/a-real-dataset-name-xyz")


def test_chat_masks_everything_but_assistant_turns():
    """Labels (loss mask) cover exactly the assistant contents and their end-of-turn marker."""
    tok = char_tokenizer()
    rec = {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "hi there"},
                              {"from": "gpt", "value": "hello"}, {"from": "human", "value": "bye"},
                              {"from": "gpt", "value": "ok bye"}]}
    ids, mask = Tokenize(tok, 64, "chat")(rec)
    assert len(ids) == len(mask)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "hello<|end|>\nok bye<|end|>\n<eos>"
    untrained = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "be nice" in untrained and "hi there" in untrained and "bye" in untrained
    assert "hello" not in untrained and "<|assistant|>" in untrained
    # And through packing: block targets carry the same mask (position t predicts token t+1).
    blocks = list(pack([(ids, mask)], seq_len=len(ids) - 1))
    block_ids, block_mask = blocks[0]
    assert torch.equal(block_ids, torch.tensor(ids))
    assert block_mask.tolist() == mask[1:]


def test_messages_format_and_default_template_without_one():
    tok = char_tokenizer(with_template=False)
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    ids, mask = Tokenize(tok, 64, "auto")(rec)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "a<|end|>\n<eos>"


def test_pack_blocks_overlap_by_one_and_pad_only_when_short():
    stream = [(list(range(10)), [True] * 10), (list(range(10, 17)), [False] * 7)]
    blocks = list(pack(stream, seq_len=4))
    assert [b[0].tolist() for b in blocks] == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, 10, 11, 12], [12, 13, 14, 15, 16]]
    assert blocks[2][1].tolist() == [True, False, False, False]
    said = []
    short = list(pack([([1, 2, 3], [True] * 3)], seq_len=8, report=said.append))
    assert len(short) == 1 and short[0][1].tolist() == [True, True] + [False] * 6
    assert len(said) == 1 and "holds 3 tokens" in said[0] and "padded with 6 masked positions" in said[0]
    list(pack([(list(range(6)), [True] * 6)], seq_len=8, report=said.append))  # padded, but mostly data
    list(pack(stream, seq_len=4, report=said.append))  # full blocks: nothing padded
    assert len(said) == 1


def test_held_out_split_is_even_and_disjoint(tmp_path):
    f = tmp_path / "ids.jsonl"
    f.write_text(json.dumps({"input_ids": list(range(60)) * 5}) + "\n")
    cfg = DataConfig(spec=str(f), seq_len=4, held_out_fraction=0.1, max_held_out_blocks=100)
    b = Blocks(cfg, Tokenize(None, 64), 0, BadRecords())
    n_blocks = b.num_train + b.held_out[0].shape[0]
    assert b.held_out[0].shape[0] == sum(is_held_out(i, 0.1) for i in range(n_blocks)) > 0
    # Each epoch visits every training block once, in a seeded order.
    ids, _, pos = b.batch(0, b.num_train)
    assert sorted(map(tuple, ids.tolist())) == sorted(map(tuple, b.train[0].tolist())) and pos == b.num_train


def test_streaming_gives_the_same_blocks_and_resumes_by_position(tmp_path):
    f = tmp_path / "ids.jsonl"
    f.write_text("\n".join(json.dumps({"input_ids": [(i * 7 + j) % 50 for j in range(23)]}) for i in range(12)) + "\n")
    cfg = DataConfig(spec=str(f), seq_len=6, held_out_fraction=0.1, streaming=True, shuffle_buffer=4)
    s = Blocks(cfg, Tokenize(None, 64), 3, BadRecords())
    mem = Blocks(DataConfig(**{**cfg.__dict__, "streaming": False}), Tokenize(None, 64), 3, BadRecords())
    assert torch.equal(s.held_out[0], mem.held_out[0])
    n = mem.num_train
    first, _, _ = s.batch(0, n)
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, mem.train[0].tolist()))
    # A fresh reader asked for position p returns what the first one returned there.
    later, _, _ = s.batch(n, 3)
    again, _, _ = Blocks(cfg, Tokenize(None, 64), 3, BadRecords()).batch(n, 3)
    assert torch.equal(later, again)


def test_distributed_ranks_split_a_global_batch(tmp_path):
    f = tmp_path / "ids.jsonl"
    f.write_text(json.dumps({"input_ids": [j % 50 for j in range(200)]}) + "\n")
    b = Blocks(DataConfig(spec=str(f), seq_len=4, held_out_fraction=0.0), Tokenize(None, 64), 0, BadRecords())
    whole, _, end = b.batch(5, 4, rank=0, world=1)
    r0, _, e0 = b.batch(5, 2, rank=0, world=2)
    r1, _, e1 = b.batch(5, 2, rank=1, world=2)
    assert e0 == e1 == end == 9
    assert torch.equal(torch.stack([r0[0], r1[0], r0[1], r1[1]]), whole)


def test_eval_prompts_from_jsonl_and_txt(tmp_path):
    from ssmspec.training.data import read_prompts

    tok = char_tokenizer()
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "ab"}, {"text": "cd"}, {"input_ids": [7, 8, 9]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "SECRET"}]},
        {"prompt": 5},
    ]) + "\n")
    bad = BadRecords("skip")
    prompts = read_prompts(str(f), tok, 64, bad)
    assert prompts[0] == tok("ab", add_special_tokens=False)["input_ids"]  # no <eos>: a prompt continues
    assert prompts[1] == tok("cd", add_special_tokens=False)["input_ids"]
    assert prompts[2] == [7, 8, 9]
    chat = tok.decode(prompts[3])
    assert chat.endswith("<|assistant|>\n") and "hi" in chat and "secret" not in chat
    assert len(prompts) == 4 and bad.count == 1 and "prompts.jsonl:5" in bad.examples[0]
    t = tmp_path / "p.txt"
    t.write_text("first one\n\nsecond\n")
    assert [tok.decode(p) for p in read_prompts(str(t), tok, 64, BadRecords())] == ["first one", "second"]
