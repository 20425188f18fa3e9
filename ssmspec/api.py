"""The small Python API the CLI wraps: load a target and a drafter, generate text.

    from ssmspec.api import load_target, load_drafter, generate_text
    from ssmspec.decoding import Engine, GenerationConfig
    from ssmspec.trees import Tree

    target = load_target("runs/target")
    drafter = load_drafter("runs/drafter", target)          # or "ngram"
    engine = Engine(target.model, drafter)                  # once: prepares the models, keeps the graphs
    result = generate_text(target, "def fib(n):", engine=engine,
                           config=GenerationConfig(method="stree", tree=Tree.from_config((3, 2, 1))))
    print(result.text, result.stats["mean_accepted"])
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from .decoding import Engine, GenerationConfig, GenerationResult, ModelDrafter, NgramDrafter
from .errors import InputError
from .limits import check_context, declared_context
from .models.loading import LoadedModel, check_same_vocab, declared_eos_ids, load_model
from .ops import paths, triton_warmup
from .runtime import configure_threads
from .tokenization import encode_prompt, tokenizer_for


def resolve_device(device: str | None) -> torch.device:
    """`auto` (or None) picks CUDA when available."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda asked for, but no CUDA GPU is available; use --device cpu")
    return torch.device(device)


def load_target(path: str | Path, *, dtype=None, device: str | None = None) -> LoadedModel:
    resolved = resolve_device(device)
    paths.check_device(resolved)  # a backend that cannot run there fails now, not at the first kernel
    if resolved.type == "cuda":
        triton_warmup.start()  # Triton's once-per-process key, hashed while the weights load
    return load_model(path, dtype=dtype, device=resolved)


def load_drafter(spec: str, target: LoadedModel, *, dtype=None):
    """`ngram` for prompt lookup, else a model directory that shares the target's vocabulary."""
    if spec == "ngram":
        return NgramDrafter()
    drafter = load_model(spec, dtype=dtype or target.model.dtype, device=target.model.device)
    check_same_vocab(target, drafter, "target", "drafter")
    return ModelDrafter(drafter.model)


def stop_token_ids(target: LoadedModel, tokenizer) -> list[int] | None:
    """The ids that end a generation unless a config names its own: the tokenizer's EOS (else the
    model config's), and every id the checkpoint's generation_config.json lists."""
    eos = getattr(tokenizer, "eos_token_id", None)  # 0 is a valid id: test for None, not falsiness
    if eos is None:
        eos = target.model.config.eos_token_id
    ids = ([eos] if eos is not None else []) + [i for i in declared_eos_ids(target.path) if i != eos]
    return ids or None


def generate_text(
    target: LoadedModel,
    prompt: str,
    *,
    drafter=None,
    config: GenerationConfig | None = None,
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    engine: Engine | None = None,
) -> GenerationResult:
    """Tokenize, generate, detokenize. `on_text` receives text as it is accepted (streaming).

    Decodes with `engine`, an Engine made once from target.model and the drafter (which then
    comes from it: leave `drafter` out or give the engine's), to keep its graphs and buffers
    across calls; without one, an Engine made for this call from `drafter`, which prepares
    target.model for the kernels in place as an Engine does (decoding/engine.py).
    On the CPU it first sets torch's thread count for decoding (ssmspec.runtime.configure_threads)
    and reports it as stats["cpu_threads"]."""
    if engine is not None:
        if engine.target is not target.model:
            raise InputError("the engine was made for another model than this target; make it with Engine(target.model, drafter)")
        if drafter is not None and drafter is not engine.drafter:
            raise InputError("give the drafter to the Engine (Engine(target.model, drafter)), not to generate_text as well")
        drafter = engine.drafter
    config = config or GenerationConfig(method="stree" if drafter is not None else "ar")
    tokenizer = tokenizer_for(target)
    ids = encode_prompt(tokenizer, prompt, chat)
    if config.eos_token_id is None:
        # On a copy: set on the caller's config, this target's EOS stayed for later calls with another target.
        config = dataclasses.replace(config, eos_token_id=stop_token_ids(target, tokenizer))
    # The context a checkpoint declares lives in its config.json; `generate` checks the rest.
    check_context(target.model.config, len(ids), config.max_new_tokens,
                  config.tree.num_nodes if config.method != "ar" and config.tree is not None else 0,
                  declared_context(target.path))
    threads = configure_threads(target.model)
    if engine is None:
        engine = Engine(target.model, drafter)
    produced: list[int] = []
    shown = ""

    def stream(new: list[int]) -> None:
        nonlocal shown
        produced.extend(new)
        text = tokenizer.decode(produced, skip_special_tokens=True)
        # Hold back a trailing replacement char: the next token may complete the character.
        if on_text and not text.endswith("\ufffd") and text.startswith(shown):
            on_text(text[len(shown):])
            shown = text

    decode = lambda toks: tokenizer.decode(toks, skip_special_tokens=True)  # noqa: E731
    result = engine.generate(ids, config, decode=decode, on_tokens=stream)
    result.text = decode(result.token_ids)
    if target.model.device.type == "cpu":
        result.stats["cpu_threads"] = threads
    if on_text and result.text.startswith(shown) and len(result.text) > len(shown):
        on_text(result.text[len(shown):])
    return result
