"""Registers, shared memory and warps of the decode kernels as compiled, and how many programs of
each fit on one SM (issue 3): whether an early-launched (PDL) kernel's programs can sit beside
the running kernel's, which decides whether their work before the wait overlaps it.

Runs one folded AR step and one folded 16- and 64-node verify of mamba2-2.7b on the Triton
backend (compiling their kernels), then reads every compiled variant from Triton's kernel caches.
Programs per SM are the minimum over the register file (65536 32-bit registers, allocated per
warp in 256-register units), shared memory (228 KB, 1 KB reserved per block) and 32 blocks / 64
warps (Hopper).

Run on the device from the repository root: python3 bench/kernel_resources.py
"""
from __future__ import annotations

import argparse
import os

import torch
from ssmspec.trees.tree import Tree

from ssmspec.models.presets import build_model
from ssmspec.ops import dispatch
from ssmspec.ops.gemv import triton as GV
from ssmspec.ops.state_replay import triton as SR
from ssmspec.ops.step_update import triton as SU
from ssmspec.ops.tree_conv import triton as TC
from ssmspec.ops.tree_scan import triton as TS

# This probe studies the Triton kernels; the default mode would take the one-launch CUDA kernels
# (ops/stream_layers, ops/stream_proj) where they run.
os.environ.setdefault("SSMSPEC_STREAM_LAYERS", "0")

KERNELS = {
    "gemv (in_proj / out_proj / lm_head)": GV._gemv_kernel,
    "skinny GEMM": GV._skinny_kernel,
    "step (_step_ssm_kernel)": SU._step_ssm_kernel,
    "step out_proj (_step_out_kernel)": SU._step_out_kernel,
    "rms_norm": SU._rms_norm_kernel,
    "tree conv": TC._tree_conv_kernel,
    "tree scan": TS._tree_scan_kernel,
    "replay (all layers)": SR._replay_states_layers_kernel,
}
REGS, SMEM, MAX_BLOCKS, MAX_WARPS = 65536, 228 * 1024, 32, 64


def compiled(fn):
    """Every CompiledKernel of a JITFunction, across Triton versions' cache layouts."""
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            yield from cache.values()
    else:
        for per_device in getattr(fn, "cache", {}).values():
            yield from per_device.values()


def _constexprs(fn, k) -> str:
    """The variant's BLOCK_* and flag constexprs by name (Triton keys them by argument index)."""
    src = getattr(k, "src", None)
    consts = dict(getattr(src, "constants", {}) or {})
    names = list(getattr(fn, "arg_names", []))
    out = []
    for key, value in consts.items():
        idx = key[0] if isinstance(key, tuple) else key
        name = names[idx] if isinstance(idx, int) and idx < len(names) else str(idx)
        if name.isupper() and value is not None:
            out.append(f"{name}={value}")
    return ", ".join(out[:9])


def per_sm(n_regs: int, shared: int, warps: int) -> int:
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = REGS // (regs_per_warp * warps) if n_regs else MAX_BLOCKS
    by_smem = SMEM // (shared + 1024) if shared else MAX_BLOCKS
    return min(by_regs, by_smem, MAX_BLOCKS, MAX_WARPS // warps)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.manual_seed(0)
    dispatch.set_backend("triton")
    model = build_model("mamba2-2.7b", dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 8), device="cuda")
    with torch.inference_mode():
        cache = model.new_cache(1, 128)
        model(prompt, cache)
        model.step(prompt[:, -1:], cache)
        for spec in ((3, 2, 1), (3, 4, 2, 1)):
            tree = Tree.from_config(spec)
            tokens = torch.randint(0, vocab, (1, tree.num_nodes), device="cuda")
            _, acts = model.verify(tokens, tree, cache)
            path = torch.zeros(1, tree.max_depth + 1, dtype=torch.long, device="cuda")
            model.replay(cache, acts, path, torch.ones(1, dtype=torch.long, device="cuda"))
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}; per compiled variant: registers per thread, spills, shared memory, "
          f"warps, programs per SM")
    print(f"{'kernel':<38} {'regs':>5} {'spill':>5} {'smem KB':>8} {'warps':>5} {'per SM':>6}  constexprs")
    for name, fn in KERNELS.items():
        for k in compiled(fn):
            md = k.metadata
            shared = getattr(md, "shared", 0)
            warps = getattr(md, "num_warps", 4)
            brief = _constexprs(fn, k)
            print(f"{name:<38} {k.n_regs:5d} {k.n_spills:5d} {shared / 1024:8.1f} {warps:5d} "
                  f"{per_sm(k.n_regs, shared, warps):6d}  {brief}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
