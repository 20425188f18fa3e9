"""Build and launch `kernel.cu`: the 16-node tree verify's projections on the weight stream.

Built on first use with torch's C++ extension loader, as ops/stream_layers is (nvcc and ninja on
the machine, Hopper, cached under TORCH_EXTENSIONS_DIR, one build per shape). `unsupported_reason`
says why a model, tree size or machine cannot use it; the caller then keeps the Triton GEMMs.
"""
from __future__ import annotations

import functools
import os

import torch

from .. import cuda_build, pdl
from ..stream_layers.cuda import machine_reason, width_reason

MAX_NODES = 16
"""Rows (batch 1 x tree nodes) of one launch: the tensor cores' 16-row A fragments."""
SLOTS = 4
"""Ring slots of 8 weight rows (40 KB at d_model 2560) per CTA."""
IN_FLIGHT = 1
"""Slots whose copies the producer keeps in flight at once (ops/stream_layers: 1)."""
ROWS = 8  # weight rows per ring slot: kernel.cu's ROWS
WARPS = 8
THREADS = WARPS * 32 + 32
MAX_OUT_ROWS = 64  # kernel.cu's MAX_OUT_ROWS: out_proj rows per CTA

_LAUNCHER = r"""
#include <torch/extension.h>
#include "launch.cuh"

static const __nv_bfloat16* bf16_or_null(const c10::optional<torch::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const __nv_bfloat16*>(t->data_ptr()) : nullptr;
}

void launch(c10::optional<torch::Tensor> out_w, c10::optional<torch::Tensor> g, torch::Tensor h,
            c10::optional<torch::Tensor> h_next, c10::optional<torch::Tensor> in_w,
            c10::optional<torch::Tensor> zx, int64_t nodes, double eps_out, double eps_in, torch::Tensor counter,
            int64_t smem, bool pdl) {
  launch_one_cta_per_sm(
      stream_proj16, THREADS, smem, pdl, bf16_or_null(out_w), bf16_or_null(g),
      reinterpret_cast<const __nv_bfloat16*>(h.data_ptr()),
      h_next.has_value() ? reinterpret_cast<__nv_bfloat16*>(h_next->data_ptr()) : nullptr, bf16_or_null(in_w),
      zx.has_value() ? reinterpret_cast<__nv_bfloat16*>(zx->data_ptr()) : nullptr, (int)nodes, (float)eps_out,
      (float)eps_in, reinterpret_cast<unsigned*>(counter.data_ptr()));
}
"""
_DECLARATION = ("void launch(c10::optional<torch::Tensor> out_w, c10::optional<torch::Tensor> g, torch::Tensor h, "
                "c10::optional<torch::Tensor> h_next, c10::optional<torch::Tensor> in_w, c10::optional<torch::Tensor> zx, "
                "int64_t nodes, double eps_out, double eps_in, torch::Tensor counter, int64_t smem, bool pdl);")


def smem_bytes(d_model: int, slots: int | None = None) -> int:
    """kernel.cu's dynamic shared memory: the ring, the reductions, the mbarriers."""
    slots = slots or SLOTS
    ring = slots * ROWS * (d_model * 2 + 64)
    return ring + (WARPS * 16 * ROWS + 16 * MAX_OUT_ROWS + WARPS * 16 + 16) * 4 + 2 * slots * 8


def unsupported_reason(model, nodes: int, device: torch.device) -> str | None:
    """Why a verify of `nodes` rows of `model` cannot take its projections from the kernel here,
    or None when it can."""
    if not 1 <= nodes <= MAX_NODES:
        return f"{nodes} rows (batch x tree nodes); the kernel takes 1..{MAX_NODES}"
    d_model = model.config.d_model
    if (why := width_reason(d_model, smem_bytes(d_model), 4096)) is not None:
        return why
    stack = model.folded_mamba_stack()
    if stack is None:
        return "every layer must be a Mamba-2 layer with its norms folded (models/fold.py)"
    shapes = set()
    for m, _ in stack:
        c = m.cfg
        if c.d_inner % d_model or m.norm.group_size != c.d_inner:
            return (f"d_inner {c.d_inner} must be a multiple of d_model and the gated norm one group "
                    f"(group size {m.norm.group_size})")
        if m.in_proj.bias is not None or m.out_proj.bias is not None:
            return "projection biases are not supported"
        if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in (m.in_proj.weight, m.out_proj.weight)):
            return "bf16 contiguous projection weights only"
        shapes.add((tuple(m.in_proj.weight.shape), tuple(m.out_proj.weight.shape)))
    if len(shapes) != 1:
        return "the layers differ in shape"
    if (why := machine_reason(device)) is not None:
        return why
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if -(-d_model // sms) > MAX_OUT_ROWS:
        return f"d_model {d_model} needs more multiprocessors than the {sms} here"
    return None


def nvcc_flags(d_model: int, d_inner: int, n_in: int, slots: int, in_flight: int) -> list[str]:
    """nvcc's flags for one shape (bench/compile_extensions.py compiles with them off the GPU)."""
    return ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-diag-suppress", "177,550",
            "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", f"-DD_MODEL={d_model}", f"-DD_INNER={d_inner}", f"-DN_IN={n_in}",
            f"-DN_SLOTS={slots}", f"-DIN_FLIGHT={in_flight}"]


@functools.cache
def _module(d_model: int, d_inner: int, n_in: int, slots: int, in_flight: int):
    """The extension for one shape (built once per shape and machine, then loaded from cache)."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "kernel.cu")) as f:
        source = f.read() + _LAUNCHER
    flags = nvcc_flags(d_model, d_inner, n_in, slots, in_flight)
    name = f"ssmspec_stream_proj_{d_model}_{d_inner}_{n_in}_{slots}_{in_flight}"
    return cuda_build.load_inline(name, "the tree verify's weight-stream projections", cpp_sources=_DECLARATION,
                                  cuda_sources=source, functions=["launch"], extra_cuda_cflags=flags,
                                  extra_include_paths=[here, os.path.join(os.path.dirname(here), "stream_layers")])


def build(model):
    """The extension for `model`'s projection shape: built now if this machine has not yet (about
    a minute; torch's loader keeps it under TORCH_EXTENSIONS_DIR), else loaded."""
    m = model.mamba_mixers()[0]
    n_in, d_model = m.in_proj.weight.shape
    return _module(d_model, m.out_proj.weight.shape[1], n_in, SLOTS, IN_FLIGHT)


class StreamProj:
    """A verify's Mamba projections at up to 16 rows (batch 1) on the weight stream.

    `runner(h, out_mixer=None, g=None, in_mixer=None, in_eps=0.0)` launches out_mixer's out_proj
    (h + out_proj(gated_norm(g)), in place into h), then in_mixer's in_proj (in_proj(pre_norm(h)),
    its pre-norm's eps in_eps), either alone when the other mixer is None, and returns zx
    (rows, N_in), or None without in_mixer. The norms' weights must be folded into the projections
    (models/fold.py).
    """

    def __init__(self, model, device: torch.device):
        m = model.mamba_mixers()[0]
        self.n_in, self.d_model = m.in_proj.weight.shape
        self.d_inner = m.out_proj.weight.shape[1]
        self.module = build(model)
        self.launch = self.module.launch
        self.smem = smem_bytes(self.d_model, SLOTS)
        # the grid barrier's tickets (kernel.cu: they count up across launches, never reset)
        self.counter = torch.zeros(1, device=device, dtype=torch.int32)

    def __call__(self, h: torch.Tensor, out_mixer=None, g: torch.Tensor | None = None, in_mixer=None,
                 in_eps: float = 0.0) -> torch.Tensor | None:
        rows = h.numel() // self.d_model
        if not (1 <= rows <= MAX_NODES and h.is_contiguous() and h.dtype == torch.bfloat16):
            raise ValueError(f"stream_proj: h must be contiguous bf16 with 1..{MAX_NODES} rows of {self.d_model}")
        if out_mixer is not None and (g is None or not g.is_contiguous() or g.numel() != rows * self.d_inner):
            raise ValueError(f"stream_proj: g must be contiguous ({rows}, {self.d_inner})")
        zx = None if in_mixer is None else torch.empty(rows, self.n_in, device=h.device, dtype=torch.bfloat16)
        self.launch(None if out_mixer is None else out_mixer.out_proj.weight, g, h,
                    None if out_mixer is None else h, None if in_mixer is None else in_mixer.in_proj.weight,
                    zx, rows, 0.0 if out_mixer is None else out_mixer.norm.eps, in_eps, self.counter, self.smem,
                    pdl.enabled(h.device))
        return zx
