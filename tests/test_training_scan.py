"""The training scan: which one a run picks, and fla's chunked simple-GLA and mamba_ssm's fused SSD
(each where its sources import; mamba_ssm also without its compiled extension) against naive_chunk_scan.

Their Triton kernels run here through Triton's interpreter in a child process (see
tests/test_ops_triton.py for why a child): fp32, tiny sizes, outputs and gradients of every input.
Real sizes and bf16 are in tests/gpu/test_training_scan_gpu.py.
"""
from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def scan_inputs(batch, steps, heads, headdim, groups, dstate, dtype=torch.float32, device="cpu", initial=True):
    """Fresh random SSD inputs in the model's conventions (dt after softplus, A negative), all requiring grad."""
    g = torch.Generator().manual_seed(steps * 131 + heads * 7 + groups)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = r(batch, steps, heads, headdim)
    dt = torch.nn.functional.softplus(r(batch, steps, heads) - 1.0).clamp(1e-3, 1.0)
    A = -torch.exp(r(heads) * 0.5)
    B = r(batch, steps, groups, dstate) * 0.5
    C = r(batch, steps, groups, dstate) * 0.5
    D = r(heads)
    h0 = r(batch, heads, headdim, dstate) * 0.5 if initial else None
    out = [x.to(dtype), dt, A, B.to(dtype), C.to(dtype), D, h0]
    return [None if t is None else t.to(device).requires_grad_() for t in out]


def scan_grads(fn, inputs, chunk_size, seed=1):
    """(y, final, grads of every input) of fn under fixed random upstream gradients on y and final."""
    y, final = fn(*inputs[:6], chunk_size, inputs[6])
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=g).to(y.device)
    gf = torch.randn(final.shape, generator=g).to(y.device)
    leaves = [t for t in inputs if t is not None]
    grads = torch.autograd.grad((y * gy).sum() + (final * gf).sum(), leaves)
    return y, final, grads


GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "initial_state")


if not INTERPRETED:

    def test_fla_scan_in_interpreter():
        pytest.importorskip("triton")
        pytest.importorskip("fla")
        pytest.importorskip("einops")
        from helpers import run_interpreted

        run_interpreted(__file__)

    def test_mamba_ssm_scan_in_interpreter():
        pytest.importorskip("triton")
        pytest.importorskip("einops")
        from ssmspec.training.scan import _import_mamba_ssd

        if _import_mamba_ssd() is None:
            pytest.skip("mamba_ssm's sources are not importable here (an optional GPU package)")
        from helpers import run_interpreted

        run_interpreted(__file__)

    def test_mamba_ssm_triton_ssd_imports_without_its_compiled_package_init(tmp_path, monkeypatch):
        """A mamba_ssm whose `__init__` fails (no compiled extension) still gives its Triton SSD,
        whose modules import each other by absolute name, and leaves no mamba_ssm module behind."""
        import sys
        import textwrap

        from ssmspec.training.scan import _import_mamba_ssd

        root = tmp_path / "mamba_ssm"
        files = {"__init__.py": "import selective_scan_cuda_missing_here\n", "ops/__init__.py": "",
                 "ops/triton/__init__.py": "", "utils/__init__.py": "", "utils/torch.py": "SCALE = 3\n",
                 "ops/triton/ssd_combined.py": textwrap.dedent("""\
                     from mamba_ssm.utils.torch import SCALE
                     def mamba_chunk_scan_combined(x):
                         return SCALE * x
                 """)}
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        monkeypatch.syspath_prepend(str(tmp_path))
        scan = _import_mamba_ssd()
        assert scan is not None and scan(2) == 6
        assert not [m for m in sys.modules if m.split(".")[0] == "mamba_ssm"]
        (root / "ops/triton/ssd_combined.py").write_text("raise ImportError('no triton here')\n")
        assert _import_mamba_ssd() is None
        assert not [m for m in sys.modules if m.split(".")[0] == "mamba_ssm"]

    def test_cpu_run_picks_the_plain_torch_scan():
        from ssmspec.training.scan import pick_training_scan

        picked = pick_training_scan("auto", torch.device("cpu"))
        assert picked.name == "ssmspec:ssmspec.ops.chunk_scan.naive.naive_chunk_scan"
        assert picked.reason == "no CUDA device"
        assert pick_training_scan("ssmspec", torch.device("cpu")).reason == "asked for"

    @pytest.mark.parametrize("choice", ["fla", "mamba_ssm"])
    def test_a_kernel_scan_asked_for_on_the_cpu_is_refused(choice):
        from ssmspec.errors import InputError
        from ssmspec.training.scan import pick_training_scan

        with pytest.raises(InputError, match=f"--scan {choice}"):
            pick_training_scan(choice, torch.device("cpu"))

    @pytest.mark.parametrize("deterministic", [False, True])
    def test_the_dx_autotuning_is_widened_once_and_never_in_deterministic_mode(deterministic):
        """`_widen_dx_autotuning` adds 2-warp / 3-stage and 4-warp / 2-stage variants of the tiles up to
        64 x 64 (their pre-hooks kept), once; mamba_ssm's deterministic mode, or one pinned config, keeps
        the list as it is (a choice by timings could differ between runs)."""
        import types

        from ssmspec.training.scan import _widen_dx_autotuning

        def config(m, n):
            return types.SimpleNamespace(kwargs={"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n}, num_warps=4, num_stages=4,
                                         pre_hook=print)

        tuner = types.SimpleNamespace(configs=[config(128, 64), config(32, 64), config(64, 64)])
        namespace = {"_chunk_scan_chunk_state_bwd_dx_kernel": tuner, "use_deterministic_mode": lambda: deterministic}
        for _ in range(2):
            _widen_dx_autotuning(namespace)
        shapes = [(c.kwargs["BLOCK_SIZE_M"], c.kwargs["BLOCK_SIZE_N"], c.num_warps, c.num_stages) for c in tuner.configs]
        if deterministic:
            assert shapes == [(128, 64, 4, 4), (32, 64, 4, 4), (64, 64, 4, 4)]
        else:
            assert shapes == [(128, 64, 4, 4), (32, 64, 4, 4), (64, 64, 4, 4), (32, 64, 2, 3), (32, 64, 4, 2),
                              (64, 64, 2, 3), (64, 64, 4, 2)]
            assert all(c.pre_hook is print for c in tuner.configs)
        pinned = types.SimpleNamespace(configs=[config(32, 64)])
        _widen_dx_autotuning({"_chunk_scan_chunk_state_bwd_dx_kernel": pinned, "use_deterministic_mode": lambda: False})
        assert len(pinned.configs) == 1

    def test_training_scan_restores_the_dispatcher(monkeypatch):
        from ssmspec.ops import dispatch
        from ssmspec.training.scan import TrainingScan, training_scan

        outer_packed = object()  # as an enclosing training_scan would have set it
        monkeypatch.setattr(dispatch, "packed_chunk_scan", outer_packed)
        before = dispatch.chunk_scan
        with training_scan("auto", torch.device("cpu")) as picked:
            assert isinstance(picked, TrainingScan)
            # the picked scan (on the CPU the dispatcher's own), behind torch.compiler.disable
            assert dispatch.chunk_scan.__wrapped__ is picked.fn is dispatch.resolve("chunk_scan", torch.device("cpu"))
            assert dispatch.packed_chunk_scan is None  # the CPU scan takes x, B and C apart
        assert dispatch.chunk_scan is before and dispatch.packed_chunk_scan is outer_packed

else:
    import sys

    import numpy as np

    from helpers import assert_close

    def _interpretable_fla():
        """fla's kernels loop with Python's `range` over tensor bounds and call `.to` on the index,
        which the interpreter's plain ints lack; its autotuner benchmarks through a GPU driver.
        Both are patched for the interpreter only: the index becomes an int32 scalar tensor, and
        every config times the same, so the first is taken."""
        import triton.language as tl
        import triton.runtime.autotuner as autotuner
        from triton.runtime.interpreter import TensorHandle

        from ssmspec.ops.chunk_scan.fla import fla_chunk_scan
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: F401  (imports every kernel module)

        builtin_range = range

        def tensor_range(*args):
            args = [int(a.handle.data.item()) if isinstance(a, tl.tensor) else int(a) for a in args]
            for i in builtin_range(*args):
                yield tl.tensor(TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)

        autotuner.Autotuner._bench = lambda self, *a, config=None, **k: [0.0, 0.0, 0.0]
        for name, module in list(sys.modules.items()):
            if name.startswith("fla.ops") and module is not None:
                module.range = tensor_range
        return fla_chunk_scan

    def _interpretable_mamba_ssm():
        """mamba_ssm's SSD (the adapter `--scan mamba_ssm` trains through) for the interpreter: its
        host code enters a CUDA device and reads the SM count, and its autotuner benchmarks
        through a GPU driver; all are patched for the interpreter only."""
        import contextlib

        import triton.runtime.autotuner as autotuner

        from ssmspec.training.scan import _mamba_ssm_scan

        scan = _mamba_ssm_scan()
        if scan is None:
            pytest.skip("mamba_ssm's sources are not importable here")
        torch.cuda.device = lambda index: contextlib.nullcontext()
        torch.cuda.get_device_properties = lambda device: type("Props", (), {"multi_processor_count": 4})()
        autotuner.Autotuner._bench = lambda self, *a, config=None, **k: [0.0, 0.0, 0.0]
        # no results on disk: the product asks Triton to keep them (training/scan.py), and Triton's
        # disk cache looks for compiled JIT functions the interpreter does not make
        autotuner.Autotuner.check_disk_cache = lambda self, key, configs, bench: bench() and False
        return scan

    def _assert_matches_naive(scan, inputs, chunk):
        """scan's y, final state and every input's gradient equal `naive_chunk_scan`'s (fp32)."""
        from ssmspec.ops.chunk_scan import naive_chunk_scan

        y_ref, f_ref, g_ref = scan_grads(naive_chunk_scan, inputs, chunk)
        y, f, g = scan_grads(scan, inputs, chunk)
        assert_close(y, y_ref, atol=1e-4, rtol=1e-4, name="y")
        assert_close(f, f_ref, atol=1e-4, rtol=1e-4, name="final_state")
        for name, got, want in zip(GRAD_NAMES, g, g_ref):
            assert_close(got, want, atol=2e-4, rtol=2e-4, name=f"d{name}")

    # without an initial state, training's case: mamba_ssm through training/scan_op.py's custom ops
    @pytest.mark.parametrize("steps,initial", [(1, True), (20, True), (63, True), (64, True), (130, True), (1, False),
                                               (40, False), (130, False)])
    @pytest.mark.parametrize("groups,headdim", [(1, 16), (2, 32)])
    @pytest.mark.parametrize("kernel", ["fla", "mamba_ssm"])
    def test_kernel_scan_equals_naive_outputs_and_gradients(kernel, steps, initial, groups, headdim):
        scan = {"fla": _interpretable_fla, "mamba_ssm": _interpretable_mamba_ssm}[kernel]()
        inputs = scan_inputs(1, steps, 4, headdim, groups, 16, initial=initial)
        _assert_matches_naive(scan, inputs, 16)

    @pytest.mark.parametrize("steps,chunk", [(40, 32), (130, 64)])
    def test_mamba_ssm_backward_after_our_keeping_forward_equals_naive(monkeypatch, steps, chunk):
        """Chunks our forward serves (multiples of its tile: 16 tokens here) run it, not mamba_ssm's
        five launches, and mamba_ssm's backward reads what it kept."""
        from ssmspec.ops.chunk_scan import triton as CS

        monkeypatch.setattr(CS, "FP32_TILE", (16, 16, 4, 1))
        scan = _interpretable_mamba_ssm()
        calls = []
        keeping = CS._launch
        monkeypatch.setattr(CS, "_launch", lambda *a, keep_chunk: calls.append(keep_chunk) or keeping(*a, keep_chunk=keep_chunk))
        inputs = scan_inputs(1, steps, 4, 16, 2, 16, initial=False)
        _assert_matches_naive(scan, inputs, chunk)
        assert calls == [chunk]

    @pytest.mark.parametrize("steps", [1, 63, 64, 130])
    def test_mamba_ssm_ops_shape_functions_match_what_the_kernels_return(steps):
        """The shapes compilation is told (the ops' fake functions: y, the final state, the tensors
        the forward keeps for the backward) are those of the kernels' outputs, whatever the length."""
        _interpretable_mamba_ssm()
        x, dt, A, B, C, D = [t.detach() for t in scan_inputs(2, steps, 6, 16, 2, 16, initial=False)[:6]]
        xBC = torch.cat([x.flatten(-2), B.flatten(-2), C.flatten(-2)], dim=-1)
        torch.library.opcheck(torch.ops.ssmspec_mamba_ssd_packed.ssd_fwd.default, (xBC, dt, A, D, 16, 16, 2),
                              test_utils=("test_schema", "test_faketensor"))

    @pytest.mark.parametrize("steps", [1, 40, 130])
    def test_mamba_ssm_on_the_conv_output_whole_equals_naive(steps):
        """`packed`, the mixer's route in training: [x | B | C] in, its gradient written whole (here
        split back into the parts' by the join's backward)."""
        scan = _interpretable_mamba_ssm()

        def packed(x, dt, A, B, C, D, chunk_size, initial_state):
            xBC = torch.cat([x.flatten(-2), B.flatten(-2), C.flatten(-2)], dim=-1)
            return scan.packed(xBC, dt, A, D, chunk_size, x.shape[-1], B.shape[-2])

        inputs = scan_inputs(1, steps, 4, 16, 2, 16, initial=False)
        _assert_matches_naive(packed, inputs, 16)

    def test_fla_scan_without_initial_state_or_D():
        from ssmspec.ops.chunk_scan import naive_chunk_scan

        fla_chunk_scan = _interpretable_fla()
        x, dt, A, B, C, _, _ = scan_inputs(2, 40, 2, 16, 1, 16, initial=False)
        y_ref, f_ref = naive_chunk_scan(x, dt, A, B, C, None, 16)
        y, f = fla_chunk_scan(x, dt, A, B, C, None, 16)
        assert_close(y, y_ref, atol=1e-4, rtol=1e-4, name="y")
        assert_close(f, f_ref, atol=1e-4, rtol=1e-4, name="final_state")
