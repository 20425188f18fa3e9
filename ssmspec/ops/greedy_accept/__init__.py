"""Greedy tree acceptance on the device: argmax of the target, accepted path, produced tokens."""
from .naive import naive_greedy_accept

__all__ = ["naive_greedy_accept"]
