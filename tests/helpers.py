"""The one tolerance helper for the whole repository, plus tiny-model builders for tests."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]


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


INTERPRETED_TEST_SUFFIXES = ("_in_interpreter", "_interpreted")
"""Tests named so call `run_interpreted`: conftest starts their files' child run when collection ends."""

_interpreted_runs: dict[str, "_InterpretedRun"] = {}


class _InterpretedRun:
    """One child pytest over several kernel test files with TRITON_INTERPRET=1, started in the
    background: on a 2-core machine it takes the second core while this process runs the rest of
    the suite (the interpreter tests were a third of the default run's time, run one by one)."""

    def __init__(self, files: list[str]):
        import os
        import subprocess
        import sys
        import tempfile

        self.files, self._verdicts = files, None
        self._dir = tempfile.mkdtemp(prefix="ssmspec-interpreted-")
        self._xml, self._log = os.path.join(self._dir, "report.xml"), open(os.path.join(self._dir, "log.txt"), "w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", f"--junitxml={self._xml}"],
            cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, stdout=self._log, stderr=subprocess.STDOUT)
        for f in files:
            _interpreted_runs[f] = self

    def verdict(self, test_file: str, timeout: float = 900) -> tuple[int, list[str]]:
        """(tests passed, failure reports) of one of the files, once the child has finished."""
        if self._verdicts is None:
            self._proc.wait(timeout=timeout)
            self._verdicts = self._read_report()
        return self._verdicts.get(test_file, (0, []))

    def _read_report(self) -> dict[str, tuple[int, list[str]]]:
        import xml.etree.ElementTree as ET

        self._log.seek(0)
        tail = self._log.read()[-3000:]
        try:
            cases = list(ET.parse(self._xml).getroot().iter("testcase"))
        except (OSError, ET.ParseError) as e:
            return {f: (0, [f"the interpreted child wrote no report ({e}):\n{tail}"]) for f in self.files}
        verdicts = {}
        for f in self.files:
            module = f[:-3].replace("/", ".")
            mine = [c for c in cases if c.get("classname") == module or c.get("classname", "").startswith(module + ".")]
            failed = [f"{c.get('name')}: {(bad.text or bad.get('message') or '')[-3000:]}"
                      for c in mine for bad in c if bad.tag in ("failure", "error")]
            passed = sum(1 for c in mine if not any(child.tag in ("failure", "error", "skipped") for child in c))
            verdicts[f] = (passed, failed or ([] if passed else [f"no test of {f} passed:\n{tail}"]))
        return verdicts

    def stop(self) -> None:
        import shutil

        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def start_interpreted(test_files: list[str]) -> None:
    """Start the child run of these kernel test files (repository-relative paths) in the background."""
    files = [f for f in test_files if f not in _interpreted_runs]
    if files:
        _InterpretedRun(files)


def stop_interpreted() -> None:
    for run in set(_interpreted_runs.values()):
        run.stop()


def run_interpreted(test_file: str) -> None:
    """Assert that a kernel test file passed in a child pytest with TRITON_INTERPRET=1.

    Triton picks the interpreter when it is imported and when each kernel is decorated, so the
    setting cannot be changed inside a test process without changing it for every other module.
    The child runs in the background from the end of collection (conftest, `start_interpreted`)
    when the calling test's name ends in one of INTERPRETED_TEST_SUFFIXES; otherwise it starts here.
    """
    rel = Path(test_file).resolve().relative_to(REPO).as_posix()
    start_interpreted([rel])
    passed, failures = _interpreted_runs[rel].verdict(rel)
    assert not failures, "interpreted kernel tests failed:\n" + "\n\n".join(failures)[-8000:]
    assert passed > 0, f"no interpreted test of {rel} passed"


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


def training_step_grads(choice: str, precision: str, device: str = "cuda"):
    """One training step of a 2-layer Mamba-2 model (d_model 256, 8 heads of 64, d_state 128) through
    the training scan `choice` under the run's autocast (bf16) or none (fp32): (the scan's reported
    name, loss, every parameter's gradient). The same weights and tokens on every call."""
    import dataclasses

    from ssmspec.models import LanguageModel, MambaConfig
    from ssmspec.models.init import init_weights
    from ssmspec.training.losses import cross_entropy
    from ssmspec.training.scan import training_scan

    cfg = dataclasses.replace(tiny_config(("mamba", "mamba")), d_model=256,
                              mamba=MambaConfig(n_heads=8, head_dim=64, d_state=128, n_groups=1, chunk_size=256))
    model = init_weights(LanguageModel(cfg), seed=0, std=0.05).to(device)
    ids = torch.randint(0, cfg.vocab_size, (2, 301), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones(2, 300, dtype=torch.bool, device=device)
    with training_scan(choice, torch.device(device)) as picked, \
            torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = cross_entropy(model(ids[:, :-1]), ids[:, 1:], mask)
    loss.backward()
    return picked.name, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def scan_training_step_grads(scan: str, reference: str, precision: str, device: str = "cuda"):
    """`training_step_grads` through `scan` and through `reference`:
    (scan's reported name, loss, grads, reference loss, reference grads)."""
    name, loss, grads = training_step_grads(scan, precision, device)
    _, loss_ref, grads_ref = training_step_grads(reference, precision, device)
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


def check_programs_write_apart(monkeypatch) -> Callable[[], None]:
    """In Triton's interpreter: fail when two programs of one launch store to one element.

    The interpreter runs a launch's programs one after another, so a program that writes another's
    elements goes unseen whenever the rightful owner runs later; on a GPU it is a race (the SSD
    decay gradients' padding slots, found on an H200 on 11-28). Each store is recorded with its
    program; a launch's records are checked when the next launch begins and by the returned
    function. Atomic stores may share elements (they are the way to). Returns the last check."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder as builder

    program, stores = [None], []

    def check() -> None:
        recorded = stores[:]
        stores.clear()
        if len(recorded) < 2:
            return
        addresses = np.concatenate([a for a, _ in recorded])
        programs = np.concatenate([np.full(a.size, p) for a, p in recorded])
        order = np.lexsort((programs, addresses))
        addresses, programs = addresses[order], programs[order]
        clash = np.flatnonzero((addresses[1:] == addresses[:-1]) & (programs[1:] != programs[:-1]))
        if clash.size:
            i = clash[0]
            raise AssertionError(f"programs {programs[i]} and {programs[i + 1]} of one launch (numbered along the "
                                 f"grid, last axis fastest) both store to one element ({clash.size} such stores)")

    set_grid_dim, set_grid_idx, masked_store = builder.set_grid_dim, builder.set_grid_idx, builder.create_masked_store

    def on_launch(self, nx, ny, nz):
        check()
        set_grid_dim(self, nx, ny, nz)

    def on_program(self, x, y, z):
        program[0] = (x * self.grid_dim[1] + y) * self.grid_dim[2] + z
        set_grid_idx(self, x, y, z)

    def on_store(self, ptrs, value, mask, cache_policy):
        stores.append((ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].ravel(), program[0]))
        return masked_store(self, ptrs, value, mask, cache_policy)

    def on_atomic_store(self, ptr, val, mask, sem, scope):
        return masked_store(self, ptr, val, mask, None)

    monkeypatch.setattr(builder, "set_grid_dim", on_launch)
    monkeypatch.setattr(builder, "set_grid_idx", on_program)
    monkeypatch.setattr(builder, "create_masked_store", on_store)
    monkeypatch.setattr(builder, "create_atomic_store", on_atomic_store)
    return check
