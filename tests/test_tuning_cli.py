"""`ssmspec tune-tree` end to end on tiny models, its tree.json driving `generate`, the bandit hook, refusals."""
from __future__ import annotations

import json
import sys

import pytest

from ssmspec.trees import TreeArms, parse_tree_spec
from ssmspec.tuning.treefile import read_tree_file



from helpers import run_cli  # noqa: E402


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny target, a tiny-hybrid of the same vocabulary, prompts, and the target's profile.

    The drafter is the target itself, so drafts are accepted and the trees differ in speed.
    """
    from ssmspec.cli.app import main

    root = tmp_path_factory.mktemp("tune")
    mp = pytest.MonkeyPatch()

    def cli(*args):
        mp.setattr(sys, "argv", ["ssmspec", *args])
        try:
            main()
        except SystemExit as e:
            assert not e.code, args

    cli("new-model", "--preset", "tiny", "--seed", "0", "--out", str(root / "target"))
    cli("new-model", "--preset", "tiny-hybrid", "--seed", "1", "--out", str(root / "other"))
    cli("profile", "--target", str(root / "target"), "--drafter", str(root / "target"), "--device", "cpu",
        "--sizes", "1,2,4,8,16", "--methods", "stree", "--repeats", "2", "--warmup", "1", "--prompt-len", "16",
        "--configs", "2,1", "--no-plot", "--out", str(root / "profile"))
    (root / "prompts.txt").write_text("abcabcabc\nhello hello\n")
    mp.undo()
    return root


def _tune(workdir, out, *extra):
    return ["tune-tree", "--target", str(workdir / "target"), "--drafter", str(workdir / "target"),
            "--prompts", str(workdir / "prompts.txt"), "--profile", str(workdir / "profile"),
            "--budget", "10", "--max-depth", "4", "--width", "3", "--max-new-tokens", "12", "--verify-top", "2",
            "--out", str(out), *extra]


def _generate(workdir, *extra, monkeypatch, capsys):
    code, out, err = run_cli(["generate", "--target", str(workdir / "target"), "--prompt", "abcabc", "--max-new-tokens",
                              "10", "--json", *extra], monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    return json.loads(out)


def test_tune_tree_static_and_bandit_files_drive_generate(workdir, tmp_path, monkeypatch, capsys):
    ar = _generate(workdir, "--method", "ar", monkeypatch=monkeypatch, capsys=capsys)
    for mode in ("static", "bandit"):
        out = tmp_path / mode
        code, stdout, err = run_cli(_tune(workdir, out, "--mode", mode, "--plot"), monkeypatch=monkeypatch, capsys=capsys)
        assert code == 0, err
        assert "chosen" in stdout and "predicted" in stdout
        data = read_tree_file(out / "tree.json")
        assert data["statistics"][0]["temperature"] == 0.0
        acc = data["statistics"][0]["acceptance"]
        assert acc[0][0] > 0.9  # the drafter is the target: its best token is accepted
        assert data["predictions"] and data["predictions"][0]["tokens_per_s"] >= data["predictions"][-1]["tokens_per_s"]
        choice = parse_tree_spec(str(out / "tree.json"))
        if mode == "static":
            assert "tree" in data and len(data["measured"]) == 2
            assert all(m["measured_tokens_per_s"] > 0 for m in data["measured"])
            for m in data["measured"]:  # predicted and measured step time, the prediction in its parts
                parts = m["predicted_parts_ms"]
                assert m["predicted_step_ms"] == pytest.approx(parts["target"] + parts["draft"] + parts["overhead"])
                assert m["measured_step_ms"] == pytest.approx(1000 * m["measured_tokens"] / m["measured_tokens_per_s"])
            profile = json.loads((workdir / "profile" / "profile.json").read_text())
            assert data["predictions"][0]["overhead_ms"] == profile["drafter_timings"]["iteration_overhead_ms"]
            assert not isinstance(choice, TreeArms)
        else:
            assert isinstance(choice, TreeArms) and (out / "bandit.png").is_file()
            run = data["bandit_run"]
            assert sum(run["pulls"]) == len(run["history"]) > 0
            assert data["bandit"]["lambda_gamma"] == pytest.approx(data["settings"]["lambda_gamma"])
        spec = _generate(workdir, "--drafter", str(workdir / "target"), "--tree", str(out / "tree.json"),
                         monkeypatch=monkeypatch, capsys=capsys)
        assert spec["token_ids"] == ar["token_ids"]
        if mode == "bandit":
            assert sum(spec["stats"]["tree_policy"]["pulls"]) == spec["stats"]["target_calls"]


def test_generate_with_a_bandit_spec_is_lossless(workdir, monkeypatch, capsys):
    ar = _generate(workdir, "--method", "ar", monkeypatch=monkeypatch, capsys=capsys)
    for extra in (["--tree", "bandit:3,1;2,2,1;1,1,1,1"], ["--tree", "bandit[state=keep]:2,1;1,1,1", "--cuda-graphs"]):
        spec = _generate(workdir, "--drafter", str(workdir / "target"), *extra, monkeypatch=monkeypatch, capsys=capsys)
        assert spec["token_ids"] == ar["token_ids"]
        policy = spec["stats"]["tree_policy"]
        assert sum(policy["pulls"]) == spec["stats"]["target_calls"]


@pytest.mark.parametrize("extra, message", [
    (["--candidates", "3,,1"], "malformed candidate"),
    (["--candidates", "bandit:3,1"], "tree configurations"),
    (["--candidates", "2,1;"], "empty candidate"),
    (["--candidates", "9,9"], "budget"),
    (["--mode", "dynamic"], "--mode"),
    (["--prompts", "{empty}"], "no usable prompt"),
    (["--target", "{other}"], "profile was measured on"),
    (["--drafter", "{other}"], "timed drafter"),
])
def test_refusals_are_one_line(workdir, tmp_path, monkeypatch, capsys, extra, message):
    (tmp_path / "empty.txt").write_text("\n  \n")
    paths = {"empty": tmp_path / "empty.txt", "other": workdir / "other"}
    args = _tune(workdir, tmp_path / "out")
    for flag, value in zip(extra[::2], extra[1::2]):
        value = value.format(**paths)
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    code, _, err = run_cli(args, monkeypatch=monkeypatch, capsys=capsys)
    assert code != 0
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "tree.json").exists()


def test_prompts_past_the_declared_context_are_skipped(workdir, tmp_path, monkeypatch, capsys):
    """As bench: a prompt that, with the tokens each measurement generates, does not fit the
    context the model's config.json declares is reported and left out; none fitting is refused."""
    import shutil

    short = tmp_path / "short"
    shutil.copytree(workdir / "other", short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 24}))
    (tmp_path / "prompts.txt").write_text("abcabcabc\n" + "x" * 40 + "\n")
    args = _tune(workdir, tmp_path / "out", "--force")
    for flag, value in (("--target", short), ("--drafter", short), ("--prompts", tmp_path / "prompts.txt")):
        args[args.index(flag) + 1] = str(value)
    code, _, err = run_cli(args, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    assert "skipped line2: 40 prompt tokens + 12 new tokens exceed the context of 24" in " ".join(err.split())
    (tmp_path / "prompts.txt").write_text("x" * 40 + "\n")
    code, _, err = run_cli(args + ["--overwrite"], monkeypatch=monkeypatch, capsys=capsys)
    last = err.strip().splitlines()[-1]  # after the profile warnings (--force) and the skipped line
    assert code != 0 and last.startswith("error: no prompt of") and "fits: 40 prompt tokens" in last, err


def test_cli_defaults_are_the_settings_defaults():
    import inspect

    from ssmspec.cli.tune_tree import tune_tree_command
    from ssmspec.tuning.tune import TuneSettings

    defaults = TuneSettings()
    params = inspect.signature(tune_tree_command).parameters
    for name in ("mode", "budget", "max_depth", "width", "temperature", "max_new_tokens", "verify_top", "arms",
                 "lambda_ucb", "state", "seed"):
        assert params[name].default.default == getattr(defaults, name), name
