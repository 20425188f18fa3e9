"""The training loop of `ssmspec distill` and `ssmspec sft`: accelerate, checkpoints, exact resume, evaluation.

`train(cfg)` reads a RunConfig, loads the models and data, and runs optimizer steps:

    for step: for micro-batch in grad_accum: loss(student, [target], batch) -> backward
              clip -> optimizer.step -> scheduler.step -> log / eval / checkpoint

Progress goes to `TrainCallbacks` (the CLI draws a rich progress bar from them) and to
log.jsonl in the output directory. A checkpoint holds the student (transformers format), the
optimizer, scheduler, RNG states and data position, so `--resume` continues the exact loss curve.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from ssmspec.errors import DataError, InputError, ModelLoadError, TokenizerMismatchError

from .config import RunConfig
from .data import BadRecords, Blocks, Tokenize, resolve_files
from .evaluation import evaluate
from .flops import device_peak_flops, steady_throughput, train_flops_per_token
from .logit_cache import DATA_FILE as TOPK_DATA_FILE, HEADER_FILE as TOPK_HEADER_FILE
from .logit_cache import TargetLogitCache, expected_header, prepare_cache
from .losses import distill_loss, sft_loss
from .micro_step import MicroStep, plan_step
from .scan import training_scan

log = logging.getLogger("ssmspec.training")

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest.json"
STATE_FILE = "state.pt"
RUN_FILE = "run.json"
LOG_FILE = "log.jsonl"


# -- callbacks --------------------------------------------------------------------------------------
class TrainCallbacks:
    """Progress hooks; every method is optional. The library never draws anything itself."""

    def on_start(self, info: dict) -> None: ...
    def on_step(self, metrics: dict) -> None: ...
    def on_eval(self, metrics: dict) -> None: ...
    def on_eval_progress(self, done: int, total: int, step: int) -> None:
        """An evaluation at training step `step` has finished `done` of its `total` units (batches, prompts)."""
    def on_message(self, text: str) -> None: ...
    def on_end(self, result: "TrainResult") -> None: ...


@dataclass
class TrainResult:
    out: str
    step: int
    final_loss: float | None
    history: list[dict] = field(default_factory=list)
    """Every logged step's metrics (loss, tokens_per_s, ...)."""
    evals: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    interrupted: bool = False


# -- target adapter ----------------------------------------------------------------------------------
class CausalLMTarget(nn.Module):
    """A transformers causal LM seen as `forward(input_ids (B, T)) -> logits (B, T, V)` (in the model's dtype).

    Used only as a distillation teacher: speculative decoding with such a target is not
    supported yet, so acceptance is not measured for it (top-1 agreement is).
    """

    def __init__(self, hf_model, tokenizer=None):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        self.tokenizer = tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, use_cache=False).logits


def load_any_model(path: str, dtype, device) -> tuple[nn.Module, object, str]:
    """(model, tokenizer, format) for anything ssmspec loads, else a transformers causal LM directory."""
    from ssmspec.models.loading import load_model

    try:
        loaded = load_model(path, dtype=dtype, device=device)
        return loaded.model, loaded.tokenizer, loaded.source_format
    except ModelLoadError as first:
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        except Exception:
            raise first from None
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except Exception:  # a model directory without tokenizer files
            tok = None
        return CausalLMTarget(hf, tok), tok, "transformers"


def load_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise InputError(f"--tokenizer {path}: cannot load a tokenizer from it ({e})") from e


def _vocab_size(model) -> int:
    return int(model.config.vocab_size)


def check_vocab(target, student, target_tok, student_tok, what_target="target", what_student="student") -> None:
    """Refuse a student that cannot draft for the target: vocabulary sizes and tokenizers must match."""
    try:
        from ssmspec.models.loading import check_same_vocab
    except ImportError:  # pragma: no cover - loading ships with the package
        check_same_vocab = None
    vt, vs = _vocab_size(target), _vocab_size(student)
    if vt != vs:
        raise TokenizerMismatchError(
            f"the {what_target} has vocab_size {vt} but the {what_student} has {vs}; the {what_student} must use the "
            f"{what_target}'s tokenizer (start from --student-preset, which takes the {what_target}'s vocabulary)"
        )
    if check_same_vocab is not None:
        a = _WithTok(target, target_tok)
        b = _WithTok(student, student_tok)
        check_same_vocab(a, b, what_target, what_student)


class _WithTok:
    """Duck-types a LoadedModel for check_same_vocab (model.config + tokenizer)."""

    def __init__(self, model, tokenizer):
        self.config = model.config
        self.tokenizer = tokenizer


# -- LoRA ------------------------------------------------------------------------------------------------
def add_lora(model: nn.Module, cfg) -> list[str]:
    """Inject peft LoRA adapters into the listed Linear layers; freeze everything else. Returns the targets used."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise InputError("--lora needs peft (pip install peft)") from e
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    targets = [t for t in cfg.targets if t in present]
    if not targets:
        raise InputError(f"--lora: none of {cfg.targets} are Linear layers of this model (it has {sorted(present)})")
    lcfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, bias="none")
    inject_adapter_in_model(lcfg, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return targets


def merged_copy(model: nn.Module) -> nn.Module:
    """A copy of the model with LoRA adapters merged into plain Linear layers (no-op without LoRA)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return model
    if not any(isinstance(m, LoraLayer) for m in model.modules()):
        return model
    merged = copy.deepcopy(model)
    for name, module in list(merged.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(merged.get_submodule(parent_name) if parent_name else merged, child, module.get_base_layer())
    for p in merged.parameters():
        p.requires_grad_(False)
    return merged


# -- schedule and optimizer -------------------------------------------------------------------------------
def lr_lambda(optim_cfg):
    """Multiplier of the peak LR at a step: linear warm-up, then cosine / linear decay to min_lr_ratio."""
    warm, total, floor = optim_cfg.warmup_steps, optim_cfg.steps, optim_cfg.min_lr_ratio

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if optim_cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if optim_cfg.schedule == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Matrices decay; norms, biases, the conv filter and the SSM's A_log / D / dt_bias do not.
        (decay if p.ndim >= 2 and "conv1d" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2),
                             **adamw_implementation(decay + no_decay))


def adamw_implementation(params: list) -> dict:
    """AdamW's implementation: fused (a few launches for every parameter) when all are floating-point
    CUDA tensors, else torch's default (foreach on CUDA, one parameter at a time on the CPU)."""
    if params and all(p.is_cuda and p.is_floating_point() for p in params):
        return {"fused": True}
    return {}


# -- output directory and checkpoints ----------------------------------------------------------------------
def prepare_out_dir(cfg: RunConfig, clean: bool = True) -> Path | None:
    """Check the output directory; returns the checkpoint to resume from, or None for a fresh run.

    --resume with nothing to resume from (no directory, an empty one, a run without a checkpoint) is refused.

    A directory holding another run (or anything else) is refused unless --resume (same run
    settings) or --overwrite (our files are removed, others left alone; only when `clean`).
    """
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a directory")
    entries = list(out.iterdir()) if out.exists() else []
    run_file = out / RUN_FILE
    holds_run = run_file.exists() or (out / CHECKPOINT_DIR).exists()
    if entries and cfg.overwrite:
        if not clean:
            return None
        for name in (CHECKPOINT_DIR, LOG_FILE, RUN_FILE, TOPK_HEADER_FILE, TOPK_DATA_FILE):
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        return None
    if not entries:
        if cfg.resume:
            raise InputError(f"--resume: {out} holds no training run to resume; leave out --resume to start one there")
        return None
    if not cfg.resume:
        what = "a training run" if holds_run else "other files"
        raise InputError(f"--out {out} already holds {what}; pass --resume to continue it or --overwrite to start over there")
    if not holds_run:
        raise InputError(f"--resume: {out} holds no training run (no {RUN_FILE}); pass --overwrite to start a new run there")
    try:
        previous = RunConfig.from_dict(json.loads(run_file.read_text())["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"--resume: {run_file} is unreadable ({e}); pass --overwrite to start over") from e
    old, new = previous.identity(), cfg.identity()
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:5])
        raise InputError(f"--resume: {out} holds a different run ({detail}); use the same settings, or --overwrite")
    found = latest_checkpoint(out)
    if found is None:
        raise InputError(f"--resume: {out} holds no checkpoint to resume from (the run stopped before its first); "
                         "start over with --overwrite")
    return found


def latest_checkpoint(out: Path) -> Path | None:
    ckdir = out / CHECKPOINT_DIR
    latest = ckdir / LATEST_FILE
    try:
        path = ckdir / json.loads(latest.read_text())["name"]
        if (path / STATE_FILE).exists():
            return path
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing or unreadable (a crash or full disk while writing it): the newest step-* below
    found = sorted(p for p in ckdir.glob("step-*") if (p / STATE_FILE).exists()) if ckdir.exists() else []
    return found[-1] if found else None


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _rng_state() -> dict:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out: Path, step: int, student: nn.Module, optimizer, scheduler, position: int, rng: dict,
                    run_info: dict, tokenizer, keep: int) -> Path:
    """Write checkpoints/step-N atomically (temporary name, then rename) and point latest.json at it."""
    from ssmspec.models.loading import save_model

    ckdir = out / CHECKPOINT_DIR
    ckdir.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    final = ckdir / name
    tmp = ckdir / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(merged_copy(student), tmp / "model", tokenizer=tokenizer)
    torch.save({
        "step": step, "data_position": position, "model": student.state_dict(),
        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng,
    }, tmp / STATE_FILE)
    _write_json_atomic(tmp / RUN_FILE, run_info)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_json_atomic(ckdir / LATEST_FILE, {"name": name, "step": step})
    for old in sorted(p for p in ckdir.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# -- the loop ------------------------------------------------------------------------------------------------
class _StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM sets a flag checked between steps, so the checkpoint written on exit is a clean one.

    SIGTERM is what `kill`, job schedulers and container runtimes send before they kill a process:
    without a handler it ended the run at once, with nothing saved since the last --save-every.
    A second signal interrupts at once.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            def handler(signum, frame):
                if self.requested:
                    raise KeyboardInterrupt
                self.requested = True

            for sig in self.SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, handler)
        return self

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        return False


def _stop_agreed(run: _Run, requested: bool) -> bool:
    """Whether to stop after this step. Alone, as soon as a signal came. Across processes, every
    one must leave after the same step (the checkpoint waits for all of them, and one that left
    alone would keep the others in the next gradient all-reduce): a signal reaches the ranks at
    different moments, so they agree by a sum of their flags, on log steps only, where the loop
    reads the loss back anyway (no extra host sync in between)."""
    if run.accelerator.num_processes == 1:
        return requested
    if run.step % run.cfg.checkpoint.log_every and run.step < run.cfg.optim.steps:
        return False
    flag = torch.tensor([float(requested)], device=run.device)
    return run.accelerator.reduce(flag, reduction="sum").item() > 0


def _resolve_precision(p: str) -> str:
    """--dtype as the run uses it: fp32, bf16 or fp16 (auto: bf16 where the GPU has it)."""
    if p == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if p == "fp16" and not torch.cuda.is_available():
        # accelerate has no fp16 autocast on the CPU: the run trained in fp32 while its log said fp16
        raise InputError("--dtype fp16 needs a CUDA GPU; on the CPU use fp32 or bf16")
    return p


def _build_student(cfg: RunConfig, vocab_size: int | None, device) -> tuple[nn.Module, object]:
    if cfg.student_preset:
        from ssmspec.models.init import init_weights
        from ssmspec.models.lm import LanguageModel
        from ssmspec.models.presets import preset_config

        mcfg = preset_config(cfg.student_preset)
        if vocab_size is not None:
            # Exactly the target's vocabulary, without the preset's padding: the student's logits
            # are compared with the target's position by position, and generate checks the sizes.
            mcfg.vocab_size = int(vocab_size)
        model = init_weights(LanguageModel(mcfg), seed=cfg.optim.seed)
        return model.to(device), None
    model, tok, _ = load_any_model(cfg.student, torch.float32, device)
    if not hasattr(model, "layers"):
        raise InputError(f"{cfg.student}: the student must be a Mamba-2 model ssmspec can load, not a {type(model).__name__}")
    return model, tok


def load_models(cfg: RunConfig, device, precision: str, target=None, student=None, tokenizer=None):
    """(target or None, student in fp32, tokenizer) for the run, given objects or loaded from cfg's paths.

    The target is frozen and in eval mode; under bf16 it is also stored in bf16 (it only runs forward).
    """
    target_tok = None
    if target is None and cfg.target:
        target, target_tok, _ = load_any_model(cfg.target, torch.bfloat16 if precision == "bf16" else torch.float32, device)
    elif target is not None:
        target_tok = getattr(target, "tokenizer", None)
        target = target.to(device)
    student_tok = None
    if student is None:
        vocab = _vocab_size(target) if target is not None else None
        if vocab is None and tokenizer is None and cfg.tokenizer:
            tokenizer = load_tokenizer(cfg.tokenizer)
        if vocab is None and tokenizer is not None:
            vocab = len(tokenizer)
        student, student_tok = _build_student(cfg, vocab, device)
    student = student.to(device=device, dtype=torch.float32)
    for module in student.modules():  # the student's LanguageModel, under peft's wrapper too
        if hasattr(module, "recompute_activations"):
            module.recompute_activations = cfg.recompute
    if tokenizer is None and cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
    tokenizer = tokenizer or target_tok or student_tok
    if target is not None:
        for p in target.parameters():
            p.requires_grad_(False)
        target.eval()
        check_vocab(target, student, target_tok or tokenizer, student_tok or (tokenizer if cfg.student_preset else None))
    if tokenizer is None and _vocab_size(student) >= 256:
        # Tokenizer-less models (e.g. `new-model` tiny presets) read text as UTF-8 bytes, as in generate.
        from ssmspec.tokenization import ByteTokenizer

        tokenizer = ByteTokenizer()
    return target, student, tokenizer


@dataclass
class _Run:
    """Everything one run holds between steps (built by `start_run`)."""

    cfg: RunConfig
    cb: TrainCallbacks
    accelerator: object
    out: Path
    target: nn.Module | None
    model: nn.Module  # wrapped by accelerate
    raw_student: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    tokenizer: object
    blocks: Blocks
    prompts: list
    bad: BadRecords
    resumed: bool
    step: int
    position: int
    info: dict = field(default_factory=dict)
    logger: "_JsonlLog | None" = None
    run_info: dict = field(default_factory=dict)
    result: TrainResult | None = None
    # What a checkpoint of the last completed step records (kept current after every step).
    done_rng: dict = field(default_factory=dict)
    done_position: int = 0
    # Throughput since the last logged step.
    window_start: float = 0.0
    window_tokens: int = 0
    run_start: float = 0.0
    run_start_step: int = 0
    cache: TargetLogitCache | None = None  # the target's top-K on disk (--cache-target-logits)
    micro_step: MicroStep | None = None  # how a micro-batch's forward, loss and backward run (built by open_log)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def tokens_per_step(self) -> int:
        c = self.cfg
        return c.optim.batch_size * c.data.seq_len * c.optim.grad_accum * self.accelerator.num_processes


def start_run(cfg: RunConfig, callbacks, target, student, tokenizer) -> _Run:
    """Check the output directory, load models and data, build the optimizer, restore a checkpoint."""
    from accelerate import Accelerator

    precision = _resolve_precision(cfg.optim.precision)
    accelerator = Accelerator(mixed_precision={"fp32": "no"}.get(precision, precision), cpu=not torch.cuda.is_available())
    main = accelerator.is_main_process
    # Progress is reported once, by the main process.
    cb = (callbacks or TrainCallbacks()) if main else TrainCallbacks()
    resolve_files(cfg.data.spec)  # a missing data path fails now, before any model is loaded
    # Every process reaches the same decision (and the same refusal); only the main one cleans.
    resume_from = prepare_out_dir(cfg, clean=main)
    accelerator.wait_for_everyone()
    torch.manual_seed(cfg.optim.seed)
    target, student, tokenizer = load_models(cfg, accelerator.device, precision, target, student, tokenizer)

    bad = BadRecords(cfg.data.on_bad_record, report=cb.on_message)
    blocks = Blocks(cfg.data, Tokenize(tokenizer, _vocab_size(student), cfg.data.format, cfg.data.text_field), cfg.optim.seed, bad)
    prompts = _eval_prompts(cfg, blocks, tokenizer, _vocab_size(student), bad)

    lora_targets = add_lora(student, cfg.lora) if cfg.lora.enabled else []
    optimizer = make_optimizer(student, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim))
    step, position = 0, 0
    if resume_from is not None:
        try:
            state = torch.load(resume_from / STATE_FILE, map_location=accelerator.device, weights_only=False)
        except Exception as e:  # a truncated or damaged file: torch raises several types
            raise InputError(f"--resume: {resume_from / STATE_FILE} is unreadable; delete {resume_from} to resume from "
                             f"an earlier checkpoint, or start over with --overwrite ({type(e).__name__}: {str(e)[:120]})") from e
        student.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, position = state["step"], state["data_position"]
        if step > cfg.optim.steps:
            raise InputError(f"--resume: the checkpoint in {cfg.out} is at step {step}, past --steps {cfg.optim.steps}; "
                             f"give --steps {step} or more to continue it")
        _set_rng_state(state["rng"])
    model, optimizer = accelerator.prepare(student, optimizer)
    run = _Run(cfg=cfg, cb=cb, accelerator=accelerator, out=Path(cfg.out), target=target, model=model,
               raw_student=accelerator.unwrap_model(model), optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer,
               blocks=blocks, prompts=prompts, bad=bad, resumed=resume_from is not None, step=step, position=position)
    run.info = {
        "mode": cfg.mode, "device": str(run.device), "world_size": accelerator.num_processes, "precision": precision,
        "student_params": sum(p.numel() for p in student.parameters()),
        "trainable_params": sum(p.numel() for p in student.parameters() if p.requires_grad), "lora_targets": lora_targets,
        "train_blocks": blocks.num_train, "held_out_blocks": int(blocks.held_out[0].shape[0]),
        "tokens_per_step": run.tokens_per_step, "resumed_from_step": step if run.resumed else None,
        "eval_prompts": len(prompts), "target_kind": None if target is None else type(target).__name__,
    }
    if cfg.loss.cache_target_logits:
        run.cache = open_target_cache(cfg, accelerator, target, blocks)
        run.info["target_cache"] = {"k": cfg.loss.cache_target_logits, "path": str(run.out / TOPK_DATA_FILE),
                                    "blocks": run.cache.num_blocks, "filled_at_start": run.cache.filled_blocks}
    return run


def open_target_cache(cfg: RunConfig, accelerator, target, blocks: Blocks) -> TargetLogitCache:
    """The run's top-K cache: checked (every process, so all refuse alike), created by the main process, then mapped."""
    header = expected_header(cfg.loss.cache_target_logits, target, blocks.train[0], cfg.data.seq_len)
    prepare_cache(Path(cfg.out), header, create=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    return TargetLogitCache(Path(cfg.out), header)


def open_log(run: _Run, scan) -> None:
    """Record the run (run.json, the log.jsonl header with the scan and FLOPs) and tell the callbacks."""
    peak, device_name = device_peak_flops(run.device)
    flops = train_flops_per_token(run.raw_student, run.cfg.data.seq_len, run.target)
    cfg = run.cfg
    plan = plan_step(cfg.compile, cfg.cuda_graphs, run.device, run.accelerator.num_processes, run.cache is not None)
    run.micro_step = MicroStep(
        plan, run.model, lambda forward, ids, mask, rows: _loss(forward, run.target, ids, mask, cfg, run.cache, rows),
        run.accelerator.backward, cfg.optim.grad_accum, run.accelerator.autocast,
        on_message=lambda text: tell(run, text))
    run.info.update({"scan": scan.name, "scan_reason": scan.reason, "step_mode": plan.name, "step_mode_reason": plan.reason,
                     "device_name": device_name, "flops_per_token": flops, "peak_flops": peak})
    run.run_info = {"config": run.cfg.to_dict(), "run": run.info}
    if run.main:
        run.out.mkdir(parents=True, exist_ok=True)
        if not run.resumed:
            _write_json_atomic(run.out / RUN_FILE, run.run_info)
    run.logger = _JsonlLog(run.out / LOG_FILE if run.main else None)
    run.logger.write({"event": "resume" if run.resumed else "start", "step": run.step, **run.info})
    log.info("training scan: %s (%s)", scan.name, scan.reason)
    run.cb.on_start({**run.info, "total_steps": run.cfg.optim.steps, "start_step": run.step})
    tell(run, f"Mamba-2 training scan: {scan.name} ({scan.reason})")
    tell(run, f"micro-step: {plan.name} ({plan.reason})"
              + ("; the first steps compile and autotune (a minute or two)" if plan.compile else ""))
    if run.cache is not None:
        c = run.info["target_cache"]
        tell(run, f"target logits: top-{c['k']} cache {c['path']}, {c['filled_at_start']} of {c['blocks']} "
              "training blocks filled; the target runs only on the others")
    run.result = TrainResult(out=str(run.out), step=run.step, final_loss=None, info=run.info)
    run.done_rng, run.done_position = _rng_state(), run.position
    run.window_start = run.run_start = time.perf_counter()
    run.run_start_step = run.step


def optimizer_step(run: _Run) -> tuple[torch.Tensor, dict, torch.Tensor | None, float]:
    """One optimizer step over grad_accum micro-batches; returns (loss, loss parts, grad norm, lr used).

    Loss, parts and grad norm stay on the device (0-dim tensors): reading them (`.item()`) waits
    for the GPU, so only logged steps read them (report_step) and the host queues the next step
    while this one runs.
    """
    cfg, accelerator, model = run.cfg, run.accelerator, run.model
    rank, world = accelerator.process_index, accelerator.num_processes
    parts_sum: dict[str, torch.Tensor] = {}
    loss_sum = None
    for micro in range(cfg.optim.grad_accum):
        rows = None if run.cache is None else run.blocks.batch_rows(run.position, cfg.optim.batch_size, rank, world)
        ids, mask, run.position = run.blocks.batch(run.position, cfg.optim.batch_size, rank, world)
        ids, mask = to_device(ids, run.device), to_device(mask, run.device)
        sync = micro == cfg.optim.grad_accum - 1
        with contextlib.nullcontext() if sync else accelerator.no_sync(model):
            loss, parts = run.micro_step(ids, mask, rows)
        # float64, as Python floats summed them before: the logged values are the same to the bit
        term = loss.detach().double() / cfg.optim.grad_accum
        loss_sum = term if loss_sum is None else loss_sum + term
        for k, v in parts.items():
            v = v.detach().double() / cfg.optim.grad_accum
            parts_sum[k] = v if k not in parts_sum else parts_sum[k] + v
    grad_norm = None
    if cfg.optim.max_grad_norm > 0:
        grad_norm = accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                cfg.optim.max_grad_norm)
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=not run.micro_step.keeps_grads)  # a captured graph adds into the same tensors
    run.step += 1
    run.done_rng, run.done_position = _rng_state(), run.position
    run.window_tokens += run.tokens_per_step
    run.result.step = run.step
    return loss_sum, parts_sum, grad_norm, lr


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU batch on the device; to a GPU through pinned memory, without waiting for the GPU.

    A copy from pageable memory waits until the GPU has run everything queued before it; from
    pinned memory it is queued behind that work (the batch is a fresh tensor, never reused).
    """
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


def tell(run: _Run, text: str) -> None:
    """A message for the user that log.jsonl keeps too (a compile or CUDA graph capture given up is why a run
    trained slower than the last: the console is often gone when someone asks)."""
    run.logger.write({"event": "message", "step": run.step, "text": text})
    run.cb.on_message(text)


def report_step(run: _Run, loss_sum: torch.Tensor, parts_sum: dict, grad_norm, lr: float) -> None:
    """Loss, throughput (tokens/s, MFU) and ETA to log.jsonl and the callbacks."""
    cfg, step = run.cfg, run.step
    loss_mean = _mean_across(run.accelerator, loss_sum, run.device)
    parts_mean = {k: _mean_across(run.accelerator, v, run.device) for k, v in parts_sum.items()}
    grad_norm = None if grad_norm is None else float(grad_norm)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)  # the window's time includes its queued GPU work
    now = time.perf_counter()
    tps = run.window_tokens / max(now - run.window_start, 1e-9)
    done = step - run.run_start_step
    eta = (now - run.run_start) / done * (cfg.optim.steps - step) if done else None
    peak = run.info["peak_flops"]
    mfu = tps * run.info["flops_per_token"] / (peak * run.accelerator.num_processes) if peak else None
    metrics = {"step": step, "loss": loss_mean, **parts_mean, "lr": lr, "grad_norm": grad_norm,
               "tokens": step * run.tokens_per_step, "tokens_per_s": tps, "mfu": mfu, "eta_s": eta,
               "elapsed_s": now - run.run_start}
    if run.device.type == "cuda":  # the most this process has held at once (graph pools included)
        metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    run.result.history.append(metrics)
    run.result.final_loss = loss_mean
    run.logger.write({"event": "step", **metrics})
    run.cb.on_step(metrics)
    run.window_start, run.window_tokens = time.perf_counter(), 0


def run_eval(run: _Run, at_step: int) -> None:
    """Held-out loss and measured acceptance at one step, with progress through on_eval_progress."""
    if run.main:
        device = run.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            # LoRA adapters are merged first: fused decode kernels read in_proj.weight directly
            # and would otherwise draft with the base weights alone.
            metrics = evaluate(merged_copy(run.raw_student), run.target, run.blocks.held_out, run.prompts, run.cfg, device,
                               mode=run.cfg.mode, progress=lambda done, total: run.cb.on_eval_progress(done, total, at_step))
        metrics = {"step": at_step, **metrics}
        run.result.evals.append(metrics)
        run.logger.write({"event": "eval", **metrics})
        run.cb.on_eval(metrics)
    run.model.train()
    # The evaluation's time is not training throughput.
    run.window_start, run.window_tokens = time.perf_counter(), 0


def checkpoint(run: _Run, at_step: int, position: int, rng: dict) -> None:
    if run.cache is not None:
        run.cache.flush()  # every block the checkpoint has trained on is on disk with it
    if run.main:
        path = save_checkpoint(run.out, at_step, run.raw_student, run.optimizer, run.scheduler, position, rng,
                               run.run_info, run.tokenizer, run.cfg.checkpoint.keep)
        run.logger.write({"event": "checkpoint", "step": at_step, "path": str(path)})
    run.accelerator.wait_for_everyone()


def after_step(run: _Run, loss_sum: torch.Tensor, parts_sum: dict, grad_norm, lr: float) -> None:
    """What a finished step triggers: a log line, an evaluation, a checkpoint, each on its cadence."""
    cfg, step, last = run.cfg, run.step, run.step == run.cfg.optim.steps
    if step % cfg.checkpoint.log_every == 0 or last:
        report_step(run, loss_sum, parts_sum, grad_norm, lr)
    if cfg.eval.eval_every and step % cfg.eval.eval_every == 0 and not last:
        run_eval(run, step)
    if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and not last:
        checkpoint(run, step, run.done_position, run.done_rng)


def save_interrupted(run: _Run) -> None:
    """Checkpoint the last completed step: an interrupted step has not touched the weights or the
    optimizer yet, and its data position and RNG are rolled back to where it began."""
    run.result.interrupted = True
    checkpoint(run, run.step, run.done_position, run.done_rng)
    run.logger.write({"event": "interrupted", "step": run.step, **cache_report(run)})
    run.cb.on_message(f"interrupted: checkpoint saved at step {run.step}; continue with --resume")


def finish(run: _Run) -> TrainResult:
    """Final evaluation (when on), the last checkpoint and the final model in cfg.out."""
    run.info["throughput"] = steady_throughput(run.result.history)
    # what the micro-steps ran as in the end (an automatic compile or capture that failed was dropped)
    run.info["step_mode_used"] = {"mode": run.micro_step.plan.name, "graphs_captured": run.micro_step.captured}
    if run.device.type == "cuda":
        run.info["throughput"]["peak_memory_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    # The checkpoint comes before the final evaluation: Ctrl-C during a long evaluation then leaves
    # every trained step saved, and --resume only evaluates and writes the model.
    checkpoint(run, run.step, run.position, _rng_state())
    if run.cfg.eval.final_eval:
        run_eval(run, run.step)
    cache_counts = cache_report(run)  # every process: the counts are summed across them
    if run.main:
        from ssmspec.models.loading import save_model

        save_model(merged_copy(run.raw_student), run.out, tokenizer=run.tokenizer)
        if run.bad.count:
            run.logger.write({"event": "bad_records", "count": run.bad.count, "examples": run.bad.examples})
        run.logger.write({"event": "end", "step": run.step, "final_loss": run.result.final_loss,
                          "throughput": run.info["throughput"], "step_mode": run.info["step_mode_used"], **cache_counts})
    run.info["bad_records"] = run.bad.count
    if run.cache is not None:
        c = run.info["target_cache"]
        run.cb.on_message(f"target logits: {c['blocks_read']} training block(s) read from the top-{c['k']} cache "
                          f"(target forwards saved), {c['blocks_computed']} computed by the target")
    run.cb.on_end(run.result)
    return run.result


def train(cfg: RunConfig, callbacks: TrainCallbacks | None = None, *, target: nn.Module | None = None,
          student: nn.Module | None = None, tokenizer=None) -> TrainResult:
    """Run (or resume) a distill / sft run described by cfg.

    target, student and tokenizer may be given as objects (tests, notebooks); otherwise they
    are loaded from the paths in cfg. Returns the TrainResult; the final student is written to
    cfg.out in the transformers format (merged, when LoRA was used). On Ctrl-C (or a
    KeyboardInterrupt raised by a callback) the last completed step is checkpointed and the
    KeyboardInterrupt propagates, so the caller can say how to resume and exit 130.
    """
    cfg.validate()
    run = start_run(cfg, callbacks, target, student, tokenizer)
    with training_scan(cfg.scan, run.device) as scan:
        open_log(run, scan)
        if not run.resumed and cfg.eval.eval_every:
            run_eval(run, 0)
        run.model.train()
        try:
            with _StopFlag() as stop:
                while run.step < cfg.optim.steps:
                    after_step(run, *optimizer_step(run))
                    if _stop_agreed(run, stop.requested):
                        raise KeyboardInterrupt
        except KeyboardInterrupt:
            save_interrupted(run)
            raise
        return finish(run)


def cache_report(run: _Run) -> dict:
    """{"target_cache": counts summed over processes} for the log (also kept in run.info), or {} without a cache."""
    if run.cache is None:
        return {}
    names = sorted(run.cache.stats)
    counts = torch.tensor([run.cache.stats[k] for k in names], dtype=torch.float64, device=run.device)
    if run.accelerator.num_processes > 1:
        counts = run.accelerator.reduce(counts, reduction="sum")
    run.info["target_cache"].update({k: int(v) for k, v in zip(names, counts.tolist())})
    return {"target_cache": dict(run.info["target_cache"])}


def _loss(model, target, ids, mask, cfg: RunConfig, cache: TargetLogitCache | None = None, rows: list[int] | None = None):
    """Loss of one micro-batch: ids (B, L+1), mask (B, L). Returns (loss, detached parts by name).

    The target runs in inference mode (no autograd; the models' no-grad kernel paths), in the run's
    autocast (bf16 on a GPU) and through the same training scan; its logits stay in their own dtype
    (the loss reads them a chunk at a time). With a cache, `rows` are the blocks' indices: their
    top-K comes from the cache (the target runs only on blocks not in it yet) and the loss is the
    sparse one over those K tokens.
    """
    inputs, next_ids = ids[:, :-1], ids[:, 1:]
    logits = model(inputs)
    if cfg.mode == "sft":
        return sft_loss(logits, next_ids, mask, cfg.loss.chunk_positions)
    if cache is not None:
        topk = cache.lookup(rows, inputs, target)
        return distill_loss(cfg.loss.loss, logits, None, next_ids, mask, cfg.loss.temperature, cfg.loss.ce_weight,
                            cfg.loss.chunk_positions, target_topk=topk)
    with torch.inference_mode():  # the loss reads these logits, never saves them for backward
        target_logits = target(inputs)
    return distill_loss(cfg.loss.loss, logits, target_logits, next_ids, mask, cfg.loss.temperature, cfg.loss.ce_weight,
                        cfg.loss.chunk_positions)


def _mean_across(accelerator, value: torch.Tensor, device) -> float:
    """A 0-dim device tensor averaged over processes, as a Python float (one host sync)."""
    if accelerator.num_processes == 1:
        return value.item()
    return accelerator.reduce(value.reshape(1).to(device=device, dtype=torch.float32), reduction="mean").item()


def _eval_prompts(cfg: RunConfig, blocks: Blocks, tokenizer, vocab_size: int, bad: BadRecords) -> list[list[int]]:
    from .data import read_prompts

    if cfg.eval.eval_prompts:
        prompts = read_prompts(cfg.eval.eval_prompts, tokenizer, vocab_size, bad)
        if not prompts:  # else acceptance went unmeasured without a word
            raise DataError(f"--eval-prompts {cfg.eval.eval_prompts}: the file holds no usable prompt")
    else:
        held = blocks.held_out[0]
        prompts = [row[: cfg.eval.prompt_len].tolist() for row in held]
    return prompts[: cfg.eval.num_prompts]


class _JsonlLog:
    """Appends one JSON object per line to log.jsonl (main process only)."""

    def __init__(self, path: Path | None):
        self.path = path

    def write(self, obj: dict) -> None:
        if self.path is None:
            return
        obj = {"time": time.time(), **obj}
        with open(self.path, "a") as f:
            f.write(json.dumps(obj, default=_jsonable) + "\n")


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, Path):
        return str(x)
    return str(x)
