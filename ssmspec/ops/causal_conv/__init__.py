"""Causal depthwise conv1d + SiLU over full sequences: the inference forward of a Mamba-2 layer
(`naive_causal_conv`) and the training form with its backward (`naive_causal_conv_train`)."""
from .naive import naive_causal_conv, naive_causal_conv_train

__all__ = ["naive_causal_conv", "naive_causal_conv_train"]
