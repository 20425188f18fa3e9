"""`ssmspec generate` end to end on `new-model` tiny models, and its one-line errors."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import fields

import helpers
import pytest

from ssmspec.decoding.generate import GenerationConfig


def run_cli(args, stdin: str = "", monkeypatch=None, capsys=None):
    """Run the CLI in-process through `main()`; returns (exit code, stdout, stderr)."""
    return helpers.run_cli(args, monkeypatch, capsys, stdin)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, preset, seed in [("target", "tiny-hybrid", 0), ("drafter", "tiny", 1), ("other", "drafter-2l", 2)]:
        subprocess.run([sys.executable, "-m", "ssmspec", "new-model", "--preset", preset, "--seed", str(seed),
                        "--out", str(root / name)], check=True, capture_output=True)
    return root


def test_generate_json_is_lossless_and_complete(models, monkeypatch, capsys):
    base = ["generate", "--target", str(models / "target"), "--prompt", "abcabcabc", "--max-new-tokens", "12", "--json"]
    code, out, _ = run_cli([*base, "--method", "ar"], monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0
    ar = json.loads(out)
    for extra in (["--drafter", str(models / "drafter"), "--tree", "2,2,1"], ["--drafter", "ngram", "--draft-len", "3"]):
        code, out, _ = run_cli([*base, *extra], monkeypatch=monkeypatch, capsys=capsys)
        assert code == 0
        spec = json.loads(out)
        assert spec["token_ids"] == ar["token_ids"] and spec["text"] == ar["text"]
        for key in ("new_tokens", "target_calls", "mean_accepted", "tokens_per_s", "method", "tree"):
            assert key in spec["stats"]
        assert spec["stats"]["new_tokens"] == 12


def test_generate_streams_text_and_summarises_on_stderr(models):
    # The real console entry point, reading the prompt from stdin.
    proc = subprocess.run([sys.executable, "-m", "ssmspec", "generate", "--target", str(models / "target"), "--prompt", "-",
                           "--drafter", "ngram", "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "3"],
                          input="hello hello", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "tokens per call" in proc.stderr and "target calls" in proc.stderr
    assert proc.stdout.strip() != ""


@pytest.mark.parametrize("args, message", [
    (["--target", "{missing}", "--prompt", "hi"], "does not exist"),
    (["--target", "{broken}", "--prompt", "hi"], "config.json"),
    (["--target", "{target}", "--prompt", "hi", "--drafter", "{other}"], "vocab"),
    (["--target", "{target}", "--prompt", "hi", "--drafter", "ngram", "--tree", "3,,1"], "tree"),
    (["--target", "{target}", "--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    (["--target", "{target}", "--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["--target", "{target}", "--prompt", ""], "empty"),
    (["--target", "{target}", "--prompt", "hi", "--method", "stree"], "drafter"),
    (["--target", "{target}", "--prompt", "hi", "--method", "chain", "--drafter", "ngram", "--tree", "2,1"], "chain"),
    (["--target", "{target}", "--prompt", "hi", "--tree", "3,2"], "--tree needs --drafter"),
    (["--target", "{target}", "--prompt", "hi", "--draft-len", "4"], "--draft-len needs --drafter"),
    (["--target", "{target}", "--prompt", "hi", "--method", "ar", "--tree", "3,2"], "--method ar drafts nothing"),
    (["--target", "{target}", "--prompt", "hi", "--drafter", "ngram", "--tree", "parents:-1"], "below the root"),
])
def test_bad_input_is_one_line_and_non_zero(models, tmp_path, monkeypatch, capsys, args, message):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    paths = {"missing": tmp_path / "nope", "broken": broken, "target": models / "target", "other": models / "other"}
    args = [a.format(**paths) for a in args]
    code, out, err = run_cli(["generate", *args], monkeypatch=monkeypatch, capsys=capsys)
    assert code != 0
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert message in lines[0].lower()


def test_cli_defaults_equal_the_dataclass_defaults():
    import inspect

    from ssmspec.cli.generate import generate_command

    defaults = {f.name: f.default for f in fields(GenerationConfig)}
    params = inspect.signature(generate_command).parameters
    for name in ("max_new_tokens", "temperature", "top_p", "top_k"):
        assert params[name].default.default == defaults[name], name
