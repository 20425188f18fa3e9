"""Typed model configuration: one dataclass per layer kind, one for the whole language model."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

LAYER_KINDS = ("mamba", "attention", "mlp", "moe")


@dataclass
class MambaConfig:
    """A Mamba-2 mixer (SSD): heads x head_dim channels, a d_state state per channel."""

    n_heads: int = 8
    """Number of SSM heads H (d_inner = n_heads * head_dim)."""
    head_dim: int = 16
    """Channels per head P."""
    d_state: int = 16
    """State size S."""
    n_groups: int = 1
    """Groups G sharing B and C (n_heads must be a multiple)."""
    conv_kernel: int = 4
    """Width K of the causal depthwise conv."""
    conv_bias: bool = True
    proj_bias: bool = False
    chunk_size: int = 64
    """Chunk length of the chunked scan used for prefill and training."""
    dt_min: float = 0.0
    """Lower clamp of softplus(dt + dt_bias) (NemotronH uses time_step_min)."""
    dt_max: float = math.inf
    """Upper clamp of the time step."""
    norm_eps: float = 1e-5
    """Epsilon of the gated RMSNorm."""
    gate_norm: bool = True
    """Whether y * silu(z) goes through the grouped RMSNorm before out_proj (False: FalconH1
    checkpoints with mamba_rms_norm false, whose mixer has no norm there)."""

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state


@dataclass
class AttentionConfig:
    """Multi-head attention with grouped KV heads and optional (partial) rotary embeddings."""

    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    rotary_dim: int = 0
    """Leading head dims that get RoPE (GPT-NeoX rotate-half); 0 = no positional encoding."""
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    out_bias: bool = False
    scale: float | None = None
    """Softmax scale of the scores; None = 1/sqrt(head_dim) (GraniteMoeHybrid sets its attention_multiplier)."""


@dataclass
class MLPConfig:
    """A feed-forward layer: gated (SwiGLU) or plain (e.g. squared ReLU)."""

    d_intermediate: int = 64
    gated: bool = True
    activation: str = "silu"
    """One of silu, relu2, gelu, relu."""
    bias: bool = False


@dataclass
class MoEConfig:
    """A mixture-of-experts feed-forward layer: per-token top-k routing over experts, plus an
    always-on shared expert (GraniteMoeHybrid's block_sparse_moe + shared_mlp, NemotronH's moe)."""

    n_experts: int = 8
    top_k: int = 2
    """Experts per token."""
    d_intermediate: int = 64
    """Hidden width of each routed expert."""
    shared_intermediate: int = 64
    """Hidden width of the shared expert (0: none)."""
    activation: str = "silu"
    gated: bool = True
    """Experts (and the shared expert) gated, act(gate) * up (GraniteMoeHybrid), or act(up) (NemotronH)."""
    router: str = "softmax"
    """softmax: the chosen experts' weights are the softmax of their top-k logits (Granite).
    sigmoid: DeepSeek-V3 style (NemotronH): sigmoid scores, a per-expert bias for the choice
    only, the top-k among the topk_group best of n_group expert groups, weights the chosen
    scores (normalised when norm_topk_prob) times routed_scaling."""
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    latent_size: int = 0
    """Width the routed experts run at, projected down from d_model and back (0: d_model)."""


@dataclass
class SharedBlockConfig:
    """Zamba2's shared transformer blocks. With it, every attention sublayer of the stack is a use
    of block (use index mod n_blocks): RMSNorm of [h | token embeddings] (2 * d_model wide),
    attention from that width back to d_model, RMSNorm, a gated MLP, and a per-use output
    projection. The block's weights are shared by its uses; each use has its own low-rank
    adapters on q, k, v and the MLP's gate/up projection, and its own output projection. The
    use's output is added to the next sublayer's input (a Mamba-2 sublayer), not to the
    residual stream."""

    n_blocks: int = 1
    d_intermediate: int = 128
    """Hidden width of the blocks' gated MLP."""
    activation: str = "gelu"
    adapter_rank: int = 0
    """Rank of the per-use adapters on the MLP's gate/up projection (0: none)."""
    attention_adapters: bool = False
    """Whether each use also has adapters of that rank on q, k and v."""


@dataclass
class ModelConfig:
    """A language model as a stack of pre-norm residual sublayers in any pattern.

    Each entry of `layers` is one sublayer: RMSNorm, then a Mamba-2 mixer, an attention layer
    or an MLP, added to the residual stream. A Bamba or mamba_ssm block (mixer + MLP) is two
    entries; a NemotronH block is one.
    """

    vocab_size: int = 256
    d_model: int = 64
    layers: list[str] = field(default_factory=lambda: ["mamba"] * 2)
    mamba: MambaConfig = field(default_factory=MambaConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mlp: MLPConfig = field(default_factory=MLPConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    norm_eps: float = 1e-5
    shared_blocks: SharedBlockConfig | None = None
    """Zamba2's shared transformer blocks; None: attention sublayers are plain attention."""
    parallel_layers: list[int] = field(default_factory=list)
    """Sublayers that run beside the one before them: they read the residual stream that the
    previous sublayer read, so both outputs are added to the same input (FalconH1's attention
    next to its Mamba-2 mixer: h + mamba(norm(h)) + attention(norm(h)))."""
    embedding_multiplier: float = 1.0
    """Scale of the token embeddings entering the residual stream (GraniteMoeHybrid, FalconH1);
    the LM head reads the unscaled table when tied."""
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if isinstance(self.mamba, dict):
            self.mamba = MambaConfig(**self.mamba)
        if isinstance(self.attention, dict):
            self.attention = AttentionConfig(**self.attention)
        if isinstance(self.mlp, dict):
            self.mlp = MLPConfig(**self.mlp)
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.shared_blocks, dict):
            self.shared_blocks = SharedBlockConfig(**self.shared_blocks)
        bad = [k for k in self.layers if k not in LAYER_KINDS]
        if bad:
            raise ValueError(f"unknown layer kinds {bad}; expected some of {LAYER_KINDS}")
        if "mamba" in self.layers and self.mamba.n_heads % self.mamba.n_groups:
            raise ValueError("mamba.n_heads must be a multiple of mamba.n_groups")
        if "attention" in self.layers and self.attention.n_heads % self.attention.n_kv_heads:
            raise ValueError("attention.n_heads must be a multiple of attention.n_kv_heads")
        bad = [i for i in self.parallel_layers if not 0 < i < len(self.layers)]
        if bad:
            raise ValueError(f"parallel_layers {bad} must index sublayers after the first")
        if self.shared_blocks is not None:
            after = [self.layers[i + 1] if i + 1 < len(self.layers) else None
                     for i, k in enumerate(self.layers) if k == "attention"]
            if any(k != "mamba" for k in after):
                raise ValueError("with shared_blocks, every attention sublayer must be followed by a mamba sublayer")
            if self.parallel_layers:
                raise ValueError("shared_blocks and parallel_layers do not combine")
        if "moe" in self.layers and not 1 <= self.moe.top_k <= self.moe.n_experts:
            raise ValueError("moe.top_k must be between 1 and moe.n_experts")
        if "moe" in self.layers and self.moe.router not in ("softmax", "sigmoid"):
            raise ValueError(f"moe.router must be softmax or sigmoid, not {self.moe.router!r}")
        if "moe" in self.layers and self.moe.router == "sigmoid" and (
                self.moe.n_experts % self.moe.n_group or not 1 <= self.moe.topk_group <= self.moe.n_group):
            raise ValueError("moe.n_group must divide moe.n_experts and moe.topk_group be between 1 and moe.n_group")

    @property
    def is_hybrid(self) -> bool:
        return "attention" in self.layers

    @property
    def is_pure_mamba(self) -> bool:
        return set(self.layers) == {"mamba"}

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["mamba"]["dt_max"] = None if math.isinf(self.mamba.dt_max) else self.mamba.dt_max
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        mamba = dict(d.get("mamba", {}))
        if mamba.get("dt_max") is None:
            mamba["dt_max"] = math.inf
        d["mamba"] = mamba
        return cls(**d)

    def num_parameters(self) -> int:
        """Parameter count from the shapes alone (no allocation)."""
        m, a, f, dm = self.mamba, self.attention, self.mlp, self.d_model
        mamba = dm * (2 * m.d_inner + 2 * m.n_groups * m.d_state + m.n_heads) + m.conv_dim * (m.conv_kernel + 1)
        mamba += 3 * m.n_heads + (m.d_inner if m.gate_norm else 0) + m.d_inner * dm
        attn = dm * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.n_heads * a.head_dim * dm
        mlp = dm * f.d_intermediate * (3 if f.gated else 2)
        e = self.moe
        mats = 3 if e.gated else 2
        d_expert = e.latent_size or dm
        moe = dm * e.n_experts + mats * (d_expert * e.n_experts * e.d_intermediate + dm * e.shared_intermediate)
        moe += e.n_experts if e.router == "sigmoid" else 0  # the choice bias
        moe += 2 * dm * e.latent_size
        per = {"mamba": mamba, "attention": attn, "mlp": mlp, "moe": moe}
        total = sum(per[k] + dm for k in self.layers) + dm
        if self.shared_blocks is not None:  # attention sublayers are uses of the shared blocks
            sb, uses = self.shared_blocks, self.layers.count("attention")
            d_in, q = 2 * dm, a.n_heads * a.head_dim
            block = d_in + d_in * (q + 2 * a.n_kv_heads * a.head_dim) + q * dm + dm + 3 * dm * sb.d_intermediate
            adapters = sb.adapter_rank * (dm + 2 * sb.d_intermediate)
            if sb.attention_adapters:
                adapters += sb.adapter_rank * (d_in + q) + 2 * sb.adapter_rank * (d_in + a.n_kv_heads * a.head_dim)
            total += sb.n_blocks * block + uses * (adapters + dm * dm - attn - dm)
        total += self.vocab_size * dm * (1 if self.tie_embeddings else 2)
        return total
