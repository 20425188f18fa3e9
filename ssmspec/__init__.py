"""ssmspec: tree-based speculative decoding for Mamba-2 and hybrid state-space language models."""

__version__ = "0.1.0"
