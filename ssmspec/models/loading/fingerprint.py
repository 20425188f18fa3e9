"""Vocabulary checks between two models and short fingerprints of tokenizers and architectures."""
from __future__ import annotations

import hashlib
import json

from ...errors import TokenizerMismatchError
from ..config import ModelConfig
from .common import LoadedModel


def _unpack(x):
    """(model, tokenizer or None) from a LoadedModel or a bare model."""
    if isinstance(x, LoadedModel):
        return x.model, x.tokenizer
    return x, getattr(x, "tokenizer", None)


def vocab_fingerprint(tokenizer) -> str:
    """Short sha256 of a tokenizer's (token, id) pairs."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def check_same_vocab(a, b, what_a: str = "target", what_b: str = "drafter") -> None:
    """Raise TokenizerMismatchError unless a and b (LoadedModel or LanguageModel) share a vocabulary."""
    model_a, tok_a = _unpack(a)
    model_b, tok_b = _unpack(b)
    va, vb = model_a.config.vocab_size, model_b.config.vocab_size
    if va != vb:
        raise TokenizerMismatchError(
            f"the {what_a} has vocab_size {va} but the {what_b} has {vb}; both must use the same tokenizer "
            f"(build the {what_b} with --vocab-from the {what_a}'s directory)"
        )
    if tok_a is not None and tok_b is not None:
        la, lb = len(tok_a), len(tok_b)
        if la != lb:
            raise TokenizerMismatchError(
                f"the {what_a}'s tokenizer has {la} tokens but the {what_b}'s has {lb} (model vocab_size {va}); "
                "both must use the same tokenizer"
            )
        fa, fb = vocab_fingerprint(tok_a), vocab_fingerprint(tok_b)
        if fa != fb:
            raise TokenizerMismatchError(
                f"the {what_a} and {what_b} tokenizers both have {la} tokens but different vocabularies "
                f"(fingerprints {fa} vs {fb}); both must use the same tokenizer"
            )


def effective_config_dict(cfg: ModelConfig) -> dict:
    """cfg.to_dict() without the sub-configs of layer kinds the model does not use."""
    d = cfg.to_dict()
    for kind in ("mamba", "attention", "mlp", "moe"):
        if kind not in cfg.layers:
            d.pop(kind)
    # Fields added with later families, left out at their defaults so that earlier models keep
    # their fingerprints.
    if d["embedding_multiplier"] == 1.0:
        d.pop("embedding_multiplier")
    if not d["parallel_layers"]:
        d.pop("parallel_layers")
    if d["shared_blocks"] is None:
        d.pop("shared_blocks")
    if "mamba" in d and d["mamba"]["gate_norm"]:
        d["mamba"].pop("gate_norm")
    if "attention" in d and d["attention"]["scale"] is None:
        d["attention"].pop("scale")
    return d


def model_fingerprint(model) -> str:
    """Short sha256 of the config and every parameter's name, shape and dtype (not the values)."""
    model, _ = _unpack(model)
    h = hashlib.sha256(json.dumps(effective_config_dict(model.config), sort_keys=True).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
    return h.hexdigest()[:16]
