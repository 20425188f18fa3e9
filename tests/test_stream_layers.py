"""ops/stream_layers: which models and machines the one-launch layer stack refuses, and why (the
kernel itself runs only on a Hopper GPU: tests/gpu/test_stream_layers_gpu.py)."""
from __future__ import annotations

import pytest
import torch
from helpers import kernel_shaped_model, tiny_model

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

    tokens = torch.zeros(1, 16, dtype=torch.long)
    assert model._stream_proj(tokens) is None  # not asked for: no warning
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSMSPEC_STREAM_LAYERS", "1")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert model._stream_proj(tokens) is None and model._stream_proj(tokens) is None
        assert len(caught) == 1 and "needs CUDA" in str(caught[0].message)


def test_the_mode_comes_from_the_environment(monkeypatch):
    from ssmspec.ops import stream_layers

    monkeypatch.delenv("SSMSPEC_STREAM_LAYERS", raising=False)
    assert stream_layers.mode() == "auto" and stream_layers.enabled()
    for value, want in (("auto", "auto"), ("1", "on"), (" ON ", "on"), ("0", "off"), ("off", "off")):
        monkeypatch.setenv("SSMSPEC_STREAM_LAYERS", value)
        assert stream_layers.mode() == want
    assert not stream_layers.enabled()
    monkeypatch.setenv("SSMSPEC_STREAM_LAYERS", "yes please")
    with pytest.raises(ValueError, match="expected 1 .* 0 .* auto"):
        stream_layers.mode()


def test_the_default_mode_falls_back_quietly_and_asking_warns(monkeypatch):
    """On the CPU the one-launch kernels cannot run: the default mode keeps the Triton path
    without a word; SSMSPEC_STREAM_LAYERS=1 says why, once per model; 0 does not even look."""
    import warnings

    monkeypatch.delenv("SSMSPEC_STREAM_LAYERS", raising=False)
    ids = torch.zeros(1, 1, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel_shaped_model()._stream_layers(ids) is None
    model = kernel_shaped_model()
    monkeypatch.setenv("SSMSPEC_STREAM_LAYERS", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert model._stream_layers(ids) is None and model._stream_layers(ids) is None
    assert len(caught) == 1 and "needs CUDA" in str(caught[0].message)
    monkeypatch.setenv("SSMSPEC_STREAM_LAYERS", "0")
    fresh = kernel_shaped_model()
    assert fresh._stream_layers(ids) is None and getattr(fresh, "_stream_runner", None) is None


def test_a_failed_build_warns_by_default_and_raises_when_asked(monkeypatch):
    """A toolkit that cannot build the kernel: the default mode warns once and keeps the Triton
    kernels (and does not try again for that model); SSMSPEC_STREAM_LAYERS=1 raises."""
    import warnings

    calls = []

    def build():
        calls.append(1)
        raise RuntimeError("Error building extension 'x'")

    monkeypatch.delenv("SSMSPEC_STREAM_LAYERS", raising=False)
    model = kernel_shaped_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert model._one_launch_runner("_probe", CPU, lambda: None, build, "the kernel", "Triton") is None
    assert len(calls) == 1 and len(caught) == 1 and "failed to build" in str(caught[0].message)
    monkeypatch.setenv("SSMSPEC_STREAM_LAYERS", "1")
    with pytest.raises(RuntimeError, match="=1, but the kernel failed to build"):
        kernel_shaped_model()._one_launch_runner("_probe", CPU, lambda: None, build, "the kernel", "Triton")


def test_the_default_mode_waits_for_gpu_tests_at_other_widths(monkeypatch):
    """mamba2-130m's width (768) fits both kernels but has not run their GPU tests: the default
    mode refuses it with that reason; SSMSPEC_STREAM_LAYERS=1 goes on to the next check."""
    import dataclasses

    from ssmspec.models import LanguageModel
    from ssmspec.models.presets import preset_config
    from ssmspec.ops import stream_proj
    from ssmspec.ops.stream_layers import GPU_TESTED_D_MODELS

    assert 768 not in GPU_TESTED_D_MODELS
    cfg = dataclasses.replace(preset_config("mamba2-130m", vocab_size=256), layers=["mamba"])
    model = LanguageModel(cfg).to(torch.bfloat16).fold_norm_weights_()
    monkeypatch.delenv("SSMSPEC_STREAM_LAYERS", raising=False)
    for reason in (unsupported_reason(model, 1, CPU), stream_proj.unsupported_reason(model, 16, CPU)):
        assert "d_model 768 has not run the kernels' GPU tests" in reason and "=1 takes them" in reason
    monkeypatch.setenv("SSMSPEC_STREAM_LAYERS", "1")
    assert unsupported_reason(model, 1, CPU) == stream_proj.unsupported_reason(model, 16, CPU) == "needs CUDA"
