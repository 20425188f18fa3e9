"""Training helpers shared by the test_training_* files, plus tests of the losses, schedule and config defaults."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close, tiny_model

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,!?'\n:-")
SPECIALS = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def char_tokenizer(with_template: bool = True):
    """A character-level transformers tokenizer (51 tokens) built in code, with a ChatML-like template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>", additional_special_tokens=SPECIALS[2:])
    if with_template:
        tok.chat_template = (
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
        )
    return tok


def bigram_target(seed: int = 1, scale: float = 0.5, vocab_size: int = 64):
    """A tiny target whose next token depends mostly on the current one (large embeddings and head, small mixers).

    A random target of this size is a hard function of its context for a student to learn in
    a few dozen CPU steps; this one is learnable, so tests of distillation see a clear signal.
    """
    model = tiny_model(seed=seed, std=0.1, vocab_size=vocab_size)
    with torch.no_grad():
        model.embeddings.weight.mul_(scale / 0.1)
        model.lm_head.weight.mul_(scale / 0.1)
    return model


@torch.no_grad()
def sample_token_data(model, path, rows: int = 40, length: int = 100, seed: int = 0):
    """Write a .jsonl of {"input_ids": [...]} sequences sampled from the model at temperature 1 (all rows at once)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (rows, 1), generator=gen, device=model.device)
    cache = model.new_cache(rows, length + 1)
    logits = model(ids, cache)[:, -1]
    out = [ids]
    for _ in range(length - 1):
        nxt = torch.multinomial(torch.softmax(logits.float().cpu(), -1), 1, generator=gen).to(model.device)
        out.append(nxt)
        logits = model.step(nxt, cache)[:, -1]
    seqs = torch.cat(out, dim=1).tolist()
    path.write_text("\n".join(json.dumps({"input_ids": s}) for s in seqs) + "\n")
    return path


@pytest.fixture
def one_thread():
    """Tiny models run far faster on one thread, especially on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- losses ----------------------------------------------------------------------------------------
def test_forward_kl_matches_definition_and_temperature_scaling():
    from ssmspec.training.losses import forward_kl

    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11) * 3
    mask = torch.ones(2, 5, dtype=torch.bool)
    for temp in (1.0, 2.0):
        ref = F.kl_div(F.log_softmax(s / temp, -1), F.log_softmax(t / temp, -1), log_target=True, reduction="none").sum(-1).mean()
        assert_close(forward_kl(s, t, mask, temp), ref * temp**2, name=f"kl T={temp}")
    assert float(forward_kl(t, t, mask)) == pytest.approx(0.0, abs=1e-6)


def test_losses_respect_the_mask():
    from ssmspec.training.losses import cross_entropy, forward_kl, total_variation

    s, t = torch.randn(1, 4, 7), torch.randn(1, 4, 7)
    ids = torch.randint(0, 7, (1, 4))
    mask = torch.tensor([[True, False, True, False]])
    for fn in (lambda a, b, m: forward_kl(a, b, m), lambda a, b, m: total_variation(a, b, m)):
        full = fn(s, t, mask)
        s2 = s.clone()
        s2[:, 1] += 100 * torch.randn(7)  # a masked position must not change the loss
        assert_close(fn(s2, t, mask), full, name="masked position leaks")
    ce = cross_entropy(s, ids, mask)
    ref = F.cross_entropy(s[0, [0, 2]], ids[0, [0, 2]])
    assert_close(ce, ref, name="ce")


def test_tvd_is_one_minus_overlap_and_bounded():
    from ssmspec.training.losses import total_variation

    s, t = torch.randn(3, 6, 9), torch.randn(3, 6, 9)
    mask = torch.ones(3, 6, dtype=torch.bool)
    tvd = total_variation(s, t, mask)
    overlap = torch.minimum(s.softmax(-1), t.softmax(-1)).sum(-1).mean()
    assert_close(tvd, 1 - overlap, name="tvd")
    assert 0 <= float(tvd) <= 1


def test_kl_plus_ce_adds_weighted_ce():
    from ssmspec.training.losses import cross_entropy, distill_loss, forward_kl

    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    ids = torch.randint(0, 5, (2, 3))
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, parts = distill_loss("kl+ce", s, t, ids, mask, temperature=1.5, ce_weight=0.25)
    assert_close(loss, forward_kl(s, t, mask, 1.5) + 0.25 * cross_entropy(s, ids, mask), name="kl+ce")
    assert set(parts) == {"kl", "ce"}


# -- schedule and config -----------------------------------------------------------------------------
def test_lr_schedule_warmup_then_cosine_to_floor():
    from ssmspec.training.config import OptimConfig
    from ssmspec.training.loop import lr_lambda

    f = lr_lambda(OptimConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine"))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1)
    lin = lr_lambda(OptimConfig(steps=100, warmup_steps=0, min_lr_ratio=0.0, schedule="linear"))
    assert lin(50) == pytest.approx(0.5)


def test_cli_defaults_equal_the_dataclass_defaults():
    """Every default has one home: a run built from the CLI with only required flags is RunConfig()'s defaults."""
    import inspect

    from ssmspec.cli import train as cli
    from ssmspec.training.config import RunConfig

    for mode, fn in (("distill", cli.distill_command), ("sft", cli.sft_command)):
        kw = {}
        for name, p in inspect.signature(fn).parameters.items():
            default = p.default.default if hasattr(p.default, "default") else p.default
            kw[name] = default
        kw.update(data="x.jsonl", out="o")
        if mode == "distill":
            kw.update(target="t", student_preset="p")
        else:
            kw.update(init_preset="p")
            kw["student"], kw["student_preset"], kw["target"] = kw.pop("model"), kw.pop("init_preset"), kw.pop("eval_target")
        got = cli.build_config(mode, **kw).to_dict()
        want = RunConfig(mode=mode, out="o", student_preset="p", target="t" if mode == "distill" else None).to_dict()
        want["data"]["spec"] = "x.jsonl"
        assert got == want, mode


def test_config_validation_names_the_flag():
    from ssmspec.errors import InputError
    from ssmspec.training.config import RunConfig

    cfg = RunConfig(mode="distill", out="o", target="t", student_preset="p")
    cfg.data.spec = "d"
    cfg.loss.loss = "mse"
    with pytest.raises(InputError, match="--loss"):
        cfg.validate()
    cfg.loss.loss = "kl"
    cfg.student = "s"
    with pytest.raises(InputError, match="exactly one"):
        cfg.validate()
