"""y = x W^T (+ b) for one row: the batch-1 decode projections, which only stream weights."""
from .naive import naive_linear, naive_norm_linear

__all__ = ["naive_linear", "naive_norm_linear"]
