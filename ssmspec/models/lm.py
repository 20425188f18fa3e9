"""A language model of pre-norm residual sublayers (Mamba-2, attention, MLP, MoE) in any pattern."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..ops import dispatch, paths
from .attention import Attention
from .cache import ModelCache, packed_mamba_rows
from .config import ModelConfig
from .fold import is_folded
from .mamba2 import Mamba2Mixer
from .mlp import MLP
from .moe import MoE
from .shared_block import SharedBlock, SharedBlockUse


class Embedding(nn.Embedding):
    """nn.Embedding that leaves a meta-device weight uninitialised: loading builds the model on
    the meta device and overwrites every weight, and `normal_` on a meta tensor imports
    torch._dynamo (5-8 s on a slow CPU) for nothing.

    multiplier scales the looked-up rows (ModelConfig.embedding_multiplier); a tied LM head reads
    the unscaled table."""

    multiplier: float = 1.0

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().forward(input_ids)
        return h if self.multiplier == 1.0 else h * self.multiplier


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and dispatch.uses_kernel("rms_norm", h.device):
            return dispatch.rms_norm(h, self.weight, self.eps)  # one launch instead of ~6 (inference only)
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * hf).to(h.dtype)


def _mlp_through_dispatch(mlp: MLP, h: torch.Tensor) -> torch.Tensor:
    """`MLP.forward` with its projections through `dispatch.linear` (GEMV for one row); same math."""
    up = dispatch.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
    if mlp.cfg.gated:
        up = mlp.act(dispatch.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)) * up
    else:
        up = mlp.act(up)
    return dispatch.linear(up, mlp.down_proj.weight, mlp.down_proj.bias)


def _folded_mlp_residual(mlp: MLP, h: torch.Tensor, eps: float, h_sq: torch.Tensor | None = None):
    """h + MLP(norm(h)) with the pre-norm folded into the up/gate projections (models/fold.py):
    the norm runs inside those projections and the residual add inside the down projection.
    h_sq: h's partial sums of squares or None (ops/gemv `norm_linear`). Returns the output and
    its partial sums of squares (or None)."""
    if mlp.cfg.gated:
        up = dispatch.norm_linear(h, mlp.up_proj.weight, mlp.up_proj.bias, 1, eps, x_sq=h_sq)
        up = dispatch.norm_linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias, 1, eps, x_sq=h_sq,
                                  activation=mlp.cfg.activation) * up
    else:  # the activation inside the projection's epilogue on the kernels
        up = dispatch.norm_linear(h, mlp.up_proj.weight, mlp.up_proj.bias, 1, eps, x_sq=h_sq,
                                  activation=mlp.cfg.activation)
    return dispatch.norm_linear(up, mlp.down_proj.weight, mlp.down_proj.bias, 0, residual=h, return_sq=True)


def _sublayer(layer, block_input, embeddings, injected, layer_cache, seqlen):
    """One sublayer's output on the full-sequence path: its mixer on its input (without the
    residual add, which the caller makes)."""
    x = layer.input(block_input, embeddings, injected)
    if layer.kind == "mamba":
        return layer.mixer(x, layer_cache)
    if layer.kind == "attention":
        return layer.mixer(x, layer_cache, seqlen)
    return layer.mixer(x)


class Sublayer(nn.Module):
    """h + mixer(norm(h)); `kind` is mamba, attention, mlp or moe."""

    def __init__(self, kind: str, cfg: ModelConfig):
        super().__init__()
        self.kind = kind
        self.parallel = False
        """Whether it reads the residual stream the previous sublayer read (ModelConfig.parallel_layers)."""
        self.injects = False
        """Whether its output goes into the next sublayer's input instead of the residual stream
        (a use of a Zamba2 shared block, ModelConfig.shared_blocks)."""
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(cfg.d_model, cfg.mamba)
        elif kind == "attention":
            self.mixer = Attention(cfg.d_model, cfg.attention)
        elif kind == "moe":
            self.mixer = MoE(cfg.d_model, cfg.moe)
        else:
            self.mixer = MLP(cfg.d_model, cfg.mlp)

    def input(self, h: torch.Tensor, embeddings: torch.Tensor, injected: torch.Tensor | None) -> torch.Tensor:
        """What the mixer reads: norm(h), or norm(h + injected) after a sublayer that injects;
        a shared-block use reads [h | token embeddings] and normalises it itself."""
        if self.injects:
            return torch.cat([h, embeddings], dim=-1)
        return self.norm(h if injected is None else h + injected)

    @property
    def norms_folded(self) -> bool:
        """Whether this sublayer's norm weights are folded into its projections (models/fold.py),
        so that the kernel paths run it as h -> h + sublayer(h) with the norms inside them."""
        if self.kind == "mamba":
            # a mixer without its gated norm (MambaConfig.gate_norm) never runs the folded kernels
            return is_folded(self.norm) and self.mixer.norm is not None and is_folded(self.mixer.norm)
        return self.kind == "mlp" and is_folded(self.norm)


@dataclass
class TreeActivations:
    """Per-sublayer activations kept by `verify` for `replay` (None for MLPs)."""

    layers: list


class LanguageModel(nn.Module):
    """Embedding -> sublayers -> final norm -> LM head, with forward / step / verify / replay paths."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embedding(cfg.vocab_size, cfg.d_model)
        self.embeddings.multiplier = cfg.embedding_multiplier
        self.layers = nn.ModuleList(Sublayer(kind, cfg) for kind in cfg.layers)
        for i in cfg.parallel_layers:
            self.layers[i].parallel = True
        if cfg.shared_blocks is not None:
            # Zamba2: the weights shared by a block's uses live here, once; each attention
            # sublayer becomes a use of block (use index mod n_blocks), with no norm of its own.
            self.shared_blocks = nn.ModuleList(SharedBlock(cfg, RMSNorm) for _ in range(cfg.shared_blocks.n_blocks))
            uses = [layer for layer in self.layers if layer.kind == "attention"]
            for j, layer in enumerate(uses):
                layer.mixer = SharedBlockUse(self.shared_blocks[j % cfg.shared_blocks.n_blocks], cfg)
                layer.norm = None
                layer.injects = True
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embeddings.weight
        self.one_launch = paths.OneLaunchRunners()
        """The one-launch CUDA kernels' runners for this model, built on first use where
        ops/paths.py says they run (none on the CPU)."""
        self.recompute_activations = False
        """Training (`forward` with gradients, no cache): keep only each sublayer's input and run
        the sublayer again in the backward pass (`sft`/`distill --recompute`): the same
        gradients in less memory, for about a third more compute."""

    def mamba_mixers(self) -> list[Mamba2Mixer]:
        """The Mamba-2 mixers of the stack, in layer order."""
        return [layer.mixer for layer in self.layers if layer.kind == "mamba"]

    def folded_mamba_stack(self) -> list[tuple[Mamba2Mixer, float]] | None:
        """(mixer, its pre-norm's eps) of every layer when every layer is a Mamba-2 layer with its
        norms folded into its projections (models/fold.py): the stack that the one-launch CUDA
        kernels run. None otherwise."""
        if not all(layer.kind == "mamba" and layer.norms_folded for layer in self.layers):
            return None
        return [(layer.mixer, layer.norm.eps) for layer in self.layers]

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight.device

    def fold_norm_weights_(self) -> "LanguageModel":
        """Fold the norm weights into the projections after them (models/fold.py), in place: the
        same function, and the kernel paths fuse the norms into the projections."""
        from .fold import fold_norm_weights_

        return fold_norm_weights_(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.weight.dtype

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None, pending: int = 0,
                  packed: bool = False) -> ModelCache:
        """An empty cache for `batch` rows; attention layers hold up to max_len positions.

        pending: slots per Mamba layer for committed inputs that the SSM state has not absorbed
        (ReplaySSM, models/cache.py): `replay` then writes the state only when the slots would
        overflow. 0 (or a model without Mamba layers): the state absorbs every replay.
        packed: every row's Mamba states and seqlen in one span of one buffer (models/cache.py
        packed_mamba_rows), so that copying or gathering whole rows is one launch (a drafter's
        per-node states); needs pending 0. The states are then strided views (batch stride = the
        row), which the step, verify and replay kernels take through their strides; the one-launch
        step (ops/stream_layers) runs at batch 1 only, where a row is contiguous anyway."""
        device = device or self.device
        dtype = dtype or self.dtype
        if pending < 0:
            raise ValueError(f"pending slots must be >= 0, got {pending}")
        if not any(layer.kind == "mamba" for layer in self.layers):
            pending, packed = 0, False
        if packed and pending:
            raise ValueError("a packed cache keeps no pending inputs: pass pending=0 or packed=False")
        layers = []
        for layer in self.layers:
            if layer.kind == "mamba":  # packed: only a template here (its shapes and dtypes)
                layers.append(layer.mixer.new_cache(batch, "meta" if packed else device, dtype, pending))
            elif layer.kind == "attention":
                layers.append(layer.mixer.new_cache(batch, max_len, device, dtype))
            else:
                layers.append(None)
        count = torch.zeros(batch, dtype=torch.long, device=device) if pending else None
        if packed:
            rows, mamba, seqlen = packed_mamba_rows(batch, layers, device)
            layers = [m if m is not None else c for m, c in zip(mamba, layers)]
            return ModelCache(layers, seqlen, None, packed_rows=rows)
        return ModelCache(layers, torch.zeros(batch, dtype=torch.long, device=device), count)

    def settle(self, cache: ModelCache) -> None:
        """Flush the cache's pending inputs into the SSM states (one launch on the kernels), so
        that every state holds all of its tokens; nothing to do when it keeps none. The paths
        that read the states directly (step, forward) call it first."""
        if cache.pending_count is None or not cache.pending_dirty:
            return
        mamba = [i for i, layer in enumerate(self.layers) if layer.kind == "mamba"]
        dispatch.settle_pending_layers([cache.layers[i].ssm_state for i in mamba],
                                       [self.layers[i].mixer.A for i in mamba], self._pending_lists(cache, mamba))
        cache.pending_count.zero_()
        cache.pending_dirty = False

    @staticmethod
    def _pending_lists(cache: ModelCache, mamba: list[int]):
        """The pending inputs of the Mamba layers `mamba` as the replay ops take them."""
        views = [cache.pending_inputs(i) for i in mamba]
        return [v[0] for v in views], [v[1] for v in views], [v[2] for v in views], cache.pending_count

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm_f(h)).float()

    def forward(self, input_ids: torch.Tensor, cache: ModelCache | None = None, last_only: bool = False) -> torch.Tensor:
        """Full-sequence path (prefill and training).

        Args:
            input_ids: (B, T).
            cache: continued from and updated in place when given.
            last_only: return only the last position's logits (B, 1, V).
        Returns:
            logits (B, T, V) in fp32.
        """
        if cache is not None:
            self.settle(cache)
        h = self.embeddings(input_ids)
        embeddings, injected = h, None  # injected: a shared-block use's output, for the next input
        block_input = h  # what a parallel sublayer reads: the previous sublayer's input
        recompute = self.recompute_activations and cache is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if not layer.parallel:
                block_input = h
            args = (layer, block_input, embeddings, injected, None if cache is None else cache.layers[i],
                    None if cache is None else cache.seqlen)
            x = checkpoint(_sublayer, *args, use_reentrant=False) if recompute else _sublayer(*args)
            injected = None
            if layer.injects:
                injected = x
            else:
                h = h + x
        if cache is not None:
            cache.seqlen += input_ids.shape[1]
        return self._logits(h[:, -1:] if last_only else h)

    def step(self, input_ids: torch.Tensor, cache: ModelCache, float_logits: bool = True) -> torch.Tensor:
        """One token per row: input_ids (B, 1) -> logits (B, 1, V) fp32; cache advanced by one.
        float_logits=False lets the kernel path keep the logits in the LM head's dtype (as in
        `verify`: one cast launch fewer, for callers that take only their argmax or cast them)."""
        self.settle(cache)
        if not torch.is_grad_enabled() and self._fusable(input_ids.device):
            return self._fused_step(input_ids, cache, float_logits)
        h = self.embeddings(input_ids)
        embeddings, injected = h, None  # injected: a shared-block use's output, for the next input
        block_input = h  # what a parallel sublayer reads: the previous sublayer's input
        for i, layer in enumerate(self.layers):
            if not layer.parallel:
                block_input = h
            x, injected = layer.input(block_input, embeddings, injected), None
            if layer.kind == "mamba":
                x = layer.mixer.step(x, cache.layers[i])
            elif layer.kind == "attention":
                x = layer.mixer.step(x, cache.layers[i], cache.seqlen)
            else:
                x = layer.mixer(x)
            if layer.injects:
                injected = x
            else:
                h = h + x
        cache.seqlen += 1
        return self._logits(h)

    def _fusable(self, device: torch.device) -> bool:
        """Whether step and verify run on the kernel path (`_fused_stack`): where ops/paths.py
        says so, and for a stack without parallel sublayers or shared blocks, whose inputs are
        not the plain residual stream that the kernel path's deferred adds assume."""
        return (paths.fused_layers(self.config.d_model, device) and not self.config.parallel_layers
                and self.config.shared_blocks is None)

    def _fused_stack(self, h: torch.Tensor, run_mixer, run_folded, float_logits: bool = True):
        """The sublayers on the kernel path: each residual add runs inside the next sublayer's
        RMSNorm (one launch instead of two: ops/step_update add_rms_norm) and the LM head goes
        through `dispatch.linear` (one-row GEMV or skinny GEMM). Sublayers whose norms are folded
        into their projections (models/fold.py) run whole, norms and residual add inside their
        projections.

        run_mixer(i, layer, normed) -> (output, activations or None);
        run_folded(i, layer, h, h_sq) -> (h + sublayer(h), its partial sums of squares or None,
        activations or None), where h_sq are h's (or None): a folded sublayer's output projection
        hands the next one's norm its sums of squares (ops/gemv `norm_linear`). run_folded may
        overwrite h (the residual add in place): h is dead once its sublayer has run.
        Returns (logits, acts): fp32 logits, or in the LM head's dtype when not float_logits.
        """
        x = None  # the previous sublayer's output, not yet added to h
        h_sq = None  # h's partial sums of squares while h is a folded sublayer's output
        acts = []
        for i, layer in enumerate(self.layers):
            if layer.norms_folded:
                if x is not None:
                    h, x, h_sq = h + x, None, None
                h, h_sq, a = run_folded(i, layer, h, h_sq)
            else:
                h_sq = None
                if x is None:
                    normed = layer.norm(h)
                else:
                    h, normed = dispatch.add_rms_norm(x, h, layer.norm.weight, layer.norm.eps)
                x, a = run_mixer(i, layer, normed)
            acts.append(a)
        if x is None:
            normed = self.norm_f(h)
        else:
            _, normed = dispatch.add_rms_norm(x, h, self.norm_f.weight, self.norm_f.eps)
        logits = dispatch.linear(normed, self.lm_head.weight, self.lm_head.bias)
        return (logits.float() if float_logits else logits), acts

    def _fused_step(self, input_ids: torch.Tensor, cache: ModelCache, float_logits: bool = True) -> torch.Tensor:
        """`step` on the kernels, same math (see `_fused_stack`). input_ids (B, 1) -> logits (B, 1, V)."""
        runner = self.one_launch.step(self, input_ids.shape[0], input_ids.device)
        if runner is not None:  # every layer, the final norm and the LM head in one launch
            logits = runner(self.embeddings(input_ids)[:, 0], cache)
            cache.seqlen += 1
            return logits[:, None]

        def run_mixer(i, layer, normed):
            if layer.kind == "mamba":
                return layer.mixer.step(normed, cache.layers[i]), None
            if layer.kind == "attention":
                return layer.mixer.step(normed, cache.layers[i], cache.seqlen), None
            if layer.kind == "moe":
                return layer.mixer(normed), None
            return _mlp_through_dispatch(layer.mixer, normed), None

        def run_folded(i, layer, h, h_sq):
            if layer.kind == "mamba":
                return layer.mixer.folded_residual_step(h, cache.layers[i], layer.norm.eps), None, None
            out, _ = _folded_mlp_residual(layer.mixer, h, layer.norm.eps)
            return out, None, None

        logits, _ = self._fused_stack(self.embeddings(input_ids), run_mixer, run_folded, float_logits)
        cache.seqlen += 1
        return logits

    def verify(self, tokens: torch.Tensor, tree, cache: ModelCache, float_logits: bool = True):
        """Logits of every node of a packed token tree in one call; the cache is left untouched.

        Args:
            tokens: (B, N) packed tree tokens, node 0 the root.
            tree: a `ssmspec.trees.Tree` (parents, depths, ancestor mask).
            cache: the state after the prefix.
            float_logits: False lets the kernel path keep the logits in the LM head's dtype (bf16
                models: half the bytes, no cast launch), for callers that only take their argmax.
        Returns:
            logits (B, N, V) fp32 (or, see float_logits, the LM head's dtype), and TreeActivations
            for `replay`.
        """
        device = tokens.device
        if not torch.is_grad_enabled() and self._fusable(device):
            return self._fused_verify(tokens, tree, cache, float_logits)
        parents = tree.parents_tensor(device)
        depth = tree.depth_tensor(device)
        mask = tree.mask_tensor(device)
        h = self.embeddings(tokens)
        acts = []
        embeddings, injected = h, None  # injected: a shared-block use's output, for the next input
        block_input = h  # what a parallel sublayer reads: the previous sublayer's input
        for i, layer in enumerate(self.layers):
            if not layer.parallel:
                block_input = h
            x, injected = layer.input(block_input, embeddings, injected), None
            if layer.kind == "mamba":
                x, a = layer.mixer.verify(x, cache.layers[i], parents, cache.pending_inputs(i))
            elif layer.kind == "attention":
                x, a = layer.mixer.verify(x, cache.layers[i], cache.seqlen, depth, mask)
            else:
                x, a = layer.mixer(x), None
            acts.append(a)
            if layer.injects:
                injected = x
            else:
                h = h + x
        return self._logits(h), TreeActivations(acts)

    def verify_splits_in_proj(self, nodes: int, batch: int = 1) -> bool:
        """Whether `verify` (without autograd) of `nodes`-node trees at `batch` rows splits the
        folded Mamba layers' in_proj and runs z's GEMM beside the conv and the scan (ops/overlap.py)."""
        if not self._fusable(self.device):
            return False  # the plain verify loop, which never splits
        return any(layer.kind == "mamba" and layer.norms_folded
                   and layer.mixer.verify_splits_in_proj(batch * nodes, batch, self.device) for layer in self.layers)

    def _fused_verify(self, tokens: torch.Tensor, tree, cache: ModelCache, float_logits: bool = True):
        """`verify` on the kernels, same math and contract (see `_fused_stack`)."""
        device = tokens.device
        parents = tree.parents_tensor(device)
        runner = self.one_launch.verify(self, tokens.numel(), device)
        if runner is not None:
            return self._stream_proj_verify(runner, tokens, parents, cache, float_logits)
        depth = tree.depth_tensor(device)
        mask = tree.mask_tensor(device)

        def run_mixer(i, layer, normed):
            if layer.kind == "mamba":
                return layer.mixer.verify(normed, cache.layers[i], parents, cache.pending_inputs(i))
            if layer.kind == "attention":
                return layer.mixer.verify(normed, cache.layers[i], cache.seqlen, depth, mask)
            if layer.kind == "moe":
                return layer.mixer(normed), None
            return _mlp_through_dispatch(layer.mixer, normed), None

        def run_folded(i, layer, h, h_sq):
            if layer.kind == "mamba":
                return layer.mixer.folded_residual_verify(h, cache.layers[i], parents, layer.norm.eps, h_sq,
                                                          cache.pending_inputs(i))
            return *_folded_mlp_residual(layer.mixer, h, layer.norm.eps, h_sq), None

        logits, acts = self._fused_stack(self.embeddings(tokens), run_mixer, run_folded, float_logits)
        return logits, TreeActivations(acts)

    def _stream_proj_verify(self, runner, tokens: torch.Tensor, parents: torch.Tensor, cache: ModelCache,
                            float_logits: bool = True):
        """`verify` with every layer's projections on the weight stream: one launch per layer
        boundary (layer i's out_proj, then layer i + 1's in_proj), the tree conv and the gated
        scan between them as Triton kernels. Same math and contract as `_fused_verify`."""
        h = self.embeddings(tokens).contiguous()
        mixers = [layer.mixer for layer in self.layers]
        zx = runner(h, in_mixer=mixers[0], in_eps=self.layers[0].norm.eps)
        acts = []
        for i, m in enumerate(mixers):
            c = m.cfg
            z, xBC, dt_raw = zx.view(*tokens.shape, -1).split([c.d_inner, c.conv_dim, c.n_heads], dim=-1)
            gated, _, a = m.verify_conv_scan(z, xBC, dt_raw, cache.layers[i], parents, cache.pending_inputs(i))
            acts.append(a)
            last = i + 1 == len(mixers)
            zx = runner(h, out_mixer=m, g=gated, in_mixer=None if last else mixers[i + 1],
                        in_eps=0.0 if last else self.layers[i + 1].norm.eps)
        logits = dispatch.linear(self.norm_f(h), self.lm_head.weight, self.lm_head.bias)
        return (logits.float() if float_logits else logits), TreeActivations(acts)

    def replay(self, cache: ModelCache, acts: TreeActivations, path: torch.Tensor, path_len: torch.Tensor) -> None:
        """Advance the cache along the accepted path: (B, M) node indices (root first), (B,) lengths.

        With pending slots (new_cache(pending=...)) the SSM states take the path's inputs into
        the slots instead, and absorb them all only when a next path of width M might not fit."""
        mamba = [i for i, layer in enumerate(self.layers) if layer.kind == "mamba"]
        pending = self._pending_lists(cache, mamba) if mamba and cache.pending_count is not None else None
        if mamba:  # every Mamba layer in one call: one launch on the kernels instead of one per layer
            states = [cache.layers[i] for i in mamba]
            saved = [acts.layers[i] for i in mamba]
            dispatch.replay_states_layers(
                [s.conv_state for s in states], [s.ssm_state for s in states], [a.xBC for a in saved],
                [a.x for a in saved], [a.dt for a in saved], [self.layers[i].mixer.A for i in mamba],
                [a.B for a in saved], path, path_len, pending,
            )
        for i, layer in enumerate(self.layers):
            if layer.kind == "attention":
                layer.mixer.replay(cache.layers[i], acts.layers[i], cache.seqlen, path, path_len)
        if pending is None:
            cache.seqlen += path_len.to(cache.seqlen.dtype)
        else:  # one launch: seqlen and the pending count (0 where the replay flushed)
            dispatch.advance_positions(cache.seqlen, cache.pending_count, path_len, path.shape[1],
                                       cache.pending_capacity)
            cache.pending_dirty = True
