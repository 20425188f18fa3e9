"""`ssmspec sft` / `distill` as a demanding user runs them: signals, damaged checkpoints, odd data and prompt files,
what the console says. Each test pins one bug that was found and fixed."""
from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch

from helpers import tiny_model
from ssmspec.cli.app import run
from ssmspec.errors import DataError, InputError
from ssmspec.training.config import DataConfig, RunConfig
from ssmspec.training.data import BadRecords, Blocks, Tokenize, read_prompts
from ssmspec.training.loop import CHECKPOINT_DIR, LATEST_FILE, STATE_FILE, TrainCallbacks, latest_checkpoint, train
from test_training_common import char_tokenizer, one_thread  # noqa: F401


@pytest.fixture(scope="module")
def token_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("edge") / "ids.jsonl"
    gen = torch.Generator().manual_seed(0)
    path.write_text("".join(json.dumps({"input_ids": torch.randint(0, 64, (60,), generator=gen).tolist()}) + "\n"
                            for _ in range(8)))
    return path


def _sft(tmp_path, data, steps=4) -> RunConfig:
    cfg = RunConfig(mode="sft", out=str(tmp_path / "out"), student_preset="(in memory)")
    cfg.data.spec, cfg.data.seq_len, cfg.data.held_out_fraction = str(data), 16, 0.2
    cfg.optim.steps, cfg.optim.batch_size = steps, 2
    cfg.eval.eval_every, cfg.checkpoint.save_every, cfg.checkpoint.log_every = 0, 0, 1
    return cfg


class _At(TrainCallbacks):
    """Calls `action` once, at the first logged step (or evaluation progress) of step `step`."""

    def __init__(self, step, action, during_eval=False):
        self.step, self.action, self.during_eval, self.done = step, action, during_eval, False

    def _maybe(self, step):
        if step == self.step and not self.done:
            self.done = True
            self.action()

    def on_step(self, m):
        if not self.during_eval:
            self._maybe(m["step"])

    def on_eval_progress(self, done, total, step):
        if self.during_eval:
            self._maybe(step)


@pytest.mark.usefixtures("one_thread")
def test_sigterm_checkpoints_at_the_step_boundary_like_ctrl_c(tmp_path, token_data):
    """SIGTERM (kill, schedulers, `docker stop`) ended the run at once with nothing saved."""
    def unhandled(signum, frame):  # stands in for the default action (death) while the test runs
        raise RuntimeError("SIGTERM reached the process's own handler")

    cfg = _sft(tmp_path, token_data, steps=6)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(KeyboardInterrupt):
            train(cfg, _At(2, lambda: os.kill(os.getpid(), signal.SIGTERM)), student=tiny_model())
        assert signal.getsignal(signal.SIGTERM) is unhandled  # put back after the run
    finally:
        signal.signal(signal.SIGTERM, before)
    assert json.loads((tmp_path / "out" / CHECKPOINT_DIR / LATEST_FILE).read_text())["step"] == 2


@pytest.mark.usefixtures("one_thread")
def test_ctrl_c_during_the_final_evaluation_keeps_every_trained_step(tmp_path, token_data):
    """The last checkpoint was written after the final evaluation: Ctrl-C there lost the whole run."""
    cfg = _sft(tmp_path, token_data, steps=3)

    def ctrl_c():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cfg, _At(3, ctrl_c, during_eval=True), student=tiny_model())
    assert latest_checkpoint(tmp_path / "out").name == "step-00000003"
    cfg.resume = True
    result = train(cfg, student=tiny_model(seed=5))  # only evaluates and writes the model
    assert result.step == 3 and result.evals[-1]["step"] == 3 and (tmp_path / "out" / "config.json").exists()


def test_an_unreadable_latest_json_falls_back_to_the_newest_checkpoint(tmp_path):
    """A truncated latest.json stopped --resume (and the CLI's Ctrl-C message) with a bare JSON error."""
    ckdir = tmp_path / CHECKPOINT_DIR
    for step in (2, 4):
        (ckdir / f"step-{step:08d}").mkdir(parents=True)
        (ckdir / f"step-{step:08d}" / STATE_FILE).write_bytes(b"x")
    for text in ('{"name": "step-000', "", "[]"):
        (ckdir / LATEST_FILE).write_text(text)
        assert latest_checkpoint(tmp_path) == ckdir / "step-00000004"


@pytest.mark.usefixtures("one_thread")
def test_a_damaged_state_file_is_named_with_what_to_do(tmp_path, token_data):
    """A truncated state.pt gave torch's zip error without the file's name."""
    cfg = _sft(tmp_path, token_data, steps=2)
    cfg.eval.final_eval = False
    train(cfg, student=tiny_model())
    state = latest_checkpoint(tmp_path / "out") / STATE_FILE
    state.write_bytes(state.read_bytes()[:1000])
    cfg.resume, cfg.optim.steps = True, 3
    with pytest.raises(InputError, match=rf"{STATE_FILE} is unreadable.*--overwrite"):
        train(cfg, student=tiny_model())


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 trains on a GPU")
def test_fp16_on_the_cpu_is_refused_instead_of_training_fp32_under_its_name():
    from ssmspec.training.loop import _resolve_precision

    with pytest.raises(InputError, match="--dtype fp16 needs a CUDA GPU"):
        _resolve_precision("fp16")
    assert _resolve_precision("bf16") == "bf16" and _resolve_precision("auto") == "fp32"


def test_format_chat_on_text_records_is_a_malformed_record_not_a_key_error(tmp_path):
    (tmp_path / "notes.txt").write_text("just some text\n" * 5)
    cfg = DataConfig(spec=str(tmp_path / "notes.txt"), seq_len=4, held_out_fraction=0.0)
    with pytest.raises(DataError, match=r"notes\.txt:1: a chat record needs a 'messages' or 'conversations' field"):
        Blocks(cfg, Tokenize(char_tokenizer(), 64, "chat"), 0, BadRecords("error"))


def test_text_field_does_not_make_txt_files_unreadable(tmp_path):
    """--text-field names a field of .jsonl records; a .txt file beside them has none and was refused."""
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "hello there"}) + "\n")
    (tmp_path / "b.txt").write_text("general kenobi\n")
    cfg = DataConfig(spec=str(tmp_path), seq_len=4, held_out_fraction=0.0, text_field="body")
    blocks = Blocks(cfg, Tokenize(char_tokenizer(), 64, "auto", "body"), 0, BadRecords("error"))
    assert blocks.num_train == 6  # 12 + 16 characters and end-of-text tokens, in blocks of 4 + 1


def test_a_non_utf8_prompts_file_names_its_line_and_follows_on_bad_record(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"hello\n\xff\xfe oops\nworld\n")
    with pytest.raises(DataError, match=r"prompts\.txt:2: not valid UTF-8"):
        read_prompts(str(prompts), char_tokenizer(), 64, BadRecords("error"))
    bad = BadRecords("skip")
    assert len(read_prompts(str(prompts), char_tokenizer(), 64, bad)) == 2 and bad.count == 1


def test_a_prompts_file_without_prompts_is_refused(tmp_path):
    """Acceptance went unmeasured without a word when --eval-prompts held nothing usable."""
    from ssmspec.training.loop import _eval_prompts

    (tmp_path / "empty.jsonl").write_text("\n")
    cfg = RunConfig(mode="distill")
    cfg.eval.eval_prompts = str(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="--eval-prompts .*empty.jsonl: the file holds no usable prompt"):
        _eval_prompts(cfg, None, char_tokenizer(), 64, BadRecords("error"))


def test_an_evaluation_with_nothing_held_out_says_so():
    """It printed 'eval: step N' and nothing else."""
    from ssmspec.training.data import _stack
    from ssmspec.training.evaluation import evaluate

    metrics = evaluate(tiny_model(), None, _stack([], 8), [], RunConfig(mode="sft"), torch.device("cpu"), mode="sft")
    assert "no held-out sequences" in metrics["acceptance_note"]


def test_the_line_after_the_last_reported_bad_record_reaches_the_callback():
    seen = []
    bad = BadRecords("skip", report=seen.append, max_reported=2)
    for i in range(4):
        bad(f"f.txt:{i}", "not valid UTF-8")
    assert seen[-1] == "more malformed records skipped; the total is reported at the end" and bad.count == 4


@pytest.fixture
def cli_files(tmp_path, monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    (tmp_path / "data.txt").write_bytes(b"w1 w2 w3 w4 w5 w6\n" * 20 + b"\xff bad\n")
    return tmp_path


def test_training_warnings_are_printed_once(cli_files, capsys, monkeypatch):
    """Each skipped record and padding note came twice: from the callbacks and from Python's last-resort log handler."""
    import sys

    logger = logging.getLogger("ssmspec.training")
    monkeypatch.setattr(logger, "handlers", [])  # as in a fresh `ssmspec` process: no handler anywhere...
    monkeypatch.setattr(logging.root, "handlers", [])  # (pytest's own sit on the root logger)
    monkeypatch.setattr(logging, "lastResort", logging.StreamHandler(sys.stderr))  # ...but Python's last resort
    args = ["sft", "--student-preset", "tiny", "--data", cli_files / "data.txt", "--out", cli_files / "out", "--steps", "1",
            "--seq-len", "1000", "--batch-size", "1", "--eval-every", "0", "--no-final-eval", "--on-bad-record", "skip"]
    assert run([str(a) for a in args]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("skipped malformed record at") == 1, err
    assert err.count("less than one --seq-len block") == 1, err


def test_an_interrupt_before_the_first_checkpoint_says_how_to_start_over(cli_files, capsys, monkeypatch):
    from ssmspec.cli import train as cli_train

    def interrupt(self, info):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_train.RichProgress, "on_start", interrupt)
    args = ["sft", "--student-preset", "tiny", "--data", cli_files / "data.txt", "--out", cli_files / "out",
            "--steps", "1", "--seq-len", "8", "--eval-every", "0", "--on-bad-record", "skip"]
    assert run([str(a) for a in args]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("nothing to resume; start over with --overwrite")


def test_help_says_what_auto_scan_and_a_bare_preset_do(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")
    assert run(["sft", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "on the CPU ssmspec" in text  # it said 'else parallel'; the CPU trains through ssmspec
    assert "else the preset's, reading text as UTF-8 bytes" in text  # it said 'needs --tokenizer'; it does not
    assert "Ctrl-C (or SIGTERM) saves a checkpoint" in text
