"""Run each method over a prompt set: warm-up, a timed pass, the losslessness check, the time split."""
from __future__ import annotations

import datetime
import importlib.metadata
import platform
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..decoding.engine import Engine
from ..decoding.generate import GenerationConfig, GenerationResult
from ..errors import InputError
from ..limits import context_limit, declared_context
from .config import BenchConfig, MethodSpec, resolve_methods
from .lossless import Verdict, check_lossless
from .prompts import Prompt, encode_fitting, load_prompts

ProgressFn = Callable[[int, int, str], None]
"""on_progress(done, total, label): prompts finished across all methods' timed passes."""

@dataclass
class BenchResult:
    config: BenchConfig
    dataset: str
    methods: list[MethodSpec]
    records: list[dict] = field(default_factory=list)
    """One per (method, prompt) timed: the generation's stats, its ids and its losslessness verdict."""
    method_info: dict = field(default_factory=dict)
    """label -> peak_memory_bytes and time_split (sums over the prompts), where measured."""
    skipped: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    environment: dict = field(default_factory=dict)
    interrupted: bool = False

    @property
    def lossless_applicable(self) -> bool:
        return self.config.temperature == 0

    @property
    def failures(self) -> int:
        return sum(1 for r in self.records if r["lossless"]["status"] == "failure")


def generate_once(engine: Engine, prompt_ids: list[int], config: GenerationConfig) -> GenerationResult:
    """One generation; the benchmark's single call into the decode loop (tests replace it)."""
    return engine.generate(prompt_ids, config)


def run_bench(config: BenchConfig, on_progress: ProgressFn | None = None) -> BenchResult:
    """Load the models, then for each method: warm up, time every prompt, check it against `ar`.

    Bad input (unknown method or dataset, no usable prompt) raises InputError before any model
    is loaded. Ctrl-C ends the run early: the result holds what finished, `interrupted` set.
    """
    from ..api import load_drafter, load_target, stop_token_ids
    from ..ops import dispatch
    from ..tokenization import tokenizer_for

    specs, note = resolve_methods(config)
    unusable: list[dict] = []
    dataset, prompts = load_prompts(config.dataset, unusable)
    dispatch.set_backend(config.backend)
    target = load_target(config.target, dtype=config.dtype, device=config.device)
    drafter = load_drafter(config.drafter, target) if config.drafter is not None else None
    tokenizer = tokenizer_for(target)
    result = BenchResult(config, dataset, specs, environment=environment(target.model))
    result.skipped.extend(unusable)  # the prompts file's records without a prompt, each said
    if note:
        result.notes.append(note)
    if not result.lossless_applicable:
        result.notes.append("losslessness check not applicable at temperature > 0 (outputs are samples)")
    eos = stop_token_ids(target, tokenizer)
    encoded = _encode_all(prompts, tokenizer, config, _context_limit(target, config), result)
    if not encoded:
        raise InputError(f"no prompt of {dataset} fits: {result.skipped[0]['reason'] if result.skipped else 'none given'}")

    model = target.model
    # One for the run. Methods run one after another: switching between ar and a speculative method
    # rebuilds the fast path (Engine), which the warm-up pays (with --warmup 0, the first timed prompt).
    engine = Engine(model, drafter)
    reference: dict[int, list[int]] = {}  # prompt index -> ar's ids (prompt ids need not be unique)
    total, done = len(specs) * len(encoded), 0
    if on_progress:
        on_progress(0, total, specs[0].label)
    try:
        for spec in specs:
            def gen_cfg(**extra) -> GenerationConfig:
                return GenerationConfig(method=spec.method, tree=spec.tree, max_new_tokens=config.max_new_tokens,
                                        temperature=config.temperature, seed=config.seed, eos_token_id=eos, **extra)

            if on_progress and config.warmup:
                on_progress(done, total, f"{spec.label} (warm-up)")
            if config.warmup:  # every prefill chain size and every tree's graphs, then the first prompts
                engine.warm_up(gen_cfg(), token=encoded[0][1][0])
            for _, ids in encoded[:config.warmup]:
                generate_once(engine, ids, gen_cfg())
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
                torch.cuda.reset_peak_memory_stats(model.device)
            info = result.method_info.setdefault(spec.label, {})
            for index, (pid, ids) in enumerate(encoded):
                out = generate_once(engine, ids, gen_cfg())
                result.records.append(_record(result, spec, index, pid, ids, out, model, reference))
                done += 1
                if on_progress:
                    on_progress(done, total, spec.label)
            if model.device.type == "cuda":
                info["peak_memory_bytes"] = torch.cuda.max_memory_allocated(model.device)
            if config.time_split:
                info["time_split"] = _time_split(engine, encoded, gen_cfg)
    except KeyboardInterrupt:
        result.interrupted = True
    return result


def _record(result: BenchResult, spec: MethodSpec, index: int, pid: str, prompt_ids: list[int],
            out: GenerationResult, model, reference: dict) -> dict:
    """The record of one timed generation, with its verdict against ar's ids for the same prompt."""
    if not result.lossless_applicable:
        verdict = Verdict("n/a")
    elif spec.method == "ar":
        reference[index] = out.token_ids
        verdict = Verdict("reference")
    else:
        verdict = check_lossless(model, prompt_ids, reference[index], out.token_ids, result.config.tie_tolerance)
    keep = ("new_tokens", "target_calls", "mean_accepted", "tokens_per_s", "decode_tokens_per_s", "elapsed_s",
            "prefill_s", "finish_reason", "drafter_steps")
    return {"dataset": result.dataset, "method": spec.label, "prompt_id": pid, "prompt_tokens": len(prompt_ids),
            **{k: out.stats[k] for k in keep if k in out.stats}, "lossless": verdict.to_dict(), "token_ids": out.token_ids}


def _time_split(engine: Engine, encoded, gen_cfg) -> dict:
    """Sums of stats["time_split"] over an untimed pass with timing on."""
    sums: dict[str, float] = {}
    for _, ids in encoded:
        split = generate_once(engine, ids, gen_cfg(timing=True)).stats.get("time_split") or {}
        for key, value in split.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return sums


def _context_limit(target, config: BenchConfig) -> int | None:
    if config.max_context is not None:
        return config.max_context
    # Pure Mamba models have no position limit; attention models may carry one, declared in
    # their config.json (the ModelConfig holds none): the limit `generate` refuses beyond.
    return context_limit(target.model.config, declared_context(target.path))[0]


def _encode_all(prompts: list[Prompt], tokenizer, config: BenchConfig, context: int | None,
                result: BenchResult) -> list[tuple[str, list[int]]]:
    """(id, token ids) of the first `limit` prompts that fit; the others are noted in `result.skipped`."""
    encoded, skipped = encode_fitting(prompts, tokenizer, config.max_new_tokens, context, config.limit)
    result.skipped.extend(skipped)
    return encoded


def environment(model) -> dict:
    """Device, versions and date for the report."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    device = model.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return {
        "device": f"{device} ({name})", "dtype": str(model.dtype).removeprefix("torch."),
        "torch": torch.__version__, "triton": version("triton"), "cuda": torch.version.cuda if device.type == "cuda" else None,
        "ssmspec": version("ssmspec"), "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
