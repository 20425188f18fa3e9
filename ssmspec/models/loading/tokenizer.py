"""The tokenizer files a model directory may hold, and reading them with transformers."""
from __future__ import annotations

from pathlib import Path

from ...errors import ModelLoadError
from .common import check_not_dangling


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(path: Path):
    """The directory's tokenizer (transformers AutoTokenizer), or None when it holds no tokenizer files."""
    for f in TOKENIZER_FILES:
        check_not_dangling(path / f)  # else the model would run on bytes without a word
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        # AutoTokenizer reads config.json too and warns about model types it does not know
        # (ssmspec's own format): noise for the user, so keep transformers quiet here.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            return AutoTokenizer.from_pretrained(str(path))
        finally:
            hf_logging.set_verbosity(verbosity)
    except Exception as e:
        raise ModelLoadError(f"{path} has tokenizer files but they do not load ({e}); remove or fix them") from e


def check_tokenizer_fits(tokenizer, vocab_size: int, path: Path) -> None:
    """Refuse a tokenizer whose ordinary tokens have ids past the model's embedding table.

    Such a tokenizer belongs to another model: its prompts failed at the first forward with
    torch's "index out of range in self". Only the base vocabulary counts (`vocab_size`, without
    added tokens): some checkpoints add special tokens past the embedding that text never produces.
    """
    base = getattr(tokenizer, "vocab_size", None)  # None without a tokenizer
    if isinstance(base, int) and base > vocab_size:
        raise ModelLoadError(
            f"the tokenizer in {path} has {base} tokens but the model's vocabulary (vocab_size in config.json) "
            f"has {vocab_size}; the tokenizer files belong to another model: put this model's tokenizer there"
        )
