"""`ssmspec distill` / `sft` flags that reach the training config, and the progress the CLI draws from the callbacks."""
from __future__ import annotations

import io
import sys

import pytest

from ssmspec.cli.app import run


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-train")
    assert run(["new-model", "--preset", "tiny", "--out", str(root / "target")]) == 0
    (root / "data.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 40)
    return root


def _distill(files, out, *extra):
    return ["distill", "--target", str(files / "target"), "--student-preset", "tiny", "--data", str(files / "data.txt"),
            "--out", str(out), "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--save-every", "0",
            "--log-every", "1", *extra]


def test_final_eval_and_loss_chunk_flags_reach_the_config(files, tmp_path, monkeypatch):
    import ssmspec.training.loop as loop

    seen = []
    monkeypatch.setattr(loop, "train", lambda cfg, cb: seen.append(cfg))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert run(_distill(files, tmp_path / "a", "--eval-every", "0", "--no-final-eval", "--loss-chunk", "64")) == 0
    assert run(_distill(files, tmp_path / "b")) == 0
    off, default = seen
    assert off.eval.eval_every == 0 and off.eval.final_eval is False and off.loss.chunk_positions == 64
    assert default.eval.final_eval is True and default.loss.chunk_positions == 0


def test_evaluation_progress_is_drawn_and_no_final_eval_skips_it(files, tmp_path, monkeypatch, capsys):
    from ssmspec.cli import train as cli_train

    calls, evals = [], []
    real_progress, real_eval = cli_train.RichProgress.on_eval_progress, cli_train.RichProgress.on_eval

    def progress(self, done, total, step):
        calls.append((done, total, step))
        real_progress(self, done, total, step)
        assert self.eval_task is not None  # a bar for the evaluation, beside the training bar

    def on_eval(self, m):
        real_eval(self, m)
        evals.append(m["step"])
        assert self.eval_task is None  # removed once the evaluation is printed

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(cli_train.RichProgress, "on_eval_progress", progress)
    monkeypatch.setattr(cli_train.RichProgress, "on_eval", on_eval)
    assert run(_distill(files, tmp_path / "final", "--eval-every", "0", "--eval-num-prompts", "1",
                        "--eval-max-new-tokens", "4")) == 0
    assert evals == [2] and calls and all(step == 2 and 0 <= done <= total for done, total, step in calls)
    assert calls[-1][0] == calls[-1][1]
    err = capsys.readouterr().err
    assert "eval: step 2" in err
    assert "on cpu, precision fp32" in " ".join(err.split())  # the run's dtype, not accelerate's "no"

    calls.clear(), evals.clear()
    assert run(_distill(files, tmp_path / "none", "--eval-every", "0", "--no-final-eval")) == 0
    assert calls == [] and evals == []


def test_step_line_shows_tokens_per_second_and_mfu_when_known():
    from ssmspec.cli.train import step_stats

    m = {"loss": 1.23456, "tokens_per_s": 12345.6, "mfu": None}
    assert step_stats(m) == "loss 1.2346, 12,346 tok/s"
    assert step_stats({**m, "mfu": 0.4213}) == "loss 1.2346, 12,346 tok/s, MFU 42.1%"
    assert step_stats({**m, "mfu": 0.4213, "peak_memory_gb": 12.34}) == "loss 1.2346, 12,346 tok/s, MFU 42.1%, peak 12.3 GB"


def test_help_of_the_new_flags(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")
    assert run(["distill", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--final-eval" in text and "--no-final-eval" in text and "--loss-chunk" in text
    assert ("auto (on a GPU fla, then mamba_ssm, when importable, else parallel; on the CPU ssmspec), fla, mamba_ssm, "
            "parallel, ssmspec (the reference)") in text
    assert "0 = none during training" in text


def test_cache_target_logits_reaches_the_config_and_runs(files, tmp_path, monkeypatch, capsys):
    import json

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    out = tmp_path / "cached"
    assert run(_distill(files, out, "--eval-every", "0", "--no-final-eval", "--cache-target-logits", "4")) == 0
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["config"]["loss"]["cache_target_logits"] == 4 and run_json["run"]["target_cache"]["k"] == 4
    assert (out / "target_topk.bin").exists() and "top-4 cache" in capsys.readouterr().err
    # sft has no target logits to cache: no such option
    code = run(["sft", "--student-preset", "tiny", "--data", str(files / "data.txt"), "--out", str(tmp_path / "s"),
                "--cache-target-logits", "4"])
    assert code != 0
