"""Decoding commands as a demanding user drives them: edge inputs that used to give wrong results,
lose work, or stop a whole run (each test failed before its fix)."""
from __future__ import annotations

import io
import json

import pytest
import torch

from helpers import run_cli
from ssmspec.benchmark import BenchConfig, report, runner
from ssmspec.benchmark.config import MethodSpec
from ssmspec.benchmark.prompts import Prompt, encode, read_prompts_file
from ssmspec.decoding.sampling import SHIFT_BELOW_TEMPERATURE, SamplingParams, probabilities, race_noise_, race_scores
from ssmspec.errors import InputError
from ssmspec.models.loading import load_model, save_model
from ssmspec.models.presets import build_model
from ssmspec.tokenization import ByteTokenizer
from ssmspec.trees import Tree


def test_a_tiny_temperature_samples_the_argmax_instead_of_nan():
    # logits / 1e-45 overflowed to +inf and the softmax gave NaN: the eager path raised
    # multinomial's error, the device path (races) returned token 0 every time.
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [1.0, -2.0, 0.0, 0.5]])
    for t in (1e-45, 1e-30):
        params = SamplingParams(temperature=t)
        p = probabilities(logits, params)
        assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
        noise = race_noise_(torch.empty(logits.shape), torch.Generator().manual_seed(0))
        assert torch.equal(race_scores(logits, params, noise).argmax(-1), logits.argmax(-1))
    # An ordinary temperature keeps its distribution; the shift's threshold changes nothing either side.
    assert torch.allclose(probabilities(logits, SamplingParams(0.7)), torch.softmax(logits / 0.7, -1))
    for t in (SHIFT_BELOW_TEMPERATURE * 0.999, SHIFT_BELOW_TEMPERATURE):
        assert torch.allclose(probabilities(logits, SamplingParams(t)), torch.softmax(logits / t, -1))


def test_prompts_files_drop_a_bom_and_split_at_line_ends_only(tmp_path):
    # A BOM (Notepad) became the first prompt's first characters in a .txt and refused a .jsonl;
    # form feeds, U+0085 and U+2028 (valid inside JSON strings) split one prompt into two.
    txt = tmp_path / "p.txt"
    txt.write_bytes("\ufeffdef f():\x0c    pass\r\n\r\nsecond\x85x\u2028y\n".encode())
    assert [(p.id, p.text) for p in read_prompts_file(txt)] == [("line1", "def f():\x0c    pass"),
                                                               ("line3", "second\x85x\u2028y")]
    jsonl = tmp_path / "p.jsonl"
    records = [{"id": "a", "prompt": "one\u2028still one"}, {"id": "b", "prompt": "form\x0cfeed"}]
    jsonl.write_bytes(("\ufeff" + "\r\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\r\n").encode())
    assert [(p.id, p.text) for p in read_prompts_file(jsonl)] == [("a", "one\u2028still one"), ("b", "form\x0cfeed")]


def test_a_stdin_prompt_drops_a_bom(monkeypatch):
    from ssmspec.cli.generate import read_prompt

    stdin = io.TextIOWrapper(io.BytesIO("\ufeffdef add(a, b):\n".encode()))
    monkeypatch.setattr("sys.stdin", stdin)
    assert read_prompt("-") == "def add(a, b):\n"


def test_an_out_below_a_file_is_refused_before_the_run(tmp_path):
    # mkdir failed only in write_outputs, after the whole benchmark had run.
    from ssmspec.cli import outputs

    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file" / "run", tmp_path / "file" / "a" / "b"):
        with pytest.raises(InputError, match="is a file"):
            outputs.claim(out, "bench", inputs={}, overwrite=False)
    outputs.claim(tmp_path / "new" / "deeper", "bench", inputs={}, overwrite=False)  # missing parents are made


def test_bench_skips_prompts_past_the_context_the_model_declares(tmp_path):
    # The help says the default context is the model's limit; bench read it from the ModelConfig,
    # which holds none, and ran prompts that `generate` refuses.
    save_model(build_model("tiny-hybrid"), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    loaded = load_model(tmp_path / "m")
    bench = BenchConfig(target=str(tmp_path / "m"), max_new_tokens=10)
    assert runner._context_limit(loaded, bench) == 64
    result = runner.BenchResult(bench, "p", [])
    prompts = [Prompt("long", text="x" * 60), Prompt("short", text="x" * 50)]
    assert [pid for pid, _ in runner._encode_all(prompts, ByteTokenizer(), bench, 64, result)] == ["short"]
    assert result.skipped[0]["prompt_id"] == "long"


class StrictTemplateTokenizer(ByteTokenizer):
    chat_template = "user turns only"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        from jinja2 import TemplateError

        if any(m.get("role") != "user" for m in messages):
            raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        return self.encode(messages[-1]["content"])


def test_a_record_the_chat_template_refuses_is_skipped_not_fatal():
    # A template's raise_exception (Llama, Gemma, Mistral templates have one) ended the whole run
    # with "unexpected TemplateError", naming no record.
    refused = Prompt("sys", messages=[{"role": "system", "content": "be brief"}])
    with pytest.raises(InputError, match="prompt sys"):
        encode(StrictTemplateTokenizer(), refused)
    bench = BenchConfig(max_new_tokens=4)
    result = runner.BenchResult(bench, "p", [])
    ok = Prompt("ok", messages=[{"role": "user", "content": "hi"}])
    assert [pid for pid, _ in runner._encode_all([refused, ok], StrictTemplateTokenizer(), bench, None, result)] == ["ok"]
    assert result.skipped[0]["prompt_id"] == "sys" and "roles must alternate" in result.skipped[0]["reason"]


def test_tune_tree_refuses_a_candidate_wider_than_the_measured_ranks():
    # Ranks past --width are unmeasured and were predicted as never accepted, silently.
    from ssmspec.tuning.tune import TuneSettings

    with pytest.raises(InputError, match="--width 4"):
        TuneSettings(width=4, candidates=(Tree.from_config((6, 1)),)).validate()
    TuneSettings(width=4, candidates=(Tree.from_config((4, 1)),)).validate()


def test_new_model_takes_the_vocabulary_of_a_model_without_a_tokenizer(tmp_path, monkeypatch, capsys):
    # `new-model --preset tiny-hybrid --out runs/target` (bytes, no tokenizer), then the help's own
    # example `new-model --preset drafter-2l --vocab-from runs/target` was refused: no tokenizer files.
    save_model(build_model("tiny", vocab_size=300), tmp_path / "target")
    code, out, err = run_cli(["new-model", "--preset", "tiny", "--vocab-from", str(tmp_path / "target"),
                              "--out", str(tmp_path / "drafter")], monkeypatch, capsys)
    assert code == 0, err
    assert "vocab 300" in out and load_model(tmp_path / "drafter").model.config.vocab_size == 300


def test_an_interrupted_method_is_compared_with_ar_on_the_same_prompts():
    # ar over 3 prompts against a method that finished 1: the speedup mixed prompt sets.
    def record(method, new, elapsed):
        return {"method": method, "new_tokens": new, "elapsed_s": elapsed, "prefill_s": 0.0, "target_calls": new,
                "lossless": {"status": "match"}}

    specs = [MethodSpec.make("ar"), MethodSpec.make("chain", Tree.chain(2))]
    result = runner.BenchResult(BenchConfig(), "p", specs, interrupted=True,
                                records=[record("ar", 10, 1.0), record("ar", 10, 9.0), record("ar", 10, 9.0),
                                         record("chain 2", 10, 0.5)])
    summaries = report.summarize(result)
    assert summaries["ar"]["speedup"] == pytest.approx(1.0)
    assert summaries["chain 2"]["speedup"] == pytest.approx(2.0)  # 20 tok/s against ar's 10 on that prompt
