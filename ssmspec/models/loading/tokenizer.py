"""The tokenizer files a model directory may hold, and reading them with transformers."""
from __future__ import annotations

from pathlib import Path

from ...errors import ModelLoadError


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(path: Path):
    """The directory's tokenizer (transformers AutoTokenizer), or None when it holds no tokenizer files."""
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
