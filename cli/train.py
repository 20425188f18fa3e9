"""`ssmspec distill` and `ssmspec sft`: train a Mamba-2 drafter, with a rich progress bar fed by callbacks.

Examples:
    ssmspec distill --target models/target --student-preset drafter-2l --data corpus/ --out drafter \\
        --steps 2000 --seq-len 1024 --batch-size 16 --eval-every 200
    ssmspec sft --model drafter --data sharegpt.json --format chat --out drafter-chat --lora
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ssmspec.training.config import (
    CheckpointConfig, DataConfig, EvalConfig, LoraSettings, LossConfig, OptimConfig, RunConfig,
)

from .app import app

_DATA, _OPT, _LOSS, _EVAL, _LORA, _CK = DataConfig(), OptimConfig(), LossConfig(), EvalConfig(), LoraSettings(), CheckpointConfig()
_RUN = RunConfig()

# Options shared by both commands (one definition each, defaults from the dataclasses).
DATA = typer.Option(..., "--data", help="Data: .jsonl/.json/.txt/.parquet files or folders (comma-separated), or a datasets name.")
OUT = typer.Option(..., "--out", help="Output directory (final model, checkpoints/, log.jsonl, run.json).")
TOKENIZER = typer.Option(None, "--tokenizer", help="Tokenizer directory, when the model directories hold none.")
FORMAT = typer.Option(_DATA.format, "--format", help="text, chat (loss on assistant turns only), tokens (input_ids records), or auto.")
TEXT_FIELD = typer.Option(_DATA.text_field, "--text-field", help="Record field holding the text (text format).")
SEQ_LEN = typer.Option(_DATA.seq_len, "--seq-len", help="Tokens per packed training sequence.")
HELD_OUT = typer.Option(_DATA.held_out_fraction, "--held-out", help="Share of packed sequences held out for evaluation.")
MAX_HELD_OUT = typer.Option(_DATA.max_held_out_blocks, "--max-held-out", help="Most held-out sequences.")
STREAMING = typer.Option(_DATA.streaming, "--streaming/--no-streaming", help="Read data lazily (corpora larger than memory).")
ON_BAD = typer.Option(_DATA.on_bad_record, "--on-bad-record", help="Malformed records: error (stop, naming file and line) or skip (report each).")
STEPS = typer.Option(_OPT.steps, "--steps", help="Optimizer steps.")
BATCH = typer.Option(_OPT.batch_size, "--batch-size", help="Sequences per micro-batch per process.")
ACCUM = typer.Option(_OPT.grad_accum, "--grad-accum", help="Micro-batches per optimizer step.")
LR = typer.Option(_OPT.lr, "--lr", help="Peak learning rate (AdamW).")
MIN_LR = typer.Option(_OPT.min_lr_ratio, "--min-lr-ratio", help="Final learning rate as a fraction of the peak.")
WARMUP = typer.Option(_OPT.warmup_steps, "--warmup-steps", help="Linear warm-up steps.")
SCHEDULE = typer.Option(_OPT.schedule, "--schedule", help="cosine, linear or constant.")
WD = typer.Option(_OPT.weight_decay, "--weight-decay", help="AdamW weight decay on matrices.")
CLIP = typer.Option(_OPT.max_grad_norm, "--max-grad-norm", help="Gradient clipping norm (0 = off).")
PRECISION = typer.Option(_OPT.precision, "--precision", help="bf16, fp16, fp32, or auto (bf16 on a GPU with it).")
SEED = typer.Option(_OPT.seed, "--seed", help="Seed for initialisation and data order.")
EVAL_PROMPTS = typer.Option(None, "--eval-prompts", help="Prompts file (.jsonl or .txt) for measuring acceptance (default: held-out text).")
EVAL_EVERY = typer.Option(_EVAL.eval_every, "--eval-every", help="Steps between evaluations (0 = only at the end).")
EVAL_N = typer.Option(_EVAL.num_prompts, "--eval-num-prompts", help="Prompts used to measure acceptance.")
EVAL_NEW = typer.Option(_EVAL.max_new_tokens, "--eval-max-new-tokens", help="Tokens generated per prompt when measuring acceptance.")
EVAL_K = typer.Option(_EVAL.draft_len, "--eval-draft-len", help="Drafted tokens per target call (chain) when measuring acceptance.")
SAVE_EVERY = typer.Option(_CK.save_every, "--save-every", help="Steps between checkpoints (one is always written at the end and on Ctrl-C).")
KEEP = typer.Option(_CK.keep, "--keep-checkpoints", help="Checkpoints kept on disk.")
LOG_EVERY = typer.Option(_CK.log_every, "--log-every", help="Steps between log lines.")
RESUME = typer.Option(False, "--resume", help="Continue the run in --out from its latest checkpoint.")
OVERWRITE = typer.Option(False, "--overwrite", help="Start over in an --out that holds another run.")
LORA = typer.Option(_LORA.enabled, "--lora/--no-lora", help="Train LoRA adapters only (peft); the merged model is saved.")
LORA_RANK = typer.Option(_LORA.rank, "--lora-rank", help="LoRA rank.")
LORA_ALPHA = typer.Option(_LORA.alpha, "--lora-alpha", help="LoRA alpha.")
LORA_TARGETS = typer.Option(",".join(_LORA.targets), "--lora-targets", help="Linear layers given adapters, where present.")
SCAN = typer.Option(_RUN.scan, "--scan", help="Training scan: auto (mamba_ssm when importable on a GPU), ssmspec, or mamba_ssm.")


def build_config(mode: str, **kw) -> RunConfig:
    """A RunConfig from the command's options (names as in the function signatures)."""
    cfg = RunConfig(
        mode=mode, out=str(kw["out"]), target=_s(kw.get("target")), student=_s(kw.get("student")),
        student_preset=kw.get("student_preset"), tokenizer=_s(kw.get("tokenizer")), resume=kw["resume"],
        overwrite=kw["overwrite"], scan=kw["scan"],
        data=DataConfig(spec=kw["data"], format=kw["format"], seq_len=kw["seq_len"], text_field=kw["text_field"],
                        held_out_fraction=kw["held_out"], max_held_out_blocks=kw["max_held_out"],
                        streaming=kw["streaming"], on_bad_record=kw["on_bad_record"]),
        optim=OptimConfig(steps=kw["steps"], batch_size=kw["batch_size"], grad_accum=kw["grad_accum"], lr=kw["lr"],
                          min_lr_ratio=kw["min_lr_ratio"], warmup_steps=kw["warmup_steps"], schedule=kw["schedule"],
                          weight_decay=kw["weight_decay"], max_grad_norm=kw["max_grad_norm"],
                          precision=kw["precision"], seed=kw["seed"]),
        loss=LossConfig(loss=kw.get("loss", _LOSS.loss), temperature=kw.get("temperature", _LOSS.temperature),
                        ce_weight=kw.get("ce_weight", _LOSS.ce_weight)),
        eval=EvalConfig(eval_every=kw["eval_every"], eval_prompts=_s(kw.get("eval_prompts")), num_prompts=kw["eval_num_prompts"],
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
    """TrainCallbacks drawing a rich progress bar (loss, tokens/s, ETA) and printing evaluations."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"), TimeRemainingColumn(),
            console=self.console, transient=False,
        )
        self.task = None

    def on_start(self, info: dict) -> None:
        self.progress.start()
        self.task = self.progress.add_task(info["mode"], total=info["total_steps"], completed=info["start_step"], loss="-", tps="-")
        line = (f"{info['mode']}: {info['trainable_params']:,} trainable of {info['student_params']:,} parameters, "
                f"{info['train_blocks'] if info['train_blocks'] is not None else 'streamed'} training / {info['held_out_blocks']} held-out "
                f"sequences, {info['world_size']} process(es) on {info['device']}, precision {info['precision']}")
        self.console.print(line)
        if info.get("resumed_from_step") is not None:
            self.console.print(f"resumed from step {info['resumed_from_step']}")

    def on_step(self, m: dict) -> None:
        self.progress.update(self.task, completed=m["step"], loss=f"{m['loss']:.4f}", tps=f"{m['tokens_per_s']:,.0f}")

    def on_eval(self, m: dict) -> None:
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


def _run(cfg: RunConfig) -> None:
    from ssmspec.training.loop import TrainCallbacks, train

    ui = RichProgress()
    cb = type("CLIProgress", (TrainCallbacks,), {})()
    for name in ("on_start", "on_step", "on_eval", "on_message", "on_end"):
        setattr(cb, name, getattr(ui, name))
    try:
        train(cfg, cb)
    finally:
        ui.close()


@app.command("distill")
def distill_command(
    target: Path = typer.Option(..., "--target", help="Frozen target: any model ssmspec loads, or a transformers causal LM directory."),
    student: Optional[Path] = typer.Option(None, "--student", help="Student Mamba-2 checkpoint directory to continue from."),
    student_preset: Optional[str] = typer.Option(None, "--student-preset", help="Or a fresh student from a preset (e.g. drafter-2l), with the target's vocabulary."),
    data: str = DATA, out: Path = OUT, tokenizer: Optional[Path] = TOKENIZER, format: str = FORMAT, text_field: str = TEXT_FIELD,
    seq_len: int = SEQ_LEN, held_out: float = HELD_OUT, max_held_out: int = MAX_HELD_OUT, streaming: bool = STREAMING,
    on_bad_record: str = ON_BAD, steps: int = STEPS, batch_size: int = BATCH, grad_accum: int = ACCUM, lr: float = LR,
    min_lr_ratio: float = MIN_LR, warmup_steps: int = WARMUP, schedule: str = SCHEDULE, weight_decay: float = WD,
    max_grad_norm: float = CLIP, precision: str = PRECISION, seed: int = SEED,
    loss: str = typer.Option(_LOSS.loss, "--loss", help="kl (forward KL at --temperature), tvd, or kl+ce."),
    temperature: float = typer.Option(_LOSS.temperature, "--temperature", help="Softmax temperature of both distributions."),
    ce_weight: float = typer.Option(_LOSS.ce_weight, "--ce-weight", help="Weight of cross-entropy on the data in kl+ce."),
    eval_prompts: Optional[Path] = EVAL_PROMPTS, eval_every: int = EVAL_EVERY, eval_num_prompts: int = EVAL_N,
    eval_max_new_tokens: int = EVAL_NEW, eval_draft_len: int = EVAL_K, save_every: int = SAVE_EVERY,
    keep_checkpoints: int = KEEP, log_every: int = LOG_EVERY, resume: bool = RESUME, overwrite: bool = OVERWRITE,
    lora: bool = LORA, lora_rank: int = LORA_RANK, lora_alpha: float = LORA_ALPHA, lora_targets: str = LORA_TARGETS,
    scan: str = SCAN,
):
    """Distil a Mamba-2 drafter from a frozen target's next-token distribution.

    Example: ssmspec distill --target tgt --student-preset drafter-2l --data corpus/ --out drafter --steps 2000
    """
    _run(build_config("distill", **locals()))


@app.command("sft")
def sft_command(
    model: Optional[Path] = typer.Option(None, "--model", help="Mamba-2 checkpoint directory to fine-tune."),
    init_preset: Optional[str] = typer.Option(None, "--init-preset", help="Or a fresh model from a preset (pretraining; needs --tokenizer)."),
    eval_target: Optional[Path] = typer.Option(None, "--eval-target", help="A target to measure acceptance against during training."),
    data: str = DATA, out: Path = OUT, tokenizer: Optional[Path] = TOKENIZER, format: str = FORMAT, text_field: str = TEXT_FIELD,
    seq_len: int = SEQ_LEN, held_out: float = HELD_OUT, max_held_out: int = MAX_HELD_OUT, streaming: bool = STREAMING,
    on_bad_record: str = ON_BAD, steps: int = STEPS, batch_size: int = BATCH, grad_accum: int = ACCUM, lr: float = LR,
    min_lr_ratio: float = MIN_LR, warmup_steps: int = WARMUP, schedule: str = SCHEDULE, weight_decay: float = WD,
    max_grad_norm: float = CLIP, precision: str = PRECISION, seed: int = SEED,
    eval_prompts: Optional[Path] = EVAL_PROMPTS, eval_every: int = EVAL_EVERY, eval_num_prompts: int = EVAL_N,
    eval_max_new_tokens: int = EVAL_NEW, eval_draft_len: int = EVAL_K, save_every: int = SAVE_EVERY,
    keep_checkpoints: int = KEEP, log_every: int = LOG_EVERY, resume: bool = RESUME, overwrite: bool = OVERWRITE,
    lora: bool = LORA, lora_rank: int = LORA_RANK, lora_alpha: float = LORA_ALPHA, lora_targets: str = LORA_TARGETS,
    scan: str = SCAN,
):
    """Next-token fine-tuning (chat: loss on assistant turns only) or pretraining on raw text.

    Example: ssmspec sft --model drafter --data sharegpt.json --format chat --out drafter-chat
    """
    kw = dict(locals())
    kw["student"], kw["student_preset"], kw["target"] = kw.pop("model"), kw.pop("init_preset"), kw.pop("eval_target")
    _run(build_config("sft", **kw))
