"""Chunked SSD scan over full sequences (prefill and training), differentiable."""
from .naive import naive_chunk_scan, naive_sequential_scan

__all__ = ["naive_chunk_scan", "naive_sequential_scan"]
