"""ops/paths.py, the one place that picks the code path, on the CPU: the settings it reads once,
the per-op choice, the model-level choices and `explain` (the one-launch kernels' refusals:
tests/test_stream_layers.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import kernel_shaped_model, tiny_model

from ssmspec.errors import CodePathError
from ssmspec.ops import dispatch, paths
from ssmspec.ops.step_update.naive import naive_add_rms_norm

CPU = torch.device("cpu")


def test_the_environment_is_read_once(monkeypatch):
    from ssmspec.ops import settings

    monkeypatch.setattr(settings, "_process", None)  # no set_backend from an earlier test in the way
    paths.environment.cache_clear()
    try:
        monkeypatch.setenv("SSMSPEC_BACKEND", "reference")
        monkeypatch.setenv("SSMSPEC_STREAM_LAYERS", "0")
        read = paths.environment()
        assert (read.backend, read.stream_layers) == ("reference", "off")
        monkeypatch.setenv("SSMSPEC_BACKEND", "triton")  # too late: read at the first use
        assert paths.environment().backend == "reference"
        paths.environment.cache_clear()
        monkeypatch.setenv("SSMSPEC_STREAM_LAYERS", "foo")
        with pytest.raises(CodePathError, match="SSMSPEC_STREAM_LAYERS='foo' is not understood"):
            dispatch.linear(torch.ones(1, 4), torch.ones(2, 4))  # the first op that asks says so
    finally:
        monkeypatch.undo()
        paths.environment.cache_clear()


def test_set_backend_is_the_process_default_and_scopes_win():
    try:
        paths.set_backend("reference")
        assert paths.get_backend() == "reference"
        with paths.use_backend("auto"):
            assert paths.get_backend() == "auto"
        assert paths.get_backend() == "reference"
    finally:
        paths.set_backend("auto")


def test_the_per_op_choice():
    assert dispatch.resolve("add_rms_norm", CPU) is naive_add_rms_norm  # auto on the CPU
    assert not dispatch.uses_kernel("linear", CPU) and paths.kernel("linear", CPU) is None
    with paths.use_backend("reference"):
        assert paths.kernel("linear", torch.device("cuda")) is None
    with paths.use_backend("triton"):
        assert paths.kernel("chunk_scan", CPU) is None  # no Triton kernel: the reference
        pytest.importorskip("triton")
        from ssmspec.ops.gemv.triton import linear

        assert paths.kernel("linear", CPU) is linear


def test_a_missing_kernel_fails_only_when_asked_for(monkeypatch):
    monkeypatch.setitem(paths.TRITON_KERNELS, "linear", ("ssmspec.ops.no_such_module", "linear"))
    paths._import_kernel.cache_clear()
    try:
        with paths.use_backend("triton"), pytest.raises(CodePathError, match="does not import .* for linear"):
            paths.kernel("linear", CPU)
        assert paths.kernel("linear", torch.device("cuda")) is None  # auto: the reference, quietly
    finally:
        monkeypatch.undo()
        paths._import_kernel.cache_clear()


def test_the_fused_path_follows_the_add_norm_kernel_and_its_width(monkeypatch):
    assert not paths.fused_layers(256, CPU)
    pytest.importorskip("triton")
    with paths.use_backend("triton"):
        assert paths.fused_layers(256, CPU)
        monkeypatch.setattr("ssmspec.ops.step_update.triton.ADD_RMS_NORM_MAX_DIM", 128)
        assert not paths.fused_layers(256, CPU)


def test_the_split_verify_layer_needs_the_kernels_and_enough_rows():
    args = (1, 32, 68, 32, 4, 4, 8, CPU)
    assert not paths.splits_in_proj(64, *args)  # auto on the CPU: the reference
    assert paths._split_reason(8, *args) == f"8 rows, fewer than {paths.SPLIT_IN_PROJ_MIN_ROWS}"
    assert paths._split_reason(64, *args) == "the Triton kernels are not in use"


def test_explain_names_each_op_and_the_model_paths():
    lines = dispatch.explain(tiny_model())
    assert lines[0].startswith("settings: backend auto, one-launch kernels")
    for op in ("chunk_scan", *paths.TRITON_KERNELS):
        assert f"{op}: reference (backend auto on cpu)" in lines
    assert "model layers: plain per-op path (backend auto on cpu)" in lines
    with paths.use_backend("reference"):
        assert "linear: reference (backend reference)" in dispatch.explain()
    pytest.importorskip("triton")
    with paths.use_backend("triton"), paths.use_stream_layers("on"):
        lines = dispatch.explain(kernel_shaped_model())
    assert "linear: triton (backend triton on cpu)" in lines and "chunk_scan: reference (no Triton kernel)" in lines
    assert "decode step (batch 1): triton (needs CUDA)" in lines
    assert "verify (16 nodes): triton (needs CUDA)" in lines
    assert "verify (64 nodes), in_proj: one GEMM (the skinny GEMM does not take both halves)" in lines \
        or "verify (64 nodes), in_proj: one GEMM (needs CUDA)" in lines


def test_the_constant_mark_is_torch_compilers():
    """paths marks _kernel_imports as torch.compiler.assume_constant_result does, without the
    decorator's import of torch._dynamo: a torch that marks otherwise fails here, not silently."""
    def ours():
        pass

    def torchs():
        pass

    paths._assume_constant_result(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) == {"_dynamo_marked_constant": True}


def test_a_command_that_loads_a_hybrid_model_does_not_import_dynamo():
    """torch._dynamo costs about 2 s of a command's start; loading a hybrid model (meta device,
    RoPE frequencies) and choosing its code paths must not import it."""
    probe = ("import sys\nimport torch\nfrom ssmspec.cli import app\nfrom ssmspec.models.presets import preset_config\n"
             "from ssmspec.models.loading.allocate import empty_model\nfrom ssmspec.ops import paths\n"
             "model = empty_model(preset_config('tiny-hybrid'))\nprint(paths.explain(model, torch.device('cpu')))\n"
             "print('dynamo', 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "dynamo False", out
