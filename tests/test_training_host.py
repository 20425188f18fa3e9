"""The training loop's host side: device values are read only on logged steps, and the values logged
are the ones the per-step reads gave (same bits), at any log cadence and with grad accumulation."""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from helpers import tiny_model
from ssmspec.training import loop
from ssmspec.training.loop import adamw_implementation, make_optimizer, train
from test_training_common import bigram_target, one_thread, sample_token_data  # noqa: F401
from test_training_loop import _config


@pytest.fixture(scope="module")
def token_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sampled.jsonl"
    return sample_token_data(bigram_target(), path, rows=40, length=100)


@pytest.mark.usefixtures("one_thread")
def test_logged_losses_are_the_per_micro_batch_values_summed_as_python_floats(tmp_path, token_data, monkeypatch):
    """What the loop logged before it kept losses on the device: sum over micro-batches of
    loss.item() / grad_accum (and each part likewise), in Python floats from 0.0."""
    micro: list[tuple[float, dict]] = []
    original = loop._loss

    def recording(*args):
        loss, parts = original(*args)
        micro.append((loss.detach().float().item(), {k: float(v) for k, v in parts.items()}))
        return loss, parts

    monkeypatch.setattr(loop, "_loss", recording)
    cfg = _config(tmp_path, token_data, steps=6, grad_accum=3)
    cfg.loss.loss = "kl+ce"
    result = train(cfg, target=bigram_target(), student=tiny_model(seed=2, std=0.02))
    assert len(micro) == 6 * 3 and len(result.history) == 6
    for i, logged in enumerate(result.history):
        loss, parts = 0.0, {}
        for value, p in micro[3 * i: 3 * i + 3]:
            loss += value / 3
            for k, v in p.items():
                parts[k] = parts.get(k, 0.0) + v / 3
        assert logged["loss"] == loss, i  # bit for bit
        assert {k: logged[k] for k in parts} == parts
        assert isinstance(logged["grad_norm"], float) and logged["grad_norm"] > 0


@pytest.mark.usefixtures("one_thread")
def test_log_cadence_changes_neither_training_nor_logged_values(tmp_path, token_data):
    every = train(_config(tmp_path / "a", token_data, mode="sft", steps=8), student=tiny_model(seed=2, std=0.02))
    cfg = _config(tmp_path / "b", token_data, mode="sft", steps=8)
    cfg.checkpoint.log_every = 4
    sparse = train(cfg, student=tiny_model(seed=2, std=0.02))
    by_step = {m["step"]: m for m in every.history}
    assert [m["step"] for m in sparse.history] == [4, 8]
    for m in sparse.history:
        for key in ("loss", "ce", "grad_norm", "lr"):
            assert m[key] == by_step[m["step"]][key], (m["step"], key)


@pytest.mark.usefixtures("one_thread")
def test_unlogged_steps_read_nothing_from_the_device(tmp_path, token_data, monkeypatch):
    """Every `.item()` / `float(tensor)` of a GPU tensor waits for the GPU; an optimizer step must queue
    its work and go on. (torch.optim reads its step counters, host tensors unless fused: not counted.)"""
    reads = {"n": 0}
    item, to_float = torch.Tensor.item, torch.Tensor.__float__

    def count(frame):
        if f"torch{os.sep}optim" not in frame.f_code.co_filename:
            reads["n"] += 1

    def counted_item(self):
        count(sys._getframe(1))
        return item(self)

    def counted_float(self):
        count(sys._getframe(1))
        return to_float(self)

    per_step: list[int] = []
    original = loop.optimizer_step

    def step(run):
        before = reads["n"]
        out = original(run)
        per_step.append(reads["n"] - before)
        return out

    monkeypatch.setattr(torch.Tensor, "item", counted_item)
    monkeypatch.setattr(torch.Tensor, "__float__", counted_float)
    monkeypatch.setattr(loop, "optimizer_step", step)
    cfg = _config(tmp_path, token_data, steps=6, grad_accum=2)
    cfg.checkpoint.log_every = 3
    train(cfg, target=bigram_target(), student=tiny_model(seed=2, std=0.02))
    assert per_step == [0] * 6
    assert reads["n"] > 0  # the logged steps did read (the counter is live)


def test_adamw_is_fused_only_when_every_parameter_is_a_cuda_float():
    cpu = [torch.nn.Parameter(torch.randn(3, 3))]
    assert adamw_implementation(cpu) == {}
    assert make_optimizer(torch.nn.Linear(4, 4), types.SimpleNamespace(
        weight_decay=0.1, lr=1e-3, beta1=0.9, beta2=0.95)).defaults["fused"] in (None, False)
    cuda = types.SimpleNamespace(is_cuda=True, is_floating_point=lambda: True)
    assert adamw_implementation([cuda, cuda]) == {"fused": True}
    assert adamw_implementation([cuda, cpu[0]]) == {}
    assert adamw_implementation([]) == {}


def test_batches_draw_each_epochs_permutation_once_and_keep_the_seeded_order(tmp_path, monkeypatch):
    import json

    from ssmspec.training import data
    from ssmspec.training.config import DataConfig
    from ssmspec.training.data import BadRecords, Blocks, Tokenize

    f = tmp_path / "ids.jsonl"
    f.write_text(json.dumps({"input_ids": [(j * 7) % 50 for j in range(205)]}) + "\n")
    blocks = Blocks(DataConfig(spec=str(f), seq_len=4, held_out_fraction=0.0), Tokenize(None, 64), 5, BadRecords())
    n = blocks.num_train
    drawn = []
    randperm = torch.randperm
    monkeypatch.setattr(data.torch, "randperm", lambda *a, **k: drawn.append(a[0]) or randperm(*a, **k))
    got = [blocks.batch(pos, 3)[0] for pos in range(0, 3 * n, 3)]  # three epochs, batches across their ends
    assert len(drawn) <= 4  # once per epoch (and once more where a batch spans two), not once per batch
    # The order is the seeded one: epoch e visits the blocks in randperm(seed * 1_000_003 + e).
    want = torch.cat([blocks.train[0][randperm(n, generator=torch.Generator().manual_seed(5 * 1_000_003 + e))]
                      for e in range(4)])
    assert torch.equal(torch.cat(got), want[: 3 * len(got)])
