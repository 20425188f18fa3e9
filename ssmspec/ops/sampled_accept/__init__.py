"""Multi-step speculative sampling (SpecInfer) on the device: the accepted path and the bonus
token of a tree whose children were drawn i.i.d. from the drafter."""
from .naive import naive_sampled_accept, rejection_residual

__all__ = ["naive_sampled_accept", "rejection_residual"]
