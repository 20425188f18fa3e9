"""The drafter's children on the device: the r-th most likely token of a logits row, per node."""
from .naive import naive_ranked_tokens

__all__ = ["naive_ranked_tokens"]
