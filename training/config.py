"""Typed training configuration: the one home of every default of `ssmspec distill` and `ssmspec sft`."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ssmspec.errors import InputError

LOSSES = ("kl", "tvd", "kl+ce")
SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
DATA_FORMATS = ("auto", "text", "chat", "tokens")
BAD_RECORD_POLICIES = ("error", "skip")
SCAN_BACKENDS = ("auto", "fla", "mamba_ssm", "parallel", "ssmspec")
LORA_TARGETS = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class DataConfig:
    """Where the training text comes from and how it becomes fixed-length blocks."""

    spec: str = ""
    """A .jsonl/.json/.txt/.parquet file, a folder of them, several joined with commas, or a datasets-library name."""
    format: str = "auto"
    """text (raw text), chat (conversations; loss on assistant turns only), tokens (records with input_ids), or auto."""
    seq_len: int = 512
    """Tokens per packed training sequence (L)."""
    text_field: str = "text"
    """Field holding the text of a record in text format."""
    held_out_fraction: float = 0.02
    """Share of packed blocks kept out of training for the held-out loss."""
    max_held_out_blocks: int = 64
    """Upper bound on held-out blocks (the rest go to training)."""
    streaming: bool = False
    """Read the data lazily instead of tokenizing it all up front (for corpora larger than memory)."""
    shuffle_buffer: int = 1024
    """Blocks held in the shuffle buffer when streaming."""
    on_bad_record: str = "error"
    """What a malformed record does: error (stop, naming file and line) or skip (report and go on)."""
    hub_split: str = "train"
    """Split to read when the spec is a datasets-library name."""


@dataclass
class OptimConfig:
    """Optimizer, schedule, batch shape and precision."""

    steps: int = 1000
    """Optimizer steps to run in total."""
    batch_size: int = 8
    """Sequences per micro-batch on each process."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine and linear schedules)."""
    warmup_steps: int = 0
    """Linear warm-up steps at the start."""
    schedule: str = "cosine"
    """cosine, linear or constant decay after warm-up."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not on norms, biases, A_log, D, dt_bias)."""
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (0 disables)."""
    precision: str = "auto"
    """bf16, fp16, fp32, or auto (bf16 on a GPU that has it, fp32 otherwise)."""
    seed: int = 0
    """Seed for initialisation, data order and everything random."""


@dataclass
class LossConfig:
    """The distillation loss; sft always uses cross-entropy."""

    loss: str = "kl"
    """kl (forward KL to the target's softened distribution), tvd (total variation) or kl+ce."""
    temperature: float = 1.0
    """Softmax temperature applied to both target and student logits."""
    ce_weight: float = 0.5
    """Weight of the cross-entropy term on the data in kl+ce."""
    chunk_positions: int = 0
    """Positions whose logits the loss turns into fp32 at once (0: as many as fit 32M fp32 values)."""
    cache_target_logits: int = 0
    """K > 0: keep the target's top-K logits per position on disk, computed once per training block, and
    distil from them (sparse KL / TVD over the top K); 0: run the target every step on its full logits."""


@dataclass
class EvalConfig:
    """Periodic evaluation: held-out loss and measured acceptance."""

    eval_every: int = 200
    """Steps between evaluations, and one before the first step (0: none during training)."""
    final_eval: bool = True
    """Evaluate once more after the last step (held-out loss and, with a target, acceptance)."""
    eval_prompts: str | None = None
    """A .jsonl (field prompt, or text/input_ids) or .txt (one per line) of prompts; default: held-out blocks."""
    num_prompts: int = 8
    """Prompts used for the acceptance measurement."""
    prompt_len: int = 32
    """Tokens of a held-out block used as a prompt when no prompt file is given."""
    max_new_tokens: int = 64
    """Tokens generated per prompt when measuring acceptance."""
    draft_len: int = 4
    """Drafted tokens per target call in the chain used to measure acceptance."""
    max_batches: int = 16
    """Held-out micro-batches used for the held-out loss."""


@dataclass
class LoraSettings:
    """Low-rank adapters (peft) instead of full fine-tuning."""

    enabled: bool = False
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Linear layers that get adapters, where the model has them."""


@dataclass
class CheckpointConfig:
    """Checkpoint and log cadence."""

    save_every: int = 500
    """Steps between checkpoints (one is always written at the end and on Ctrl-C or SIGTERM)."""
    keep: int = 2
    """Most recent checkpoints kept on disk."""
    log_every: int = 10
    """Steps between lines in log.jsonl and progress updates."""


@dataclass
class RunConfig:
    """A whole training run; written as run.json in the output directory and with every checkpoint."""

    mode: str = "distill"
    """distill (match a frozen target's distribution) or sft (next-token cross-entropy on the data)."""
    out: str = ""
    """Output directory: final model, checkpoints/, log.jsonl, run.json."""
    target: str | None = None
    """Target model directory (distill; optional for sft, where it is only used to measure acceptance)."""
    student: str | None = None
    """Existing student checkpoint directory (--student)."""
    student_preset: str | None = None
    """Preset name of a fresh student (--student-preset)."""
    tokenizer: str | None = None
    """Tokenizer directory, when neither model directory holds one."""
    resume: bool = False
    overwrite: bool = False
    scan: str = "auto"
    """Chunked-scan implementation for training: fla (fla-core), mamba_ssm, parallel (chunk-parallel plain torch),
    ssmspec (the plain-torch reference, a loop over chunks), or auto (on a GPU the first of fla, mamba_ssm importable, else parallel; on the CPU ssmspec)."""
    recompute: bool = False
    """Recompute each sublayer's activations in the backward pass instead of keeping them (the same
    gradients; less memory, so larger batches fit; about a third more compute)."""
    compile: bool | None = None
    """torch.compile the student's forward: True, False, or None for automatic (on a CUDA device)."""
    cuda_graphs: bool | None = None
    """Replay each micro-step from a CUDA graph: True, False, or None for automatic (one CUDA process,
    no --cache-target-logits)."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    # Fields that may change between a run and its resumption without changing what is trained.
    _RESUMABLE_CHANGES = (
        "out", "resume", "overwrite", "scan", "recompute", "compile", "cuda_graphs", "optim.steps", "eval", "checkpoint", "data.on_bad_record",
        "loss.chunk_positions",
    )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        d = dict(d)
        subs = {"data": DataConfig, "optim": OptimConfig, "loss": LossConfig, "eval": EvalConfig,
                "lora": LoraSettings, "checkpoint": CheckpointConfig}
        for key, sub in subs.items():
            if isinstance(d.get(key), dict):
                d[key] = sub(**d[key])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def identity(self) -> dict:
        """The fields that define what a run trains; a resumed run must match them."""
        flat = _flatten(self.to_dict())
        return {k: v for k, v in flat.items() if not any(k == p or k.startswith(p + ".") for p in self._RESUMABLE_CHANGES)}

    def validate(self) -> None:
        """Raise InputError naming the first bad value."""
        def bad(msg):
            raise InputError(msg)

        if self.mode not in ("distill", "sft"):
            bad(f"mode must be distill or sft, not {self.mode!r}")
        if not self.out:
            bad("--out is required: the directory the run writes to")
        if self.mode == "distill" and not self.target:
            bad("distill needs --target: the frozen model the student learns from")
        if bool(self.student) == bool(self.student_preset):
            bad("give exactly one of --student DIR or --student-preset NAME")
        if not self.data.spec:
            bad("--data is required: a file, folder, or datasets-library name")
        if self.resume and self.overwrite:
            bad("--resume continues the run in --out and --overwrite deletes it: give one of them, not both")
        checks = [
            (self.data.format, DATA_FORMATS, "--format"), (self.data.on_bad_record, BAD_RECORD_POLICIES, "--on-bad-record"),
            (self.optim.schedule, SCHEDULES, "--schedule"), (self.optim.precision, PRECISIONS, "--dtype"),
            (self.loss.loss, LOSSES, "--loss"), (self.scan, SCAN_BACKENDS, "--scan"),
        ]
        for value, allowed, flag in checks:
            if value not in allowed:
                bad(f"{flag} must be one of {', '.join(allowed)}, not {value!r}")
        positive = [(self.data.seq_len, "--seq-len"), (self.optim.steps, "--steps"), (self.optim.batch_size, "--batch-size"),
                    (self.optim.grad_accum, "--grad-accum"), (self.eval.draft_len, "--eval-draft-len"),
                    (self.checkpoint.keep, "--keep-checkpoints"), (self.checkpoint.log_every, "--log-every")]
        for value, flag in positive:
            if value < 1:
                bad(f"{flag} must be at least 1, got {value}")
        if self.data.seq_len < 2:
            bad("--seq-len must be at least 2")
        if not self.optim.lr > 0:
            bad(f"--lr must be positive, got {self.optim.lr}")
        if not self.loss.temperature > 0:
            bad(f"--distill-temperature must be positive, got {self.loss.temperature}")
        if not 0 <= self.data.held_out_fraction < 1:
            bad(f"--held-out must be in [0, 1), got {self.data.held_out_fraction}")
        if self.loss.chunk_positions < 0:
            bad(f"--loss-chunk must be 0 (automatic) or positive, got {self.loss.chunk_positions}")
        if self.loss.cache_target_logits < 0:
            bad(f"--cache-target-logits must be 0 (off) or a positive K, got {self.loss.cache_target_logits}")
        if self.loss.cache_target_logits and self.mode != "distill":
            bad("--cache-target-logits is for distill: sft's loss reads no target logits")
        if self.loss.cache_target_logits and self.data.streaming:
            bad("--cache-target-logits needs the data in memory (leave out --streaming): streamed blocks have no stable index")
        if self.eval.eval_every < 0 or self.checkpoint.save_every < 0:
            bad("--eval-every and --save-every must be 0 (off) or positive")
        if self.lora.enabled and self.lora.rank < 1:
            bad(f"--lora-rank must be at least 1, got {self.lora.rank}")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
