"""Tokenizer helpers: a byte-level fallback for tokenizer-less models, and prompt encoding."""
from __future__ import annotations

from .errors import InputError


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: lets `new-model` tiny models (vocab >= 256) take text."""

    eos_token_id = None
    chat_template = None

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text)}

    def save_pretrained(self, path) -> None:
        """Nothing to write: a model saved without tokenizer files falls back to bytes again."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def tokenizer_for(loaded) -> object:
    """The model's own tokenizer, or the byte fallback when it has none and the vocabulary allows."""
    if loaded.tokenizer is not None:
        return loaded.tokenizer
    if loaded.model.config.vocab_size >= 256:
        return ByteTokenizer()
    raise InputError(
        f"{loaded.path} has no tokenizer and its vocabulary ({loaded.model.config.vocab_size}) is too small for "
        "bytes; create the model with --vocab-from a directory holding a tokenizer"
    )


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    if not prompt or not prompt.strip():
        raise InputError("the prompt is empty; pass --prompt TEXT (or --prompt - to read it from stdin)")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("--chat needs a tokenizer with a chat template, and this model's tokenizer has none")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(prompt))
