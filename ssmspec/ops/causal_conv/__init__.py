"""Causal depthwise conv1d + SiLU over full sequences (the inference forward of a Mamba-2 layer)."""
from .naive import naive_causal_conv, naive_causal_conv_train

__all__ = ["naive_causal_conv", "naive_causal_conv_train"]
