"""Every error path of every command: one line on stderr, a non-zero exit status, never a traceback.

The walk below reads the registered commands and their options from the Typer app, so a command
added to `ssmspec.cli.app.COMMANDS` is covered without touching this file (a free-text string
option needs one line in FREE_TEXT, a required one a value in GOOD, a command needing more than
its required options a line in BASE).
"""
from __future__ import annotations

import inspect
import io
import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from ssmspec.cli.app import app, run

MISSING = "/nonexistent/ssmspec-test-path"
# Bad values of string options that take free text (anything else must refuse an unknown name).
FREE_TEXT = {
    "--prompt": [""], "--drafter": ["", MISSING], "--tree": ["3,,1"], "--stop": [""], "--data": [""],
    "--text-field": [""], "--lora-targets": [], "--sizes": ["0,2", "two", "1,,2,4", "4"], "--methods": ["stree,warp"],
    "--configs": ["3;x", "3,2;;1"], "--device": ["tpu", "cuda:x"],
}


def run_cli(args, monkeypatch, capsys, stdin=""):
    """The CLI in-process through its boundary; returns (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = run([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *, status=2, mentions=None):
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert code == status and lines[0].startswith("error: "), (code, err)
    if mentions is not None:
        assert mentions.lower() in lines[0].lower(), (mentions, err)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny target made by `ssmspec new-model`, a text file, and an ordinary file."""
    root = tmp_path_factory.mktemp("cli-errors")
    assert run(["new-model", "--preset", "tiny", "--out", str(root / "target")]) == 0
    (root / "data.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 40)
    (root / "file.txt").write_text("not a directory\n")
    return root


# -- the walk: each kind of bad value for each option of each command ---------------------------------
def _options(callback):
    """(flag, python type, OptionInfo) of each option of a command, hidden ones included."""
    hints = typing.get_type_hints(callback)
    for name, param in inspect.signature(callback).parameters.items():
        info = param.default
        kind = hints[name]
        if typing.get_origin(kind) is typing.Union:  # Optional[X]
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if typing.get_origin(kind) in (list, typing.List):
            kind = typing.get_args(kind)[0]
        yield info.param_decls[0].split("/")[0], kind, info


def _bad_values(flag, kind, info):
    """(value, what the one-line message must mention) pairs; a flag gets the value as an extra word."""
    if kind is bool:
        return [(["true"], "true")]
    if kind is int:
        return [([v], flag) for v in ("abc", "1.5", "1e20", "-1")]
    if kind is float:
        return [([v], flag) for v in ("abc", "nan", "inf", "-inf", "-1")]
    if kind is Path:
        if info.exists:
            return [([MISSING], flag)]
        return [(["{file}"], flag)] if flag == "--out" else []  # an --out that is a file
    if flag in FREE_TEXT:
        return [([v], flag.lstrip("-")) for v in FREE_TEXT[flag]]
    return [(["bogus-name"], flag)]  # a choice


GOOD = {"--prompt": "hi", "--data": "{data}", "--preset": "tiny", "--prompts": "{data}"}
# Options a command needs beyond its required ones, so that only the value under test is wrong.
BASE = {"distill": ["--student-preset", "tiny"], "sft": ["--student-preset", "tiny"]}


def _base_args(name, callback):
    """Values for the command's required options (a model directory for paths that must exist)."""
    args = list(BASE.get(name, []))
    for flag, kind, info in _options(callback):
        if info.default is not ...:
            continue
        if flag in GOOD:
            args += [flag, GOOD[flag]]
        elif kind is Path:
            args += [flag, "{target}" if info.exists else "{fresh}"]
        else:
            raise AssertionError(f"give the required option {flag} a valid value in GOOD")
    return args


def _walk():
    for command in app.registered_commands:
        for flag, kind, info in _options(command.callback):
            for value, mentions in _bad_values(flag, kind, info):
                yield pytest.param(command.name, command.callback, flag, value, mentions,
                                   id=f"{command.name} {flag} {' '.join(value)}")


def test_every_command_is_walked():
    names = {p.values[0] for p in _walk()}
    assert names == {c.name for c in app.registered_commands}
    assert {"generate", "distill", "sft", "new-model", "profile"} <= names


@pytest.mark.parametrize("command, callback, flag, value, mentions", list(_walk()))
def test_bad_option_value_is_one_line(files, tmp_path, monkeypatch, capsys, command, callback, flag, value, mentions):
    paths = {"target": files / "target", "data": files / "data.txt", "file": files / "file.txt", "fresh": tmp_path / "out"}
    args = [a.format(**paths) for a in [command, *_base_args(command, callback), flag, *value]]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert_one_line_error(code, err, mentions=mentions)
    assert not (tmp_path / "out").exists()  # refused before writing anything


# -- usage errors, help and version ------------------------------------------------------------------
@pytest.mark.parametrize("args, mentions", [
    (["frobnicate"], "frobnicate"),
    (["generate", "--frobnicate"], "--frobnicate"),
    (["--frobnicate"], "--frobnicate"),
    (["generate", "--target", "{target}"], "--prompt"),
    (["generate", "--target", "{target}", "--prompt", "hi", "--json", "true"], "true"),
    (["generate", "--target", "{target}", "--prompt", "hi", "--max-new-tokens"], "--max-new-tokens"),
    (["distill", "--target", "{target}", "--data", "{data}", "--out", "{fresh}", "--temperature", "2"], "--temperature"),
])
def test_usage_errors_are_one_line(files, tmp_path, monkeypatch, capsys, args, mentions):
    paths = {"target": files / "target", "data": files / "data.txt", "fresh": tmp_path / "out"}
    code, _, err = run_cli([a.format(**paths) for a in args], monkeypatch, capsys)
    assert_one_line_error(code, err, mentions=mentions)


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["prepare"], ["profile", "--out", "{fresh}"]])
def test_the_triton_backend_off_cuda_is_refused_before_any_kernel(files, tmp_path, monkeypatch, capsys, command):
    from ssmspec.ops import settings

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(settings, "_process", settings._process)  # --backend sets it for the process: restored after
    rest = [a.format(fresh=tmp_path / "out") for a in command[1:]]
    code, _, err = run_cli([command[0], "--target", files / "target", *rest, "--backend", "triton", "--device", "cpu"],
                           monkeypatch, capsys)
    assert_one_line_error(code, err, mentions="the triton backend runs on a CUDA GPU")


def test_no_arguments_print_help_and_one_line(monkeypatch, capsys):
    code, out, err = run_cli([], monkeypatch, capsys)
    assert code == 2 and "generate" in out and "distill" in out
    assert_one_line_error(code, err)


@pytest.mark.parametrize("command", [[]] + [[c.name] for c in app.registered_commands])
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_goes_to_stdout_with_status_0(monkeypatch, capsys, command, flag):
    code, out, err = run_cli([*command, flag], monkeypatch, capsys)
    assert code == 0 and err == "" and "Usage" in out
    if command:  # our flags are plain flags (typer's own --help row shows a type)
        assert [line for line in out.splitlines() if "<bool>" in line and "--help" not in line] == []


def test_version(monkeypatch, capsys):
    code, out, err = run_cli(["--version"], monkeypatch, capsys)
    assert code == 0 and out.startswith("ssmspec ") and err == ""


def test_library_errors_are_one_line_with_the_traceback_on_request(files, monkeypatch, capsys):
    args = ["generate", "--target", files / "target", "--prompt", "hi", "--drafter", "ngram", "--tree", "3,,1"]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert_one_line_error(code, err, mentions="tree")
    monkeypatch.setenv("SSMSPEC_DEBUG", "1")
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize("error, status", [
    (FileNotFoundError(2, "No such file or directory", "x.json"), 2),
    (PermissionError(13, "Permission denied", "/root/x"), 2),
    (OSError(28, "No space left on device"), 1),
    (ValueError("bad\nvalue"), 2),
    (RuntimeError("Expected one of cpu, cuda device type at start of device string: tpu"), 1),
    (MemoryError(), 1),
    (KeyError("surprise"), 1),
])
def test_os_and_torch_errors_are_one_line(files, monkeypatch, capsys, error, status):
    import ssmspec.api

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(ssmspec.api, "load_target", fail)
    code, _, err = run_cli(["generate", "--target", files / "target", "--prompt", "hi"], monkeypatch, capsys)
    assert_one_line_error(code, err, status=status)


def test_cuda_out_of_memory_is_one_line(files, monkeypatch, capsys):
    import torch

    import ssmspec.api

    def fail(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 GiB\n(more)")

    monkeypatch.setattr(ssmspec.api, "load_target", fail)
    code, _, err = run_cli(["generate", "--target", files / "target", "--prompt", "hi"], monkeypatch, capsys)
    assert_one_line_error(code, err, status=1, mentions="out of GPU memory")
    assert "--max-new-tokens" in err and "--grad-accum" not in err


@pytest.mark.parametrize("command, option", [("sft", "--recompute"), ("distill", "--grad-accum"), ("profile", "--sizes"),
                                             ("tune-tree", "--budget"), ("bench", "--max-new-tokens")])
def test_out_of_memory_names_the_failing_commands_own_options(command, option):
    import torch

    from ssmspec.cli.app import _command, explain

    assert _command(["--version"]) is None and _command([command, "--target", "x"]) == command
    for error in (torch.cuda.OutOfMemoryError("CUDA out of memory"), MemoryError()):
        status, message = explain(error, _command([command, "--out", "x"]))
        assert status == 1 and option in message, message


# -- output directories: never an input, --overwrite only our own output --------------------------------
def _tree(path: Path) -> dict:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["is", "inside", "contains"])
@pytest.mark.parametrize("command", ["distill", "sft"])
def test_training_never_writes_into_an_input_model(files, tmp_path, monkeypatch, capsys, command, where):
    model = files / "target"
    before = _tree(model)
    out = {"is": model, "inside": model / "drafter", "contains": model.parent}[where]
    role = ["--target", model, "--student-preset", "tiny"] if command == "distill" else ["--student", model]
    code, _, err = run_cli([command, *role, "--data", files / "data.txt", "--out", out, "--overwrite", "--steps", "1"],
                           monkeypatch, capsys)
    assert_one_line_error(code, err, mentions=str(model))
    assert "--overwrite" not in err  # an input is never a directory to overwrite
    assert _tree(model) == before and not (model / "drafter").exists()


def test_other_commands_never_write_into_an_input_model(files, monkeypatch, capsys):
    model = files / "target"
    before = _tree(model)
    for args in (["new-model", "--preset", "tiny", "--vocab-from", model, "--out", model, "--overwrite"],
                 ["profile", "--target", model, "--out", model / "profile", "--overwrite"],
                 ["bench", "--target", model, "--out", model / "bench", "--overwrite"],
                 ["tune-tree", "--target", model, "--drafter", model, "--prompts", files / "data.txt", "--profile", model,
                  "--out", model.parent, "--overwrite"]):
        code, _, err = run_cli(args, monkeypatch, capsys)
        assert_one_line_error(code, err, mentions=str(model))
        assert "--overwrite" not in err
    assert _tree(model) == before


def test_overwrite_replaces_only_the_commands_own_output(files, tmp_path, monkeypatch, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "weights.bin").write_text("precious")
    code, _, err = run_cli(["new-model", "--preset", "tiny", "--out", foreign, "--overwrite"], monkeypatch, capsys)
    assert_one_line_error(code, err, mentions=".ssmspec-output")
    assert "--overwrite" not in err and (foreign / "weights.bin").read_text() == "precious"

    mine = tmp_path / "mine"
    assert run_cli(["new-model", "--preset", "tiny", "--out", mine], monkeypatch, capsys)[0] == 0
    code, _, err = run_cli(["new-model", "--preset", "tiny", "--out", mine], monkeypatch, capsys)
    assert_one_line_error(code, err, mentions="--overwrite")
    # Another command's output is not this command's to replace.
    code, _, err = run_cli(["distill", "--target", files / "target", "--student-preset", "tiny", "--data",
                            files / "data.txt", "--out", mine, "--overwrite"], monkeypatch, capsys)
    assert_one_line_error(code, err, mentions="new-model")
    assert run_cli(["new-model", "--preset", "tiny", "--out", mine, "--overwrite", "--seed", "3"],
                   monkeypatch, capsys)[0] == 0


def test_resume_with_nothing_to_resume_is_refused(files, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(["distill", "--target", files / "target", "--student-preset", "tiny", "--data",
                            files / "data.txt", "--out", tmp_path / "empty", "--resume"], monkeypatch, capsys)
    assert_one_line_error(code, err, mentions="--resume")


# -- interrupts --------------------------------------------------------------------------------------
def test_ctrl_c_in_training_saves_says_how_to_resume_and_exits_130(files, tmp_path, monkeypatch, capsys):
    from ssmspec.cli import train as cli_train

    def interrupt(self, metrics):
        if metrics["step"] == 1:
            raise KeyboardInterrupt

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(cli_train.RichProgress, "on_step", interrupt)
    args = ["distill", "--target", files / "target", "--student-preset", "tiny", "--data", files / "data.txt",
            "--out", tmp_path / "d", "--steps", "50", "--seq-len", "16", "--batch-size", "2", "--eval-every", "0",
            "--save-every", "0", "--log-every", "1"]
    monkeypatch.setattr(sys, "argv", ["ssmspec", *map(str, args)])
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith("--resume") and "continue with: ssmspec distill" in err
    assert (tmp_path / "d" / ".ssmspec-output").exists() and (tmp_path / "d" / "checkpoints").is_dir()


def _ssmspec(*args, **kwargs):
    exe = Path(sys.executable).parent / "ssmspec"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ssmspec"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SSMSPEC_DEBUG", None)
    return subprocess.Popen([*cmd, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, **kwargs)


def _sigint_by_default() -> None:
    """In the child before exec: Ctrl-C's default action. A shell starts background jobs with SIGINT
    ignored, their children inherit that, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_generate_prints_the_partial_output_and_exits_130(files):
    proc = _ssmspec("generate", "--target", files / "target", "--prompt", "hello", "--max-new-tokens", 100_000,
                    preexec_fn=_sigint_by_default)
    first = proc.stdout.read1(64)  # the first streamed text: generation is under way
    assert first, proc.stderr.read().decode()
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(first + out) > len(first)
    assert "interrupted after" in err.strip().splitlines()[-1] and "stop: interrupted" in err


def test_the_installed_command_behaves(files):
    """A representative subset through the real entry point, run side by side (each start imports torch)."""
    runs = {
        "not a number": (_ssmspec("generate", "--target", files / "target", "--prompt", "hi", "--max-new-tokens", "abc"),
                         2, "--max-new-tokens"),
        "non-UTF-8 stdin": (_ssmspec("generate", "--target", files / "target", "--prompt", "-", stdin=subprocess.PIPE),
                            2, "UTF-8"),
    }
    for name, (proc, status, mentions) in runs.items():
        _, err = proc.communicate(b"caf\xe9 \xff\xfe" if proc.stdin else None, timeout=180)
        err = err.decode()
        assert proc.returncode == status, (name, err)
        assert_one_line_error(proc.returncode, err, status=status, mentions=mentions)


def test_a_run_from_before_markers_is_recognised_by_its_run_json(files, tmp_path, monkeypatch, capsys):
    old = tmp_path / "old"
    old.mkdir()
    (old / "run.json").write_text('{"config": {"mode": "distill"}}')
    base = ["--data", files / "data.txt", "--out", old]
    code, _, err = run_cli(["distill", "--target", files / "target", "--student-preset", "tiny", *base], monkeypatch, capsys)
    assert_one_line_error(code, err, mentions="--overwrite")
    code, _, err = run_cli(["sft", "--student-preset", "tiny", *base, "--overwrite"], monkeypatch, capsys)
    assert_one_line_error(code, err, mentions="ssmspec distill")
    assert (old / "run.json").exists()
