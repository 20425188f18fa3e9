"""Embedding lookup that also hands the first norm its sums of squares (the verify path)."""
from .naive import naive_embed

__all__ = ["naive_embed"]
