"""transformers attention-only causal LMs (Llama, Qwen2, Mistral, Gemma, ...) loaded as a TransformersTarget.

These are not mapped onto ssmspec's own modules: transformers runs them, and
`models/hf_causal.TransformersTarget` gives them the target paths of the decode loop.
"""
from __future__ import annotations

from pathlib import Path

from ...errors import ModelLoadError
from .common import LoadedModel, few_names, resolve_dtype
from .tokenizer import check_tokenizer_fits, load_tokenizer

# Decoder-only families whose every layer is attention with a plain per-layer KV cache, which is
# what TransformersTarget's cache holds. Hybrids with SSM or linear-attention layers (Jamba,
# Zamba2, FalconH1, GraniteMoeHybrid, ...) need their own states and are not listed.
KV_CACHE_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "starcoder2",
    "olmo", "olmo2", "granite", "smollm3",
})


def is_transformers_causal_lm(cfg: dict) -> bool:
    """Whether a parsed config.json is one of the KV-cache families above."""
    return cfg.get("model_type") in KV_CACHE_MODEL_TYPES


def load_transformers_target(path: Path, *, dtype=None, device="cpu") -> LoadedModel:
    """The directory's transformers causal LM, in eval mode, wrapped as a TransformersTarget."""
    from ..hf_causal import TransformersTarget

    try:
        from transformers import AutoModelForCausalLM

        hf, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype) or "auto",
                                                         output_loading_info=True)
    except Exception as e:  # missing or foreign weights: say which directory
        raise ModelLoadError(f"cannot load {path} as a transformers causal LM: {e}") from e
    # transformers initialises missing weights at random and only warns: refuse, as every other format does.
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelLoadError(
            f"weights in {path} do not match config.json ({hf.config.model_type}): missing tensors "
            f"{few_names(missing)}. The config and weights must come from the same model"
        )
    model = TransformersTarget(hf.to(device).eval())
    tokenizer = load_tokenizer(path)
    check_tokenizer_fits(tokenizer, model.config.vocab_size, path)
    model.tokenizer = tokenizer
    return LoadedModel(model=model, tokenizer=tokenizer, source_format="transformers", path=path)
