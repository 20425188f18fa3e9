"""load_model: read a model directory of any format and load it strictly into a LanguageModel."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from ...errors import ModelLoadError
from ..lm import LanguageModel
from .allocate import check_fits, empty_model
from .common import LoadedModel, Renamer, check_not_dangling, few_names, resolve_dtype
from .formats import parse_config
from .hf_causal_lm import is_transformers_causal_lm, load_transformers_target
from .tokenizer import check_tokenizer_fits, load_tokenizer

# Weight files in the order we look for them (transformers' own preference: safetensors first).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def load_model(path, *, dtype=None, device="cpu") -> LoadedModel:
    """Load a model directory of any supported format into a LanguageModel.

    Args:
        path: directory with config.json and weights (safetensors, sharded safetensors, or .bin).
        dtype: parameter dtype ("fp32", "bf16", a torch dtype); None keeps the checkpoint's.
        device: where the parameters go.
    Returns:
        LoadedModel(model in eval mode, tokenizer or None, source_format, path).
    Raises:
        ModelLoadError with a sentence saying what to fix.
    """
    path = Path(path)
    raw = _read_config(path)
    if is_transformers_causal_lm(raw):  # Llama, Qwen2, ...: run by transformers (models/hf_causal.py)
        return load_transformers_target(path, dtype=dtype, device=device)
    cfg, fmt, rename = parse_config(raw)
    source, _ = _read_weights(path)
    state = _map_state(source, rename)
    if cfg.tie_embeddings and _stores_another_head(state):
        # transformers keeps both tensors of such a checkpoint (and warns); tying them here loaded
        # the head over the embeddings, so the model ran on neither of the stored tensors.
        warnings.warn(f"{path}: config.json ties the embeddings but the weights hold an lm_head that differs "
                      "from them; both are kept, as transformers does", stacklevel=2)
        cfg.tie_embeddings = False
    dtype = resolve_dtype(dtype)
    if dtype is None:
        floats = [t.dtype for t in state.values() if t.is_floating_point()]
        dtype = floats[0] if floats else torch.float32
    check_fits(cfg, device, dtype)
    model = empty_model(cfg, device=device, dtype=dtype)
    state = _check_and_fill(state, model, path)
    model.load_state_dict(state, strict=True)
    model.eval()
    tokenizer = load_tokenizer(path)
    check_tokenizer_fits(tokenizer, cfg.vocab_size, path)
    return LoadedModel(model=model, tokenizer=tokenizer, source_format=fmt, path=path)


def _read_config(path: Path) -> dict:
    """The parsed config.json of a model directory, with a clear error for each way it can be missing or broken."""
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist; pass a directory holding config.json and weights")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory; pass the directory that holds config.json")
    cfg_file = path / "config.json"
    check_not_dangling(cfg_file)
    if not cfg_file.exists():
        raise ModelLoadError(
            f"{path} has no config.json; a model directory needs config.json and weights "
            "(create one with `ssmspec new-model` or `save_pretrained`)"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON ({e}); fix or regenerate the file") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file} must hold a JSON object, not {type(cfg).__name__}")
    return cfg


def _read_weights(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of the first weight file found (all shards of an index), on the CPU, and its name."""
    for name in WEIGHT_FILES:
        file = path / name
        check_not_dangling(file)
        if not file.exists():
            continue
        if name.endswith(".index.json"):
            try:
                index = json.loads(file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{file} is not a valid shard index (needs a weight_map): {e}") from e
            if not isinstance(index, dict) or not all(isinstance(v, str) for v in index.values()):
                raise ModelLoadError(f"{file} is not a valid shard index: its weight_map must map tensor names "
                                     "to shard file names")
            state = {}
            for shard in sorted(set(index.values())):
                check_not_dangling(path / shard)
                if not (path / shard).exists():
                    raise ModelLoadError(f"{file} lists shard {shard}, which is missing from {path}")
                state.update(_load_tensor_file(path / shard))
            return state, name
        return _load_tensor_file(file), name
    raise ModelLoadError(
        f"{path} has config.json but no weights; expected one of {', '.join(WEIGHT_FILES)}"
    )


def _load_tensor_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file), device="cpu")
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which one
        raise ModelLoadError(f"cannot read weights file {file}: {e}") from e
    # A .bin may pickle anything: a training checkpoint ({"model": state_dict, ...}), a list.
    if not isinstance(state, dict):
        raise ModelLoadError(f"weights file {file} holds a {type(state).__name__}, not a state dict of tensors; "
                             "save the model's state_dict() alone")
    bad = next((k for k, v in state.items() if not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise ModelLoadError(f"weights file {file} is not a state dict of tensors (its entry {bad!r} is a "
                             f"{type(state[bad]).__name__}); save the model's state_dict() alone")
    return state


def _stores_another_head(state: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint stores an lm_head that is not a copy of its embeddings."""
    head, embeddings = state.get("lm_head.weight"), state.get("embeddings.weight")
    if head is None or embeddings is None or head is embeddings:
        return False
    return head.shape != embeddings.shape or not torch.equal(head, embeddings.to(head.dtype))


def _map_state(source: dict[str, torch.Tensor], rename: Renamer) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names; two landing on one name is an error."""
    out = {}
    for name, tensor in source.items():
        for new, t in rename(name, tensor):
            if new in out:
                raise ModelLoadError(f"two checkpoint tensors map onto {new}; the checkpoint is not a valid model")
            out[new] = t
    return out


def _check_and_fill(state: dict[str, torch.Tensor], model: LanguageModel, where: Path) -> dict[str, torch.Tensor]:
    """state completed with a tied head, after checking it has exactly the model's tensors and shapes."""
    expected = model.state_dict()
    if model.config.tie_embeddings:
        # Tied checkpoints may or may not store the head; when stored it must be the embedding.
        if "lm_head.weight" not in state and "embeddings.weight" in state:
            state["lm_head.weight"] = state["embeddings.weight"]
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {few_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {few_names(unexpected)}")
        raise ModelLoadError(
            f"weights in {where} do not match config.json: {'; '.join(parts)}. "
            "The config and weights must come from the same model"
        )
    for k, t in state.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise ModelLoadError(
                f"weights in {where}: tensor {k} has shape {tuple(t.shape)} but config.json implies "
                f"{tuple(expected[k].shape)}; the config and weights must come from the same model"
            )
    return state
