"""The one tolerance helper for the whole repository, plus tiny-model builders for tests."""
from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-4, name: str = ""):
    """Assert elementwise closeness, reporting max-abs and relative RMS error first."""
    actual = actual.detach().float().cpu()
    expected = expected.detach().float().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values (unwritten output lanes?)"
    diff = (actual - expected).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    rel_rms = (diff.pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-12)).item() if diff.numel() else 0.0
    ok = bool((diff <= atol + rtol * expected.abs()).all())
    assert ok, f"{name}: max abs err {max_abs:.3e}, rel RMS err {rel_rms:.3e} (atol {atol}, rtol {rtol})"
    return max_abs, rel_rms


def tiny_config(layers=("mamba", "mamba"), vocab_size: int = 64, **overrides):
    """A small ModelConfig with awkward sizes (2 groups, partial RoPE, GQA) for fast CPU tests."""
    from ssmspec.models import AttentionConfig, MambaConfig, MLPConfig, ModelConfig

    return ModelConfig(
        vocab_size=vocab_size,
        d_model=32,
        layers=list(layers),
        mamba=MambaConfig(n_heads=4, head_dim=8, d_state=8, n_groups=2, chunk_size=8),
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8, rotary_dim=4),
        mlp=MLPConfig(d_intermediate=48),
        **overrides,
    )


def tiny_model(layers=("mamba", "mamba"), vocab_size: int = 64, seed: int = 0, std: float = 0.2, **overrides):
    """A random tiny LanguageModel in fp32 with weights large enough to give peaked logits."""
    from ssmspec.models import LanguageModel
    from ssmspec.models.init import init_weights

    model = LanguageModel(tiny_config(layers, vocab_size, **overrides))
    return init_weights(model, seed=seed, std=std).eval()


def kernel_shaped_model(layers=("mamba", "mamba"), device="cpu"):
    """The smallest bf16 model that ops/stream_layers runs: d_model 256, d_state 128, one group,
    expand 2, norms folded."""
    import dataclasses

    from ssmspec.models import LanguageModel, MambaConfig
    from ssmspec.models.init import init_weights

    cfg = dataclasses.replace(tiny_config(layers), d_model=256,
                              mamba=MambaConfig(n_heads=8, head_dim=64, d_state=128, n_groups=1, chunk_size=8))
    model = init_weights(LanguageModel(cfg), seed=0, std=0.05).eval().to(device, torch.bfloat16)
    model.fold_norm_weights_()  # after the move: folding is recorded per weight tensor
    return model


def run_interpreted(test_file: str) -> None:
    """Run a kernel test file in a child pytest with TRITON_INTERPRET=1 and assert that it passed.

    Triton picks the interpreter when it is imported and when each kernel is decorated, so the
    setting cannot be changed inside a test process without changing it for every other module.
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(test_file).resolve().relative_to(repo)), "-q", "-x",
         "-p", "no:cacheprovider"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"interpreted kernel tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout and "no tests ran" not in proc.stdout, proc.stdout[-2000:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a against b, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_cli(args, monkeypatch, capsys, stdin: str = ""):
    """Run the CLI in-process through `main()`; returns (exit code, stdout, stderr)."""
    import io
    import sys

    from ssmspec.cli.app import main

    monkeypatch.setattr(sys, "argv", ["ssmspec", *args])
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def scan_training_step_grads(scan: str, reference: str, precision: str, device: str = "cuda"):
    """One training step of a 2-layer Mamba-2 model (d_model 256, 8 heads of 64, d_state 128)
    through the training scan `scan` and through `reference`, under the run's autocast:
    (scan's reported name, loss, grads, reference loss, reference grads)."""
    import dataclasses

    from ssmspec.models import LanguageModel, MambaConfig
    from ssmspec.models.init import init_weights
    from ssmspec.training.losses import cross_entropy
    from ssmspec.training.scan import training_scan

    cfg = dataclasses.replace(tiny_config(("mamba", "mamba")), d_model=256,
                              mamba=MambaConfig(n_heads=8, head_dim=64, d_state=128, n_groups=1, chunk_size=256))
    model = init_weights(LanguageModel(cfg), seed=0, std=0.05).to(device)
    ids = torch.randint(0, cfg.vocab_size, (2, 301), device=device)
    mask = torch.ones(2, 300, dtype=torch.bool, device=device)

    def loss_and_grads(choice):
        model.zero_grad(set_to_none=True)
        with training_scan(choice, torch.device(device)) as picked, \
                torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = cross_entropy(model(ids[:, :-1]), ids[:, 1:], mask)
        loss.backward()
        return picked.name, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    name, loss, grads = loss_and_grads(scan)
    _, loss_ref, grads_ref = loss_and_grads(reference)
    return name, loss, grads, loss_ref, grads_ref


def assert_caches_equal(a, b):
    """Two caches hold the same states (attention: the valid prefix of each row)."""
    from ssmspec.models import AttentionLayerCache, MambaLayerCache

    assert a.seqlen.tolist() == b.seqlen.tolist()
    for i, (ca, cb) in enumerate(zip(a.layers, b.layers)):
        if isinstance(ca, MambaLayerCache):
            assert_close(ca.conv_state, cb.conv_state, atol=1e-5, name=f"layer {i} conv state")
            assert_close(ca.ssm_state, cb.ssm_state, atol=1e-5, name=f"layer {i} ssm state")
        elif isinstance(ca, AttentionLayerCache):
            for row, length in enumerate(a.seqlen.tolist()):  # only the valid prefix is meaningful
                assert_close(ca.keys[row, :, :length], cb.keys[row, :, :length], atol=1e-5, name=f"layer {i} keys")
                assert_close(ca.values[row, :, :length], cb.values[row, :, :length], atol=1e-5, name=f"layer {i} values")
