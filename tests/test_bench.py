"""`ssmspec bench` end to end on `new-model` tiny models: outputs, the losslessness check, refusals."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

from ssmspec.benchmark import BenchConfig, report, run_bench, runner
from ssmspec.benchmark.lossless import check_lossless, classify_gap, default_tie_tolerance, first_difference, reference_logits

SHORT_PROMPTS = "def add(a, b):\nThe quick brown fox\nimport os\n\n  \nclass Stack:\n"


from helpers import run_cli  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, seed in [("target", 0), ("drafter", 1)]:
        subprocess.run([sys.executable, "-m", "ssmspec", "new-model", "--preset", "tiny", "--seed", str(seed),
                        "--out", str(root / name)], check=True, capture_output=True)
    (root / "prompts.txt").write_text(SHORT_PROMPTS)
    return root


def bench_args(models, out, *extra):
    return ["bench", "--target", str(models / "target"), "--drafter", str(models / "drafter"), "--limit", "3",
            "--max-new-tokens", "8", "--warmup", "1", "--out", str(out), *extra]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_bench_humaneval_writes_table_records_summary_and_report(models, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    code, stdout, err = run_cli(bench_args(models, out, "--dataset", "humaneval", "--methods", "ar,chain,stree",
                                           "--tree", "2,1", "--tree", "1,1,1", "--draft-len", "3"),
                                monkeypatch, capsys)
    assert code == 0, err
    labels = ["ar", "chain 3", "stree 2,1", "stree 1,1,1"]
    for label in labels:
        assert label in stdout
    assert "(1.00x)" in stdout
    records = read_jsonl(out / "results.jsonl")
    assert [r["method"] for r in records] == [m for m in labels for _ in range(3)]
    assert {r["prompt_id"] for r in records} == {"HumanEval/0", "HumanEval/1", "HumanEval/2"}
    ar = {r["prompt_id"]: r["token_ids"] for r in records if r["method"] == "ar"}
    for r in records:
        assert r["new_tokens"] == 8 and len(r["token_ids"]) == 8
        if r["method"] != "ar":  # fp32: exact, and the record says so
            assert r["lossless"]["status"] == "match" and r["token_ids"] == ar[r["prompt_id"]]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lossless"] == {"applicable": True, "failures": 0, "ties": 0}
    assert summary["config"]["max_new_tokens"] == 8 and summary["environment"]["torch"] == torch.__version__
    for label in labels:
        s, rows = summary["methods"][label], [r for r in records if r["method"] == label]
        # Totals over totals, not means of per-prompt rates.
        assert s["tokens_per_s"] == pytest.approx(sum(r["new_tokens"] for r in rows) / sum(r["elapsed_s"] for r in rows))
        assert s["tokens_per_call"] == pytest.approx(sum(r["new_tokens"] - 1 for r in rows) / sum(r["target_calls"] for r in rows))
        assert s["target_calls"] == sum(r["target_calls"] for r in rows)
    assert summary["methods"]["ar"]["speedup"] == pytest.approx(1.0)
    text = (out / "report.md").read_text()
    assert "| ar | " in text and "stree 1,1,1" in text and "torch:" in text and "0 failures" in text


def test_library_run_adds_ar_as_reference_and_aggregates(models):
    config = BenchConfig(target=str(models / "target"), drafter="ngram", dataset=str(models / "prompts.txt"),
                         methods=("chain",), draft_lens=(2,), max_new_tokens=6, warmup=1, device="cpu")
    seen = []
    result = run_bench(config, on_progress=lambda done, total, label: seen.append((done, total)))
    assert [m.label for m in result.methods] == ["ar", "chain 2"]
    assert any("ar added" in n for n in result.notes)
    assert seen[-1] == (8, 8)  # 4 usable prompts (blank lines dropped) x 2 methods
    assert result.failures == 0 and not result.interrupted
    summaries = report.summarize(result)
    assert summaries["chain 2"]["lossless"] == {"match": 4}
    assert summaries["chain 2"]["prompts"] == 4


def test_temperature_above_zero_has_no_reference_and_no_check(models):
    config = BenchConfig(target=str(models / "target"), drafter=str(models / "drafter"), dataset=str(models / "prompts.txt"),
                         methods=("stree",), trees=("2,1",), max_new_tokens=5, temperature=0.8, limit=2, warmup=0)
    result = run_bench(config)
    assert [m.label for m in result.methods] == ["stree 2,1"]
    assert {r["lossless"]["status"] for r in result.records} == {"n/a"}
    assert any("not applicable" in n for n in result.notes)
    (row,) = report.table_rows(report.summarize(result))
    assert "x)" not in row[1] and row[-1].startswith("n/a")


def _flip_speculative(monkeypatch, position: int = 3):
    """A deliberately wrong method: chain and stree change one token of their output."""
    real = runner.generate_once

    def wrong(engine, ids, config):
        out = real(engine, ids, config)
        if config.method != "ar":
            out.token_ids = list(out.token_ids)
            out.token_ids[position] = (out.token_ids[position] + 1) % engine.target.config.vocab_size
        return out

    monkeypatch.setattr(runner, "generate_once", wrong)


def test_losslessness_check_catches_a_wrong_method_and_exits_1(models, tmp_path, monkeypatch, capsys):
    _flip_speculative(monkeypatch)
    out = tmp_path / "out"
    code, stdout, err = run_cli(bench_args(models, out, "--prompts", str(models / "prompts.txt"), "--methods", "chain,stree",
                                           "--tree", "2,1"), monkeypatch, capsys)
    assert code == 1
    assert "losslessness failure" in err
    assert "FAILED" in stdout
    records = read_jsonl(out / "results.jsonl")
    bad = [r for r in records if r["method"] != "ar"]
    assert len(bad) == 6 and all(r["lossless"]["status"] == "failure" and r["lossless"]["position"] == 3 for r in bad)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lossless"]["failures"] == 6 and summary["methods"]["chain 4"]["lossless"] == {"failure": 3}
    assert "**failure**" in (out / "report.md").read_text()


def test_losslessness_failure_in_the_library_result(models, monkeypatch):
    _flip_speculative(monkeypatch, position=0)
    config = BenchConfig(target=str(models / "target"), drafter="ngram", dataset=str(models / "prompts.txt"),
                         methods=("ar", "chain"), max_new_tokens=4, limit=2, warmup=0)
    result = run_bench(config)
    assert result.failures == 2
    assert all(r["lossless"]["reason"] == "fp32 outputs must be identical" for r in result.records if r["method"] != "ar")


def test_tie_classification():
    bf16, fp16 = torch.bfloat16, torch.float16
    # 4 ulps: bf16 eps 2^-7 at magnitude 12 (exponent 3) -> 0.25; fp16 eps 2^-10 -> 1/32.
    assert default_tie_tolerance(bf16, 12.0) == pytest.approx(0.25)
    assert default_tie_tolerance(fp16, 12.0) == pytest.approx(4 * 2**-10 * 8)
    assert default_tie_tolerance(bf16, 0.3) == pytest.approx(4 * 2**-7)  # magnitude floored at 1
    assert classify_gap(0.2, bf16, 12.0, None) == ("tie", pytest.approx(0.25))
    assert classify_gap(0.3, bf16, 12.0, None)[0] == "failure"
    assert classify_gap(0.2, fp16, 12.0, None)[0] == "failure"
    assert classify_gap(0.04, bf16, 12.0, 0.05) == ("tie", 0.05)
    assert classify_gap(0.06, bf16, 12.0, 0.05)[0] == "failure"
    assert classify_gap(0.0, torch.float32, 12.0, 1.0)[0] == "failure"  # fp32: any difference fails
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_check_lossless_measures_the_targets_logit_gap(models):
    from ssmspec.api import load_target

    model = load_target(models / "target", dtype="bf16", device="cpu").model
    prompt, reference = [10, 20, 30, 40], [5, 6, 7]
    logits = reference_logits(model, prompt + reference[:1])
    first, second = logits.topk(6).indices.tolist()[0], logits.topk(6).indices.tolist()[5]  # a gap above zero
    gap = float(logits[first] - logits[second])
    ids = [reference[0], second, 9]
    loose = check_lossless(model, prompt, [reference[0], first, 9], ids, tolerance=gap + 1e-3)
    assert loose.status == "tie" and loose.position == 1 and loose.logit_gap == pytest.approx(gap)
    assert (loose.ar_token, loose.token) == (first, second)
    strict = check_lossless(model, prompt, [reference[0], first, 9], ids, tolerance=gap / 2)
    assert strict.status == "failure"
    assert check_lossless(model, prompt, reference, list(reference)).status == "match"
    fp32 = load_target(models / "target", dtype="fp32", device="cpu").model
    assert check_lossless(fp32, prompt, [reference[0], first, 9], ids, tolerance=1e9).status == "failure"


@pytest.mark.parametrize("extra, message", [
    (["--dataset", "gsm8k"], "--dataset"),
    (["--prompts", "{empty_jsonl}"], "no usable prompt"),
    (["--prompts", "{blank_txt}"], "no usable prompt"),
    (["--prompts", "{csv}"], ".jsonl or .txt"),
    (["--prompts", "{missing}"], "does not exist"),
    (["--methods", "ar,beam"], "unknown method"),
    (["--methods", "ar", "--tree", "2,1"], "stree"),
    (["--dataset", "humaneval", "--prompts", "{blank_txt}"], "not both"),
    (["--max-context", "4"], "fits"),
])
def test_refusals_are_one_line_and_non_zero(models, tmp_path, monkeypatch, capsys, extra, message):
    paths = {"empty_jsonl": tmp_path / "p.jsonl", "blank_txt": tmp_path / "p.txt", "csv": tmp_path / "p.csv",
             "missing": tmp_path / "nope.jsonl"}
    paths["empty_jsonl"].write_text('{"text": "no prompt key"}\n{"messages": []}\n')
    paths["blank_txt"].write_text("\n   \n")
    paths["csv"].write_text("a,b\n")
    code, _, err = run_cli(bench_args(models, tmp_path / "out", *[a.format(**paths) for a in extra]), monkeypatch, capsys)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err


def test_out_is_replaced_only_with_overwrite_and_only_bench_output(models, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    args = bench_args(models, out, "--prompts", str(models / "prompts.txt"), "--methods", "ar", "--limit", "1",
                      "--max-new-tokens", "2", "--warmup", "0")
    assert run_cli(args, monkeypatch, capsys)[0] == 0
    assert (out / ".ssmspec-output").is_file() and (out / "summary.json").is_file()
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and "--overwrite" in err and err.count("\n") == 1, err
    assert run_cli([*args, "--overwrite"], monkeypatch, capsys)[0] == 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    code, _, err = run_cli(bench_args(models, foreign, "--methods", "ar", "--overwrite"), monkeypatch, capsys)
    assert code == 2 and ".ssmspec-output" in err and (foreign / "notes.txt").read_text() == "keep me"


def test_long_prompts_are_reported_and_skipped(models):
    config = BenchConfig(target=str(models / "target"), dataset=str(models / "prompts.txt"), methods=("ar",),
                         max_new_tokens=4, warmup=0, max_context=20)
    result = run_bench(config)
    # 'The quick brown fox' is 19 bytes: 19 + 4 > 20; the others fit.
    assert [s["prompt_id"] for s in result.skipped] == ["line2"]
    assert "exceed the context of 20" in result.skipped[0]["reason"]
    assert {r["prompt_id"] for r in result.records} == {"line1", "line3", "line6"}
    assert "skipped line2" in report.markdown(result)


def test_records_without_a_prompt_are_reported_and_skipped(models, tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "hello"}\n{"text": "no prompt key"}\n{"prompt": "world"}\n')
    config = BenchConfig(target=str(models / "target"), dataset=str(path), methods=("ar",), max_new_tokens=2, warmup=0)
    result = run_bench(config)
    assert [s["prompt_id"] for s in result.skipped] == ["mixed.jsonl:2"]
    assert {r["prompt_id"] for r in result.records} == {"line1", "line3"}
    assert "skipped mixed.jsonl:2: no non-empty 'prompt'" in report.markdown(result)


def test_interrupt_writes_what_finished_and_exits_130(models, tmp_path, monkeypatch, capsys):
    real, calls = runner.generate_once, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 5:  # 1 warm-up + 3 ar prompts, then the chain warm-up
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(runner, "generate_once", interrupted)
    out = tmp_path / "out"
    code, _, err = run_cli(bench_args(models, out, "--prompts", str(models / "prompts.txt"), "--methods", "ar,chain",
                                      "--drafter", "ngram"), monkeypatch, capsys)
    assert code == 130 and "interrupted" in err
    assert [r["method"] for r in read_jsonl(out / "results.jsonl")] == ["ar"] * 3
    assert json.loads((out / "summary.json").read_text())["interrupted"] is True


def test_time_split_comes_from_the_decode_loop(models):
    # GenerationConfig(timing=True) fills stats["time_split"]; bench sums it over an untimed pass.
    config = BenchConfig(target=str(models / "target"), dataset=str(models / "prompts.txt"), methods=("ar",),
                         max_new_tokens=3, limit=2, warmup=0, time_split=True)
    result = run_bench(config)
    split = result.method_info["ar"]["time_split"]
    assert set(split) == {"prefill_s", "draft_s", "verify_s", "host_s"}
    assert split["prefill_s"] > 0 and split["verify_s"] > 0 and split["draft_s"] == 0
    (row,) = report.table_rows(report.summarize(result))
    assert row[5].endswith("%") and row[5].count("/") == 3


def test_cli_defaults_equal_the_dataclass_defaults():
    import inspect

    from ssmspec.cli.bench import bench_command

    defaults = {f.name: f.default for f in fields(BenchConfig)}
    params = inspect.signature(bench_command).parameters
    for name in ("max_new_tokens", "temperature", "seed", "warmup", "time_split", "limit", "tie_tolerance", "max_context"):
        assert params[name].default.default == defaults[name], name
    assert params["methods"].default.default == ",".join(defaults["methods"])


@pytest.mark.requires_cuda
def test_bench_on_cuda_in_bf16_reports_memory_and_no_failures(models, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    code, stdout, err = run_cli(bench_args(models, out, "--prompts", str(models / "prompts.txt"), "--device", "cuda",
                                           "--dtype", "bf16", "--tree", "2,1", "--time-split"), monkeypatch, capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lossless"]["failures"] == 0
    for s in summary["methods"].values():
        assert s["peak_memory_bytes"] > 0 and s["tokens_per_s"] > 0


def test_methods_resolve_in_order_with_ar_first_and_each_shape_once():
    from ssmspec.benchmark import resolve_methods

    config = BenchConfig(target="x", drafter="ngram", methods=("stree", "chain", "ar"), trees=("3,2,1", "3,2,1", "2,2"),
                         draft_lens=(4, 4, 2))
    specs, note = resolve_methods(config)
    assert [s.label for s in specs] == ["ar", "stree 3,2,1", "stree 2,2", "chain 4", "chain 2"] and note is None
    specs, note = resolve_methods(BenchConfig(target="x", drafter="ngram", methods=("chain",)))
    assert [s.label for s in specs] == ["ar", "chain 4"] and "reference" in note
    specs, note = resolve_methods(BenchConfig(target="x", drafter="ngram", methods=("chain",), temperature=1.0))
    assert [s.label for s in specs] == ["chain 4"] and note is None
