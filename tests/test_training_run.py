"""Run-level behaviour of the training loop: evaluation switches and progress, --resume refusals,
throughput and MFU in the log, and the FLOPs formula behind MFU."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import tiny_config, tiny_model
from ssmspec.errors import InputError
from ssmspec.training.flops import device_peak_flops, matmul_params, mixer_forward_flops, train_flops_per_token
from ssmspec.training.loop import TrainCallbacks, train
from test_training_common import bigram_target, one_thread, sample_token_data  # noqa: F401
from test_training_loop import _config


@pytest.fixture(scope="module")
def token_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sampled.jsonl"
    return sample_token_data(bigram_target(), path, rows=40, length=100)


def _events(cfg):
    return [json.loads(line) for line in open(os.path.join(cfg.out, "log.jsonl"))]


class _Recorder(TrainCallbacks):
    def __init__(self):
        self.progress, self.evals = [], []

    def on_eval_progress(self, done, total, step):
        self.progress.append((step, done, total))

    def on_eval(self, metrics):
        self.evals.append(metrics["step"])


@pytest.mark.usefixtures("one_thread")
def test_no_evaluation_at_all_when_both_are_off(tmp_path, token_data):
    cfg = _config(tmp_path, token_data, steps=3)
    cfg.eval.eval_every, cfg.eval.final_eval = 0, False
    rec = _Recorder()
    result = train(cfg, rec, target=bigram_target(), student=tiny_model(seed=2, std=0.02))
    assert result.evals == [] and rec.evals == [] and rec.progress == []
    assert not any(e["event"] == "eval" for e in _events(cfg))
    assert result.step == 3 and os.path.exists(os.path.join(cfg.out, "config.json"))


@pytest.mark.usefixtures("one_thread")
def test_evaluations_report_their_progress(tmp_path, token_data):
    pytest.importorskip("ssmspec.decoding.generate", reason="acceptance needs ssmspec.decoding")
    cfg = _config(tmp_path, token_data, steps=4)
    cfg.eval.eval_every, cfg.eval.num_prompts, cfg.eval.max_new_tokens = 2, 2, 6
    rec = _Recorder()
    result = train(cfg, rec, target=bigram_target(), student=tiny_model(seed=2, std=0.02))
    assert [m["step"] for m in result.evals] == rec.evals == [0, 2, 4]
    for step in (0, 2, 4):
        seen = [(done, total) for s, done, total in rec.progress if s == step]
        total = seen[0][1]
        batches = -(-result.info["held_out_blocks"] // cfg.optim.batch_size)  # held-out batches, then 2 prompts
        assert batches >= 1 and total == batches + 2
        assert [done for done, _ in seen] == list(range(total + 1))
        assert all(t == total for _, t in seen)


@pytest.mark.usefixtures("one_thread")
def test_final_evaluation_alone(tmp_path, token_data):
    cfg = _config(tmp_path, token_data, steps=2, mode="sft")
    cfg.eval.eval_every, cfg.eval.final_eval = 0, True
    result = train(cfg, student=tiny_model(seed=2, std=0.02))
    assert [m["step"] for m in result.evals] == [2]
    assert "held_out_ce" in result.evals[0] and "mean_accepted" not in result.evals[0]


@pytest.mark.parametrize("make_dir", [False, True], ids=["missing", "empty"])
def test_resume_with_nothing_to_resume_is_refused(tmp_path, token_data, make_dir):
    cfg = _config(tmp_path, token_data, steps=2)
    cfg.resume = True
    if make_dir:
        os.makedirs(cfg.out)
    with pytest.raises(InputError) as err:
        train(cfg, target=bigram_target(), student=tiny_model(seed=2, std=0.02))
    message = str(err.value)
    assert message.startswith("--resume:") and "no training run to resume" in message and "\n" not in message
    assert not make_dir or os.listdir(cfg.out) == []


@pytest.mark.usefixtures("one_thread")
def test_log_reports_scan_flops_and_throughput(tmp_path, token_data):
    cfg = _config(tmp_path, token_data, steps=2)
    target, student = bigram_target(), tiny_model(seed=2, std=0.02)
    train(cfg, target=target, student=student)
    events = _events(cfg)
    start = events[0]
    assert start["event"] == "start"
    assert start["scan"] == "ssmspec:ssmspec.ops.chunk_scan.naive.naive_chunk_scan"
    assert start["scan_reason"] == "no CUDA device"
    assert start["flops_per_token"] == train_flops_per_token(student, cfg.data.seq_len, target)
    assert start["peak_flops"] is None and start["device_name"] == "cpu"
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 2
    assert all(e["tokens_per_s"] > 0 and e["mfu"] is None for e in steps)
    end = events[-1]
    assert end["event"] == "end"
    assert end["throughput"] == {"tokens_per_s": steps[1]["tokens_per_s"], "mfu": None, "windows": 1}


def test_steady_throughput_leaves_out_the_first_window():
    from ssmspec.training.flops import steady_throughput

    history = [{"tokens_per_s": 1.0, "mfu": 0.01}, {"tokens_per_s": 10.0, "mfu": 0.1}, {"tokens_per_s": 30.0, "mfu": 0.3},
               {"tokens_per_s": 20.0, "mfu": 0.2}]
    assert steady_throughput(history) == {"tokens_per_s": 20.0, "mfu": 0.2, "windows": 3}
    assert steady_throughput(history[:1]) == {"tokens_per_s": 1.0, "mfu": 0.01, "windows": 1}
    assert steady_throughput([]) == {"tokens_per_s": None, "mfu": None, "windows": 0}


def test_flops_formula_on_a_tiny_model():
    """6 N (every Linear once) + 3 x the mixers' forward, written out by hand for tiny_config."""
    cfg = tiny_config(("mamba", "attention", "mamba"), tie_embeddings=True)
    from ssmspec.models import LanguageModel

    model = LanguageModel(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear > cfg.vocab_size * cfg.d_model
    assert matmul_params(model) == linear  # the tied head counts (it multiplies), the embedding lookup does not
    m, a, T = cfg.mamba, cfg.attention, 100
    l = min(m.chunk_size, T)
    conv_dim = m.n_heads * m.head_dim + 2 * m.n_groups * m.d_state
    mamba = m.n_heads * (2 * l * (m.d_state + m.head_dim) + 4 * m.d_state * m.head_dim) + 2 * m.conv_kernel * conv_dim
    attention = 4 * a.n_heads * a.head_dim * T
    assert mixer_forward_flops(model, T) == 2 * mamba + attention
    assert train_flops_per_token(model, T) == 6 * linear + 3 * (2 * mamba + attention)
    target = LanguageModel(tiny_config(("mamba",)))
    assert train_flops_per_token(model, T, target) == (train_flops_per_token(model, T) + 2 * matmul_params(target)
                                                      + mixer_forward_flops(target, T))


def test_peak_flops_table():
    assert device_peak_flops("cpu") == (None, "cpu")
