"""Real tokenizers end to end: --vocab-from, --chat templates, and vocabulary mismatches."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_tokenizer(out_dir, words, chat=True):
    """A word-level tokenizer built in code (no downloads), saved in transformers' format."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<|end|>", "<|user|>", "<|assistant|>"]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|end|>")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def ssmspec(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "ssmspec", *args], capture_output=True, text=True, input=stdin)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    words = [f"w{i}" for i in range(60)]
    make_tokenizer(root / "tok", words)
    make_tokenizer(root / "tok-other", list(reversed(words)))  # same size, different ids
    for name, preset, vocab in [("target", "tiny-hybrid", "tok"), ("drafter", "tiny", "tok"), ("alien", "tiny", "tok-other")]:
        proc = ssmspec("new-model", "--preset", preset, "--out", str(root / name), "--vocab-from", str(root / vocab))
        assert proc.returncode == 0, proc.stderr
    return root


def test_chat_prompt_uses_the_template_and_stays_lossless(pair):
    base = ["generate", "--target", str(pair / "target"), "--prompt", "w1 w2 w3", "--chat", "--max-new-tokens", "10", "--json"]
    ar = ssmspec(*base, "--method", "ar")
    spec = ssmspec(*base, "--drafter", str(pair / "drafter"), "--tree", "2,2")
    assert ar.returncode == 0 and spec.returncode == 0, ar.stderr + spec.stderr
    assert json.loads(ar.stdout)["token_ids"] == json.loads(spec.stdout)["token_ids"]
    plain = ssmspec("generate", "--target", str(pair / "target"), "--prompt", "w1 w2 w3", "--max-new-tokens", "10", "--json")
    # The template adds role tokens, so the chat prompt conditions the model differently.
    assert json.loads(plain.stdout)["token_ids"] != json.loads(ar.stdout)["token_ids"]


def test_drafter_with_another_vocabulary_is_refused(pair):
    proc = ssmspec("generate", "--target", str(pair / "target"), "--prompt", "w1", "--drafter", str(pair / "alien"))
    assert proc.returncode != 0
    assert proc.stderr.startswith("error:") and "vocabular" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_without_template_is_a_clear_error(tmp_path):
    make_tokenizer(tmp_path / "tok", ["a", "b"], chat=False)
    assert ssmspec("new-model", "--preset", "tiny", "--out", str(tmp_path / "m"), "--vocab-from", str(tmp_path / "tok")).returncode == 0
    proc = ssmspec("generate", "--target", str(tmp_path / "m"), "--prompt", "a b", "--chat")
    assert proc.returncode != 0 and "chat template" in proc.stderr
