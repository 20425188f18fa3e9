"""Chunked SSD scan over full sequences (prefill and training), differentiable: naive.py (plain torch, the
reference, a loop over chunks), parallel.py (plain torch, every chunk at once)
and fla.py (fla-core's Triton kernels, an optional GPU extra); training/scan.py picks."""
from .naive import naive_chunk_scan, naive_sequential_scan
from .parallel import parallel_chunk_scan

__all__ = ["naive_chunk_scan", "naive_sequential_scan", "parallel_chunk_scan"]
