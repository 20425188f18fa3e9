"""`ssmspec distill` and `ssmspec sft`: train a Mamba-2 drafter, with a rich progress bar fed by callbacks.

Examples:
    ssmspec distill --target models/target --student-preset drafter-2l --data corpus/ --out drafter \\
        --steps 2000 --seq-len 1024 --batch-size 16 --eval-every 200
    ssmspec sft --student drafter --data sharegpt.json --format chat --out drafter-chat --lora
"""
from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from ssmspec.models.presets import PRESETS
from ssmspec.training.config import (
    BAD_RECORD_POLICIES, DATA_FORMATS, LOSSES, PRECISIONS, SCAN_BACKENDS, SCHEDULES,
    CheckpointConfig, DataConfig, EvalConfig, LoraSettings, LossConfig, OptimConfig, RunConfig,
)

from . import options, outputs

_DATA, _OPT, _LOSS, _EVAL, _LORA, _CK = DataConfig(), OptimConfig(), LossConfig(), EvalConfig(), LoraSettings(), CheckpointConfig()
_RUN = RunConfig()

# Options shared by both commands (one definition each, defaults from the dataclasses).
DATA = typer.Option(..., "--data", help="Data: .jsonl/.json/.txt/.parquet files or folders (comma-separated), or a datasets name.",
                    callback=options.non_empty)
OUT = typer.Option(..., "--out", help="Output directory (final model, checkpoints/, log.jsonl, run.json).")
TOKENIZER = typer.Option(None, "--tokenizer", exists=True, file_okay=False, help="Tokenizer directory, when the model directories hold none.")
FORMAT = options.choice(_DATA.format, "--format", choices=DATA_FORMATS,
                        help="text, chat (loss on assistant turns only), tokens (input_ids records), or auto.")
TEXT_FIELD = typer.Option(_DATA.text_field, "--text-field", help="Record field holding the text (text format).", callback=options.non_empty)
SEQ_LEN = options.count(_DATA.seq_len, "--seq-len", min=2, help="Tokens per packed training sequence.")
HELD_OUT = options.real(_DATA.held_out_fraction, "--held-out", max=1.0, below=True, help="Share of packed sequences held out for evaluation.")
MAX_HELD_OUT = options.count(_DATA.max_held_out_blocks, "--max-held-out", help="Most held-out sequences.")
STREAMING = options.flag(_DATA.streaming, "--streaming/--no-streaming", help="Read data lazily (corpora larger than memory).")
ON_BAD = options.choice(_DATA.on_bad_record, "--on-bad-record", choices=BAD_RECORD_POLICIES,
                        help="Malformed records: error (stop, naming file and line) or skip (report each).")
STEPS = options.count(_OPT.steps, "--steps", min=1, help="Optimizer steps.")
BATCH = options.count(_OPT.batch_size, "--batch-size", min=1, help="Sequences per micro-batch per process.")
ACCUM = options.count(_OPT.grad_accum, "--grad-accum", min=1, help="Micro-batches per optimizer step.")
LR = options.real(_OPT.lr, "--lr", above=True, help="Peak learning rate (AdamW).")
MIN_LR = options.real(_OPT.min_lr_ratio, "--min-lr-ratio", max=1.0, help="Final learning rate as a fraction of the peak.")
WARMUP = options.count(_OPT.warmup_steps, "--warmup-steps", help="Linear warm-up steps.")
SCHEDULE = options.choice(_OPT.schedule, "--schedule", choices=SCHEDULES, help="Learning-rate schedule after warm-up.")
WD = options.real(_OPT.weight_decay, "--weight-decay", help="AdamW weight decay on matrices.")
CLIP = options.real(_OPT.max_grad_norm, "--max-grad-norm", help="Gradient clipping norm (0 = off).")
DTYPE = options.choice(_OPT.precision, "--dtype", choices=PRECISIONS, help="Training precision (auto: bf16 on a GPU with it).")
PRECISION = options.deprecated("--precision", use="--dtype", callback=DTYPE.callback)
SEED = options.count(_OPT.seed, "--seed", help="Seed for initialisation and data order.")
EVAL_PROMPTS = typer.Option(None, "--eval-prompts", exists=True, dir_okay=False,
                            help="Prompts file (.jsonl or .txt) for measuring acceptance (default: held-out text).")
EVAL_EVERY = options.count(_EVAL.eval_every, "--eval-every", help="Steps between evaluations (0 = none during training).")
FINAL_EVAL = options.flag(_EVAL.final_eval, "--final-eval/--no-final-eval", help="Evaluate once more after the last step.")
EVAL_N = options.count(_EVAL.num_prompts, "--eval-num-prompts", min=1, help="Prompts used to measure acceptance.")
EVAL_NEW = options.count(_EVAL.max_new_tokens, "--eval-max-new-tokens", min=1, max=options.MAX_NEW_TOKENS,
                         help="Tokens generated per prompt when measuring acceptance.")
EVAL_K = options.count(_EVAL.draft_len, "--eval-draft-len", min=1, help="Drafted tokens per target call (chain) when measuring acceptance.")
SAVE_EVERY = options.count(_CK.save_every, "--save-every", help="Steps between checkpoints (one is always written at the end and on Ctrl-C or SIGTERM).")
KEEP = options.count(_CK.keep, "--keep-checkpoints", min=1, help="Checkpoints kept on disk.")
LOG_EVERY = options.count(_CK.log_every, "--log-every", min=1, help="Steps between log lines.")
RESUME = options.flag(False, "--resume", help="Continue the run in --out from its latest checkpoint.")
OVERWRITE = options.flag(False, "--overwrite", help="Start over in an --out that holds an earlier run of this command.")
LORA = options.flag(_LORA.enabled, "--lora/--no-lora", help="Train LoRA adapters only (peft); the merged model is saved.")
LORA_RANK = options.count(_LORA.rank, "--lora-rank", min=1, help="LoRA rank.")
LORA_ALPHA = options.real(_LORA.alpha, "--lora-alpha", above=True, help="LoRA alpha.")
LORA_TARGETS = typer.Option(",".join(_LORA.targets), "--lora-targets", help="Linear layers given adapters, where present.")
SCAN = typer.Option(_RUN.scan, "--scan", metavar="NAME", callback=options.one_of(SCAN_BACKENDS),
                    help="Training scan, one of: auto (on a GPU fla, then mamba_ssm, when importable, else parallel; on the CPU "
                         "ssmspec), fla, mamba_ssm, parallel, ssmspec (the reference).")
RECOMPUTE = options.flag(_RUN.recompute, "--recompute/--no-recompute",
                         help="Recompute each sublayer's activations in the backward pass: the same gradients in less GPU "
                              "memory (larger --batch-size fits), about a third more compute.")
COMPILE = typer.Option(_RUN.compile, "--compile/--no-compile", metavar="",
                       help="torch.compile the student's forward (fuses each layer's elementwise work; the first steps "
                            "take a minute or two longer). Default: on a GPU.")
CUDA_GRAPHS = typer.Option(_RUN.cuda_graphs, "--cuda-graphs/--no-cuda-graphs", metavar="",
                           help="Capture each micro-step (forward, loss, backward) in a CUDA graph after two ordinary runs "
                                "and replay it: no per-kernel host work. Default: on one GPU without --cache-target-logits.")
LOSS_CHUNK = options.count(_LOSS.chunk_positions, "--loss-chunk", max=1 << 24,
                           help="Positions whose logits the loss turns into fp32 at once (0 = as many as fit 32M values).")
MODEL_DIR = dict(exists=True, file_okay=False)


def build_config(mode: str, **kw) -> RunConfig:
    """A RunConfig from the command's options (names as in the function signatures)."""
    cfg = RunConfig(
        mode=mode, out=str(kw["out"]), target=_s(kw.get("target")), student=_s(kw.get("student")),
        student_preset=kw.get("student_preset"), tokenizer=_s(kw.get("tokenizer")), resume=kw["resume"],
        overwrite=kw["overwrite"], scan=kw["scan"], recompute=kw["recompute"], compile=kw["compile"],
        cuda_graphs=kw["cuda_graphs"],
        data=DataConfig(spec=kw["data"], format=kw["format"], seq_len=kw["seq_len"], text_field=kw["text_field"],
                        held_out_fraction=kw["held_out"], max_held_out_blocks=kw["max_held_out"],
                        streaming=kw["streaming"], on_bad_record=kw["on_bad_record"]),
        optim=OptimConfig(steps=kw["steps"], batch_size=kw["batch_size"], grad_accum=kw["grad_accum"], lr=kw["lr"],
                          min_lr_ratio=kw["min_lr_ratio"], warmup_steps=kw["warmup_steps"], schedule=kw["schedule"],
                          weight_decay=kw["weight_decay"], max_grad_norm=kw["max_grad_norm"],
                          precision=kw["dtype"], seed=kw["seed"]),
        loss=LossConfig(loss=kw.get("loss", _LOSS.loss), temperature=kw.get("distill_temperature", _LOSS.temperature),
                        ce_weight=kw.get("ce_weight", _LOSS.ce_weight), chunk_positions=kw["loss_chunk"],
                        cache_target_logits=kw.get("cache_target_logits", _LOSS.cache_target_logits)),
        eval=EvalConfig(eval_every=kw["eval_every"], final_eval=kw["final_eval"], eval_prompts=_s(kw.get("eval_prompts")), num_prompts=kw["eval_num_prompts"],
                        max_new_tokens=kw["eval_max_new_tokens"], draft_len=kw["eval_draft_len"]),
        lora=LoraSettings(enabled=kw["lora"], rank=kw["lora_rank"], alpha=kw["lora_alpha"],
                          targets=[t.strip() for t in kw["lora_targets"].split(",") if t.strip()]),
        checkpoint=CheckpointConfig(save_every=kw["save_every"], keep=kw["keep_checkpoints"], log_every=kw["log_every"]),
    )
    cfg.validate()
    return cfg


def _s(x) -> Optional[str]:
    return None if x is None else str(x)


class RichProgress:
    """TrainCallbacks drawing rich progress bars (training: loss, tokens/s, MFU, ETA; each evaluation) and printing evaluations."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
            console=self.console, transient=False,
        )
        self.task = None
        self.eval_task = None

    def on_start(self, info: dict) -> None:
        self.progress.start()
        self.task = self.progress.add_task(info["mode"], total=info["total_steps"], completed=info["start_step"], stats="")
        line = (f"{info['mode']}: {info['trainable_params']:,} trainable of {info['student_params']:,} parameters, "
                f"{info['train_blocks'] if info['train_blocks'] is not None else 'streamed'} training / {info['held_out_blocks']} held-out "
                f"sequences, {info['world_size']} process(es) on {info['device']}, precision {info['precision']}")
        self.console.print(line)
        if info.get("resumed_from_step") is not None:
            self.console.print(f"resumed from step {info['resumed_from_step']}")

    def on_step(self, m: dict) -> None:
        self.progress.update(self.task, completed=m["step"], stats=step_stats(m))

    def on_eval_progress(self, done: int, total: int, step: int) -> None:
        if self.eval_task is None:
            self.eval_task = self.progress.add_task(f"eval @ step {step}", total=total, stats="held-out loss, acceptance")
        self.progress.update(self.eval_task, completed=done, total=total)

    def on_eval(self, m: dict) -> None:
        if self.eval_task is not None:
            self.progress.remove_task(self.eval_task)
            self.eval_task = None
        parts = [f"step {m['step']}"]
        for key, label in (("held_out_loss", "held-out loss"), ("held_out_ce", "ce"), ("held_out_kl", "kl"),
                           ("agreement", "top-1 agreement"), ("mean_accepted", "accepted/call")):
            if m.get(key) is not None:
                parts.append(f"{label} {m[key]:.4f}")
        if m.get("acceptance_note"):
            parts.append(m["acceptance_note"])
        self.console.print("eval: " + ", ".join(parts))

    def on_message(self, text: str) -> None:
        self.console.print(text)

    def on_end(self, result) -> None:
        self.progress.stop()
        loss = "-" if result.final_loss is None else f"{result.final_loss:.4f}"
        extra = f"; {result.info['bad_records']} malformed record(s) skipped" if result.info.get("bad_records") else ""
        self.console.print(f"done: step {result.step}, loss {loss}; model written to {result.out}{extra}")

    def close(self) -> None:
        self.progress.stop()


def step_stats(m: dict) -> str:
    """The training bar's text for one logged step: loss, tokens/s and, where known, MFU and peak GPU memory."""
    text = f"loss {m['loss']:.4f}, {m['tokens_per_s']:,.0f} tok/s"
    if m.get("mfu") is not None:
        text += f", MFU {100 * m['mfu']:.1f}%"
    if m.get("peak_memory_gb") is not None:
        text += f", peak {m['peak_memory_gb']:.1f} GB"
    return text


def _run(mode: str, kw: dict, inputs: dict) -> None:
    """Check --out, build the config, train with a progress bar; after Ctrl-C say how to resume and exit 130."""
    from ssmspec.training.loop import TrainCallbacks, latest_checkpoint, train

    kw["dtype"] = options.merge_alias(kw["dtype"], kw.pop("precision"), _OPT.precision, "--dtype", "--precision")
    cfg = build_config(mode, **kw)
    out = Path(cfg.out)
    data_paths = {"--data": Path(p.strip()) for p in cfg.data.spec.split(",") if p.strip()}
    if outputs.owner_of(out) is None and _run_mode(out) == mode:
        outputs.mark(out, mode)  # a run written before output markers existed: its run.json says whose it is
    outputs.claim(out, mode, inputs={**inputs, **data_paths}, overwrite=cfg.overwrite, resume=cfg.resume)
    # The callbacks print every warning the training library logs; without a handler of its own,
    # Python's last-resort handler printed each one a second time, unformatted.
    logger = logging.getLogger("ssmspec.training")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    ui = RichProgress()
    cb = type("CLIProgress", (TrainCallbacks,), {})()
    for name in ("on_start", "on_step", "on_eval", "on_eval_progress", "on_message", "on_end"):
        setattr(cb, name, getattr(ui, name))
    try:
        train(cfg, cb)
    except KeyboardInterrupt:
        ui.close()
        if latest_checkpoint(out) is None:
            # --out now holds the run's start (run.json, log.jsonl): a plain rerun is refused there
            print(f"{mode} interrupted before its first checkpoint: nothing to resume; start over with --overwrite",
                  file=sys.stderr)
        else:
            print(f"{mode} interrupted; continue with: {resume_command()}", file=sys.stderr)
        raise typer.Exit(130) from None
    finally:
        ui.close()
        outputs.mark(out, mode)


def _run_mode(out: Path) -> Optional[str]:
    """The mode recorded in a training run's run.json in `out`, if there is one."""
    import json

    from ssmspec.training.loop import RUN_FILE

    try:
        return json.loads((out / RUN_FILE).read_text())["config"]["mode"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_command() -> str:
    """This command line with --resume instead of --overwrite."""
    args = [a for a in sys.argv[1:] if a not in ("--overwrite", "--resume")]
    return shlex.join(["ssmspec", *args, "--resume"])


def distill_command(
    target: Path = typer.Option(..., "--target", **MODEL_DIR, help="Frozen target: any model ssmspec loads, or a transformers causal LM directory."),
    student: Optional[Path] = typer.Option(None, "--student", **MODEL_DIR, help="Student Mamba-2 checkpoint directory to continue from."),
    student_preset: Optional[str] = options.choice(None, "--student-preset", choices=tuple(PRESETS),
                                                   help="Or a fresh student from a preset (e.g. drafter-2l), with the target's vocabulary."),
    data: str = DATA, out: Path = OUT, tokenizer: Optional[Path] = TOKENIZER, format: str = FORMAT, text_field: str = TEXT_FIELD,
    seq_len: int = SEQ_LEN, held_out: float = HELD_OUT, max_held_out: int = MAX_HELD_OUT, streaming: bool = STREAMING,
    on_bad_record: str = ON_BAD, steps: int = STEPS, batch_size: int = BATCH, grad_accum: int = ACCUM, lr: float = LR,
    min_lr_ratio: float = MIN_LR, warmup_steps: int = WARMUP, schedule: str = SCHEDULE, weight_decay: float = WD,
    max_grad_norm: float = CLIP, dtype: str = DTYPE, precision: Optional[str] = PRECISION, seed: int = SEED,
    loss: str = options.choice(_LOSS.loss, "--loss", choices=LOSSES,
                               help="kl (forward KL at --distill-temperature), tvd, or kl+ce."),
    distill_temperature: float = options.real(_LOSS.temperature, "--distill-temperature", above=True,
                                              help="Softmax temperature of both distributions in the loss."),
    ce_weight: float = options.real(_LOSS.ce_weight, "--ce-weight", help="Weight of cross-entropy on the data in kl+ce."),
    eval_prompts: Optional[Path] = EVAL_PROMPTS, eval_every: int = EVAL_EVERY, final_eval: bool = FINAL_EVAL,
    eval_num_prompts: int = EVAL_N,
    eval_max_new_tokens: int = EVAL_NEW, eval_draft_len: int = EVAL_K, save_every: int = SAVE_EVERY,
    keep_checkpoints: int = KEEP, log_every: int = LOG_EVERY, resume: bool = RESUME, overwrite: bool = OVERWRITE,
    lora: bool = LORA, lora_rank: int = LORA_RANK, lora_alpha: float = LORA_ALPHA, lora_targets: str = LORA_TARGETS,
    scan: str = SCAN, recompute: bool = RECOMPUTE, compile: Optional[bool] = COMPILE,
    cuda_graphs: Optional[bool] = CUDA_GRAPHS, loss_chunk: int = LOSS_CHUNK,
    cache_target_logits: int = options.count(
        _LOSS.cache_target_logits, "--cache-target-logits", metavar="K",
        help="Store the target's top-K logits per position on disk (out/target_topk.bin, K x 6 bytes per token) the first "
             "time a training block is drawn and read them back later, instead of running the target every step; the "
             "loss becomes the sparse KL/TVD over those K tokens (0 = off: full logits every step)."),
):
    """Distil a Mamba-2 drafter from a frozen target's next-token distribution.

    Ctrl-C (or SIGTERM) saves a checkpoint, prints the command that resumes the run, and exits with status 130.

    Example: ssmspec distill --target tgt --student-preset drafter-2l --data corpus/ --out drafter --steps 2000
    """
    kw = dict(locals())
    _run("distill", kw, inputs={"--target": target, "--student": student, "--tokenizer": tokenizer,
                                "--eval-prompts": eval_prompts})


def sft_command(
    student: Optional[Path] = typer.Option(None, "--student", **MODEL_DIR, help="Mamba-2 checkpoint directory to fine-tune."),
    student_preset: Optional[str] = options.choice(None, "--student-preset", choices=tuple(PRESETS),
                                                   help="Or a fresh model from a preset (pretraining), with the vocabulary of --target "
                                                        "or --tokenizer, else the preset's, reading text as UTF-8 bytes."),
    target: Optional[Path] = typer.Option(None, "--target", **MODEL_DIR, help="A target to measure acceptance against during training."),
    model: Optional[Path] = options.deprecated("--model", use="--student", **MODEL_DIR),
    init_preset: Optional[str] = options.deprecated("--init-preset", use="--student-preset", callback=options.one_of(tuple(PRESETS))),
    eval_target: Optional[Path] = options.deprecated("--eval-target", use="--target", **MODEL_DIR),
    data: str = DATA, out: Path = OUT, tokenizer: Optional[Path] = TOKENIZER, format: str = FORMAT, text_field: str = TEXT_FIELD,
    seq_len: int = SEQ_LEN, held_out: float = HELD_OUT, max_held_out: int = MAX_HELD_OUT, streaming: bool = STREAMING,
    on_bad_record: str = ON_BAD, steps: int = STEPS, batch_size: int = BATCH, grad_accum: int = ACCUM, lr: float = LR,
    min_lr_ratio: float = MIN_LR, warmup_steps: int = WARMUP, schedule: str = SCHEDULE, weight_decay: float = WD,
    max_grad_norm: float = CLIP, dtype: str = DTYPE, precision: Optional[str] = PRECISION, seed: int = SEED,
    eval_prompts: Optional[Path] = EVAL_PROMPTS, eval_every: int = EVAL_EVERY, final_eval: bool = FINAL_EVAL,
    eval_num_prompts: int = EVAL_N,
    eval_max_new_tokens: int = EVAL_NEW, eval_draft_len: int = EVAL_K, save_every: int = SAVE_EVERY,
    keep_checkpoints: int = KEEP, log_every: int = LOG_EVERY, resume: bool = RESUME, overwrite: bool = OVERWRITE,
    lora: bool = LORA, lora_rank: int = LORA_RANK, lora_alpha: float = LORA_ALPHA, lora_targets: str = LORA_TARGETS,
    scan: str = SCAN, recompute: bool = RECOMPUTE, compile: Optional[bool] = COMPILE,
    cuda_graphs: Optional[bool] = CUDA_GRAPHS, loss_chunk: int = LOSS_CHUNK,
):
    """Next-token fine-tuning (chat: loss on assistant turns only) or pretraining on raw text.

    Ctrl-C (or SIGTERM) saves a checkpoint, prints the command that resumes the run, and exits with status 130.

    Example: ssmspec sft --student drafter --data sharegpt.json --format chat --out drafter-chat
    """
    kw = dict(locals())
    for new, old in (("student", "model"), ("student_preset", "init_preset"), ("target", "eval_target")):
        kw[new] = options.merge_alias(kw[new], kw.pop(old), None, "--" + new.replace("_", "-"), "--" + old.replace("_", "-"))
    _run("sft", kw, inputs={"--student": kw["student"], "--target": kw["target"], "--tokenizer": tokenizer,
                            "--eval-prompts": eval_prompts})
