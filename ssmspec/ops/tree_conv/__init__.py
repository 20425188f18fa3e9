"""Causal depthwise conv1d over a packed token tree: a node's window is its ancestors."""
from .naive import conv_window_indices, naive_tree_conv

__all__ = ["conv_window_indices", "naive_tree_conv"]
