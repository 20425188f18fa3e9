"""Read and write model directories: transformers Mamba2 / NemotronH / Bamba, mamba_ssm, and ssmspec's own format.

Every format is mapped onto one `ModelConfig` and onto `LanguageModel.state_dict()` names, then
loaded strictly: a missing or unexpected tensor, or a shape mismatch, is a `ModelLoadError` that
names it, never a silently half-random model.

One module per format (`hf_mamba2`, `hf_hybrid` for NemotronH and Bamba, `mamba_ssm`, `native`),
`formats` picks one from config.json, `load` and `save` read and write a directory, `tokenizer`
and `fingerprint` cover vocabularies and model identity, `allocate` builds the empty model.
"""
from __future__ import annotations

from .allocate import check_fits, empty_model
from .common import LoadedModel, Renamer, declared_eos_ids, resolve_dtype
from .fingerprint import check_same_vocab, effective_config_dict, model_fingerprint, vocab_fingerprint
from .formats import config_from_dict, detect_format
from .hf_mamba2 import mamba2_compatible
from .load import WEIGHT_FILES, load_model
from .native import NATIVE_FORMAT_VERSION, NATIVE_MODEL_TYPE
from .save import save_model
from .tokenizer import TOKENIZER_FILES, load_tokenizer

__all__ = [
    "LoadedModel", "NATIVE_FORMAT_VERSION", "NATIVE_MODEL_TYPE", "Renamer", "TOKENIZER_FILES", "WEIGHT_FILES",
    "check_fits", "check_same_vocab", "config_from_dict", "declared_eos_ids", "detect_format", "effective_config_dict", "empty_model",
    "load_model", "load_tokenizer", "mamba2_compatible", "model_fingerprint", "resolve_dtype", "save_model",
    "vocab_fingerprint",
]
