"""`ssmspec prepare`: what it runs (one generation per setting through an Engine), and what it refuses."""
from __future__ import annotations

import pytest

from cli.prepare import prepare
from helpers import tiny_model
from ssmspec.cli.app import run
from ssmspec.decoding import ModelDrafter
from ssmspec.trees import parse_tree_spec


def test_prepare_runs_every_setting_and_says_which_code_runs():
    target = tiny_model(seed=1)
    drafter = ModelDrafter(tiny_model(seed=2))
    shapes = [parse_tree_spec("3,2,1"), parse_tree_spec("bandit:2,1;1,1")]
    lines = list(prepare(target, drafter, shapes, temperature=0.7))
    ready = [line for line in lines if "ready in" in line]
    assert [line.split(": ready")[0] for line in ready] == [
        "ar", "stree 3,2,1", f"stree {shapes[1].spec()}", "ar at T=0.7", "stree 3,2,1 at T=0.7",
        f"stree {shapes[1].spec()} at T=0.7"]
    assert any(line.startswith("  settings:") for line in lines)  # then the code paths (ops/paths.py explain)


def test_prepare_without_a_drafter_prepares_ar_only():
    lines = list(prepare(tiny_model(seed=1), None, [], 0.0))
    assert [line.split(": ready")[0] for line in lines if "ready in" in line] == ["ar"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare")
    assert run(["new-model", "--preset", "tiny", "--out", str(root / "target")]) == 0
    return root / "target"


def test_prepare_on_the_cpu_says_there_is_nothing_to_build(target_dir, capsys):
    assert run(["prepare", "--target", str(target_dir), "--drafter", "ngram", "--device", "cpu"]) == 0
    assert "nothing to build on cpu" in capsys.readouterr().out


@pytest.mark.parametrize("args, mentions", [
    (["--tree", "3,2,1"], "--tree needs --drafter"),
    (["--drafter", "ngram", "--tree", "3,,1"], "malformed tree spec"),
    (["--drafter", "/nonexistent/x"], "not a model directory"),
])
def test_prepare_refuses_with_one_line(target_dir, capsys, args, mentions):
    assert run(["prepare", "--target", str(target_dir), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and mentions in err[0]


def test_the_cache_locations_come_from_triton_and_torch():
    from cli.prepare import _cache_dirs

    lines = _cache_dirs()
    assert [line.split(":")[0] for line in lines] == ["Triton kernels", "CUDA extensions"]
    assert all(line.split(": ", 1)[1] for line in lines)
