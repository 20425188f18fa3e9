"""`distill --cache-target-logits K`: the sparse top-K loss against plain-torch references, and the on-disk
cache of the target's top-K (filled once per block, read back later, resumed, refused for another target)."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import assert_close, tiny_model
from ssmspec.errors import InputError
from ssmspec.training import logit_cache
from ssmspec.training.config import RunConfig
from ssmspec.training.logit_cache import DATA_FILE, HEADER_FILE, TargetLogitCache, top_k_logits
from ssmspec.training.loop import TrainCallbacks, train
from ssmspec.training.losses import chunked_loss, forward_kl, topk_forward_kl, total_variation
from test_training_common import bigram_target, one_thread  # noqa: F401


# -- the loss --------------------------------------------------------------------------------------------
def _topk_inputs(dtype=torch.float32, batch=3, steps=7, vocab=50, k=6):
    s = (torch.randn(batch, steps, vocab) * 3).to(dtype).requires_grad_()
    t = torch.randn(batch, steps, vocab, dtype=dtype) * 3
    values, ids = t.topk(k, dim=-1)
    ids_data = torch.randint(0, vocab, (batch, steps))
    mask = torch.rand(batch, steps) > 0.3
    mask[0, 0] = True
    return s, values, ids, ids_data, mask


def _reference_tvd(s, values, ids, mask, temperature):
    """TVD between the renormalised top-K target (0 off its ids) and the student, in plain torch."""
    p = torch.zeros_like(s, dtype=torch.float32).scatter(-1, ids, F.softmax(values.float() / temperature, -1))
    per_pos = 0.5 * (p - F.softmax(s.float() / temperature, -1)).abs().sum(-1)
    m = mask.float()
    return (per_pos * m).sum() / m.sum()


def _reference_kl(s, values, ids, mask, temperature):
    """The definition written out: sum over the K ids of p_t (log p_t - log q_s), times T^2, masked mean."""
    log_q = F.log_softmax(s.float() / temperature, -1).gather(-1, ids)
    p = F.softmax(values.float() / temperature, -1)
    per_pos = (p * (p.log() - log_q)).sum(-1) * temperature**2
    m = mask.float()
    return (per_pos * m).sum() / m.sum()


@pytest.mark.parametrize("chunk", [0, 1, 4, 100])  # auto, one row, not dividing 21 rows, more than all
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("mix", [{"kl": 1.0}, {"kl": 1.0, "ce": 0.5}, {"tvd": 1.0}, {"kl": 0.3, "tvd": 2.0}])
def test_topk_loss_equals_the_plain_torch_reference(chunk, temperature, mix):
    s, values, ids, ids_data, mask = _topk_inputs()
    loss, parts = chunked_loss(s, mask, target_topk=(values, ids), next_ids=ids_data, temperature=temperature,
                               chunk_positions=chunk, **mix)
    (grad,) = torch.autograd.grad(loss * 1.7, s)
    terms = {"kl": _reference_kl(s, values, ids, mask, temperature),
             "tvd": _reference_tvd(s, values, ids, mask, temperature),
             "ce": F.cross_entropy(s[mask], ids_data[mask])}
    ref = sum(w * terms[k] for k, w in mix.items())
    (grad_ref,) = torch.autograd.grad(ref * 1.7, s)
    assert_close(loss, ref, atol=1e-5, rtol=1e-5, name="loss")
    assert_close(grad, grad_ref, atol=1e-6, rtol=1e-4, name="grad")
    for k in mix:
        assert_close(parts[k], terms[k], atol=1e-5, rtol=1e-5, name=k)
    if "kl" in mix:  # the library's own reference says the same
        assert_close(topk_forward_kl(s, values, ids, mask, temperature), terms["kl"], atol=1e-6, rtol=1e-6, name="ref")


@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_of_the_whole_vocabulary_is_the_full_loss(chunk, temperature):
    s, _, _, _, mask = _topk_inputs()
    t = torch.randn(s.shape) * 3
    values, ids = t.topk(t.shape[-1], dim=-1)
    values = values - values[..., :1]  # stored shifted: the distribution does not change
    for name, ref_fn in (("kl", forward_kl), ("tvd", total_variation)):
        loss, _ = chunked_loss(s, mask, target_topk=(values, ids), temperature=temperature, chunk_positions=chunk,
                               **{name: 1.0})
        ref = ref_fn(s, t, mask, temperature)
        (grad,) = torch.autograd.grad(loss, s)
        (grad_ref,) = torch.autograd.grad(ref, s)
        assert_close(loss, ref, atol=1e-5, rtol=1e-5, name=name)
        assert_close(grad, grad_ref, atol=1e-6, rtol=1e-4, name=f"{name} grad")


def test_stored_values_are_shifted_fp16_and_int32_ids():
    logits = torch.tensor([[[1.0, 5.0, -2.0, 4.5], [0.0, 0.0, 7.0, float("-inf")]]])
    values, ids = top_k_logits(logits, 3)
    assert values.dtype == torch.float16 and ids.dtype == torch.int32
    assert ids[0, 0].tolist() == [1, 3, 0] and values[0, 0].tolist() == [0.0, -0.5, -4.0]
    values, _ = top_k_logits(logits, 4)
    assert torch.isfinite(values).all()  # -inf is clamped to float16's lowest: p is 0 there, not NaN


# -- the cache in a run ------------------------------------------------------------------------------------
BLOCKS, SEQ_LEN, BATCH, K = 8, 16, 4, 5  # two steps per epoch


class CountingTarget(nn.Module):
    """A target that counts its forward calls and the rows they ran on."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.calls, self.rows = 0, 0

    def forward(self, input_ids):
        self.calls += 1
        self.rows += input_ids.shape[0]
        return self.inner(input_ids)


@pytest.fixture(scope="module")
def exact_data(tmp_path_factory):
    """One record of exactly BLOCKS blocks of SEQ_LEN + 1 tokens (consecutive blocks share one)."""
    path = tmp_path_factory.mktemp("data") / "ids.jsonl"
    ids = torch.randint(0, 64, (BLOCKS * SEQ_LEN + 1,), generator=torch.Generator().manual_seed(3)).tolist()
    path.write_text(json.dumps({"input_ids": ids}) + "\n")
    return path


def _config(out, data, steps=2 * BLOCKS // BATCH, k=K):
    cfg = RunConfig(mode="distill", out=str(out), target="(in memory)", student_preset="(in memory)")
    cfg.data.spec, cfg.data.seq_len, cfg.data.held_out_fraction = str(data), SEQ_LEN, 0.0
    cfg.optim.steps, cfg.optim.batch_size, cfg.optim.lr = steps, BATCH, 1e-2
    cfg.eval.eval_every, cfg.eval.final_eval = 0, False
    cfg.checkpoint.log_every, cfg.checkpoint.save_every = 1, 0
    cfg.loss.cache_target_logits = k
    return cfg


class _Calls(TrainCallbacks):
    """Target calls seen at each logged step; optionally a KeyboardInterrupt after step `stop`."""

    def __init__(self, target, stop=None):
        self.target, self.stop, self.by_step, self.messages = target, stop, {}, []

    def on_step(self, m):
        self.by_step[m["step"]] = self.target.calls
        if m["step"] == self.stop:
            raise KeyboardInterrupt

    def on_message(self, text):
        self.messages.append(text)


def _events(cfg, name):
    return [e for e in map(json.loads, open(os.path.join(cfg.out, "log.jsonl"))) if e["event"] == name]


@pytest.mark.usefixtures("one_thread")
def test_target_runs_in_the_first_epoch_only_and_later_epochs_read_its_top_k(tmp_path, exact_data, monkeypatch):
    target = CountingTarget(bigram_target())
    lookups = []
    real_lookup = TargetLogitCache.lookup

    def spy(self, rows, inputs, tgt):
        out = real_lookup(self, rows, inputs, tgt)
        lookups.append((list(rows), inputs.clone(), out))
        return out

    monkeypatch.setattr(TargetLogitCache, "lookup", spy)
    cfg = _config(tmp_path / "out", exact_data)
    cb = _Calls(target)
    result = train(cfg, cb, target=target, student=tiny_model(seed=2, std=0.02))
    assert cb.by_step == {1: 1, 2: 2, 3: 2, 4: 2}  # one call per first-epoch step, none after
    assert target.rows == BLOCKS
    assert sorted(r for rows, _, _ in lookups[:2] for r in rows) == list(range(BLOCKS))
    # Second epoch: the values the loss got are the cached ones, equal to a fresh top-K of the target.
    for rows, inputs, (values, ids) in lookups[2:]:
        with torch.inference_mode():
            fresh_values, fresh_ids = top_k_logits(target.inner(inputs), K)
        assert torch.equal(ids, fresh_ids.long())
        assert_close(values.float(), fresh_values.float(), atol=2e-3, rtol=0, name="values")
    end = _events(cfg, "end")[0]["target_cache"]
    assert end["blocks_read"] == BLOCKS and end["blocks_computed"] == BLOCKS
    assert end["target_calls"] == 2 and end["target_calls_saved"] == 2
    run = json.load(open(os.path.join(cfg.out, "run.json")))["run"]["target_cache"]
    assert run["k"] == K and run["filled_at_start"] == 0 and run["blocks"] == BLOCKS
    assert any("top-5 cache" in m for m in cb.messages) and any("read from the top-5 cache" in m for m in cb.messages)
    assert os.path.getsize(os.path.join(cfg.out, DATA_FILE)) == TargetLogitCache.file_size(BLOCKS, SEQ_LEN, K)
    assert len(result.history) == 4


@pytest.mark.usefixtures("one_thread")
def test_interrupted_run_resumes_filling_only_the_missing_blocks(tmp_path, exact_data):
    full = train(_config(tmp_path / "a", exact_data), target=CountingTarget(bigram_target()),
                 student=tiny_model(seed=2, std=0.02))
    cfg = _config(tmp_path / "b", exact_data)
    first = CountingTarget(bigram_target())
    with pytest.raises(KeyboardInterrupt):
        train(cfg, _Calls(first, stop=1), target=first, student=tiny_model(seed=2, std=0.02))
    assert first.rows == BATCH
    filled = TargetLogitCache(cfg.out, json.load(open(os.path.join(cfg.out, HEADER_FILE))))
    assert filled.filled_blocks == BATCH
    assert _events(cfg, "interrupted")[0]["target_cache"]["blocks_computed"] == BATCH

    cfg.resume = True
    second = CountingTarget(bigram_target())
    resumed = train(cfg, target=second, student=tiny_model(seed=9, std=0.02))
    assert second.rows == BLOCKS - BATCH and second.calls == 1  # only the other half of the first epoch
    assert _events(cfg, "resume")[0]["target_cache"]["filled_at_start"] == BATCH
    want = {m["step"]: m["loss"] for m in full.history}
    for m in resumed.history:
        assert m["loss"] == pytest.approx(want[m["step"]], rel=1e-5, abs=1e-6), m["step"]


@pytest.mark.usefixtures("one_thread")
def test_a_cache_written_for_another_target_is_refused(tmp_path, exact_data):
    cfg = _config(tmp_path / "out", exact_data, steps=1)
    train(cfg, target=bigram_target(seed=1), student=tiny_model(seed=2, std=0.02))
    cfg.resume, cfg.optim.steps = True, 2
    with pytest.raises(InputError) as e:
        train(cfg, target=bigram_target(seed=5), student=tiny_model(seed=2, std=0.02))
    message = str(e.value)
    assert "\n" not in message and "another target" in message and "--overwrite" in message
    # --overwrite starts over, with a new cache for the new target
    cfg.resume, cfg.overwrite = False, True
    train(cfg, target=bigram_target(seed=5), student=tiny_model(seed=2, std=0.02))


def test_header_checks_k_and_data_layout(tmp_path):
    target = bigram_target()
    blocks = torch.randint(0, 64, (4, SEQ_LEN + 1))
    header = logit_cache.expected_header(3, target, blocks, SEQ_LEN)
    assert logit_cache.prepare_cache(tmp_path, header, create=True) is False
    assert logit_cache.prepare_cache(tmp_path, header, create=True) is True
    for other, what in ((logit_cache.expected_header(4, target, blocks, SEQ_LEN), "another K"),
                        (logit_cache.expected_header(3, target, blocks.flip(0), SEQ_LEN), "other training data")):
        with pytest.raises(InputError, match=what):
            logit_cache.prepare_cache(tmp_path, other, create=True)
    with pytest.raises(InputError, match="more than the target's vocabulary"):
        logit_cache.expected_header(65, target, blocks, SEQ_LEN)


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c, "mode", "sft"), "is for distill"),
    (lambda c: setattr(c.data, "streaming", True), "--streaming"),
    (lambda c: setattr(c.loss, "cache_target_logits", -1), "or a positive K, got -1"),
])
def test_config_refusals(tmp_path, change, message):
    cfg = _config(tmp_path, "data.jsonl")
    change(cfg)
    with pytest.raises(InputError, match=message):
        cfg.validate()
