"""ops/stream_layers: which models and machines the one-launch layer stack refuses, and why (the
kernel itself runs only on a Hopper GPU: tests/gpu/test_stream_layers_gpu.py)."""
from __future__ import annotations

import pytest
import torch
from helpers import kernel_shaped_model, tiny_model

from ssmspec.ops import paths
from ssmspec.ops.stream_layers import unsupported_reason

CPU = torch.device("cpu")


def test_a_kernel_shaped_model_is_refused_only_for_the_device():
    assert unsupported_reason(kernel_shaped_model(), 1, CPU) == "needs CUDA"


def test_refusals_name_the_reason():
    model = kernel_shaped_model()
    assert unsupported_reason(model, 2, CPU) == "batch 1 only"
    assert "norms folded" in unsupported_reason(kernel_shaped_model(("mamba", "mlp")), 1, CPU)
    small = tiny_model().to(torch.bfloat16)
    small.fold_norm_weights_()
    assert "d_model 32" in unsupported_reason(small, 1, CPU)
    unfolded = kernel_shaped_model()
    with torch.no_grad():  # a norm weight changed since folding
        unfolded.layers[0].norm.weight.fill_(2.0)
    assert "norms folded" in unsupported_reason(unfolded, 1, CPU)
    model.layers[1].mixer.A_log.data = model.layers[1].mixer.A_log.data.float()
    assert "share one dtype" in unsupported_reason(model, 1, CPU)
    head = kernel_shaped_model()
    head.norm_f.weight.data = head.norm_f.weight.data.float()
    assert "LM head" in unsupported_reason(head, 1, CPU)
    fp32 = kernel_shaped_model()
    fp32.layers[0].mixer.in_proj.weight.data = fp32.layers[0].mixer.in_proj.weight.data.float()
    assert unsupported_reason(fp32, 1, CPU) == "bf16 weights only"


def test_stream_proj_refuses_with_the_reason():
    """ops/stream_proj (the 16-node verify's weight-stream projections, same opt-in): what it
    refuses, and the model keeps the Triton verify, with one warning, when it does."""
    import warnings

    from ssmspec.ops import stream_proj

    model = kernel_shaped_model()
    assert stream_proj.unsupported_reason(model, 16, CPU) == "needs CUDA"
    assert "rows" in stream_proj.unsupported_reason(model, 17, CPU)
    assert "rows" in stream_proj.unsupported_reason(model, 0, CPU)
    assert "Mamba-2" in stream_proj.unsupported_reason(kernel_shaped_model(("mamba", "mlp")), 16, CPU)
    unfolded = kernel_shaped_model()
    with torch.no_grad():
        unfolded.layers[0].norm.weight.fill_(2.0)
    assert "folded" in stream_proj.unsupported_reason(unfolded, 16, CPU)
    fp32 = kernel_shaped_model()
    fp32.layers[0].mixer.out_proj.weight.data = fp32.layers[0].mixer.out_proj.weight.data.float()
    assert "bf16" in stream_proj.unsupported_reason(fp32, 16, CPU)
    small = tiny_model().to(torch.bfloat16)
    small.fold_norm_weights_()
    assert "d_model 32" in stream_proj.unsupported_reason(small, 16, CPU)
    # the ring of 4 slots of 8 rows at mamba2-2.7b fits beside a tree-scan program (32 KB of 228)
    assert stream_proj.cuda.smem_bytes(2560) + 1024 + 33 * 1024 <= 228 * 1024

    with paths.use_stream_layers("auto"), warnings.catch_warnings():
        warnings.simplefilter("error")  # not asked for: no warning
        assert model.one_launch.verify(model, 16, CPU) is None
    with paths.use_stream_layers("1"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = kernel_shaped_model()
        assert fresh.one_launch.verify(fresh, 16, CPU) is None and fresh.one_launch.verify(fresh, 8, CPU) is None
        assert fresh.one_launch.verify(fresh, 17, CPU) is None  # larger trees never take it: nothing to say
    assert len(caught) == 1 and "needs CUDA" in str(caught[0].message)


def test_the_settings_come_from_the_environment():
    """Read once per process (ops/paths.py `environment`); `read_settings` is the parser."""
    for value, want in (("", "auto"), ("auto", "auto"), ("1", "on"), (" ON ", "on"), ("0", "off"), ("off", "off")):
        assert paths.read_settings({"SSMSPEC_STREAM_LAYERS": value}).stream_layers == want
    assert paths.read_settings({}) == paths.Settings("auto", "auto", False)
    assert paths.read_settings({"SSMSPEC_BACKEND": "Triton", "TRITON_INTERPRET": "1"}) == \
        paths.Settings("triton", "auto", True)


@pytest.mark.parametrize("environ, match", [({"SSMSPEC_STREAM_LAYERS": "yes please"}, "SSMSPEC_STREAM_LAYERS='yes please'"),
                                            ({"SSMSPEC_BACKEND": "cuda"}, "SSMSPEC_BACKEND='cuda' is not a backend")])
def test_bad_settings_raise_one_typed_sentence(environ, match):
    from ssmspec.errors import CodePathError, SsmspecError

    with pytest.raises(CodePathError, match=match) as info:
        paths.read_settings(environ)
    assert isinstance(info.value, SsmspecError) and "\n" not in str(info.value)
    with pytest.raises(CodePathError, match="unknown backend 'foo'"):
        paths.set_backend("foo")
    with pytest.raises(CodePathError, match="unknown backend"):
        paths.use_backend("foo")
    with pytest.raises(CodePathError, match="one-launch mode"):
        paths.use_stream_layers("maybe")


def test_scoped_settings_nest_and_restore():
    outer = paths.settings()
    with paths.use_backend("reference"):
        assert paths.get_backend() == "reference"
        with paths.use_stream_layers("0"), paths.use_backend("triton"):
            inner = paths.settings()
            assert (inner.backend, inner.stream_layers, inner.interpret) == ("triton", "off", outer.interpret)
        middle = paths.settings()
        assert (middle.backend, middle.stream_layers, middle.interpret) == ("reference", outer.stream_layers,
                                                                             outer.interpret)
    assert paths.settings() == outer
    with pytest.raises(RuntimeError), paths.use_backend("reference"):
        raise RuntimeError("boom")
    assert paths.settings() == outer


def test_the_default_mode_falls_back_quietly_and_asking_warns():
    """On the CPU the one-launch kernels cannot run: the default mode keeps the Triton path
    without a word; SSMSPEC_STREAM_LAYERS=1 says why, once per model; 0 does not even look."""
    import warnings

    with paths.use_stream_layers("auto"), warnings.catch_warnings():
        warnings.simplefilter("error")
        model = kernel_shaped_model()
        assert model.one_launch.step(model, 1, CPU) is None
    model = kernel_shaped_model()
    with paths.use_stream_layers("on"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert model.one_launch.step(model, 1, CPU) is None and model.one_launch.step(model, 1, CPU) is None
        assert model.one_launch.step(model, 2, CPU) is None  # batch 2 never takes it: nothing to say
    assert len(caught) == 1 and "needs CUDA" in str(caught[0].message)
    fresh = kernel_shaped_model()
    with paths.use_stream_layers("off"):
        assert fresh.one_launch.step(fresh, 1, CPU) is None and fresh.one_launch.kept("step", CPU) is None
        assert paths.step_reason(fresh, 1, CPU) == "SSMSPEC_STREAM_LAYERS=0"


def test_a_failed_build_warns_by_default_and_raises_when_asked(monkeypatch):
    """A toolkit that cannot build the kernel: the default mode warns once and keeps the Triton
    kernels (and does not try again for that model); SSMSPEC_STREAM_LAYERS=1 raises a typed error."""
    import warnings

    from ssmspec.errors import CodePathError
    from ssmspec.ops import stream_layers

    calls = []

    def build(model, device):
        calls.append(1)
        raise RuntimeError("Error building extension 'x'")

    # as if this CPU could run it: the kernel's own checks pass, its build fails
    monkeypatch.setattr(paths, "step_reason", lambda model, batch, device: None)
    monkeypatch.setattr(stream_layers, "StreamLayers", build)
    model = kernel_shaped_model()
    with paths.use_stream_layers("auto"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert model.one_launch.step(model, 1, CPU) is None
    assert len(calls) == 1 and len(caught) == 1 and "failed to build" in str(caught[0].message)
    with paths.use_stream_layers("1"), pytest.raises(CodePathError, match="=1, but the one-launch layer stack failed"):
        fresh = kernel_shaped_model()
        fresh.one_launch.step(fresh, 1, CPU)


def test_any_width_that_fits_the_tiling_passes_the_width_check():
    """mamba2-130m's width (768) fits both kernels: refused here only for the device, in every
    mode (which widths run is decided by the kernels' limits; tests/gpu runs them at the presets'
    widths)."""
    import dataclasses

    from ssmspec.models import LanguageModel
    from ssmspec.models.presets import preset_config
    from ssmspec.ops import stream_proj

    cfg = dataclasses.replace(preset_config("mamba2-130m", vocab_size=256), layers=["mamba"])
    model = LanguageModel(cfg).to(torch.bfloat16).fold_norm_weights_()
    assert unsupported_reason(model, 1, CPU) == stream_proj.unsupported_reason(model, 16, CPU) == "needs CUDA"
    odd = dataclasses.replace(cfg, d_model=640)
    assert "d_model 640 does not fit" in unsupported_reason(LanguageModel(odd).to(torch.bfloat16).fold_norm_weights_(),
                                                             1, CPU)


def test_the_model_names_its_mamba_stack_for_the_kernels():
    model = kernel_shaped_model()
    stack = model.folded_mamba_stack()
    assert [m for m, _ in stack] == model.mamba_mixers() == [layer.mixer for layer in model.layers]
    assert [eps for _, eps in stack] == [layer.norm.eps for layer in model.layers]
    assert kernel_shaped_model(("mamba", "mlp")).folded_mamba_stack() is None
    assert len(kernel_shaped_model(("mamba", "mlp")).mamba_mixers()) == 1


def test_each_cache_keeps_its_table_of_layer_pointers(monkeypatch):
    """A captured CUDA graph reads the kernel's table of layer pointers by address: a step on
    another cache must neither free nor rebuild the first cache's table (one is kept per cache)."""
    from ssmspec.ops.stream_layers import StreamLayers

    model = kernel_shaped_model()
    runner = object.__new__(StreamLayers)  # the kernel needs a Hopper GPU; its tables do not
    runner.mixers = [m for m, _ in model.folded_mamba_stack()]
    runner.zx, runner._tables = torch.empty(1), {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    a, b = model.new_cache(1, 8), model.new_cache(1, 8)
    first = runner.table(a)
    other = runner.table(b)
    assert runner.table(a) is first and other is not first
    assert int(first[1, -1]) == a.layers[1].ssm_state.data_ptr()
    assert int(other[1, -1]) == b.layers[1].ssm_state.data_ptr()
