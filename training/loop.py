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

from ssmspec.errors import InputError, ModelLoadError, TokenizerMismatchError

from .config import RunConfig
from .data import BadRecords, Blocks, Tokenize, resolve_files
from .evaluation import evaluate
from .losses import cross_entropy, distill_loss
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
    """A transformers causal LM seen as `forward(input_ids (B, T)) -> fp32 logits (B, T, V)`.

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
        return self.hf(input_ids=input_ids, use_cache=False).logits.float()


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
    return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2))


# -- output directory and checkpoints ----------------------------------------------------------------------
def prepare_out_dir(cfg: RunConfig, clean: bool = True) -> Path | None:
    """Check the output directory; returns the checkpoint to resume from, or None for a fresh run.

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
        for name in (CHECKPOINT_DIR, LOG_FILE, RUN_FILE):
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        return None
    if not entries:
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
    return latest_checkpoint(out)


def latest_checkpoint(out: Path) -> Path | None:
    ckdir = out / CHECKPOINT_DIR
    latest = ckdir / LATEST_FILE
    if latest.exists():
        path = ckdir / json.loads(latest.read_text())["name"]
        if (path / STATE_FILE).exists():
            return path
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
    """Ctrl-C sets a flag checked between steps, so the checkpoint written on exit is a clean one.

    A second Ctrl-C interrupts at once.
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)

            def handler(signum, frame):
                if self.requested:
                    raise KeyboardInterrupt
                self.requested = True

            signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def _resolve_precision(p: str) -> str:
    if p == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return {"fp32": "no"}.get(p, p)


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


def train(cfg: RunConfig, callbacks: TrainCallbacks | None = None, *, target: nn.Module | None = None,
          student: nn.Module | None = None, tokenizer=None) -> TrainResult:
    """Run (or resume) a distill / sft run described by cfg.

    target, student and tokenizer may be given as objects (tests, notebooks); otherwise they
    are loaded from the paths in cfg. Returns the TrainResult; the final student is written to
    cfg.out in the transformers format (merged, when LoRA was used).
    """
    from accelerate import Accelerator

    cfg.validate()
    out = Path(cfg.out)
    precision = _resolve_precision(cfg.optim.precision)
    accelerator = Accelerator(mixed_precision=precision, cpu=not torch.cuda.is_available())
    device = accelerator.device
    main = accelerator.is_main_process
    # Progress is reported once, by the main process.
    cb = (callbacks or TrainCallbacks()) if main else TrainCallbacks()
    resolve_files(cfg.data.spec)  # a missing data path fails now, before any model is loaded
    # Every process reaches the same decision (and the same refusal); only the main one cleans.
    resume_from = prepare_out_dir(cfg, clean=main)
    accelerator.wait_for_everyone()
    torch.manual_seed(cfg.optim.seed)

    # Models. The target is frozen; under bf16 it is also stored in bf16 (it only runs forward).
    target_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    target_tok = None
    if target is None and cfg.target:
        target, target_tok, _ = load_any_model(cfg.target, target_dtype, device)
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

    # Data.
    bad = BadRecords(cfg.data.on_bad_record, report=cb.on_message)
    blocks = Blocks(cfg.data, Tokenize(tokenizer, _vocab_size(student), cfg.data.format, cfg.data.text_field), cfg.optim.seed, bad)
    prompts = _eval_prompts(cfg, blocks, tokenizer, _vocab_size(student), bad)

    lora_targets = add_lora(student, cfg.lora) if cfg.lora.enabled else []
    trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in student.parameters())
    optimizer = make_optimizer(student, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim))

    step, position = 0, 0
    if resume_from is not None:
        state = torch.load(resume_from / STATE_FILE, map_location=device, weights_only=False)
        student.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, position = state["step"], state["data_position"]
        _set_rng_state(state["rng"])
    model, optimizer = accelerator.prepare(student, optimizer)
    raw_student = accelerator.unwrap_model(model)

    world, rank = accelerator.num_processes, accelerator.process_index
    tokens_per_step = cfg.optim.batch_size * cfg.data.seq_len * cfg.optim.grad_accum * world
    with training_scan(cfg.scan, device) as scan:
        scan_name = scan.name
        info = {
            "mode": cfg.mode, "device": str(device), "world_size": world, "precision": precision, "scan": scan_name,
            "scan_reason": scan.reason,
            "student_params": total_params, "trainable_params": trainable, "lora_targets": lora_targets,
            "train_blocks": blocks.num_train, "held_out_blocks": int(blocks.held_out[0].shape[0]),
            "tokens_per_step": tokens_per_step, "resumed_from_step": step if resume_from is not None else None,
            "eval_prompts": len(prompts), "target_kind": None if target is None else type(target).__name__,
        }
        run_info = {"config": cfg.to_dict(), "run": info}
        log_file = out / LOG_FILE
        if main:
            out.mkdir(parents=True, exist_ok=True)
            if resume_from is None:
                _write_json_atomic(out / RUN_FILE, run_info)
        logger = _JsonlLog(log_file if main else None)
        logger.write({"event": "resume" if resume_from is not None else "start", "step": step, **info})
        log.info("training scan: %s", scan_name)
        cb.on_start({**info, "total_steps": cfg.optim.steps, "start_step": step})
        cb.on_message(f"Mamba-2 training scan: {scan_name}")

        result = TrainResult(out=str(out), step=step, final_loss=None, info=info)

        def run_eval(at_step: int):
            if not main:
                return
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                # LoRA adapters are merged first: fused decode kernels read in_proj.weight directly
                # and would otherwise draft with the base weights alone.
                metrics = evaluate(merged_copy(raw_student), target, blocks.held_out, prompts, cfg, device, mode=cfg.mode)
            metrics = {"step": at_step, **metrics}
            result.evals.append(metrics)
            logger.write({"event": "eval", **metrics})
            cb.on_eval(metrics)

        def checkpoint(at_step: int, pos: int, rng: dict):
            if main:
                path = save_checkpoint(out, at_step, raw_student, optimizer, scheduler, pos, rng, run_info, tokenizer,
                                       cfg.checkpoint.keep)
                logger.write({"event": "checkpoint", "step": at_step, "path": str(path)})
            accelerator.wait_for_everyone()

        if resume_from is None and cfg.eval.eval_every:
            run_eval(0)
        model.train()
        window_start, window_tokens = time.perf_counter(), 0
        run_start, run_start_step = time.perf_counter(), step
        # What a checkpoint of the last completed step records (kept current after every step).
        done_rng, done_position = _rng_state(), position
        try:
            with _StopFlag() as stop:
                while step < cfg.optim.steps:
                    parts_sum: dict[str, float] = {}
                    loss_sum = 0.0
                    for micro in range(cfg.optim.grad_accum):
                        ids, mask, position = blocks.batch(position, cfg.optim.batch_size, rank, world)
                        ids, mask = ids.to(device), mask.to(device)
                        sync = micro == cfg.optim.grad_accum - 1
                        ctx = contextlib.nullcontext() if sync else accelerator.no_sync(model)
                        with ctx:
                            with accelerator.autocast():
                                loss, parts = _loss(model, target, ids, mask, cfg)
                            accelerator.backward(loss / cfg.optim.grad_accum)
                        loss_sum += loss.detach().float().item() / cfg.optim.grad_accum
                        for k, v in parts.items():
                            parts_sum[k] = parts_sum.get(k, 0.0) + float(v) / cfg.optim.grad_accum
                    grad_norm = None
                    if cfg.optim.max_grad_norm > 0:
                        grad_norm = float(accelerator.clip_grad_norm_(
                            [p for p in model.parameters() if p.requires_grad], cfg.optim.max_grad_norm))
                    lr = scheduler.get_last_lr()[0]
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    step += 1
                    done_rng, done_position = _rng_state(), position
                    window_tokens += tokens_per_step
                    result.step = step

                    if step % cfg.checkpoint.log_every == 0 or step == cfg.optim.steps:
                        loss_mean = _mean_across(accelerator, loss_sum, device)
                        parts_mean = {k: _mean_across(accelerator, v, device) for k, v in parts_sum.items()}
                        now = time.perf_counter()
                        tps = window_tokens / max(now - window_start, 1e-9)
                        done = step - run_start_step
                        eta = (now - run_start) / done * (cfg.optim.steps - step) if done else None
                        metrics = {"step": step, "loss": loss_mean, **parts_mean, "lr": lr, "grad_norm": grad_norm,
                                   "tokens": step * tokens_per_step, "tokens_per_s": tps, "eta_s": eta,
                                   "elapsed_s": now - run_start}
                        result.history.append(metrics)
                        result.final_loss = loss_mean
                        logger.write({"event": "step", **metrics})
                        cb.on_step(metrics)
                        window_start, window_tokens = time.perf_counter(), 0
                    if cfg.eval.eval_every and step % cfg.eval.eval_every == 0 and step < cfg.optim.steps:
                        run_eval(step)
                        model.train()
                    if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < cfg.optim.steps:
                        checkpoint(step, done_position, done_rng)
                    if stop.requested:
                        raise KeyboardInterrupt
        except KeyboardInterrupt:
            # Save the last completed step: an interrupted step has not touched the weights or the
            # optimizer yet, and its data position and RNG are rolled back to where it began.
            result.interrupted = True
            checkpoint(step, done_position, done_rng)
            logger.write({"event": "interrupted", "step": step})
            cb.on_message(f"interrupted: checkpoint saved at step {step}; continue with --resume")
            raise

        if cfg.eval.eval_every or prompts:
            run_eval(step)
        checkpoint(step, position, _rng_state())
        if main:
            from ssmspec.models.loading import save_model

            save_model(merged_copy(raw_student), out, tokenizer=tokenizer)
            if bad.count:
                logger.write({"event": "bad_records", "count": bad.count, "examples": bad.examples})
            logger.write({"event": "end", "step": step, "final_loss": result.final_loss})
        info["bad_records"] = bad.count
        cb.on_end(result)
        return result


def _loss(model, target, ids, mask, cfg: RunConfig):
    """Loss of one micro-batch: ids (B, L+1), mask (B, L)."""
    inputs, next_ids = ids[:, :-1], ids[:, 1:]
    logits = model(inputs)
    if cfg.mode == "sft":
        ce = cross_entropy(logits, next_ids, mask)
        return ce, {"ce": ce.detach()}
    with torch.no_grad():
        target_logits = target(inputs)
    return distill_loss(cfg.loss.loss, logits, target_logits, next_ids, mask, cfg.loss.temperature, cfg.loss.ce_weight)


def _mean_across(accelerator, value: float, device) -> float:
    if accelerator.num_processes == 1:
        return value
    t = torch.tensor([value], device=device, dtype=torch.float32)
    return float(accelerator.reduce(t, reduction="mean").item())


def _eval_prompts(cfg: RunConfig, blocks: Blocks, tokenizer, vocab_size: int, bad: BadRecords) -> list[list[int]]:
    from .data import read_prompts

    if cfg.eval.eval_prompts:
        prompts = read_prompts(cfg.eval.eval_prompts, tokenizer, vocab_size, bad)
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
