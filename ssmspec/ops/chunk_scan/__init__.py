"""Chunked SSD scan over full sequences (prefill and training), differentiable: naive.py (plain torch, the
reference) and fla.py (fla-core's Triton kernels, an optional GPU extra; training/scan.py picks)."""
from .naive import naive_chunk_scan, naive_sequential_scan

__all__ = ["naive_chunk_scan", "naive_sequential_scan"]
