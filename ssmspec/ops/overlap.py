"""A second stream, and ready counters, for work that overlaps within one verify layer.

The tree verify's Mamba layer is a chain: in_proj, the tree conv, the tree scan, out_proj. While
the conv and the scan run the weight stream idles, although only x, B, C and dt feed them: the
gate z (half of in_proj's weights) is needed only at the scan's end. `Mamba2Mixer` can therefore
split in_proj in two and run z's GEMM on a second stream beside the conv and the scan, where
ops/paths.py `splits_in_proj` says it pays. The scan cannot wait for z's whole launch (a graph
edge would put z's GEMM back on the chain), so it waits for ready counters instead:

- z's GEMM (ops/gemv `skinny_linear`, `ready_flags`) adds, once an output tile is stored, the
  number of scan programs that read each head's columns to that head's counter (a CTA barrier,
  then a release at GPU scope, as a cooperative grid sync does);
- each scan program (ops/tree_scan `tree_scan_gated`, `gate_flags`) looks at its head's counter
  before its last products and reads z past L1 then, or, if z was not ready, waits for the
  counter at its gate and reads z again; then it counts the counter down, so the counters are
  back at 0 when the layer ends and the next layer reuses them (one verify at a time per device:
  the counters are shared).

Why this cannot deadlock: z's GEMM waits for nothing but its inputs, so it finishes once it gets
SMs. The scan's programs spin only after all of the conv finished, and let the next kernel
launch only once none of them has a wait ahead, so what can hold SMs while they spin is the scan
itself and z's GEMM. z's GEMM therefore progresses as long as one SM holds no scan program: the
caller checks that the scan has fewer programs than the GPU has SMs (ops/paths.py `leaves_an_sm`,
counting a whole SM per program, the worst case).
"""
from __future__ import annotations

import functools

import torch

from . import paths


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of `device` (one per device, created on first use)."""
    return _side_stream(device.index if device.index is not None else torch.cuda.current_device())


_COUNTERS: dict[tuple[str, int | None, int], torch.Tensor] = {}
"""Ready counters per (device, count): one entry per device and head count in use, never
replaced (a captured graph keeps reading the buffer it was captured with)."""


def ready_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """n int32 ready counters on `device`, zero between uses (shared: the layers that use them run
    one after another). None when none exist yet and a CUDA graph is being captured: a buffer
    first made inside a capture would belong to that graph's memory pool."""
    key = (device.type, device.index, n)
    counters = _COUNTERS.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return counters


def split_in_proj_counters(rows: int, batch: int, d_inner: int, rest: int, k: int, element_size: int,
                           heads: int, head_dim: int, device: torch.device):
    """(ready counters, scan programs reading each head) with which a verify layer runs z's GEMM
    beside its conv and scan, or None where it should not (ops/paths.py `splits_in_proj`, same
    arguments)."""
    if not paths.splits_in_proj(rows, batch, d_inner, rest, k, element_size, heads, head_dim, device):
        return None
    from .tree_scan import triton as scan

    counters = ready_counters(device, heads)
    return None if counters is None else (counters, scan.gate_readers(batch, head_dim))
