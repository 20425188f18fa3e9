"""Build and run `kernel.cu` for a model: the layer stack of a batch-1 decode step in one launch.

Built on first use with torch's C++ extension loader (nvcc and ninja on the machine; the build
is cached under TORCH_EXTENSIONS_DIR, one per shape), for Hopper (sm_90a: the kernel's bulk copies
and mbarriers). `unsupported_reason` says why a model or machine cannot use it; the caller then
keeps the Triton path. ops/paths.py decides when to use it.
"""
from __future__ import annotations

import functools
import os
import shutil

import torch

from .. import cuda_build, pdl

SLOTS = 5          # ring slots (5 measured faster than 2, 3 or 4)
SLOT_SEGMENTS = 8  # d_model-wide rows per slot: kernel.cu's SLOT_SEGS
MAX_SMEM = 227 * 1024
CONSUMER_THREADS = 256
THREADS = CONSUMER_THREADS + 32

_LAUNCHER = r"""
#include <torch/extension.h>
#include "launch.cuh"

void launch(torch::Tensor table, int64_t n_layers, torch::Tensor h_in, torch::Tensor h_out, torch::Tensor zx,
            torch::Tensor g, torch::Tensor hbuf, torch::Tensor counter, double eps_in, double eps_out,
            double dt_min, double dt_max, torch::Tensor lm_w, torch::Tensor norm_w, double eps_f,
            torch::Tensor logits, int64_t smem, bool pdl) {
  // The grid barrier's counter starts at zero (a new tensor) and each launch leaves it at zero.
  launch_one_cta_per_sm(
      stream_layers, THREADS, smem, pdl, reinterpret_cast<const Layer*>(table.data_ptr()), (int)n_layers,
      reinterpret_cast<const __nv_bfloat16*>(h_in.data_ptr()), reinterpret_cast<__nv_bfloat16*>(h_out.data_ptr()),
      reinterpret_cast<__nv_bfloat16*>(zx.data_ptr()), reinterpret_cast<__nv_bfloat16*>(g.data_ptr()),
      reinterpret_cast<__nv_bfloat16*>(hbuf.data_ptr()), reinterpret_cast<unsigned*>(counter.data_ptr()),
      (float)eps_in, (float)eps_out, (float)dt_min, (float)dt_max,
      reinterpret_cast<const __nv_bfloat16*>(lm_w.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(norm_w.data_ptr()),
      (int)lm_w.size(0), (float)eps_f, logits.data_ptr<float>());
}
"""
_DECLARATION = ("void launch(torch::Tensor table, int64_t n_layers, torch::Tensor h_in, torch::Tensor h_out, "
                "torch::Tensor zx, torch::Tensor g, torch::Tensor hbuf, torch::Tensor counter, double eps_in, "
                "double eps_out, double dt_min, double dt_max, torch::Tensor lm_w, torch::Tensor norm_w, double eps_f, "
                "torch::Tensor logits, int64_t smem, bool pdl);")


def smem_bytes(d_model: int) -> int:
    """kernel.cu's dynamic shared memory: the ring, the step's arrays, the mbarriers."""
    return SLOTS * SLOT_SEGMENTS * d_model * 2 + (2 * 128 + 64 + 4 * 64) * 4 + 3 * SLOTS * 8


def width_reason(d_model: int, smem: int, widest: int) -> str | None:
    """The width check both one-launch kernels make (this one and ops/stream_proj), or None: a
    multiple of 256 (the tiling) whose shared memory, `smem`, fits."""
    if d_model % 256 or smem > MAX_SMEM:
        return f"d_model {d_model} does not fit the kernel's tiling (a multiple of 256 up to {widest})"
    return None


def machine_reason(device: torch.device) -> str | None:
    """The machine checks both one-launch kernels make, or None: CUDA, Hopper, nvcc and ninja."""
    if device.type != "cuda":
        return "needs CUDA"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "needs a Hopper GPU (sm_90)"
    if shutil.which("nvcc") is None or shutil.which("ninja") is None:
        return "needs nvcc and ninja to build"
    return None


def unsupported_reason(model, batch: int, device: torch.device) -> str | None:
    """Why `model`'s decode step cannot run on the kernel here, or None when it can."""
    if batch != 1:
        return "batch 1 only"
    d_model = model.config.d_model
    if (why := width_reason(d_model, smem_bytes(d_model), 2816)) is not None:
        return why
    stack = model.folded_mamba_stack()
    if stack is None:
        return "every layer must be a Mamba-2 layer with its norms folded (models/fold.py)"
    limits = set()
    for m, pre_norm_eps in stack:
        c = m.cfg
        if c.d_state != 128 or c.n_groups != 1 or c.d_inner != 2 * d_model or m.norm.group_size != c.d_inner:
            return (f"mixer shape not supported (d_state {c.d_state}, groups {c.n_groups}, d_inner {c.d_inner}, "
                    f"norm group {m.norm.group_size}): needs d_state 128, one group, d_inner 2 * d_model")
        if m.in_proj.bias is not None or m.out_proj.bias is not None or m.conv1d.bias is None:
            return "projection biases, or a conv without bias, are not supported"
        if any(t.dtype != torch.bfloat16 for t in (m.in_proj.weight, m.out_proj.weight, m.conv1d.weight)):
            return "bf16 weights only"
        if len({m.dt_bias.dtype, m.A_log.dtype, m.D.dtype}) != 1 or m.dt_bias.dtype not in (torch.bfloat16, torch.float32):
            return "dt_bias, A_log and D must share one dtype, bf16 or fp32"
        limits.add((pre_norm_eps, m.norm.eps, c.dt_min, c.dt_max, c.conv_kernel, c.n_heads, c.head_dim,
                    m.dt_bias.dtype))
    if len(limits) != 1:
        return "the layers differ in shape, eps or dt limits"
    lm, norm_f = model.lm_head, model.norm_f
    if lm.bias is not None or lm.weight.dtype != torch.bfloat16 or not lm.weight.is_contiguous() \
            or norm_f.weight.dtype != torch.bfloat16:
        return "the LM head must be bf16 without bias, after a bf16 final norm"
    if (why := machine_reason(device)) is not None:
        return why
    ctas = torch.cuda.get_device_properties(device).multi_processor_count
    if -(-d_model // ctas) > 32 or -(-2 * d_model // ctas) > 64:
        return f"d_model {d_model} needs more multiprocessors than the {ctas} here"
    return None


def nvcc_flags(d_model: int, n_heads: int, head_dim: int, conv_k: int, param_fp32: bool) -> list[str]:
    """nvcc's flags for one shape (bench/compile_extensions.py compiles with them off the GPU)."""
    return ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-diag-suppress", "177,550",
            "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", f"-DD_MODEL={d_model}", f"-DN_HEADS={n_heads}",
            f"-DHEAD_DIM={head_dim}", "-DD_STATE=128", f"-DCONV_K={conv_k}", f"-DN_SLOTS={SLOTS}",
            f"-DPARAM_T={'float' if param_fp32 else '__nv_bfloat16'}"]


@functools.cache
def _module(d_model: int, n_heads: int, head_dim: int, conv_k: int, param_fp32: bool):
    """The extension for one shape (built once per shape and machine, then loaded from cache)."""
    with open(os.path.join(os.path.dirname(__file__), "kernel.cu")) as f:
        source = f.read() + _LAUNCHER
    flags = nvcc_flags(d_model, n_heads, head_dim, conv_k, param_fp32)
    name = f"ssmspec_stream_layers_{d_model}_{n_heads}_{head_dim}_{conv_k}_{'f32' if param_fp32 else 'bf16'}"
    return cuda_build.load_inline(name, "the one-launch decode kernel", cpp_sources=_DECLARATION,
                                  cuda_sources=source, functions=["launch"], extra_cuda_cflags=flags,
                                  extra_include_paths=[os.path.dirname(os.path.abspath(__file__))])


def build(model):
    """The extension for `model`'s layer shape: built now if this machine has not yet (about a
    minute; torch's loader keeps it under TORCH_EXTENSIONS_DIR), else loaded."""
    first = model.mamba_mixers()[0]
    c = first.cfg
    return _module(model.config.d_model, c.n_heads, c.head_dim, c.conv_kernel, first.dt_bias.dtype == torch.float32)


class StreamLayers:
    """A model's decode step at batch 1 after the embedding in one launch of kernel.cu: every
    Mamba layer, the final norm and the LM head.

    `runner(h, cache)`: h (1, d_model) bf16, the embedded token -> logits (1, vocab) fp32 (a new
    tensor); conv and SSM states of `cache` advanced in place. Each set of weight and state
    tensors gets its table of layer pointers, built on its first step (not while a CUDA graph is
    being captured: run the step once before capturing, as `decoding/graphs.py` does) and kept
    for the runner's life: a captured graph reads its table by address, so a step on another
    cache must not free or rebuild it (a few hundred bytes per cache).
    """

    def __init__(self, model, device: torch.device):
        reason = unsupported_reason(model, 1, device)
        if reason is not None:
            raise ValueError(f"stream_layers: {reason}")
        self.model = model
        stack = model.folded_mamba_stack()
        self.mixers = [m for m, _ in stack]
        first = self.mixers[0]
        c = first.cfg
        self.d_model = model.config.d_model
        self.smem = smem_bytes(self.d_model)
        self.launch = build(model).launch
        self.eps_in, self.eps_out = stack[0][1], first.norm.eps
        self.dt_min, self.dt_max = float(c.dt_min), float(c.dt_max)
        bf = torch.bfloat16
        self.zx = torch.empty(first.in_proj.weight.shape[0], device=device, dtype=bf)
        self.g = torch.empty(c.d_inner, device=device, dtype=bf)
        self.hbuf = torch.empty(2, self.d_model, device=device, dtype=bf)
        self.counter = torch.zeros(1, device=device, dtype=torch.int32)
        self._tables: dict[tuple, torch.Tensor] = {}

    def table(self, cache) -> torch.Tensor:
        """The device array of the kernel's `Layer` structs (kernel.cu, in its field order) for this model
        and cache."""
        per_layer = [(m.in_proj.weight, m.out_proj.weight, m.conv1d.weight, m.conv1d.bias, m.dt_bias, m.A_log, m.D,
                      lc.conv_state, lc.ssm_state)
                     for m, lc in zip(self.mixers, cache.layers)]
        rows = [[t.data_ptr() for t in tensors] for tensors in per_layer]
        key = tuple(map(tuple, rows))
        table = self._tables.get(key)
        if table is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("stream_layers: new weight or state tensors during CUDA-graph capture; "
                                   "run one step first")
            for tensors in per_layer:
                if not all(t.is_contiguous() for t in tensors) or tensors[-1].dtype != torch.float32 \
                        or tensors[-2].dtype != torch.bfloat16:
                    raise ValueError("stream_layers: weights and states must be contiguous, the SSM state fp32 and "
                                     "the conv state bf16")
            table = self._tables[key] = torch.tensor(rows, dtype=torch.int64, device=self.zx.device)
        return table

    def __call__(self, h: torch.Tensor, cache) -> torch.Tensor:
        out = torch.empty_like(h)
        logits = torch.empty(1, self.model.lm_head.weight.shape[0], device=h.device, dtype=torch.float32)
        self.launch(self.table(cache), len(self.mixers), h.contiguous(), out, self.zx, self.g, self.hbuf,
                    self.counter, self.eps_in, self.eps_out, self.dt_min, self.dt_max, self.model.lm_head.weight,
                    self.model.norm_f.weight, self.model.norm_f.eps, logits, self.smem,
                    pdl.enabled(out.device))
        return logits
