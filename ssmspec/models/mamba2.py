"""The Mamba-2 mixer with its three paths: `forward` (sequence), `step` (one token), `verify` (tree)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import dispatch, overlap, paths
from ..ops.causal_conv.naive import with_conv_history
from .cache import MambaLayerCache
from .config import MambaConfig


def split_conv_output(xBC: torch.Tensor, heads: int, head_dim: int, groups: int):
    """The views x (..., heads, head_dim), B and C (..., groups, d_state) of the conv's output [x | B | C]."""
    d_state = (xBC.shape[-1] - heads * head_dim) // (2 * groups)
    x, B, C = xBC.split([heads * head_dim, groups * d_state, groups * d_state], dim=-1)
    return x.unflatten(-1, (heads, head_dim)), B.unflatten(-1, (groups, d_state)), C.unflatten(-1, (groups, d_state))


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of channels (norm_before_gate=False), computed in fp32."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and dispatch.uses_kernel("gated_rms_norm", y.device):
            return dispatch.gated_rms_norm(y, z, self.weight, self.group_size, self.eps)  # one launch
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        h = h.unflatten(-1, (-1, self.group_size))  # (..., groups, group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.flatten(-2).to(dtype)


@dataclass
class MambaTreeActivations:
    """What `verify` keeps for replay: enough to advance conv and SSM states along any path."""

    xBC: torch.Tensor  # (B, N, C) pre-conv inputs
    x: torch.Tensor  # (B, N, H, P) SSM inputs after the conv
    dt: torch.Tensor  # (B, N, H) processed time steps
    B: torch.Tensor  # (B, N, G, S)


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | xBC | dt]; causal conv on xBC; SSD scan; gated RMSNorm; out_proj.

    Parameter names follow transformers' Mamba2Mixer, so its checkpoints load directly.
    """

    def __init__(self, d_model: int, cfg: MambaConfig):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(d_model, 2 * cfg.d_inner + 2 * cfg.n_groups * cfg.d_state + cfg.n_heads, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(cfg.n_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.n_heads))
        self.D = nn.Parameter(torch.ones(cfg.n_heads))
        self.norm = GatedRMSNorm(cfg.d_inner, cfg.d_inner // cfg.n_groups, cfg.norm_eps) if cfg.gate_norm else None
        self.out_proj = nn.Linear(cfg.d_inner, d_model, bias=cfg.proj_bias)

    # -- shared pieces ----------------------------------------------------------------------
    def new_cache(self, batch: int, device, dtype, pending: int = 0) -> MambaLayerCache:
        """pending: slots for inputs not yet absorbed by the SSM state (models/cache.py), or 0."""
        c = self.cfg
        cache = MambaLayerCache(
            conv_state=torch.zeros(batch, c.conv_dim, c.conv_kernel - 1, device=device, dtype=dtype),
            ssm_state=torch.zeros(batch, c.n_heads, c.head_dim, c.d_state, device=device, dtype=torch.float32),
        )
        if pending:
            cache.pending_x = torch.zeros(batch, pending, c.n_heads, c.head_dim, device=device, dtype=dtype)
            cache.pending_dt = torch.zeros(batch, pending, c.n_heads, device=device, dtype=torch.float32)
            cache.pending_B = torch.zeros(batch, pending, c.n_groups, c.d_state, device=device, dtype=dtype)
        return cache

    @property
    def A(self) -> torch.Tensor:
        if not torch.is_grad_enabled() and dispatch.uses_kernel("tree_scan", self.A_log.device):
            # Fast path: computed once per weight version, so verify/replay launch nothing for
            # it (and a CUDA graph captures a fixed tensor).
            key = (self.A_log.data_ptr(), self.A_log._version)
            if getattr(self, "_A_key", None) != key:
                self._A_cached, self._A_key = -torch.exp(self.A_log.float()), key
            return self._A_cached
        return -torch.exp(self.A_log.float())

    def _split_projection(self, h: torch.Tensor):
        c = self.cfg
        if not torch.is_grad_enabled() and dispatch.uses_kernel("linear", h.device):
            # GEMV / skinny GEMM for few rows (tree verify), cuBLAS above: ops/gemv
            proj = dispatch.linear(h, self.in_proj.weight, self.in_proj.bias)
        else:
            proj = self.in_proj(h)
        return proj.split([c.d_inner, c.conv_dim, c.n_heads], dim=-1)  # z, xBC, dt

    def _time_step(self, dt_raw: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and dispatch.uses_kernel("time_step", dt_raw.device):
            return dispatch.time_step(dt_raw, self.dt_bias, self.cfg.dt_min, self.cfg.dt_max)  # one launch
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        return dt.clamp(self.cfg.dt_min, self.cfg.dt_max)

    def _split_conv_out(self, xBC: torch.Tensor):
        return split_conv_output(xBC, self.cfg.n_heads, self.cfg.head_dim, self.cfg.n_groups)

    def _output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.norm is None:  # no norm: out_proj(y * silu(z)), the product in fp32
            gated = (y.flatten(-2).float() * F.silu(z.float())).to(z.dtype)
            if not torch.is_grad_enabled() and dispatch.uses_kernel("linear", y.device):
                return dispatch.linear(gated, self.out_proj.weight, self.out_proj.bias)
            return self.out_proj(gated)
        if not torch.is_grad_enabled() and dispatch.uses_kernel("gated_rms_norm", y.device):
            # one launch: the kernel rounds y to z's dtype itself, as the line below does
            normed = dispatch.gated_rms_norm(y.flatten(-2), z, self.norm.weight, self.norm.group_size, self.norm.eps)
            return dispatch.linear(normed, self.out_proj.weight, self.out_proj.bias)
        y = y.flatten(-2).to(z.dtype)  # (..., H*P)
        return self.out_proj(self.norm(y, z))

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1)  # (C, K)

    # -- full sequence (prefill, training) --------------------------------------------------
    def forward(self, h: torch.Tensor, cache: MambaLayerCache | None = None) -> torch.Tensor:
        """Args: h (B, T, D); cache updated in place when given. Returns (B, T, D)."""
        z, xBC, dt_raw = self._split_projection(h)
        T = h.shape[1]
        K = self.cfg.conv_kernel
        state = None if cache is None else cache.conv_state  # (B, C, K-1): the inputs before this call's
        if not torch.is_grad_enabled() and dispatch.uses_kernel("causal_conv", xBC.device):
            # conv and silu in one launch reading xBC in place (eager inference: a distillation
            # target, evaluation); conv1d would transpose xBC around a generic depthwise kernel
            xBC_conv = dispatch.causal_conv(xBC, state, self.conv_weight, self.conv1d.bias)
        elif state is None and K == 4 and dispatch.uses_kernel("causal_conv_train", xBC.device):
            # training: one launch each way, each row of x, dy, y and dx moved once (ops/causal_conv)
            xBC_conv = dispatch.causal_conv_train(xBC, self.conv_weight, self.conv1d.bias)
        else:
            xBC_conv = F.silu(self._causal_conv(with_conv_history(xBC, state, K), T))
        if cache is not None:  # after the conv has read it: the last K-1 inputs, this call's and before
            tail = with_conv_history(xBC[:, -(K - 1):], state, K)[:, -(K - 1):]
            cache.conv_state.copy_(tail.transpose(1, 2))
        dt = self._time_step(dt_raw)
        if cache is None and torch.is_grad_enabled() and dispatch.packed_chunk_scan is not None:
            # training through a kernel that takes the conv's output whole and gives its gradient
            # whole: no copy assembling [dx | dB | dC] in the backward (training/scan_op.py)
            c = self.cfg
            y, _ = dispatch.packed_chunk_scan(xBC_conv, dt, self.A, self.D, c.chunk_size, c.head_dim, c.n_groups)
            return self._output(y, z)
        x, B, C = self._split_conv_out(xBC_conv)
        # without autograd (a distillation target, evaluation, a drafter catching up on 3+ tokens in the
        # host-loop decode): the forward-only kernel; a GPU prefill in decoding goes by ChainPrefill instead
        scan = dispatch.chunk_scan_forward if not torch.is_grad_enabled() and \
            dispatch.uses_kernel("chunk_scan_forward", x.device) else dispatch.chunk_scan
        y, final = scan(x, dt, self.A, B, C, self.D, self.cfg.chunk_size, None if cache is None else cache.ssm_state)
        if cache is not None:
            cache.ssm_state.copy_(final)
        return self._output(y, z)

    def _causal_conv(self, extended: torch.Tensor, T: int) -> torch.Tensor:
        """The depthwise causal conv of (B, K-1+T, C) left-padded inputs -> (B, T, C) in their dtype."""
        if torch.compiler.is_compiling():
            # K shifted products, summed in fp32: Inductor fuses them with the silu after into one
            # kernel each way, where conv1d is a launch per pass plus transposed copies around it
            weight = self.conv_weight.float()  # (C, K)
            out = sum(extended[:, k : k + T].float() * weight[:, k] for k in range(weight.shape[1]))
            if self.conv1d.bias is not None:
                out = out + self.conv1d.bias.float()
            return out.to(extended.dtype)
        conv = F.conv1d(extended.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, groups=self.cfg.conv_dim)
        return conv.transpose(1, 2)[:, :T]

    # -- one token ---------------------------------------------------------------------------
    def step(self, h: torch.Tensor, cache: MambaLayerCache) -> torch.Tensor:
        """Args: h (B, 1, D); cache updated in place. Returns (B, 1, D)."""
        if self.norm is not None and dispatch.uses_kernel("mamba_step", h.device):  # the kernel has the norm inside
            return self._fused_step(h, cache)
        z, xBC, dt_raw = self._split_projection(h)
        window = torch.cat([cache.conv_state.to(xBC.dtype), xBC.transpose(1, 2)], dim=-1)  # (B, C, K)
        cache.conv_state.copy_(window[:, :, 1:])
        conv = (window.float() * self.conv_weight.float()).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias.float()
        x, B, C = self._split_conv_out(F.silu(conv).to(xBC.dtype))  # x (B, H, P), B/C (B, G, S)
        dt = self._time_step(dt_raw[:, 0])  # (B, H)
        heads, groups = self.cfg.n_heads, self.cfg.n_groups
        Bh = B.float().repeat_interleave(heads // groups, dim=1)  # (B, H, S)
        Ch = C.float().repeat_interleave(heads // groups, dim=1)
        state = cache.ssm_state * torch.exp(dt * self.A)[..., None, None]
        state = state + torch.einsum("bh,bhp,bhs->bhps", dt, x.float(), Bh)
        cache.ssm_state.copy_(state)
        y = torch.einsum("bhps,bhs->bhp", state, Ch) + x.float() * self.D.float()[:, None]
        return self._output(y[:, None], z)

    def _fused_step(self, h: torch.Tensor, cache: MambaLayerCache) -> torch.Tensor:
        """`step` on the kernels: GEMV in_proj, conv + state update + gated norm in two launches
        (ops/step_update), GEMV out_proj. Same math as `step`; h (B, 1, D) -> (B, 1, D)."""
        c = self.cfg
        zxbcdt = dispatch.linear(h, self.in_proj.weight, self.in_proj.bias)
        z, xBC, dt_raw = zxbcdt.split([c.d_inner, c.conv_dim, c.n_heads], dim=-1)
        out = dispatch.mamba_step(
            xBC[:, 0], dt_raw[:, 0], z[:, 0], cache.conv_state, cache.ssm_state, self.conv_weight,
            self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight, c.n_groups,
            c.d_inner // self.norm.group_size, c.dt_min, c.dt_max, self.norm.eps,
        )
        return dispatch.linear(out[:, None], self.out_proj.weight, self.out_proj.bias)

    def folded_residual_step(self, h: torch.Tensor, cache: MambaLayerCache, pre_norm_eps: float) -> torch.Tensor:
        """h + step(pre_norm(h)) with both norms' weights folded into in_proj and out_proj
        (models/fold.py), on the kernels: in_proj with the pre-norm inside it, then the fused
        step with the gated norm and the residual add inside out_proj (at batch 1 three launches
        for the whole sublayer). h (B, 1, D) -> (B, 1, D); cache updated in place."""
        c = self.cfg
        zxbcdt = dispatch.norm_linear(h, self.in_proj.weight, self.in_proj.bias, 1, pre_norm_eps)
        z, xBC, dt_raw = zxbcdt.split([c.d_inner, c.conv_dim, c.n_heads], dim=-1)
        out = dispatch.mamba_step_out(
            xBC[:, 0], dt_raw[:, 0], z[:, 0], cache.conv_state, cache.ssm_state, self.conv_weight,
            self.conv1d.bias, self.dt_bias, self.A_log, self.D, None, c.n_groups,
            c.d_inner // self.norm.group_size, c.dt_min, c.dt_max, self.norm.eps, self.out_proj.weight,
            self.out_proj.bias, residual=h[:, 0],
        )
        return out[:, None]

    # -- packed tree -------------------------------------------------------------------------
    def verify(self, h: torch.Tensor, cache: MambaLayerCache, parents: torch.Tensor, pending=None):
        """Outputs of all tree nodes, each as if its root-to-node path were decoded alone.

        Writes nothing to the cache; returns the activations `replay` needs.

        Args:
            h: (B, N, D) inputs of the packed tree nodes.
            cache: the state after the prefix (before the root).
            parents: (N,) int, -1 for the root.
            pending: the cache's pending inputs (ModelCache.pending_inputs), or None.
        Returns:
            out (B, N, D) and MambaTreeActivations.
        """
        z, xBC, dt_raw = self._split_projection(h)
        xBC_conv = dispatch.tree_conv(xBC, cache.conv_state, self.conv_weight, self.conv1d.bias, parents)
        x, B, C = self._split_conv_out(xBC_conv)
        dt = self._time_step(dt_raw)
        y = dispatch.tree_scan(x, dt, self.A, B, C, self.D, parents, cache.ssm_state, pending)
        return self._output(y, z), MambaTreeActivations(xBC=xBC, x=x, dt=dt, B=B)

    def _split_args(self, rows: int, batch: int, device: torch.device) -> tuple:
        c, w = self.cfg, self.in_proj.weight
        return (rows, batch, c.d_inner, c.conv_dim + c.n_heads, w.shape[1], w.element_size(), c.n_heads, c.head_dim,
                device)

    def verify_splits_in_proj(self, rows: int, batch: int, device: torch.device) -> bool:
        """Whether `folded_residual_verify` on `rows` rows (batch x nodes) splits in_proj and runs
        z's GEMM beside the conv and the scan (ops/overlap.py)."""
        return paths.splits_in_proj(*self._split_args(rows, batch, device))

    def folded_residual_verify(self, h: torch.Tensor, cache: MambaLayerCache, parents: torch.Tensor,
                               pre_norm_eps: float, h_sq: torch.Tensor | None = None, pending=None):
        """h + verify(pre_norm(h)) with both norms' weights folded into in_proj and out_proj
        (models/fold.py), on the kernels: the pre-norm inside in_proj, the time step and the gate
        inside the tree scan, the gated norm and the residual add inside out_proj.

        h_sq: h's partial sums of squares from its producer, or None (ops/gemv `norm_linear`);
        the gated value's come from the scan, so neither norm needs a launch of its own.
        pending: the cache's pending inputs, as in `verify`.
        h (B, N, D) -> (B, N, D), its partial sums of squares (or None), and the activations
        for `replay`. h itself may be overwritten by the output (the residual add in place).

        From ops/paths.SPLIT_IN_PROJ_MIN_ROWS rows on (where `verify_splits_in_proj`), in_proj
        runs as two GEMMs and z's beside the conv and the scan, on a second stream."""
        c = self.cfg
        w, bias = self.in_proj.weight, self.in_proj.bias
        split = overlap.split_in_proj_counters(*self._split_args(h.numel() // h.shape[-1], h.shape[0], h.device))
        side = None
        if split is None:
            zxbcdt = dispatch.norm_linear(h, w, bias, 1, pre_norm_eps, x_sq=h_sq)
            z, xBC, dt_raw = zxbcdt.split([c.d_inner, c.conv_dim, c.n_heads], dim=-1)
        else:
            # ops/overlap.py: in_proj in two, [x B C dt] first; then z's GEMM on the second stream
            # runs beside the conv and the scan, which waits for z's columns by ready counters.
            # (Launched beside both, z's GEMM measured level at 64 nodes, so it waits for the first.)
            counters, readers = split
            z_args = (h, w[: c.d_inner], None if bias is None else bias[: c.d_inner], 1, pre_norm_eps)
            z_flags = (counters, c.head_dim, readers)
            xbcdt = dispatch.norm_linear(h, w[c.d_inner:], None if bias is None else bias[c.d_inner:], 1,
                                         pre_norm_eps, x_sq=h_sq)
            if h.is_cuda:
                main, side = torch.cuda.current_stream(h.device), overlap.side_stream(h.device)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    # z's memory is freed on the main stream after the join below; the side
                    # stream's next use of it is the next layer's z, ordered after that join
                    z = dispatch.norm_linear(*z_args, x_sq=h_sq, ready_flags=z_flags)
            else:  # the CPU interpreter runs launches one after another
                z = dispatch.norm_linear(*z_args, x_sq=h_sq, ready_flags=z_flags)
            xBC, dt_raw = xbcdt.split([c.conv_dim, c.n_heads], dim=-1)
        try:
            gated, g_sq, acts = self.verify_conv_scan(z, xBC, dt_raw, cache, parents, pending,
                                                      gate_flags=None if split is None else split[0])
        except Exception:
            if split is not None:  # z's GEMM raised the counters and no scan counted them down
                if side is not None:
                    main.wait_stream(side)
                split[0].zero_()
            raise
        if side is not None:
            main.wait_stream(side)
        norm_groups = c.d_inner // self.norm.group_size
        if g_sq.shape[1] != norm_groups:  # norm groups other than the SSM groups: the norm reduces itself
            g_sq = None
        out, out_sq = dispatch.norm_linear(gated, self.out_proj.weight, self.out_proj.bias, norm_groups,
                                           self.norm.eps, residual=h, x_sq=g_sq, return_sq=True,
                                           reuse_residual=True)
        return out, out_sq, acts

    def verify_conv_scan(self, z, xBC, dt_raw, cache: MambaLayerCache, parents: torch.Tensor, pending=None,
                         gate_flags=None):
        """The verify layer between its projections, on the kernels: the tree conv of in_proj's
        xBC and the gated tree scan (gated = y * silu(z), the time step from dt_raw inside).
        -> (gated (B, N, d_inner), its partial sums of squares per SSM group, the activations
        for `replay`). gate_flags: z's ready counters when z's GEMM runs beside (ops/overlap.py)."""
        c = self.cfg
        xBC_conv = dispatch.tree_conv(xBC, cache.conv_state, self.conv_weight, self.conv1d.bias, parents)
        x, B, C = self._split_conv_out(xBC_conv)
        gated, dt, g_sq = dispatch.tree_scan_gated(x, dt_raw, self.dt_bias, c.dt_min, c.dt_max, self.A, B, C,
                                                   self.D, z, parents, cache.ssm_state, return_sq=True,
                                                   pending=pending, gate_flags=gate_flags)
        return gated, g_sq, MambaTreeActivations(xBC=xBC, x=x, dt=dt, B=B)

    def replay(self, cache: MambaLayerCache, acts: MambaTreeActivations, path: torch.Tensor, path_len: torch.Tensor):
        """Advance the cache over the accepted path (B, M) of valid length path_len (B,).

        A cache with pending slots needs the model-wide count: LanguageModel.replay."""
        if cache.pending_x is not None:
            raise ValueError("this layer cache keeps pending inputs: replay through LanguageModel.replay")
        dispatch.replay_states(cache.conv_state, cache.ssm_state, acts.xBC, acts.x, acts.dt, self.A, acts.B,
                               path, path_len)
